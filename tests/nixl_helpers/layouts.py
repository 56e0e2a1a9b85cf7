"""Real vLLM specs, laid out as vLLM lays them, for the NIXL shim tests and benchmark.

`kv_cache_config` reproduces vLLM 0.32's ``get_kv_cache_config_from_groups`` (kv_cache_utils)
without a ``VllmConfig``: bytes per block as ``_get_kv_cache_bytes_per_block``, one
``KVCacheTensor`` per (group, spec) with strides from vLLM's own ``compute_layout_strides``,
groups aliasing from byte 0. `allocate` is vLLM's ``allocate_kv_cache`` loop over vLLM's
own ``create_kv_cache_views`` (importing ``vllm.v1.worker.utils`` itself takes 20-50 s).

Each family builder lays out the specs of ``kvspec_traits._families`` (which mirror the
models' ``get_kv_cache_spec``, vLLM file named there) in vLLM's cache groups, with small
dimensions where the real ones do not matter. :class:`Family` is the one description of
a test layout: its groups per TP size, its layout and, for the connector tests, the tiny
model and MLA backend of the worker's config.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import _families as families

if TYPE_CHECKING:
    from tests.mla_backends import MLABackend

AttnSpec = TypeVar("AttnSpec", bound=AttentionSpec)

__all__ = [
    "DSV2",
    "FAMILIES",
    "LLAMA",
    "Family",
    "allocate",
    "build",
    "fill_pattern",
    "group",
    "kv_cache_config",
    "layer_names",
]


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


LLAMA, DSV2 = "llama", "deepseek-v2"
"""The tiny served models (tests/conftest.py ``tiny_models``) a connector worker's config
reads: a Llama (no MLA) and a DeepSeek-V2 (MLA)."""


@dataclass(frozen=True)
class Family:
    """A model family's cache groups for a TP size, the layout vLLM allocates them in,
    and, for the connector's worker tests, the tiny model whose config the worker reads
    and the MLA backend that config selects (None: not an MLA model)."""

    groups: Callable[[int], list[KVCacheGroupSpec]]
    layout: KVCacheLayout
    model: str = LLAMA
    mla_backend: MLABackend | None = None


def layer_names(fmt: str, idx: Iterable[int]) -> list[str]:
    return [fmt.format(i) for i in idx]


def group(names: list[str], spec: KVCacheSpec) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)


def stage_groups(groups: list[KVCacheGroupSpec], held: range) -> list[KVCacheGroupSpec]:
    """The cache groups of a pipeline stage that holds model layers ``held`` (the
    ``(start, end)`` of vLLM's ``get_pp_indices``): each group with its layers whose
    index (``...layers.{i}...``) is in ``held``; a group left empty is dropped, as a
    stage's KV cache config has only its own layers."""
    staged = [
        group(
            [n for n in g.layer_names if int(n.split("layers.")[1].split(".")[0]) in held],
            g.kv_cache_spec,
        )
        for g in groups
    ]
    return [g for g in staged if g.layer_names]


def grown_attention(state_bytes: int, attention: Callable[[int], AttnSpec], block: int) -> AttnSpec:
    """``attention(block)`` at the first block size, doubling from ``block``, whose page
    holds a recurrent state of ``state_bytes``: vLLM unifies a hybrid model's page size by
    raising the attention block size and padding the state page to the attention page."""
    spec = attention(block)
    while spec.page_size_bytes < state_bytes:
        block *= 2
        spec = attention(block)
    return spec


# Each builder mirrors the model's get_kv_cache_spec through kvspec_traits._families (the
# vLLM file is named there); ``spec`` overrides that family's sizes (block size, dtype,
# heads) where a test serves a tiny model or an attention backend's block size.


def llama_gqa(tp: int, layers: int = 4, **spec: Any) -> list[KVCacheGroupSpec]:
    """Llama-3 8B GQA: 8 KV heads of 128 split by TP."""
    attn = families.llama_gqa(tp=tp, **spec)
    return [group(layer_names("model.layers.{}.self_attn.attn", range(layers)), attn)]


def deepseek_v3(
    tp: int, layers: int = 3, cache_dtype: str | None = "auto", **spec: Any
) -> list[KVCacheGroupSpec]:
    del tp  # MLA is replicated: the same spec on every rank
    mla = families.deepseek_v3_mla(cache_dtype=cache_dtype, **spec)  # type: ignore[arg-type]
    return [group(layer_names("model.layers.{}.self_attn.attn", range(layers)), mla)]


def deepseek_v32(
    tp: int, layers: int = 3, block_size: int = 64, **mla: Any
) -> list[KVCacheGroupSpec]:
    """MLA (fp8_ds_mla unless ``mla`` says otherwise) plus the V3.2 indexer cache; both
    FullAttention-type, so one UniformType group."""
    del tp
    mla = {"cache_dtype": "fp8_ds_mla", **mla}
    specs: dict[str, KVCacheSpec] = {}
    for i in range(layers):
        specs[f"model.layers.{i}.self_attn.attn"] = families.deepseek_v3_mla(
            block_size=block_size, **mla
        )
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = families.deepseek_v32_indexer(
            block_size=block_size
        )
    uniform = UniformTypeKVCacheSpecs(block_size=block_size, kv_cache_specs=specs)
    return [group(list(specs), uniform)]


# The four DeepSeek-V4 caches the NIXL tests lay out per layer (kvspec_traits._families:
# compressed MLA, the sparse SWA cache, V4.1's compressor ring, the indexer cache), by
# layer-name suffix.
DSV4_CACHES = {
    "mla": "attn.mla",
    "swa": "attn.compressor.swa",
    "ring": "attn.compressor.ring",
    "indexer": "attn.indexer.k_cache",
}


def deepseek_v4_specs(
    layers: int, block_size: int = 64
) -> dict[str, list[tuple[str, KVCacheSpec]]]:
    """Per cache kind of :data:`DSV4_CACHES`, (layer name, spec) of every layer."""
    caches = families.deepseek_v4(block_size=block_size)
    return {
        kind: [(f"model.layers.{i}.{suffix}", getattr(caches, kind)) for i in range(layers)]
        for kind, suffix in DSV4_CACHES.items()
    }


def deepseek_v4(tp: int, layers: int = 2, block_size: int = 64) -> list[KVCacheGroupSpec]:
    del tp
    return [
        group([n for n, _ in members], members[0][1])
        for members in deepseek_v4_specs(layers, block_size).values()
    ]


def gpt_oss(tp: int, layers: int = 4, **spec: Any) -> list[KVCacheGroupSpec]:
    """gpt-oss: alternating full and sliding-window layers; two groups of equal page
    size that alias (hybrid allocator)."""
    full, swa = families.gpt_oss(tp=tp, **spec)
    return [
        group(layer_names("model.layers.{}.attn", range(0, layers, 2)), full),
        group(layer_names("model.layers.{}.attn", range(1, layers, 2)), swa),
    ]


def llama4(tp: int, layers: int = 4, **spec: Any) -> list[KVCacheGroupSpec]:
    """Llama-4: three chunked-local layers per global one."""
    local, full = families.llama4(tp=tp, **spec)
    return [
        group([f"model.layers.{i}.attn" for i in range(layers) if i % 4 != 3], local),
        group([f"model.layers.{i}.attn" for i in range(layers) if i % 4 == 3], full),
    ]


def qwen35(tp: int, layers: int = 4) -> list[KVCacheGroupSpec]:
    """Qwen3.5, small: GDN state (conv [Q, K, V] 3 x 2048 wide, 16 value heads of
    128 x 128, bf16, TP-sharded) for three of four layers, full attention (2 KV heads of
    256) for the fourth."""
    gdn: dict[str, Any] = {
        "conv_dim": 3 * 2048,
        "value_heads": 16,
        "dtypes": (torch.bfloat16,) * 2,
        "tp": tp,
    }
    state = families.gdn_state(conv_layout="DS", **gdn).page_size_bytes
    attn = grown_attention(
        state,
        lambda block: families.llama_gqa(block_size=block, num_kv_heads=2, head_size=256, tp=tp),
        16,
    )
    state_spec = families.gdn_state(
        block_size=attn.block_size, conv_layout="DS", page_size_padded=attn.page_size_bytes, **gdn
    )
    return [
        group([f"model.layers.{i}.linear_attn" for i in range(layers) if i % 4 != 3], state_spec),
        group([f"model.layers.{i}.self_attn.attn" for i in range(layers) if i % 4 == 3], attn),
    ]


def jamba(tp: int, layers: int = 4) -> list[KVCacheGroupSpec]:
    """Jamba, small: Mamba-1 layers (d_inner 512, fp32) with one attention layer in four
    (8 KV heads of 128)."""
    m1: dict[str, Any] = {"d_inner": 512, "dtypes": (torch.float32,) * 2, "tp": tp}
    state = families.mamba1_state(conv_layout="DS", **m1).page_size_bytes
    attn = grown_attention(state, lambda block: families.llama_gqa(block_size=block, tp=tp), 16)
    mamba = families.mamba1_state(
        block_size=attn.block_size, conv_layout="DS", page_size_padded=attn.page_size_bytes, **m1
    )
    return [
        group([f"model.layers.{i}.mamba" for i in range(layers) if i % 4 != 1], mamba),
        group([f"model.layers.{i}.attn" for i in range(layers) if i % 4 == 1], attn),
    ]


FAMILIES: dict[str, Family] = {
    "llama_gqa": Family(llama_gqa, KVCacheLayout.LBHNC),
    "deepseek_v3": Family(deepseek_v3, KVCacheLayout.LBHNC),
    "deepseek_v3_fp8": Family(
        lambda tp: deepseek_v3(tp, cache_dtype="fp8_ds_mla"), KVCacheLayout.LBHNC
    ),
    "deepseek_v32": Family(deepseek_v32, KVCacheLayout.LBHNC),
    "deepseek_v4": Family(deepseek_v4, KVCacheLayout.BLHNC),
    "gpt_oss": Family(gpt_oss, KVCacheLayout.LBHNC),
    "llama4": Family(llama4, KVCacheLayout.LBHNC),
    "qwen35": Family(qwen35, KVCacheLayout.LBHNC),
    "jamba": Family(jamba, KVCacheLayout.LBHNC),
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
