"""The traits protocol, its enums and the frozen value type that implements it.

Nothing here imports vLLM or torch: connector code imports this package early, and a
dtype travels as its name (``"bfloat16"``), a quantisation mode as vLLM's enum member name.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Annotated, Any, Protocol

from kvspec_traits._kinds import GroupRule, TokenScope, TPLayout

__all__ = [
    "GroupRule",
    "KVLayoutTraits",
    "LayoutTraits",
    "PageComponent",
    "TPLayout",
    "TokenScope",
    "TraitValue",
    "group_rule",
    "has_ring",
    "is_state",
    "trait_names",
    "trait_types",
    "traits_as_dict",
]


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
    tp_split: tuple[int, ...] | None = None
    """How this component of a ``STATE_SHARDED`` page divides across tensor-parallel
    ranks: the sizes, along its first dimension and in this rank's elements, of the runs
    each rank holds one contiguous slice of (their sum is ``shape[0]``). Mamba-2's conv
    state in vLLM's DS layout ``(conv_dim, kernel - 1)`` is ``(x, B, C)``, each run
    ``1/TP`` of the model's; its SSM state ``(heads, head_dim)`` is ``(heads,)``. A rank
    of another TP size finds its share of a peer's component from these runs alone.

    ``None``: the spec does not say how the component splits (a connector must not move
    it between TP sizes); always ``None`` on pages that are not TP-sharded states.
    Source: the adapter (vLLM's Mamba specs: ``mamba_type`` and ``shapes``, as vLLM's
    ``derive_mamba_conv_split`` decomposes them)."""

    def __post_init__(self) -> None:
        split = self.tp_split
        if split is None:
            return
        if (
            not isinstance(split, tuple)
            or not split
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in split)
        ):
            raise ValueError(
                f"component {self.name!r}: tp_split must be None or a non-empty tuple of "
                f"positive ints, got {split!r}"
            )
        if not self.shape or sum(split) != self.shape[0]:
            raise ValueError(
                f"component {self.name!r}: tp_split {split} must add up to the first "
                f"dimension of its shape {self.shape}"
            )


TraitValue = bool | int | str | Fraction | None | TPLayout | TokenScope | tuple[PageComponent, ...]


class KVLayoutTraits(Protocol):
    """Read-only facts about one KV cache page that a KV-transfer connector needs.

    Each member's docstring says what it means and which vLLM spec fields it comes from;
    ``docs/traits/`` has one page per trait with the value for every spec class.
    """

    @property
    def spec_name(self) -> str:
        """Name of the spec class these traits describe.

        Source: ``type(spec).__qualname__``. For messages and reports only: branching on it
        would bring back the class lists this library exists to remove.
        """
        ...

    @property
    def is_mla(self) -> bool:
        """Whether a state is one vector with no separate V ("no separate V", not "is this
        an MLA model").

        True for MLA, and also for vLLM's ring buffer (CircularBufferSpec), the 3-head
        HiddenStateCacheSpec and the HiSparse pages: none of them stores a V. Whether a
        cache is the same on every TP rank (NIXL's ``is_mla_region`` question) is
        :attr:`tp_layout`; use ``is_mla`` to size a cache (no ``2 *`` for V).

        Source: ``head_size_v == 0`` on attention specs (MLAAttentionSpec and its
        subclasses default it to 0; SlidingWindowMLASpec too; vLLM's ring buffer sets it).
        A Mamba state is never MLA; HiSparse pages are copies of MLA pages (class identity:
        they carry no layout fields).
        """
        ...

    @property
    def tp_layout(self) -> TPLayout:
        """How the cache splits across tensor-parallel ranks.

        Source: attention specs are REPLICATED when ``max_tp_shards == 1`` or when
        ``is_mla`` (a single latent has no heads to split), else HEAD_SHARDED. Mamba specs
        are REPLICATED when ``tp_replicated``, else STATE_SHARDED. This is the question
        NIXL's ``_region_is_mla`` really asks: may a region be read from one remote rank?
        """
        ...

    @property
    def tp_shards(self) -> int | None:
        """How many distinct shards the cache has across TP ranks.

        1 when REPLICATED; ``max_tp_shards`` for a head-sharded spec that bounds it (ranks
        beyond hold replicas). None means "one shard per TP rank": a head-sharded layer
        such as Llama's (each rank holds ``num_head_slots`` heads of its own; the spec's
        ``num_kv_heads`` is already the per-rank count, so the spec cannot say how many
        ranks there are), and a STATE_SHARDED recurrent state likewise. For a given TP
        size, ``kvspec_traits.transfer.shard_count(tp_layout, tp_shards, tp_size)`` is
        the number.

        Source: ``max_tp_shards`` (attention), ``tp_replicated`` (Mamba), the TP layout.
        """
        ...

    @property
    def token_scope(self) -> TokenScope:
        """Which tokens a page keeps, and so which blocks a transfer must move.

        Source: the class's meaning (FullAttentionSpec: FULL even with a kernel
        ``sliding_window``, since the manager keeps every block; SlidingWindowSpec and
        SlidingWindowMLASpec: SLIDING_WINDOW; ChunkedLocalAttentionSpec: CHUNKED; RSWASpec:
        PROMPT_AND_WINDOW; CircularBufferSpec: RING; MambaSpec: RECURRENT_STATE;
        CrossAttentionSpec: ENCODER; EncoderOnlyAttentionSpec: NONE; HiSparse: SPARSE_*).
        """
        ...

    @property
    def window_tokens(self) -> int | None:
        """Size in tokens of a windowed scope; None for unwindowed scopes.

        Source: ``sliding_window``, ``attention_chunk_size``, ``rswa_window``, or the ring
        capacity ``block_size`` of a CircularBufferSpec.
        """
        ...

    @property
    def block_size(self) -> int:
        """Tokens per block.

        Source: ``spec.block_size`` (for a group, the group spec's own).
        """
        ...

    @property
    def num_head_slots(self) -> int:
        """H of the logical ``[B, H, N, C]`` page.

        Source: ``num_head_slots`` when a backend packs heads, else ``num_kv_heads``
        (vLLM's ``spec.num_heads``); ``MambaSpec.num_heads``; 1 for opaque pages.
        """
        ...

    @property
    def kv_head_contiguous(self) -> bool:
        """Whether each KV head's data is one contiguous run of head slots in a page.

        Source: True when a page has one slot per KV head (``num_head_slots`` None or
        equal to ``num_kv_heads``), when it has a single KV head (MLA), or when the
        backend groups the slots by KV head (vLLM 0.34's ``kv_head_major_slots``: head
        ``h``'s K and V slots adjacent, as MiniMax-M3's NVFP4 MSA pages); False when
        several slots per head are laid out otherwise (FlashInfer's NVFP4 pages put
        every head's K slot before every head's V slot, so ``kv_head_major_slots``
        moves bytes without changing the page size), and for pages without KV heads
        (recurrent states, opaque HiSparse pages). A connector may split a
        head-sharded page across TP ranks at byte offsets only when it is True.
        """
        ...

    @property
    def tokens_per_state(self) -> int | Fraction | None:
        """Tokens one stored state covers.

        Source: ``spec.tokens_per_state``: 1 normally, > 1 for compressed states
        (DeepSeek-V4: 4 or 128), a Fraction < 1 when several states per token are stored
        (pooled cross-attention). None for a recurrent state (vLLM's -1). An opaque
        HiSparse page counts as one state of ``block_size`` tokens.
        """
        ...

    @property
    def states_per_block(self) -> int:
        """N of the page: stored states per block.

        Source: ``block_size // tokens_per_state`` (vLLM's ``spec.num_states``); 1 for a
        recurrent state.
        """
        ...

    @property
    def state_bytes(self) -> int:
        """C of the page: bytes of one (head slot, state) cell.

        Source: ``state_content_bytes`` when packed (fp8_ds_mla: 656 B per token for
        DeepSeek-V3, 584 B for V4), else ``(head_size + head_size_v) * itemsize``; for a
        Mamba state the sum of ``prod(shape) * itemsize`` over its tensors.
        """
        ...

    @property
    def unpadded_page_size_bytes(self) -> int:
        """Bytes of content in one page, before alignment padding.

        Source: ``num_head_slots * states_per_block * state_bytes``; for Mamba the state
        size (vLLM's ``real_page_size_bytes``). Checked against vLLM's own value.
        """
        ...

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block occupies in memory, padding included.

        Source: ``page_size_padded`` when set (DeepSeek alignment to 512 or 576 B, Mamba
        page padding), else the unpadded page. Checked against ``spec.page_size_bytes``.
        """
        ...

    @property
    def per_token_bytes(self) -> int | Fraction | None:
        """Content bytes per token, exact.

        Source: ``num_head_slots * state_bytes / tokens_per_state``: an int, or a Fraction
        when a state covers several tokens (DeepSeek-V4 ratio 128: 584/128 = 73/16 B).
        Padding is excluded. None for a recurrent state, whose size does not grow with
        tokens. MLA is counted once (the Mooncake store sized it as K plus V).
        """
        ...

    @property
    def dtype(self) -> str | None:
        """Element dtype of the cache, by name.

        Source: ``str(spec.dtype)`` without ``torch.`` (``"bfloat16"``, ``"uint8"`` for
        packed fp8 layouts); the Mamba states' common dtype, None when they differ; None
        for opaque HiSparse pages.
        """
        ...

    @property
    def kv_quant_mode(self) -> str:
        """Quantisation of the cache, as vLLM's ``KVQuantMode`` member name.

        Source: ``spec.kv_quant_mode.name`` (``"NONE"``, ``"FP8_PER_TENSOR"``, ...);
        ``"NONE"`` for specs without the field.
        """
        ...

    @property
    def components(self) -> tuple[PageComponent, ...]:
        """The tensors inside one page, with per-block shapes, dtypes and sizes.

        Source: ``k`` and ``v`` of ``(heads, states, head_size[_v])``; one ``latent`` for
        MLA; one ``packed`` uint8 cell for ``state_content_bytes`` layouts; ``state0``,
        ``state1``, ... from ``MambaSpec.shapes``/``dtypes``; one ``opaque`` page for
        HiSparse. Their sizes add up to ``unpadded_page_size_bytes``. A TP-sharded
        state's components may say how each divides across TP ranks
        (:attr:`PageComponent.tp_split`; vLLM's Mamba kinds as its NIXL transfer
        decomposes them), which is what lets a connector move the state between
        different TP sizes.
        """
        ...

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the cache takes part in prefix caching.

        Source: ``spec.prefix_cacheable`` (False for rings, HiSparse pages and
        bounded-replay SWA-MLA); a group only if every member.
        """
        ...

    @property
    def uses_slot_mapping(self) -> bool:
        """Whether the worker writes the cache through a per-token slot mapping.

        Source: ``spec.uses_slot_mapping`` (False for rings and HiSparse hot pages, which
        address their pages themselves).
        """
        ...

    @property
    def transferable(self) -> bool:
        """Whether a prefill/decode connector moves this cache between engines.

        Source: False for encoder-only layers (nothing kept), cross-attention (the decode
        engine runs its own encoder; vLLM's Mooncake store refuses it) and HiSparse pages
        (device copies of a host pool; vLLM gives their groups ``enable_kv_transfer=False``);
        True otherwise, rings included (NIXL moves them as scratch regions).
        """
        ...

    @property
    def attention_page(self) -> bool:
        """Whether a page is an attention page: K/V (or latent) cells of ``[head slots,
        states, cell]``, one state per ``tokens_per_state`` tokens ("does this layer have a
        paged per-token K/V page?").

        Source: the attention fields (``num_kv_heads``, ``head_size``, ``head_size_v``,
        ``dtype``) every AttentionSpec subclass has, rings included; False for a recurrent
        state (Mamba's ``shapes``) and the opaque HiSparse pages (only a ``page_size``).
        """
        ...

    @property
    def token_paged(self) -> bool:
        """Whether a request's blocks follow its tokens: neither a recurrent state (one
        state per request) nor a ring (one page rewritten in place).

        Source: the token scope: False for RECURRENT_STATE and RING, True otherwise
        (HiSparse pages too: copies of token-paged MLA pages).
        """
        ...

    @property
    def keeps_prompt(self) -> bool:
        """Whether every prompt block stays allocated for the request's lifetime, so a
        prefix hit on this layer is the whole matched prefix (vLLM's full-attention
        managers: full, MLA, sink, hidden-state and R-SWA pages).

        Source: the token scope FULL or PROMPT_AND_WINDOW (R-SWA evicts only generated
        tokens); False for a bare AttentionSpec, which no vLLM manager allocates.
        """
        ...

    @property
    def holds_hidden_states(self) -> bool:
        """Whether the pages hold a model's hidden states (the activations a drafter or
        an external store reads back), not attention K/V, a latent or a recurrent state.
        A connector that extracts hidden states (vLLM's ``ExampleHiddenStatesConnector``)
        finds their group by this; every layout trait of such a page may equal another
        page's (vLLM's are MLA pages of ``num_kv_heads`` hidden states).

        Source: the adapter: True for vLLM's ``HiddenStateCacheSpec`` (a marker subclass of
        MLAAttentionSpec with no field of its own, so class identity, as for HiSparse
        pages), False for every other spec; a group only if all its members agree.
        """
        ...

    @property
    def grouped(self) -> bool:
        """Whether these are the traits of a group spec: several layers' pages side by
        side, each layer's own traits in ``traits_for_layer`` (where code unwraps vLLM's
        ``UniformTypeKVCacheSpecs`` to its members).

        Source: ``kv_cache_specs`` (the group spec's per-layer members); False for every
        spec of one layer.
        """
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutTraits(KVLayoutTraits):
    """The frozen value every built-in adapter returns; third-party adapters may too.

    Every trait is a keyword; ``holds_hidden_states`` and ``grouped`` default to False,
    and a field added after 0.1.0 gets a default that keeps an older adapter's answer
    right (``docs/extending.md``, "Compatibility").

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
    kv_head_contiguous: bool
    tokens_per_state: int | Fraction | None
    states_per_block: int
    state_bytes: int
    unpadded_page_size_bytes: Annotated[int, GroupRule.SUM]
    page_size_bytes: Annotated[int, GroupRule.SUM]
    per_token_bytes: Annotated[int | Fraction | None, GroupRule.SUM]
    dtype: str | None
    kv_quant_mode: str
    components: Annotated[tuple[PageComponent, ...], GroupRule.MEMBERS] = field(default=())
    prefix_cacheable: Annotated[bool, GroupRule.ALL]
    uses_slot_mapping: bool
    transferable: Annotated[bool, GroupRule.ALL]
    attention_page: bool
    token_paged: bool
    keeps_prompt: bool
    # Fields added after an adapter was written get a default that keeps its answer right
    # (docs/extending.md, "Compatibility"): an adapter that predates holds_hidden_states
    # answers for pages that are not hidden states, and one layer's traits are never a
    # group's (GroupTraits answers for groups), so False is right for both.
    holds_hidden_states: bool = False
    grouped: Annotated[bool, GroupRule.MEMBERS] = False

    def __post_init__(self) -> None:
        # The protocol's properties sit on the base class, so dataclass takes them as the
        # default of a field left out: refuse that instead of storing a property object.
        missing = [f.name for f in fields(self) if isinstance(getattr(self, f.name), property)]
        if missing:
            raise TypeError(
                f"LayoutTraits() missing keyword argument(s): {', '.join(missing)} "
                "(every trait without a default is required; see kvspec_traits.trait_names())"
            )
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
        if (
            self.tp_layout is not TPLayout.REPLICATED
            and self.tp_shards is not None
            and self.tp_shards < 2
        ):
            raise ValueError(
                f"{self.spec_name}: a {self.tp_layout.name} layout splits into 2 or more "
                f"shards (or None: up to the TP size), got tp_shards={self.tp_shards}; "
                "one shard is TPLayout.REPLICATED"
            )

        paged = self.token_scope not in (TokenScope.RECURRENT_STATE, TokenScope.RING)
        kept = self.token_scope in (TokenScope.FULL, TokenScope.PROMPT_AND_WINDOW)
        if self.token_paged != paged or (self.keeps_prompt and not kept) or self.grouped:
            raise ValueError(
                f"{self.spec_name}: token_paged={self.token_paged}, keeps_prompt="
                f"{self.keeps_prompt}, grouped={self.grouped} contradict token_scope "
                f"{self.token_scope.name} (one layer's traits: a group's are GroupTraits)"
            )

    def as_dict(self) -> dict[str, TraitValue]:
        """Every trait by name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def trait_names() -> tuple[str, ...]:
    """The names of every member of :class:`KVLayoutTraits`, in declaration order."""
    return tuple(f.name for f in fields(LayoutTraits))


def traits_as_dict(traits: KVLayoutTraits) -> Mapping[str, TraitValue]:
    """Every trait of any implementation, by name (reads each property once)."""
    return {name: getattr(traits, name) for name in trait_names()}


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(LayoutTraits, include_extras=True)


def group_rule(name: str) -> GroupRule:
    """How a group answers trait ``name``: the :class:`GroupRule` on its annotation in
    :class:`LayoutTraits`, else ``COMMON``."""
    hint = _hints()[name]
    if typing.get_origin(hint) is Annotated:
        for extra in hint.__metadata__:
            if isinstance(extra, GroupRule):
                return extra
    return GroupRule.COMMON


def trait_types() -> dict[str, tuple[tuple[type[Any], ...], bool]]:
    """Each trait's accepted runtime types and whether it may be ``None``, read from
    :class:`LayoutTraits`'s annotations (``int | Fraction | None`` -> ``((int, Fraction),
    True)``; ``tuple[PageComponent, ...]`` -> ``((tuple,), False)``)."""
    found: dict[str, tuple[tuple[type[Any], ...], bool]] = {}
    for name, hint in typing.get_type_hints(LayoutTraits).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        accepted = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
        found[name] = (accepted, type(None) in args)
    return {name: found[name] for name in trait_names()}


# -- single-layer predicates asked by the transfer layer and the connector ----------------


def is_state(traits: KVLayoutTraits) -> bool:
    """Whether a layer's cache is a recurrent state (one indivisible page per block,
    never split into kernel blocks nor by heads), not token-addressed pages."""
    return traits.token_scope is TokenScope.RECURRENT_STATE


def has_ring(traits: Iterable[KVLayoutTraits]) -> bool:
    """Whether any of these layers' caches is a ring buffer (one page rewritten in
    place, :attr:`TokenScope.RING`): a transfer region's ``scratch``, a plan's default
    ``PlanLayout.rows``, the connector's CSA-linear models."""
    return any(t.token_scope is TokenScope.RING for t in traits)
