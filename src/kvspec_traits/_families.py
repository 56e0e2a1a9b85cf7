"""Model families: real vLLM KV cache specs, built as each model's ``get_kv_cache_spec``
builds them.

One function per family (its docstring names the vLLM code it mirrors). The defaults are
the named model's sizes at TP 1, which :mod:`kvspec_traits.catalog` shows; the keyword
parameters are the ones a server changes (the attention backend's block size, the model
and cache dtypes, the TP size) and the ones a test shrinks to a tiny model's (head
counts, state widths). The catalog, the NIXL test layouts (tests/nixl_helpers/layouts.py)
and the connector's differential tests all build their specs here.

Importing this module imports vLLM and torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Unpack

from kvspec_traits._deps import needs

with needs("kvspec_traits._families (real vLLM specs of model families)"):
    import torch
    from vllm.v1 import kv_cache_interface as kvi

__all__ = [
    "DeepSeekV4Caches",
    "StateOptions",
    "deepseek_v3_mla",
    "deepseek_v32_indexer",
    "deepseek_v4",
    "gdn_state",
    "gpt_oss",
    "llama4",
    "llama_gqa",
    "mamba1_state",
]

BF16: Any = torch.bfloat16
# The key width of DeepSeek's MLA latent cache: 512 NoPE + 64 RoPE elements per token.
MLA_HEAD_SIZE = 576


def _heads(total: int, tp: int) -> int:
    # vLLM's attention layers: the KV heads are split by TP, replicated below one a rank.
    return max(total // tp, 1)


def llama_gqa(
    *,
    block_size: int = 16,
    num_kv_heads: int = 8,
    head_size: int = 128,
    dtype: torch.dtype = BF16,
    cache_dtype: Literal["auto", "fp8"] = "auto",
    tp: int = 1,
) -> kvi.FullAttentionSpec:
    """Llama-3 8B grouped-query attention (vllm/model_executor/layers/attention/
    attention.py ``get_kv_cache_spec``): 8 KV heads of 128 split by TP; an fp8 KV cache
    stores float8_e4m3fn."""
    return kvi.FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=_heads(num_kv_heads, tp),
        head_size=head_size,
        dtype=torch.float8_e4m3fn if cache_dtype == "fp8" else dtype,
        kv_quant_mode=kvi.get_kv_quant_mode(cache_dtype),
    )


def deepseek_v3_mla(
    *,
    block_size: int = 64,
    dtype: torch.dtype = BF16,
    cache_dtype: Literal["auto", "fp8_ds_mla"] | None = "auto",
) -> kvi.MLAAttentionSpec:
    """DeepSeek-V2/V3 MLA (vllm/model_executor/layers/attention/mla_attention.py): one
    latent of 576 per token, replicated across TP; fp8_ds_mla stores 656 bytes of
    content per token as uint8. ``cache_dtype=None`` leaves the spec's
    ``cache_dtype_str`` unset, as a spec built outside a model (a bare group) has it."""
    ds = cache_dtype == "fp8_ds_mla"
    return kvi.MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=MLA_HEAD_SIZE,
        dtype=torch.uint8 if ds else dtype,
        cache_dtype_str=cache_dtype,
        kv_quant_mode=kvi.get_kv_quant_mode(cache_dtype or "auto"),
        state_content_bytes=656 if ds else None,
    )


def deepseek_v32_indexer(*, block_size: int = 64) -> kvi.MLAAttentionSpec:
    """DeepSeek-V3.2's indexer key cache (vllm/model_executor/models/deepseek_v2.py):
    head_dim 128 + 128 // 128 * 4 scale bytes, fp8 stored as uint8, INDEXER role."""
    return kvi.MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=kvi.SparseCacheRole.INDEXER,
    )


@dataclass(frozen=True, slots=True)
class DeepSeekV4Caches:
    """The caches of a DeepSeek-V4 layer with an fp8_ds_mla KV cache (compress ratio 4),
    and the compressor ring of DeepSeek-V4.1."""

    mla: kvi.MLAAttentionSpec
    """Compressed MLA (models/deepseek_v4/attention.py): 4 tokens per state, 584 B of
    state (448 B NoPE + 128 B RoPE + 8 B scale), pages padded to 576 B."""
    indexer: kvi.MLAAttentionSpec
    """The compressed indexer cache (models/deepseek_v4/attention.py): 132 B, ratio 4."""
    swa: kvi.SlidingWindowMLASpec
    """The sparse SWA cache (v1/attention/backends/mla/sparse_swa.py
    ``DeepseekV4SWACache``): 584 B per token, 128-token window, pages padded to 576 B."""
    compressor_state: kvi.SlidingWindowMLASpec
    """The SWA-MLA compressor state (models/deepseek_v4/compressor.py): state_dim =
    2 * coff(2) * head_dim(512) float32; block size = the ratio (4)."""
    ring: kvi.CircularBufferSpec
    """DeepSeek-V4.1's compressor ring (models/deepseek_v41/compressor.py)."""


def deepseek_v4(*, block_size: int = 64) -> DeepSeekV4Caches:
    """DeepSeek-V4's caches at the attention backend's ``block_size`` (the compressor
    state and the ring keep their own block sizes)."""
    fp8 = kvi.get_kv_quant_mode("fp8_ds_mla")
    return DeepSeekV4Caches(
        mla=kvi.MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=512,
            dtype=torch.uint8,
            tokens_per_state=4,
            cache_dtype_str="fp8_ds_mla",
            alignment=576,
            model_version="deepseek_v4",
            kv_quant_mode=fp8,
            state_content_bytes=584,
        ),
        indexer=kvi.MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=132,
            dtype=torch.uint8,
            tokens_per_state=4,
            alignment=576,
        ),
        swa=kvi.SlidingWindowMLASpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=512,
            dtype=torch.uint8,
            sliding_window=128,
            cache_dtype_str="fp8_ds_mla",
            state_content_bytes=584,
            alignment=576,
            model_version="deepseek_v4",
            kv_quant_mode=fp8,
        ),
        compressor_state=kvi.SlidingWindowMLASpec(
            block_size=4,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=2048,
            dtype=torch.float32,
            sliding_window=8,
            alignment=512,
        ),
        ring=kvi.CircularBufferSpec(
            block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0, dtype=torch.float32
        ),
    )


def gpt_oss(
    *,
    block_size: int = 16,
    num_kv_heads: int = 8,
    head_size: int = 64,
    dtype: torch.dtype = BF16,
    sliding_window: int = 128,
    tp: int = 1,
) -> tuple[kvi.FullAttentionSpec, kvi.SlidingWindowSpec]:
    """gpt-oss (vllm/model_executor/layers/attention/attention.py): full and 128-token
    sliding-window layers alternate, 8 KV heads of 64; (full, sliding window)."""
    heads = _heads(num_kv_heads, tp)
    return (
        kvi.FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype
        ),
        kvi.SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=dtype,
            sliding_window=sliding_window,
        ),
    )


def llama4(
    *,
    block_size: int = 16,
    num_kv_heads: int = 8,
    head_size: int = 128,
    dtype: torch.dtype = BF16,
    attention_chunk_size: int = 8192,
    tp: int = 1,
) -> tuple[kvi.ChunkedLocalAttentionSpec, kvi.FullAttentionSpec]:
    """Llama-4 (vllm/model_executor/layers/attention/chunked_local_attention.py): three
    chunked-local (8192-token) layers per global one, 8 KV heads of 128; (local, full)."""
    heads = _heads(num_kv_heads, tp)
    return (
        kvi.ChunkedLocalAttentionSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=dtype,
            attention_chunk_size=attention_chunk_size,
        ),
        kvi.FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype
        ),
    )


ConvLayout = Literal["SD", "DS"]


class StateOptions(TypedDict, total=False):
    """How a recurrent state is allocated, for :func:`gdn_state` and :func:`mamba1_state`:
    ``block_size`` (default 1024), ``conv_layout`` (vLLM's default ``"SD"`` stores the conv
    state transposed, ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` as (conv_dim, kernel - 1)),
    ``page_size_padded`` (a hybrid model's unified page) and ``mamba_type`` (a
    ``MambaAttentionBackendEnum`` member's name; default: the spec's own)."""

    block_size: int
    conv_layout: ConvLayout
    page_size_padded: int | None
    mamba_type: str | None


def _mamba(
    conv: tuple[int, int],
    ssm: tuple[int, ...],
    dtypes: tuple[torch.dtype, torch.dtype],
    options: StateOptions,
) -> kvi.MambaSpec:
    # conv is (conv_dim, kernel - 1).
    shape = conv if options.get("conv_layout", "SD") == "DS" else (conv[1], conv[0])
    extra: dict[str, Any] = {}
    mamba_type = options.get("mamba_type")
    if mamba_type is not None:
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        extra["mamba_type"] = MambaAttentionBackendEnum[mamba_type]
    return kvi.MambaSpec(
        block_size=options.get("block_size", 1024),
        shapes=(shape, ssm),
        dtypes=dtypes,
        page_size_padded=options.get("page_size_padded"),
        **extra,
    )


def gdn_state(
    *,
    conv_dim: int = 8192,
    value_heads: int = 32,
    head_k: int = 128,
    head_v: int = 128,
    dtypes: tuple[torch.dtype, torch.dtype] = (BF16, torch.float32),
    tp: int = 1,
    **options: Unpack[StateOptions],
) -> kvi.MambaSpec:
    """Qwen3.5's Gated DeltaNet state (vllm/model_executor/layers/mamba/abstract.py):
    the conv state (conv_dim [Q, K, V] x kernel 4 - 1, TP-sharded) and the SSM state
    (value heads x head_k x head_v, TP-sharded)."""
    return _mamba((conv_dim // tp, 3), (value_heads // tp, head_k, head_v), dtypes, options)


def mamba1_state(
    *,
    d_inner: int = 8192,
    state_size: int = 16,
    dtypes: tuple[torch.dtype, torch.dtype] = (BF16, BF16),
    tp: int = 1,
    **options: Unpack[StateOptions],
) -> kvi.MambaSpec:
    """Jamba's Mamba-1 state (vllm/model_executor/layers/mamba/abstract.py): conv state
    (d_inner x kernel 4 - 1) and SSM state (d_inner x 16), d_inner TP-sharded."""
    return _mamba((d_inner // tp, 3), (d_inner // tp, state_size), dtypes, options)
