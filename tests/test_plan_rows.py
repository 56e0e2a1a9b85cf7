"""Whole-row regions: a paged view whose block is not one dense page, in a block-major
storage, is registered as the storage row, as vLLM 0.32's ``register_kv_caches`` does
(vLLM's test_register_kv_caches[*-BHLNC-*] and
test_register_packed_dsv4_mla_cache_as_single_region). Views are vLLM's own
(``create_kv_cache_views`` through tests/nixl_helpers/layouts.py); bytes move through
real NIXL agents (UCX on DRAM) and are compared through each layer's view."""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from collections.abc import Callable  # NIXL reads its log level at import

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import traits_of
from kvspec_traits.nixl import TraitsNixlAgent
from kvspec_traits.transfer import RegionPlan, plan_regions
from tests.nixl_helpers import layouts

NB = 8


Layout = tuple[KVCacheConfig, dict[str, torch.Tensor]]


def _transfer(
    agents: list[TraitsNixlAgent], build: Callable[[], Layout], block_ids: list[int]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], RegionPlan]:
    config_p, caches_p = build()
    config_d, caches_d = build()
    layouts.fill_pattern(caches_p, seed=21)
    plan_p, plan_d = plan_regions(caches_p, config_p), plan_regions(caches_d, config_d)
    producer, consumer = TraitsNixlAgent(), TraitsNixlAgent()
    agents.extend((producer, consumer))
    producer.register_plan(plan_p)
    consumer.register_plan(plan_d)
    peer = consumer.connect(producer.metadata())
    consumer.read_blocks(peer, [block_ids], timeout=20, progress=producer.progress)
    return caches_p, caches_d, plan_d


def _assert_blocks(
    src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], block_ids: list[int]
) -> None:
    """Through each layer's own view: requested blocks equal the producer's, the
    others are still zero."""

    def raw(view: torch.Tensor) -> torch.Tensor:  # bytes (random fp16 has NaNs)
        return view.contiguous().view(torch.uint8)

    for layer, view in dst.items():
        for block in range(view.shape[0]):
            if block in block_ids:
                assert torch.equal(raw(view[block]), raw(src[layer][block])), (layer, block)
            else:
                assert not bool(raw(view[block]).any()), (layer, block)


def _bhlnc() -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Four full-attention layers of 4 heads x 16 tokens x (K 16 + V 16) fp16 in one
    BHLNC allocation: [B, H, L, N, C], so a layer's block is 4 runs of 1 KiB, one per
    head, 4 KiB apart (the other layers' heads in between)."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=16, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    groups = [KVCacheGroupSpec(names, spec)]
    config = layouts.kv_cache_config(groups, NB, KVCacheLayout.BHLNC)
    return config, layouts.allocate(config, KVCacheLayout.BHLNC)


def test_bhlnc_layers_sharing_storage_are_one_row_region(agents: list[TraitsNixlAgent]) -> None:
    config, caches = _bhlnc()
    page = traits_of(config.kv_cache_groups[0].kv_cache_spec).page_size_bytes
    assert page == 16 * 4 * 2 * 16 * 2  # tokens x heads x (K, V) x head size x fp16
    view = caches["model.layers.0.self_attn.attn"]
    assert not view[0].is_contiguous()  # heads of the other layers in between
    plan = plan_regions(caches, config)
    row = 4 * page  # vLLM's BHLNC block stride: every layer's page of the block
    assert len(plan.regions) == 1
    region = plan.regions[0]
    assert (region.block_len, region.block_stride, region.num_blocks) == (row, row, NB)
    assert region.base_addr == layouts.backing(caches).data_ptr()
    assert region.layers == tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
    assert region.name == "model.layers.0.self_attn.attn"
    assert not region.head_major  # a row is never split by heads
    block_ids = [1, 2, 5]
    src, dst, _ = _transfer(agents, _bhlnc, block_ids)
    _assert_blocks(src, dst, block_ids)


def _dsv4_packed() -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """vLLM's test_register_packed_dsv4_mla_cache_as_single_region: four DeepSeek-V4
    MLA layers (64 states x 584 B = 37376 B, padded to 576 B: 37440 B pages) in one
    BLHNC allocation, each view 37376 B of its 37440 B slot in a 149760 B row."""
    spec = MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        tokens_per_state=4,
        alignment=576,
        model_version="deepseek_v4",
        state_content_bytes=584,
    )
    names = [f"layer{i}" for i in range(4)]
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * 4 * NB, layers=names, layer_stride=page, block_stride=4 * page
    )
    config = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        kv_cache_layout="BLHNC",
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, NB, KVCacheLayout.BLHNC, tensor)
    return config, dict(zip(names, views, strict=True))


def test_packed_deepseek_v4_rows_are_one_region(agents: list[TraitsNixlAgent]) -> None:
    config, caches = _dsv4_packed()
    traits = traits_of(config.kv_cache_groups[0].kv_cache_spec)
    assert (traits.unpadded_page_size_bytes, traits.page_size_bytes) == (
        64 * 584,
        37440,
    )  # 37376 rounded up to a multiple of 576
    plan = plan_regions(caches, config)
    row = 4 * 37440
    assert [(r.base_addr, r.block_len, r.block_stride) for r in plan.regions] == [
        (layouts.backing(caches).data_ptr(), row, row)
    ]
    assert plan.regions[0].layers == ("layer0", "layer1", "layer2", "layer3")
    block_ids = [0, 3, 4]
    src, dst, _ = _transfer(agents, _dsv4_packed, block_ids)
    _assert_blocks(src, dst, block_ids)


def test_rows_are_not_used_for_dense_pages() -> None:
    """LBHNC pages are dense per block: one region per layer, as before."""
    groups = layouts.llama_gqa(1)
    config = layouts.kv_cache_config(groups, NB, KVCacheLayout.LBHNC)
    plan = plan_regions(layouts.allocate(config, KVCacheLayout.LBHNC), config)
    assert len(plan.regions) == 4
    page = 16 * 8 * 2 * 128 * 2
    assert [(r.block_len, r.block_stride) for r in plan.regions] == [(page, page)] * 4
