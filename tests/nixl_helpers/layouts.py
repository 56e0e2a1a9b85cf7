"""Real vLLM specs, laid out as vLLM lays them, for the NIXL shim tests and benchmark.

`kv_cache_config` reproduces vLLM 0.32's ``get_kv_cache_config_from_groups`` (kv_cache_utils)
without a ``VllmConfig``: bytes per block as ``_get_kv_cache_bytes_per_block``, one
``KVCacheTensor`` per (group, spec) with strides from vLLM's own ``compute_layout_strides``,
groups aliasing from byte 0. `allocate` is vLLM's ``allocate_kv_cache`` loop over vLLM's
own ``create_kv_cache_views`` (importing ``vllm.v1.worker.utils`` itself takes 20-50 s).

Each family builder mirrors the model's ``get_kv_cache_spec`` (file named in its
docstring) with small dimensions where the real ones do not matter.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    compute_layout_strides,
    create_kv_cache_views,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

__all__ = ["Family", "FAMILIES", "allocate", "fill_pattern", "kv_cache_config"]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _layer_spec(group: KVCacheGroupSpec, layer: str) -> KVCacheSpec:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer]
    return spec


def _bytes_per_block(groups: list[KVCacheGroupSpec], layout: KVCacheLayout) -> int:
    # vLLM's _get_kv_cache_bytes_per_block.
    if not layout.is_block_outermost:
        return max(
            sum(
                _round_up(
                    _layer_spec(g, n).page_size_bytes,
                    _layer_spec(g, n).get_block_stride_alignment(),
                )
                for n in g.layer_names
            )
            for g in groups
        )
    per_block = max(sum(_layer_spec(g, n).page_size_bytes for n in g.layer_names) for g in groups)
    alignments = [
        _layer_spec(g, n).get_block_stride_alignment() for g in groups for n in g.layer_names
    ]
    return _round_up(per_block, math.lcm(*alignments))


def kv_cache_config(
    groups: list[KVCacheGroupSpec], num_blocks: int, layout: KVCacheLayout
) -> KVCacheConfig:
    """vLLM's get_kv_cache_config_from_groups for a fixed block count."""
    bytes_per_block = _bytes_per_block(groups, layout)
    interleaved = bytes_per_block if layout.is_block_outermost else None
    size = bytes_per_block * num_blocks
    tensors = []
    for group in groups:
        by_spec: defaultdict[KVCacheSpec, list[str]] = defaultdict(list)
        for name in group.layer_names:
            by_spec[_layer_spec(group, name)].append(name)
        offset = 0
        for spec, names in by_spec.items():
            block_stride = interleaved
            padded = _round_up(spec.page_size_bytes, spec.get_block_stride_alignment())
            if block_stride is None and padded != spec.page_size_bytes:
                block_stride = padded
            layer_stride, block_stride, _, _, _ = compute_layout_strides(
                spec,
                num_blocks,
                len(names),
                layout,
                fixed_strides=(None, block_stride, None, None, None),
            )
            tensors.append(
                KVCacheTensor(
                    size=size,
                    layers=names,
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                    offset=offset,
                )
            )
            offset += len(names) * (
                spec.page_size_bytes if layout.is_block_outermost else layer_stride
            )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout=layout.name,
    )


def allocate(
    config: KVCacheConfig, layout: KVCacheLayout, kernel_block_sizes: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """vLLM's allocate_kv_cache (CPU): one int8 buffer, per-layer [B, H, N, C] views
    (kernel-block rows where ``kernel_block_sizes[group]`` splits a block)."""
    size = config.kv_cache_tensors[0].size
    buf = torch.zeros(size, dtype=torch.int8)
    caches: dict[str, torch.Tensor] = {}
    for tensor in config.kv_cache_tensors:
        gid, group = next(
            (i, g)
            for i, g in enumerate(config.kv_cache_groups)
            if tensor.layers[0] in g.layer_names
        )
        spec = _layer_spec(group, tensor.layers[0])
        kernel = None if kernel_block_sizes is None else kernel_block_sizes[gid]
        views = create_kv_cache_views(
            buf, spec, config.num_blocks, layout, tensor, kernel_block_size=kernel
        )
        caches.update(zip(tensor.layers, views, strict=True))
    return caches


def fill_pattern(caches: dict[str, torch.Tensor], seed: int) -> None:
    """Fill the whole backing allocation with seeded random bytes."""
    storage = next(iter(caches.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))


def backing(caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """The shared backing allocation as a flat uint8 tensor (a view, not a copy)."""
    storage = next(iter(caches.values())).untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@dataclass(frozen=True)
class Family:
    name: str
    groups: Callable[[int], list[KVCacheGroupSpec]]
    """Cache groups for a TP size."""
    layout: KVCacheLayout


def _names(prefix: str, idx: range, suffix: str) -> list[str]:
    return [f"{prefix}.{i}.{suffix}" for i in idx]


def _group(names: list[str], spec: KVCacheSpec) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)


def llama_gqa(tp: int, layers: int = 4) -> list[KVCacheGroupSpec]:
    """Llama-3 8B GQA (attention.py get_kv_cache_spec): 8 KV heads of 128 split by TP."""
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8 // tp, head_size=128, dtype=torch.bfloat16
    )
    return [_group(_names("model.layers", range(layers), "self_attn.attn"), spec)]


def _mla(dtype: str = "auto", **kw: object) -> MLAAttentionSpec:
    # mla_attention.py get_kv_cache_spec: one latent of 512 + 64 rope = 576.
    ds = dtype == "fp8_ds_mla"
    return MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=576,
        dtype=torch.uint8 if ds else torch.bfloat16,
        cache_dtype_str=dtype,
        kv_quant_mode=get_kv_quant_mode(dtype),
        state_content_bytes={"fp8_ds_mla": 656}.get(dtype),
        **kw,  # type: ignore[arg-type]
    )


def deepseek_v3(tp: int, layers: int = 3, dtype: str = "auto") -> list[KVCacheGroupSpec]:
    del tp  # MLA is replicated: the same spec on every rank
    return [_group(_names("model.layers", range(layers), "self_attn.attn"), _mla(dtype))]


def deepseek_v32(tp: int, layers: int = 3) -> list[KVCacheGroupSpec]:
    """MLA (fp8_ds_mla) plus the V3.2 indexer cache (deepseek_v2.py: 128 + 4 scale bytes,
    uint8, INDEXER role); both FullAttention-type, so one UniformType group."""
    from vllm.v1.kv_cache_interface import SparseCacheRole

    del tp
    specs: dict[str, KVCacheSpec] = {}
    for i in range(layers):
        specs[f"model.layers.{i}.self_attn.attn"] = _mla("fp8_ds_mla")
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=64,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=132,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        )
    uniform = UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=specs)
    return [_group(list(specs), uniform)]


def deepseek_v4_specs(layers: int) -> dict[str, list[tuple[str, KVCacheSpec]]]:
    """DeepSeek-V4 caches (models/deepseek_v4/attention.py, compressor.py,
    deepseek_v41/compressor.py), fp8_ds_mla: compressed MLA (ratio 4, 584 B states,
    576 B alignment), SWA-MLA compressor state (max_tp_shards=1), the ring
    (CircularBufferSpec) and the indexer cache (132 B, ratio 4)."""
    mla = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        tokens_per_state=4,
        cache_dtype_str="fp8_ds_mla",
        alignment=576,
        model_version="deepseek_v4",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
        state_content_bytes=584,
    )
    swa = SlidingWindowMLASpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.bfloat16,
        sliding_window=128,
        alignment=576,
    )
    ring = CircularBufferSpec(
        block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0, dtype=torch.float32
    )
    indexer = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=132,
        dtype=torch.uint8,
        tokens_per_state=4,
        alignment=576,
    )
    out: dict[str, list[tuple[str, KVCacheSpec]]] = {
        "mla": [],
        "swa": [],
        "ring": [],
        "indexer": [],
    }
    for i in range(layers):
        out["mla"].append((f"model.layers.{i}.attn.mla", mla))
        out["swa"].append((f"model.layers.{i}.attn.compressor.swa", swa))
        out["ring"].append((f"model.layers.{i}.attn.compressor.ring", ring))
        out["indexer"].append((f"model.layers.{i}.attn.indexer.k_cache", indexer))
    return out


def deepseek_v4(tp: int, layers: int = 2) -> list[KVCacheGroupSpec]:
    del tp
    return [
        _group([n for n, _ in members], members[0][1])
        for members in deepseek_v4_specs(layers).values()
    ]


def gpt_oss(tp: int, layers: int = 4) -> list[KVCacheGroupSpec]:
    """gpt-oss: alternating full and 128-token sliding-window layers, 8 KV heads of 64;
    two groups of equal page size that alias (hybrid allocator)."""
    full = FullAttentionSpec(
        block_size=16, num_kv_heads=8 // tp, head_size=64, dtype=torch.bfloat16
    )
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=8 // tp, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    return [
        _group(_names("model.layers", range(0, layers, 2), "attn"), full),
        _group(_names("model.layers", range(1, layers, 2), "attn"), swa),
    ]


def llama4(tp: int, layers: int = 4) -> list[KVCacheGroupSpec]:
    """Llama-4: three chunked-local (8192) layers per global one, 8 KV heads of 128."""
    local = ChunkedLocalAttentionSpec(
        block_size=16,
        num_kv_heads=8 // tp,
        head_size=128,
        dtype=torch.bfloat16,
        attention_chunk_size=8192,
    )
    full = FullAttentionSpec(
        block_size=16, num_kv_heads=8 // tp, head_size=128, dtype=torch.bfloat16
    )
    return [
        _group([f"model.layers.{i}.attn" for i in range(layers) if i % 4 != 3], local),
        _group([f"model.layers.{i}.attn" for i in range(layers) if i % 4 == 3], full),
    ]


def qwen35(tp: int, layers: int = 4) -> list[KVCacheGroupSpec]:
    """Qwen3.5: GDN (mamba/abstract.py MambaSpec: conv + ssm state, TP-sharded) for three
    of four layers, full attention for the fourth; vLLM unifies the page size by raising
    the attention block size and padding the Mamba page to it."""
    conv = (3 * 2048 // tp, 3)  # conv_dim x (kernel - 1)
    ssm = (16 // tp, 128, 128)  # value heads x head_k x head_v
    state = 2 * (conv[0] * conv[1]) + 2 * math.prod(ssm)  # bf16
    attn_block = 16
    # 2 KV heads of 256, K and V, bf16: 2048 bytes per token at TP 1.
    while attn_block * max(2 // tp, 1) * 256 * 2 * 2 < state:
        attn_block *= 2
    attn = FullAttentionSpec(
        block_size=attn_block, num_kv_heads=max(2 // tp, 1), head_size=256, dtype=torch.bfloat16
    )
    gdn = MambaSpec(
        block_size=attn_block,
        shapes=(conv, ssm),
        dtypes=(torch.bfloat16, torch.bfloat16),
        page_size_padded=attn.page_size_bytes,
    )
    return [
        _group([f"model.layers.{i}.linear_attn" for i in range(layers) if i % 4 != 3], gdn),
        _group([f"model.layers.{i}.self_attn.attn" for i in range(layers) if i % 4 == 3], attn),
    ]


def jamba(tp: int, layers: int = 4) -> list[KVCacheGroupSpec]:
    """Jamba: Mamba1 layers (conv (d_inner, 3) + ssm (d_inner, 16), fp32) with one
    attention layer in four (8 KV heads of 128)."""
    d_inner = 512 // tp
    conv, ssm = (d_inner, 3), (d_inner, 16)
    state = 4 * (math.prod(conv) + math.prod(ssm))
    block = 16
    attn = FullAttentionSpec(
        block_size=block, num_kv_heads=8 // tp, head_size=128, dtype=torch.bfloat16
    )
    while attn.page_size_bytes < state:
        block *= 2
        attn = FullAttentionSpec(
            block_size=block, num_kv_heads=8 // tp, head_size=128, dtype=torch.bfloat16
        )
    mamba = MambaSpec(
        block_size=block,
        shapes=(conv, ssm),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=attn.page_size_bytes,
    )
    return [
        _group([f"model.layers.{i}.mamba" for i in range(layers) if i % 4 != 1], mamba),
        _group([f"model.layers.{i}.attn" for i in range(layers) if i % 4 == 1], attn),
    ]


FAMILIES: dict[str, Family] = {
    "llama_gqa": Family("llama_gqa", llama_gqa, KVCacheLayout.LBHNC),
    "deepseek_v3": Family("deepseek_v3", deepseek_v3, KVCacheLayout.LBHNC),
    "deepseek_v3_fp8": Family(
        "deepseek_v3_fp8", lambda tp: deepseek_v3(tp, dtype="fp8_ds_mla"), KVCacheLayout.LBHNC
    ),
    "deepseek_v32": Family("deepseek_v32", deepseek_v32, KVCacheLayout.LBHNC),
    "deepseek_v4": Family("deepseek_v4", deepseek_v4, KVCacheLayout.BLHNC),
    "gpt_oss": Family("gpt_oss", gpt_oss, KVCacheLayout.LBHNC),
    "llama4": Family("llama4", llama4, KVCacheLayout.LBHNC),
    "qwen35": Family("qwen35", qwen35, KVCacheLayout.LBHNC),
    "jamba": Family("jamba", jamba, KVCacheLayout.LBHNC),
}


def build(
    family: str, num_blocks: int, tp: int = 1, kernel_block_size: int | None = None
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """A family's config and caches; ``kernel_block_size`` splits the attention groups'
    blocks into kernel blocks of that many tokens (Mamba groups are never split)."""
    fam = FAMILIES[family]
    config = kv_cache_config(fam.groups(tp), num_blocks, fam.layout)
    kernels = None
    if kernel_block_size is not None:
        kernels = [
            spec.block_size if isinstance(spec, MambaSpec) else kernel_block_size
            for spec in (g.kv_cache_spec for g in config.kv_cache_groups)
        ]
    return config, allocate(config, fam.layout, kernels)
