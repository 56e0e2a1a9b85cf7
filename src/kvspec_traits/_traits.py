"""The traits protocol, its enums and the frozen value type that implements it.

Nothing here imports vLLM or torch: connector code imports this package early, and a
dtype travels as its name (``"bfloat16"``), a quantisation mode as vLLM's enum member name.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Protocol

__all__ = [
    "KVLayoutTraits",
    "LayoutTraits",
    "PageComponent",
    "TPLayout",
    "TokenScope",
    "TraitValue",
    "trait_names",
    "traits_as_dict",
]


class TPLayout(enum.Enum):
    """How one layer's cache is split across tensor-parallel ranks."""

    REPLICATED = "replicated"
    """Every TP rank holds the same bytes (MLA latent, replicated conv state).
    A connector reads such a region from one remote rank."""
    HEAD_SHARDED = "head_sharded"
    """Each rank holds a slice of the KV heads; ranks are combined by heads."""
    STATE_SHARDED = "state_sharded"
    """Each rank holds a slice of a recurrent state (Mamba/GDN channels)."""


class TokenScope(enum.Enum):
    """Which tokens a page keeps, which is what decides what a transfer must move."""

    FULL = "full"
    """Every token of the request, for its lifetime."""
    SLIDING_WINDOW = "sliding_window"
    """Only the last ``window_tokens`` tokens (blocks behind the window are freed)."""
    CHUNKED = "chunked"
    """Tokens of the current attention chunk of ``window_tokens`` tokens."""
    PROMPT_AND_WINDOW = "prompt_and_window"
    """The whole prompt plus the last ``window_tokens`` generated tokens (R-SWA)."""
    RING = "ring"
    """A fixed ring of ``window_tokens`` rows per request, rewritten in place."""
    RECURRENT_STATE = "recurrent_state"
    """A state that summarises all tokens so far; its size does not grow with tokens."""
    ENCODER = "encoder"
    """Encoder outputs of the request (cross-attention), written once."""
    SPARSE_HOT = "sparse_hot"
    """HiSparse: a fixed per-request working set of device blocks, rebuilt per request."""
    SPARSE_RESIDENT = "sparse_resident"
    """HiSparse: reclaimable device copies of pages whose source of truth is on the host."""
    NONE = "none"
    """Nothing is kept across steps (encoder-only attention)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PageComponent:
    """One tensor inside a page, per block: K, V, a latent vector or a state tensor.

    ``shape`` is the per-block shape in elements of ``dtype`` (for attention
    ``(head_slots, states, head_size)``); ``nbytes`` is its size in one page. A packed
    or opaque component has ``dtype`` ``"uint8"`` and its last dimension in bytes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


TraitValue = (
    bool | int | str | Fraction | None | TPLayout | TokenScope | tuple[PageComponent, ...]
)


class KVLayoutTraits(Protocol):
    """Read-only facts about one KV cache page that a KV-transfer connector needs.

    Each member's docstring says what it means and which vLLM spec fields it comes from;
    ``docs/traits/`` has one page per trait with the value for every spec class.
    """

    @property
    def spec_name(self) -> str:
        """Qualified name of the spec class these traits describe (for messages only:
        never branch on it)."""
        ...

    @property
    def is_mla(self) -> bool:
        """One latent vector per token state and no separate V (``head_size_v == 0``)."""
        ...

    @property
    def tp_layout(self) -> TPLayout:
        """How the cache splits across TP ranks (from ``max_tp_shards``,
        ``MambaSpec.tp_replicated``, and ``is_mla``)."""
        ...

    @property
    def tp_shards(self) -> int | None:
        """Distinct shards across TP: 1 when replicated, ``max_tp_shards`` when the spec
        bounds it, ``None`` when it shards up to the TP size."""
        ...

    @property
    def token_scope(self) -> TokenScope:
        """Which tokens a page keeps (see :class:`TokenScope`)."""
        ...

    @property
    def window_tokens(self) -> int | None:
        """The window, chunk or ring size in tokens for windowed scopes, else ``None``."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per block (``spec.block_size``)."""
        ...

    @property
    def num_head_slots(self) -> int:
        """H of the logical ``[B, H, N, C]`` page (``spec.num_heads``)."""
        ...

    @property
    def tokens_per_state(self) -> int | Fraction | None:
        """Tokens one stored state covers; ``None`` for a recurrent state."""
        ...

    @property
    def states_per_block(self) -> int:
        """N of the page: stored states per block (``spec.num_states``)."""
        ...

    @property
    def state_bytes(self) -> int:
        """C of the page in bytes: one (head slot, state) cell
        (``spec.state_content_size_bytes``)."""
        ...

    @property
    def unpadded_page_size_bytes(self) -> int:
        """Bytes of content in one page, before alignment padding."""
        ...

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block occupies, padding included (``spec.page_size_bytes``)."""
        ...

    @property
    def per_token_bytes(self) -> int | Fraction | None:
        """Content bytes per token (exact; a ``Fraction`` when a state covers several
        tokens); ``None`` when the size does not grow with tokens."""
        ...

    @property
    def dtype(self) -> str | None:
        """Element dtype name of the cache (``"bfloat16"``, ``"uint8"``), ``None`` if
        the page is opaque bytes or holds several dtypes."""
        ...

    @property
    def kv_quant_mode(self) -> str:
        """vLLM's ``KVQuantMode`` member name (``"NONE"``, ``"FP8_PER_TENSOR"``, ...)."""
        ...

    @property
    def components(self) -> tuple[PageComponent, ...]:
        """The tensors of one page (K and V, one latent, or the state tensors)."""
        ...

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the group takes part in prefix caching (``spec.prefix_cacheable``)."""
        ...

    @property
    def uses_slot_mapping(self) -> bool:
        """Whether the worker writes it through a per-token slot mapping."""
        ...

    @property
    def transferable(self) -> bool:
        """Whether a prefill/decode connector moves this cache between engines."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutTraits(KVLayoutTraits):
    """The frozen value every built-in adapter returns; third-party adapters may too.

    Construction checks internal consistency (a page is at least its content, the
    components add up to the content, a sharded layout is not also one shard) and
    raises ``ValueError`` naming the field.
    """

    spec_name: str
    is_mla: bool
    tp_layout: TPLayout
    tp_shards: int | None
    token_scope: TokenScope
    window_tokens: int | None
    block_size: int
    num_head_slots: int
    tokens_per_state: int | Fraction | None
    states_per_block: int
    state_bytes: int
    unpadded_page_size_bytes: int
    page_size_bytes: int
    per_token_bytes: int | Fraction | None
    dtype: str | None
    kv_quant_mode: str
    components: tuple[PageComponent, ...] = field(default=())
    prefix_cacheable: bool
    uses_slot_mapping: bool
    transferable: bool

    def __post_init__(self) -> None:
        if self.page_size_bytes < self.unpadded_page_size_bytes:
            raise ValueError(
                f"{self.spec_name}: page_size_bytes {self.page_size_bytes} is smaller than "
                f"its content unpadded_page_size_bytes {self.unpadded_page_size_bytes}"
            )
        parts = sum(c.nbytes for c in self.components)
        if self.components and parts != self.unpadded_page_size_bytes:
            raise ValueError(
                f"{self.spec_name}: components add up to {parts} bytes but "
                f"unpadded_page_size_bytes is {self.unpadded_page_size_bytes}"
            )
        if self.tp_layout is TPLayout.REPLICATED and self.tp_shards != 1:
            raise ValueError(
                f"{self.spec_name}: a REPLICATED layout has tp_shards 1, got {self.tp_shards}"
            )
        if self.tp_shards is not None and self.tp_shards < 1:
            raise ValueError(f"{self.spec_name}: tp_shards must be >= 1, got {self.tp_shards}")

    def as_dict(self) -> dict[str, TraitValue]:
        """Every trait by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def trait_names() -> tuple[str, ...]:
    """The names of every member of :class:`KVLayoutTraits`, in declaration order."""
    return tuple(f.name for f in fields(LayoutTraits))


def traits_as_dict(traits: KVLayoutTraits) -> Mapping[str, TraitValue]:
    """Every trait of any implementation, by name (reads each property once)."""
    return {name: getattr(traits, name) for name in trait_names()}
