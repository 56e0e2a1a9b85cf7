"""Built-in adapters: one per KV cache spec class of vLLM 0.32 and 0.33.

This is the only module of the library that names vLLM spec classes. Each adapter derives
its traits from the spec's own fields; class identity decides only what the fields cannot
(the token scope a class stands for, and the HiSparse pages, which carry no layout fields).
They register through the public :func:`register_adapter` into ``BUILTINS``, which every
:class:`Registry` copies on first use.
"""

from __future__ import annotations

from fractions import Fraction
from math import prod
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvspec_traits._errors import UnsupportedSpecError
from kvspec_traits._group import GroupTraits
from kvspec_traits._registry import Registry, register_adapter, resolving_registry
from kvspec_traits._traits import LayoutTraits, PageComponent, TokenScope, TPLayout

__all__ = ["BUILTINS"]

BUILTINS = Registry(builtins=False, entry_points=False, name="vllm built-ins")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _exact(value: Fraction) -> int | Fraction:
    return int(value) if value.denominator == 1 else value


def _attention(spec: AttentionSpec, *, scope: TokenScope, window: int | None,
               transferable: bool = True) -> LayoutTraits:
    """Traits of a paged attention cache, from AttentionSpec's fields alone.

    - is_mla: ``head_size_v == 0`` (one vector per state, no separate V).
    - tp: ``max_tp_shards == 1`` or MLA -> REPLICATED (a single latent has no heads to
      split); otherwise HEAD_SHARDED into ``max_tp_shards`` (None: up to the TP size).
    - page: ``num_heads * num_states * state_content_size_bytes``, padded to
      ``page_size_padded``; content per token is ``num_heads * C / tokens_per_state``.
    """
    itemsize = spec.dtype.itemsize
    is_mla = spec.head_size_v == 0
    heads = spec.num_head_slots if spec.num_head_slots is not None else spec.num_kv_heads
    tps = spec.tokens_per_state
    states = spec.block_size // tps if tps > 0 else 1
    if spec.state_content_bytes is not None:
        cell = spec.state_content_bytes
        components: tuple[PageComponent, ...] = (
            PageComponent(name="packed", shape=(heads, states, cell), dtype="uint8",
                          nbytes=heads * states * cell),
        )
    else:
        cell = (spec.head_size + spec.head_size_v) * itemsize
        k = PageComponent(name="latent" if is_mla else "k",
                          shape=(heads, states, spec.head_size), dtype=dtype_name(spec.dtype),
                          nbytes=heads * states * spec.head_size * itemsize)
        components = (k,) if is_mla else (
            k,
            PageComponent(name="v", shape=(heads, states, spec.head_size_v),
                          dtype=dtype_name(spec.dtype),
                          nbytes=heads * states * spec.head_size_v * itemsize),
        )
    unpadded = heads * states * cell
    replicated = spec.max_tp_shards == 1 or is_mla
    return LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=is_mla,
        tp_layout=TPLayout.REPLICATED if replicated else TPLayout.HEAD_SHARDED,
        tp_shards=1 if replicated else spec.max_tp_shards,
        token_scope=scope,
        window_tokens=window,
        block_size=spec.block_size,
        num_head_slots=heads,
        tokens_per_state=tps,
        states_per_block=states,
        state_bytes=cell,
        unpadded_page_size_bytes=unpadded,
        page_size_bytes=spec.page_size_padded if spec.page_size_padded is not None else unpadded,
        per_token_bytes=_exact(Fraction(heads * cell) / Fraction(tps)),
        dtype=dtype_name(spec.dtype),
        kv_quant_mode=spec.kv_quant_mode.name,
        components=components,
        prefix_cacheable=spec.prefix_cacheable,
        uses_slot_mapping=spec.uses_slot_mapping,
        transferable=transferable,
    )


@register_adapter(KVCacheSpec, registry=BUILTINS)
def _abstract(spec: KVCacheSpec) -> LayoutTraits:
    # Reached by KVCacheSpec itself and by any direct subclass without its own adapter.
    raise UnsupportedSpecError(
        type(spec), "KVCacheSpec is abstract and a direct subclass has no layout fields "
        "an adapter could read")


def _keeps_every_token(spec: AttentionSpec) -> LayoutTraits:
    # FullAttentionSpec's `sliding_window`/`attention_chunk_size` only change the kernel:
    # the manager keeps every token's block (hybrid allocator off), so the scope is FULL.
    # A bare AttentionSpec has no window of its own either.
    return _attention(spec, scope=TokenScope.FULL, window=None)


# One function, registered for each class by name: a subclass not listed here still goes
# through the MRO walk and its byte-math check, never silently through this list.
for _cls in (AttentionSpec, FullAttentionSpec, MLAAttentionSpec, HiddenStateCacheSpec,
             SinkFullAttentionSpec):
    register_adapter(_cls, _keeps_every_token, registry=BUILTINS)
del _cls


@register_adapter(RSWASpec, registry=BUILTINS)
def _rswa(spec: RSWASpec) -> LayoutTraits:
    return _attention(spec, scope=TokenScope.PROMPT_AND_WINDOW, window=spec.rswa_window)


@register_adapter(ChunkedLocalAttentionSpec, registry=BUILTINS)
def _chunked(spec: ChunkedLocalAttentionSpec) -> LayoutTraits:
    return _attention(spec, scope=TokenScope.CHUNKED, window=spec.attention_chunk_size)


def _sliding(spec: SlidingWindowSpec) -> LayoutTraits:
    return _attention(spec, scope=TokenScope.SLIDING_WINDOW, window=spec.sliding_window)


register_adapter(SlidingWindowSpec, _sliding, registry=BUILTINS)
register_adapter(SlidingWindowMLASpec, _sliding, registry=BUILTINS)


@register_adapter(CircularBufferSpec, registry=BUILTINS)
def _ring(spec: CircularBufferSpec) -> LayoutTraits:
    # block_size is the ring capacity: one block per request, rewritten in place.
    return _attention(spec, scope=TokenScope.RING, window=spec.block_size)


@register_adapter(EncoderOnlyAttentionSpec, registry=BUILTINS)
def _encoder_only(spec: EncoderOnlyAttentionSpec) -> LayoutTraits:
    # Encoder-only layers keep nothing across steps (vLLM sizes them at 0 bytes).
    return _attention(spec, scope=TokenScope.NONE, window=None, transferable=False)


@register_adapter(CrossAttentionSpec, registry=BUILTINS)
def _cross(spec: CrossAttentionSpec) -> LayoutTraits:
    # Encoder outputs are recomputed by the engine that runs the encoder; vLLM's
    # connectors do not move them (Mooncake's store lists them as unsupported).
    return _attention(spec, scope=TokenScope.ENCODER, window=None, transferable=False)


@register_adapter(MambaSpec, registry=BUILTINS)
def _mamba(spec: MambaSpec) -> LayoutTraits:
    """A recurrent state: one page per block holding every state tensor once.

    Sizes are ``prod(shape) * itemsize`` per tensor; ``tp_replicated`` decides REPLICATED
    against STATE_SHARDED. The page does not grow with tokens, so ``per_token_bytes`` and
    ``tokens_per_state`` are None.
    """
    components = tuple(
        PageComponent(name=f"state{i}", shape=tuple(shape), dtype=dtype_name(dtype),
                      nbytes=prod(shape) * dtype.itemsize)
        for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True))
    )
    content = sum(c.nbytes for c in components)
    dtypes = {c.dtype for c in components}
    return LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=False,
        tp_layout=TPLayout.REPLICATED if spec.tp_replicated else TPLayout.STATE_SHARDED,
        tp_shards=1 if spec.tp_replicated else None,
        token_scope=TokenScope.RECURRENT_STATE,
        window_tokens=None,
        block_size=spec.block_size,
        num_head_slots=spec.num_heads,
        tokens_per_state=None,
        states_per_block=1,
        state_bytes=content,
        unpadded_page_size_bytes=content,
        page_size_bytes=spec.page_size_padded if spec.page_size_padded is not None else content,
        per_token_bytes=None,
        dtype=dtypes.pop() if len(dtypes) == 1 else None,
        kv_quant_mode="NONE",
        components=components,
        prefix_cacheable=spec.prefix_cacheable,
        uses_slot_mapping=spec.uses_slot_mapping,
        transferable=True,
    )


def _hisparse(spec: HiSparseHotSpec | HiSparseResidentSpec, scope: TokenScope) -> LayoutTraits:
    """HiSparse pages are opaque copies of MLA pages (vLLM builds them only from
    MLAAttentionSpec layers), kept on the device for a host-backed cache. Their fields
    hold only a page size, so MLA and replication come from class identity here; they are
    never transferred (their groups have ``enable_kv_transfer=False``)."""
    page = spec.page_size
    return LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        tp_shards=1,
        token_scope=scope,
        window_tokens=None,
        block_size=spec.block_size,
        num_head_slots=1,
        tokens_per_state=spec.block_size,
        states_per_block=1,
        state_bytes=page,
        unpadded_page_size_bytes=page,
        page_size_bytes=page,
        per_token_bytes=_exact(Fraction(page, spec.block_size)),
        dtype=None,
        kv_quant_mode="NONE",
        components=(PageComponent(name="opaque", shape=(page,), dtype="uint8", nbytes=page),),
        prefix_cacheable=spec.prefix_cacheable,
        uses_slot_mapping=spec.uses_slot_mapping,
        transferable=False,
    )


@register_adapter(HiSparseHotSpec, registry=BUILTINS)
def _hisparse_hot(spec: HiSparseHotSpec) -> LayoutTraits:
    return _hisparse(spec, TokenScope.SPARSE_HOT)


@register_adapter(HiSparseResidentSpec, registry=BUILTINS)
def _hisparse_resident(spec: HiSparseResidentSpec) -> LayoutTraits:
    return _hisparse(spec, TokenScope.SPARSE_RESIDENT)


@register_adapter(UniformTypeKVCacheSpecs, registry=BUILTINS)
def _group(spec: UniformTypeKVCacheSpecs) -> GroupTraits:
    registry = resolving_registry()
    members: dict[str, Any] = {
        layer: registry.traits_of(member) for layer, member in spec.kv_cache_specs.items()
    }
    return GroupTraits(type(spec).__qualname__, members, block_size=spec.block_size)
