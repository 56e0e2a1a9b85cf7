"""Spec classes vLLM has never seen, as a model author adding the next cache would write
them, each with an adapter registered through :mod:`kvspec_traits.extend` only (no
connector edit, no table): the inputs of ``tests/test_connector_new_classes.py``.

- :class:`LatentPageSpec` derives from vLLM's ``KVCacheSpec`` directly: an MLA-format
  latent, one vector of ``latent_size`` elements per token, the same on every TP rank.
- :class:`WindowedHeadsSpec` derives from ``AttentionSpec`` but not ``SlidingWindowSpec``:
  K and V per KV head (head-sharded), of which only the last ``window`` tokens are kept.
- :class:`WkvStateSpec` derives from ``KVCacheSpec`` directly (not ``MambaSpec``): an
  RWKV-style recurrent state, a token-shift vector of ``dim`` elements followed by a
  ``heads x head_dim x head_dim`` wkv matrix, this rank's share of each (TP-sharded) or
  the whole model's (``tp_replicated``). Its adapter says how each part divides across
  TP ranks (``PageComponent.tp_split``: by its leading dimension);
  :class:`UndescribedWkvStateSpec` is the same page whose adapter does not.

The page math is the classes' own (``page_size_bytes``); the registry checks each
adapter's answer against it on every resolution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec

from kvspec_traits import PageComponent, TokenScope, TPLayout
from kvspec_traits.extend import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    BASE_IGNORES,
    LayoutTraits,
    Registry,
    attention_traits,
    default_registry,
    dtype_name,
    register_adapter,
)

__all__ = [
    "REGISTRY",
    "LatentPageSpec",
    "UndescribedWkvStateSpec",
    "WindowedHeadsSpec",
    "WkvStateSpec",
]

REGISTRY: Registry = default_registry.copy(name="new spec classes")
"""vLLM's built-in adapters plus the three below (a copy: the default stays as it is)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class LatentPageSpec(KVCacheSpec):
    """One latent vector of ``latent_size`` ``dtype`` elements per token, no V, the same
    bytes on every TP rank."""

    latent_size: int
    dtype: torch.dtype

    @property
    def num_heads(self) -> int:
        return 1

    @property
    def tokens_per_state(self) -> int:
        return 1

    @property
    def state_content_size_bytes(self) -> int:
        return self.latent_size * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.state_content_size_bytes

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        max_len = vllm_config.model_config.max_model_len
        return _cdiv(max_len, self.block_size) * self.page_size_bytes


@register_adapter(
    LatentPageSpec,
    registry=REGISTRY,
    reads=(
        "block_size",
        "latent_size",
        "dtype",
        "num_heads",
        "tokens_per_state",
        "state_content_size_bytes",
        "page_size_bytes",
        "max_memory_usage_bytes",
    ),
    ignores=BASE_IGNORES,
)
def _latent(spec: LatentPageSpec) -> LayoutTraits:
    cell = spec.latent_size * spec.dtype.itemsize
    page = spec.block_size * cell
    return LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        tp_shards=1,
        token_scope=TokenScope.FULL,
        window_tokens=None,
        block_size=spec.block_size,
        num_head_slots=1,
        kv_head_contiguous=True,
        tokens_per_state=1,
        states_per_block=spec.block_size,
        state_bytes=cell,
        unpadded_page_size_bytes=page,
        page_size_bytes=page,
        per_token_bytes=cell,
        dtype=dtype_name(spec.dtype),
        kv_quant_mode="NONE",
        components=(
            PageComponent(
                name="latent",
                shape=(1, spec.block_size, spec.latent_size),
                dtype=dtype_name(spec.dtype),
                nbytes=page,
            ),
        ),
        prefix_cacheable=True,
        uses_slot_mapping=True,
        transferable=True,
        attention_page=True,
        token_paged=True,
        keeps_prompt=True,
        holds_hidden_states=False,
        grouped=False,
    )


@dataclass(frozen=True, kw_only=True)
class WindowedHeadsSpec(AttentionSpec):
    """vLLM's attention page (K and V per KV head) of which the manager keeps only the
    last ``window`` tokens' blocks; not a ``SlidingWindowSpec``."""

    window: int


@register_adapter(
    WindowedHeadsSpec,
    registry=REGISTRY,
    reads=(*ATTENTION_READS, "window"),
    ignores=ATTENTION_IGNORES,
)
def _windowed(spec: WindowedHeadsSpec) -> LayoutTraits:
    return attention_traits(spec, token_scope=TokenScope.SLIDING_WINDOW, window_tokens=spec.window)


@dataclass(frozen=True, kw_only=True)
class WkvStateSpec(KVCacheSpec):
    """A recurrent state per request: ``dim`` shift elements then a ``heads x head_dim
    x head_dim`` wkv matrix (this rank's share of each, or, ``tp_replicated``, the
    model's whole), padded to ``page_size_padded`` where a hybrid model unifies pages."""

    dim: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    tp_replicated: bool = False
    num_speculative_blocks: int = 0
    page_size_padded: int | None = None

    @property
    def num_heads(self) -> int:
        return 1

    @property
    def tokens_per_state(self) -> int:
        return -1  # vLLM's "a state covers every token"

    @property
    def content_bytes(self) -> int:
        return (self.dim + self.heads * self.head_dim**2) * self.dtype.itemsize

    @property
    def state_content_size_bytes(self) -> int:
        return self.content_bytes

    @property
    def page_size_bytes(self) -> int:
        padded = self.page_size_padded
        return self.content_bytes if padded is None else padded

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.page_size_bytes


_WKV_READS = (
    "block_size",
    "prefix_cacheable",
    "dim",
    "heads",
    "head_dim",
    "dtype",
    "tp_replicated",
    "num_speculative_blocks",
    "page_size_padded",
    "num_heads",
    "tokens_per_state",
    "state_content_size_bytes",
    "page_size_bytes",
    "max_memory_usage_bytes",
)


def _wkv_traits(spec: WkvStateSpec, *, described: bool) -> LayoutTraits:
    dtype = dtype_name(spec.dtype)
    shift, wkv = spec.dim * spec.dtype.itemsize, spec.heads * spec.head_dim**2 * spec.dtype.itemsize
    split = described and not spec.tp_replicated
    return LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=False,
        tp_layout=TPLayout.REPLICATED if spec.tp_replicated else TPLayout.STATE_SHARDED,
        tp_shards=1 if spec.tp_replicated else None,
        token_scope=TokenScope.RECURRENT_STATE,
        window_tokens=None,
        block_size=spec.block_size,
        num_head_slots=1,
        kv_head_contiguous=False,
        tokens_per_state=None,
        states_per_block=1,
        state_bytes=shift + wkv,
        unpadded_page_size_bytes=shift + wkv,
        page_size_bytes=spec.page_size_bytes,
        per_token_bytes=None,
        dtype=dtype,
        kv_quant_mode="NONE",
        components=(
            PageComponent(
                name="shift",
                shape=(spec.dim,),
                dtype=dtype,
                nbytes=shift,
                tp_split=(spec.dim,) if split else None,
            ),
            PageComponent(
                name="wkv",
                shape=(spec.heads, spec.head_dim, spec.head_dim),
                dtype=dtype,
                nbytes=wkv,
                tp_split=(spec.heads,) if split else None,
            ),
        ),
        prefix_cacheable=spec.prefix_cacheable,  # vLLM's default: True
        uses_slot_mapping=True,
        transferable=True,
        attention_page=False,
        token_paged=False,
        keeps_prompt=False,
        holds_hidden_states=False,
        grouped=False,
    )


@register_adapter(WkvStateSpec, registry=REGISTRY, reads=_WKV_READS, ignores=BASE_IGNORES)
def _wkv(spec: WkvStateSpec) -> LayoutTraits:
    return _wkv_traits(spec, described=True)


@dataclass(frozen=True, kw_only=True)
class UndescribedWkvStateSpec(WkvStateSpec):
    """:class:`WkvStateSpec`'s page, whose adapter does not say how it splits by TP."""


@register_adapter(
    UndescribedWkvStateSpec, registry=REGISTRY, reads=_WKV_READS, ignores=BASE_IGNORES
)
def _undescribed(spec: UndescribedWkvStateSpec) -> LayoutTraits:
    return _wkv_traits(spec, described=False)
