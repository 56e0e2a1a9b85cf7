"""What the built-in adapters share: the registry they register into, the fields they
read and ignore, field validation, and the attention math (:func:`attention_traits`).

Spec classes appear here only in annotations; the classes themselves are looked up in
:mod:`._builtins`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Final

import torch

from kvspec_traits._errors import InvalidSpecError
from kvspec_traits._registry import Registry
from kvspec_traits._traits import LayoutTraits, PageComponent, TokenScope, TPLayout, TraitValue

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
    )

__all__ = [
    "ATTENTION_IGNORES",
    "ATTENTION_READS",
    "BASE_IGNORES",
    "BUILTINS",
    "attention_traits",
    "dtype_name",
    "positive_int",
]

BUILTINS = Registry(builtins=False, entry_points=False, name="vllm built-ins")

# -- field accounting --------------------------------------------------------------------

BASE_IGNORES: Final = (
    # Whether decode context parallelism spreads token positions over ranks: decided with
    # the DCP size at run time; each rank's page is laid out the same.
    "dcp_sharded",
    # Byte alignment between consecutive blocks (vLLM >= 0.32): the spacing of pages in
    # the allocation, which connectors read from the tensors; a page's content is unchanged.
    "block_stride_alignment",
    # vLLM 0.33: whether a draft model owns the layer (excluded from equality upstream).
    "is_draft",
)
"""Fields of ``KVCacheSpec`` that no built-in adapter needs: they do not change a page."""

_SPEC_READS: Final = ("block_size", "page_size_bytes", "prefix_cacheable", "uses_slot_mapping")

ATTENTION_READS: Final = (
    *_SPEC_READS,
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "kv_quant_mode",
    "max_tp_shards",
    "page_size_padded",
    "num_head_slots",
    "state_content_bytes",
    "tokens_per_state",
    # vLLM 0.34: head slots grouped by KV head (kv_head_contiguous).
    "kv_head_major_slots",
    "num_heads",
    "num_states",
    "state_content_size_bytes",
    "unpadded_page_size_bytes",
    "real_page_size_bytes",
)
"""What :func:`attention_traits` reads from an ``AttentionSpec``."""

ATTENTION_IGNORES: Final = (
    *BASE_IGNORES,
    # FullAttentionSpec: the kernel's window or chunk; the manager keeps every block.
    "sliding_window",
    "attention_chunk_size",
    # Scheduling only (prefix LM, non-causal multi-token decode of drafts).
    "non_causal",
    "non_causal_multi_token_decode",
    # MLA bookkeeping. The packing cache_dtype_str names reaches the page through
    # dtype, kv_quant_mode and state_content_bytes (read); alignment through
    # page_size_padded, which __post_init__ sets from it (read).
    "cache_dtype_str",
    "alignment",
    "model_version",
    # DeepSeek sparse attention: which role a cache plays, who computes the shared
    # index, the width of a worker-side top-k buffer (vLLM 0.33). Not in the page.
    "cache_role",
    "is_index_group_leader",
    "topk_buffer_width",
    # SlidingWindowSpec: blocks retained past the window for a speculative re-prefill;
    # not attended, and each page is laid out the same.
    "extra_retained_tokens",
    # SinkFullAttentionSpec: sink tokens live in the layer's weights, not in its pages.
    "sink_len",
)
"""Attention fields the built-in adapters know do not change a page's layout."""

_WINDOW_READS: Final = ("sliding_window", "attention_chunk_size", "rswa_window", "bounded_replay")

_MAMBA_READS: Final = (
    *_SPEC_READS,
    "shapes",
    "dtypes",
    "page_size_padded",
    "tp_replicated",
    "num_heads",
    "tokens_per_state",
    # Which kernel family computes the state: how its conv state splits across TP ranks
    # (PageComponent.tp_split, as vLLM's derive_mamba_conv_split decomposes it).
    "mamba_type",
    # vLLM 0.34: each state starts at a multiple of state_alignment bytes.
    "state_alignment",
    "state_content_size_bytes",
    "real_page_size_bytes",
)
_MAMBA_IGNORES: Final = (
    *BASE_IGNORES,
    # How many state blocks the manager keeps per request (prefix caching, speculative
    # decoding, prefill checkpoints); each page holds one state either way.
    "mamba_cache_mode",
    "num_speculative_blocks",
    "num_prefill_checkpoint_blocks",
    "prefill_checkpoint_alignment",
)


# -- validation ---------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(spec: object, name: str, *, optional: bool = False, minimum: int = 1) -> Any:
    """``spec.<name>`` if it is an int of at least ``minimum`` (or None when
    ``optional``); else :class:`InvalidSpecError` naming the spec, field and value."""
    value = getattr(spec, name)
    if value is None and optional:
        return None
    if not _is_int(value) or value < minimum:
        want = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise InvalidSpecError(spec, name, value, want + (" or None" if optional else ""))
    return value


def _dtype(spec: object, name: str = "dtype") -> torch.dtype:
    value = getattr(spec, name)
    if not isinstance(value, torch.dtype):
        raise InvalidSpecError(spec, name, value, "a torch.dtype")
    return value


def _flag(spec: object, name: str, default: bool = False) -> bool:
    value = getattr(spec, name, default)
    if not isinstance(value, bool):
        raise InvalidSpecError(spec, name, value, "a bool")
    return value


def _tokens_per_state(spec: AttentionSpec, block_size: int) -> int | Fraction:
    tps = spec.tokens_per_state
    if isinstance(tps, bool) or not isinstance(tps, int | Fraction) or tps <= 0:
        raise InvalidSpecError(
            spec,
            "tokens_per_state",
            tps,
            "a positive int or Fraction (tokens one stored state covers)",
        )
    states = Fraction(block_size) / Fraction(tps)
    if states.denominator != 1:
        raise InvalidSpecError(
            spec,
            "tokens_per_state",
            tps,
            f"a divisor of block_size={block_size} (or 1/n): a block holds whole states",
        )
    return tps


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _exact(value: Fraction) -> int | Fraction:
    return int(value) if value.denominator == 1 else value


def _quant_mode(spec: object) -> str:
    mode = getattr(spec, "kv_quant_mode", None)
    if not isinstance(mode, enum.Enum):
        raise InvalidSpecError(spec, "kv_quant_mode", mode, "a vLLM KVQuantMode member")
    return mode.name


# -- attention ------------------------------------------------------------------------------

# The scopes whose manager keeps every prompt block (R-SWA evicts generated tokens only).
_KEEPS_PROMPT: Final = frozenset({TokenScope.FULL, TokenScope.PROMPT_AND_WINDOW})


@dataclass(frozen=True, slots=True)
class _AttentionFields:
    """``AttentionSpec``'s layout fields, each checked (see :func:`attention_traits`)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    max_tp_shards: int | None
    slots: int | None
    packed: int | None  # state_content_bytes
    padded: int | None  # page_size_padded
    head_major: bool
    tps: int | Fraction
    kv_quant_mode: str

    @property
    def is_mla(self) -> bool:
        return self.head_size_v == 0


def _attention_fields(spec: AttentionSpec) -> _AttentionFields:
    block_size = positive_int(spec, "block_size")
    return _AttentionFields(
        block_size=block_size,
        num_kv_heads=positive_int(spec, "num_kv_heads"),
        head_size=positive_int(spec, "head_size"),
        head_size_v=positive_int(spec, "head_size_v", minimum=0),
        dtype=_dtype(spec),
        max_tp_shards=positive_int(spec, "max_tp_shards", optional=True),
        slots=positive_int(spec, "num_head_slots", optional=True),
        packed=positive_int(spec, "state_content_bytes", optional=True),
        padded=positive_int(spec, "page_size_padded", optional=True),
        head_major=_flag(spec, "kv_head_major_slots"),
        tps=_tokens_per_state(spec, block_size),
        kv_quant_mode=_quant_mode(spec),
    )


def _head_slots(spec: AttentionSpec, f: _AttentionFields) -> int:
    heads = f.slots if f.slots is not None else f.num_kv_heads
    if f.head_major and heads % f.num_kv_heads:
        raise InvalidSpecError(
            spec,
            "kv_head_major_slots",
            f.head_major,
            f"False: num_head_slots={heads} cannot be grouped by {f.num_kv_heads} KV heads",
        )
    return heads


_Cell = tuple[tuple[PageComponent, ...], int]
"""A page's components and the bytes of one cell (one state of one head slot)."""


def _given_cell(
    cell: Sequence[tuple[str, int, str | torch.dtype]], heads: int, states: int
) -> _Cell:
    components = tuple(
        PageComponent(
            name=name,
            shape=(heads, states, n),
            dtype=_dtype_name_of(part),
            nbytes=heads * states * n * _itemsize(part),
        )
        for name, n, part in cell
    )
    return components, sum(n * _itemsize(part) for _, n, part in cell)


def _kv_cell(f: _AttentionFields, heads: int, states: int) -> _Cell:
    # vLLM's own cell: K then V, or the latent alone (MLA), or packed bytes.
    if f.packed is not None:
        packed = PageComponent(
            name="packed",
            shape=(heads, states, f.packed),
            dtype="uint8",
            nbytes=heads * states * f.packed,
        )
        return (packed,), f.packed
    itemsize = f.dtype.itemsize
    k = PageComponent(
        name="latent" if f.is_mla else "k",
        shape=(heads, states, f.head_size),
        dtype=dtype_name(f.dtype),
        nbytes=heads * states * f.head_size * itemsize,
    )
    cell_bytes = (f.head_size + f.head_size_v) * itemsize
    if f.is_mla:
        return (k,), cell_bytes
    v = PageComponent(
        name="v",
        shape=(heads, states, f.head_size_v),
        dtype=dtype_name(f.dtype),
        nbytes=heads * states * f.head_size_v * itemsize,
    )
    return (k, v), cell_bytes


def attention_traits(
    spec: AttentionSpec,
    *,
    token_scope: TokenScope = TokenScope.FULL,
    window_tokens: int | None = None,
    transferable: bool = True,
    cell: Sequence[tuple[str, int, str | torch.dtype]] | None = None,
    **overrides: TraitValue,
) -> LayoutTraits:
    """Traits of a paged attention cache, from ``AttentionSpec``'s fields alone.

    - is_mla: ``head_size_v == 0`` (one vector per state, no separate V).
    - tp: ``max_tp_shards == 1`` or MLA -> REPLICATED (a single latent has no heads to
      split); otherwise HEAD_SHARDED into ``max_tp_shards`` (None: up to the TP size).
    - page: ``num_heads * num_states * state_content_size_bytes``, padded to
      ``page_size_padded``; content per token is ``num_heads * C / tokens_per_state``.
    - kv_head_contiguous: one slot per KV head, a single KV head, or
      ``kv_head_major_slots``.

    ``token_scope``, ``window_tokens`` and ``transferable`` are what the class stands
    for. ``cell`` describes a cell laid out otherwise than vLLM's K/V (or latent, or
    packed) cell: its parts in order, each ``(name, elements, dtype)``; C is then their
    sum and each part is a component of shape ``(head slots, states, elements)``. Any
    other trait may be overridden by keyword (``spec_name=...``); the registry checks the
    result against the spec's own byte math either way. Raises :class:`InvalidSpecError`
    naming the field for values that describe no layout (``block_size=0``,
    ``tokens_per_state=0``, a window that is not a positive int).
    """
    f = _attention_fields(spec)
    if window_tokens is not None and (not _is_int(window_tokens) or window_tokens <= 0):
        raise InvalidSpecError(
            spec,
            _window_field(spec),
            window_tokens,
            f"a positive int (tokens of its {token_scope.value} window)",
        )
    heads = _head_slots(spec, f)
    states = int(Fraction(f.block_size) / Fraction(f.tps))
    components, cell_bytes = (
        _given_cell(cell, heads, states) if cell is not None else _kv_cell(f, heads, states)
    )
    unpadded = heads * states * cell_bytes
    if f.padded is not None and f.padded < unpadded:
        raise InvalidSpecError(
            spec,
            "page_size_padded",
            f.padded,
            f"None or at least the page content, {unpadded} bytes",
        )
    replicated = f.max_tp_shards == 1 or f.is_mla
    traits = LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=f.is_mla,
        tp_layout=TPLayout.REPLICATED if replicated else TPLayout.HEAD_SHARDED,
        tp_shards=1 if replicated else f.max_tp_shards,
        token_scope=token_scope,
        window_tokens=window_tokens,
        block_size=f.block_size,
        num_head_slots=heads,
        kv_head_contiguous=heads == f.num_kv_heads or f.num_kv_heads == 1 or f.head_major,
        tokens_per_state=f.tps,
        states_per_block=states,
        state_bytes=cell_bytes,
        unpadded_page_size_bytes=unpadded,
        page_size_bytes=f.padded if f.padded is not None else unpadded,
        per_token_bytes=_exact(Fraction(heads * cell_bytes) / Fraction(f.tps)),
        dtype=dtype_name(f.dtype),
        kv_quant_mode=f.kv_quant_mode,
        components=components,
        prefix_cacheable=_flag(spec, "prefix_cacheable", True),
        uses_slot_mapping=_flag(spec, "uses_slot_mapping", True),
        transferable=transferable,
        attention_page=True,
        token_paged=token_scope is not TokenScope.RING,
        keeps_prompt=token_scope in _KEEPS_PROMPT,
        holds_hidden_states=False,
        grouped=False,
    )
    return replace(traits, **overrides) if overrides else traits  # type: ignore[arg-type]


def _itemsize(dtype: str | torch.dtype) -> int:
    return _as_dtype(dtype).itemsize


def _dtype_name_of(dtype: str | torch.dtype) -> str:
    return dtype_name(_as_dtype(dtype))


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise TypeError(
            f"attention_traits(cell=...): {dtype!r} is not a torch dtype or "
            "the name of one ('float32', 'int8', ...)"
        )
    return found


def _window_field(spec: object) -> str:
    for name in ("sliding_window", "attention_chunk_size", "rswa_window"):
        if hasattr(spec, name):
            return name
    return "block_size"


def _window(spec: object, name: str) -> int:
    value = getattr(spec, name)
    if not _is_int(value) or value <= 0:
        raise InvalidSpecError(spec, name, value, "a positive int (tokens of the window)")
    return int(value)
