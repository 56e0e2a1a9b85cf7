"""Recurrent-state and HiSparse pages: :func:`mamba_traits` and the HiSparse math."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from math import prod
from typing import TYPE_CHECKING, Final

import torch

from kvspec_traits._errors import InvalidSpecError
from kvspec_traits._traits import LayoutTraits, PageComponent, TokenScope, TPLayout, TraitValue
from kvspec_traits._vllm_adapters._common import (
    _SPEC_READS,
    BASE_IGNORES,
    _exact,
    _flag,
    _is_int,
    dtype_name,
    positive_int,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import (
        HiSparseHotSpec,
        HiSparseResidentSpec,
        MambaSpec,
    )

__all__ = ["mamba_traits"]

# -- recurrent state ----------------------------------------------------------------------


def _shapes(spec: MambaSpec) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    shapes, dtypes = spec.shapes, spec.dtypes
    if not isinstance(shapes, tuple | list) or not shapes:
        raise InvalidSpecError(spec, "shapes", shapes, "a non-empty tuple of shapes")
    if not isinstance(dtypes, tuple | list) or len(dtypes) != len(shapes):
        raise InvalidSpecError(
            spec, "dtypes", dtypes, f"a tuple of {len(shapes)} torch.dtype, one per shape"
        )
    out = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        if (
            not isinstance(shape, tuple | list)
            or not shape
            or not all(_is_int(d) and d > 0 for d in shape)
        ):
            raise InvalidSpecError(
                spec, "shapes", shapes, "a tuple of non-empty shapes of positive ints"
            )
        if not isinstance(dtype, torch.dtype):
            raise InvalidSpecError(spec, "dtypes", dtypes, "a tuple of torch.dtype")
        out.append((tuple(shape), dtype))
    return tuple(out)


def _tp_splits(
    spec: MambaSpec, states: tuple[tuple[tuple[int, ...], torch.dtype], ...]
) -> tuple[tuple[int, ...] | None, ...]:
    """How each state tensor of a TP-sharded Mamba page divides across TP ranks (the
    runs along its first dimension, :attr:`PageComponent.tp_split`), as vLLM's NIXL
    transfer decomposes it (``derive_mamba_conv_split``): the conv state in the DS layout
    ``(conv_dim, kernel - 1)`` by sub-projection (Mamba-1 ``(x,)``, Mamba-2 ``(x, B, C)``,
    GDN ``(Q, K, V)``), the temporal state by its heads. ``None`` for a kernel family or
    a conv layout (vLLM's default SD, ``(kernel - 1, conv_dim)``) that vLLM does not
    decompose, and for a page of other than two tensors: no split is described."""
    from vllm import envs

    unknown: tuple[tuple[int, ...] | None, ...] = (None,) * len(states)
    kind = getattr(spec.mamba_type, "name", None)
    # vLLM's layout rule (mamba_utils.get_conv_state_layout: the env var, else SD), read
    # here uncached: its answer is cached for the process on first use, which a traits
    # lookup must not be the one to make.
    if len(states) != 2 or envs.VLLM_SSM_CONV_STATE_LAYOUT != "DS":
        return unknown
    (conv, _), (temporal, _) = states
    if len(conv) != 2:
        return unknown
    conv_dim = conv[0]
    if kind == "MAMBA1" and temporal[0] == conv_dim:
        runs: tuple[int, ...] = (conv_dim,)
    elif kind == "MAMBA2" and len(temporal) == 2:
        x = temporal[0] * temporal[1]  # local heads x head_dim
        runs = (x, (conv_dim - x) // 2, (conv_dim - x) // 2)
    elif kind == "GDN_ATTN" and len(temporal) == 3:
        value = temporal[0] * temporal[1]  # local value heads x head_v_dim
        runs = ((conv_dim - value) // 2, (conv_dim - value) // 2, value)
    else:
        return unknown
    if sum(runs) != conv_dim or min(runs) <= 0:
        return unknown  # not the decomposition vLLM's kernels lay out: undescribed
    return (runs, (temporal[0],))


def _state_components(
    spec: MambaSpec, replicated: bool, alignment: int
) -> tuple[PageComponent, ...]:
    # Each state tensor in order, each followed by the gap to the next multiple of
    # ``alignment`` bytes (a ``pad<i>`` component), with its TP split when sharded.
    states = _shapes(spec)
    splits = (None,) * len(states) if replicated else _tp_splits(spec, states)
    components: list[PageComponent] = []
    for i, ((shape, dtype), split) in enumerate(zip(states, splits, strict=True)):
        nbytes = prod(shape) * dtype.itemsize
        components.append(
            PageComponent(
                name=f"state{i}",
                shape=shape,
                dtype=dtype_name(dtype),
                nbytes=nbytes,
                tp_split=split,
            )
        )
        gap = -nbytes % alignment
        if gap:
            components.append(
                PageComponent(name=f"pad{i}", shape=(gap,), dtype="uint8", nbytes=gap)
            )
    return tuple(components)


def mamba_traits(spec: MambaSpec, **overrides: TraitValue) -> LayoutTraits:
    """A recurrent state: one page per block holding every state tensor once.

    Sizes are ``prod(shape) * itemsize`` per tensor, each starting at a multiple of
    ``state_alignment`` bytes (vLLM 0.34; the gap is a ``pad<i>`` uint8 component);
    ``tp_replicated`` decides REPLICATED against STATE_SHARDED. The page does not grow
    with tokens, so ``per_token_bytes`` and ``tokens_per_state`` are None.
    """
    block_size = positive_int(spec, "block_size")
    num_heads = positive_int(spec, "num_heads")
    if num_heads != 1:
        # vLLM sizes the page without it (page_size_bytes is the states' sum) but views it
        # as num_heads rows of that sum (compute_layer_kv_cache_shape_bytes): no layout.
        raise InvalidSpecError(
            spec, "num_heads", num_heads, "1 (vLLM's page of a state has no head dimension)"
        )
    alignment = positive_int(spec, "state_alignment") if hasattr(spec, "state_alignment") else 1
    padded = positive_int(spec, "page_size_padded", optional=True)
    tps = spec.tokens_per_state
    if not _is_int(tps) or tps > 0:
        raise InvalidSpecError(
            spec, "tokens_per_state", tps, "an int <= 0 (vLLM's -1: a state covers every token)"
        )
    replicated = _flag(spec, "tp_replicated")
    components = _state_components(spec, replicated, alignment)
    content = sum(c.nbytes for c in components)
    if padded is not None and (padded < content or padded % alignment):
        raise InvalidSpecError(
            spec,
            "page_size_padded",
            padded,
            f"None or a multiple of state_alignment={alignment} of at least the content, "
            f"{content} bytes",
        )
    dtypes = {c.dtype for c in components if not c.name.startswith("pad")}
    traits = LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=False,
        tp_layout=TPLayout.REPLICATED if replicated else TPLayout.STATE_SHARDED,
        tp_shards=1 if replicated else None,
        token_scope=TokenScope.RECURRENT_STATE,
        window_tokens=None,
        block_size=block_size,
        num_head_slots=num_heads,
        kv_head_contiguous=False,
        tokens_per_state=None,
        states_per_block=1,
        state_bytes=content,
        unpadded_page_size_bytes=content,
        page_size_bytes=padded if padded is not None else content,
        per_token_bytes=None,
        dtype=dtypes.pop() if len(dtypes) == 1 else None,
        kv_quant_mode="NONE",
        components=components,
        prefix_cacheable=_flag(spec, "prefix_cacheable", True),
        uses_slot_mapping=_flag(spec, "uses_slot_mapping", True),
        transferable=True,
        attention_page=False,
        token_paged=False,
        keeps_prompt=False,
        holds_hidden_states=False,
        grouped=False,
    )
    return replace(traits, **overrides) if overrides else traits  # type: ignore[arg-type]


def _hisparse(spec: HiSparseHotSpec | HiSparseResidentSpec, scope: TokenScope) -> LayoutTraits:
    """HiSparse pages are opaque copies of MLA pages (vLLM builds them only from
    MLAAttentionSpec layers), kept on the device for a host-backed cache. Their fields
    hold only a page size, so MLA and replication come from class identity here; they are
    never transferred (their groups have ``enable_kv_transfer=False``)."""
    page = positive_int(spec, "page_size")
    block_size = positive_int(spec, "block_size")
    return LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        tp_shards=1,
        token_scope=scope,
        window_tokens=None,
        block_size=block_size,
        num_head_slots=1,
        kv_head_contiguous=False,
        tokens_per_state=block_size,
        states_per_block=1,
        state_bytes=page,
        unpadded_page_size_bytes=page,
        page_size_bytes=page,
        per_token_bytes=_exact(Fraction(page, block_size)),
        dtype=None,
        kv_quant_mode="NONE",
        components=(PageComponent(name="opaque", shape=(page,), dtype="uint8", nbytes=page),),
        prefix_cacheable=_flag(spec, "prefix_cacheable", False),
        uses_slot_mapping=_flag(spec, "uses_slot_mapping", True),
        transferable=False,
        attention_page=False,
        token_paged=True,
        keeps_prompt=False,
        holds_hidden_states=False,
        grouped=False,
    )


_HISPARSE_READS: Final = (*_SPEC_READS, "page_size")
# blocks_per_request: how many blocks a request holds, not what one holds.
_HISPARSE_IGNORES: Final = (*BASE_IGNORES, "blocks_per_request")
