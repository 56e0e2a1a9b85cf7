"""Region planning from traits, without NIXL: real vLLM specs, tensors laid out by vLLM's
own ``compute_layout_strides``/``create_kv_cache_views`` (see nixl_helpers/layouts.py).

Expected values are hand-computed from vLLM's formulas and say so: a page is
``num_heads * num_states * state_content_size_bytes`` (AttentionSpec), padded by
``_apply_alignment_padding`` to a multiple of ``alignment``; layer-outer layouts place
layer ``l`` at ``offset + l * num_blocks * page``; groups alias from byte 0.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import numpy as np
import pytest
import torch
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import TokenScope, TPLayout
from kvspec_traits.extend import LayoutTraits, default_registry
from kvspec_traits.nixl import (
    MissingPeerError,
    block_desc_ids,
    build_block_descs,
    build_state_descs,
    merge_runs,
    transfer_items,
)
from kvspec_traits.transfer import (
    SHARED_REGION_GROUP_ID,
    BlockIdError,
    MissingLayerError,
    PlanLayout,
    Read,
    RegionConflictError,
    RegionPlan,
    Rows,
    UnsupportedLayoutError,
    lanes_of,
    peer_regions,
    plan_regions,
    tp_reads,
)
from tests.nixl_helpers import layouts

NB = 8


def _plan(family: str, num_blocks: int = NB, tp: int = 1, rank: int = 0) -> tuple[RegionPlan, int]:
    config, caches = layouts.build(family, num_blocks, tp=tp)
    plan = plan_regions(caches, config, tp_size=tp, tp_rank=rank)
    return plan, plan.registrations[0].base


def _offsets(plan: RegionPlan, base: int) -> list[int]:
    return [r.base_addr - base for r in plan.regions]


# -- layout families ---------------------------------------------------------------------


def test_llama_gqa_one_head_sharded_region_per_layer() -> None:
    plan, base = _plan("llama_gqa")
    page = 16 * 8 * (128 + 128) * 2  # block 16, 8 KV heads, K+V of 128, bf16
    assert [r.block_len for r in plan.regions] == [page] * 4
    assert [r.block_stride for r in plan.regions] == [page] * 4
    assert _offsets(plan, base) == [i * NB * page for i in range(4)]  # layer-outer
    assert [r.replicated for r in plan.regions] == [False] * 4
    assert plan.region_group_ids == [0] * 4
    assert [r.num_blocks for r in plan.regions] == [NB] * 4
    assert all(r.tp_layout is TPLayout.HEAD_SHARDED and r.head_major for r in plan.regions)
    assert plan.registrations[0].length == 4 * NB * page


def test_llama_gqa_tp2_halves_the_block() -> None:
    plan, _ = _plan("llama_gqa", tp=2, rank=1)
    assert [r.block_len for r in plan.regions] == [16 * 4 * 256 * 2] * 4
    assert all(r.num_head_slots == 4 for r in plan.regions)


def test_llama_nhd_layout_is_not_head_major() -> None:
    # LBNHC puts heads inside each token: a head slice of a block is not one run.
    groups = layouts.llama_gqa(1)
    config = layouts.kv_cache_config(groups, NB, KVCacheLayout.LBNHC)
    plan = plan_regions(layouts.allocate(config, KVCacheLayout.LBNHC), config)
    assert [r.block_len for r in plan.regions] == [65536] * 4
    assert not any(r.head_major for r in plan.regions)
    with pytest.raises(ValueError, match="head slices are not contiguous"):
        tp_reads(plan.regions[0], local_tp=1, local_rank=0, remote_tp=2)


@pytest.mark.parametrize(
    ("family", "page"),
    [
        ("deepseek_v3", 64 * 576 * 2),  # bf16 latent of 512 + 64 rope
        ("deepseek_v3_fp8", 64 * 656),  # fp8_ds_mla: 656 opaque bytes per token
    ],
)
def test_deepseek_v3_mla_is_replicated(family: str, page: int) -> None:
    plan, base = _plan(family)
    assert [r.block_len for r in plan.regions] == [page] * 3
    assert _offsets(plan, base) == [i * NB * page for i in range(3)]
    assert [r.replicated for r in plan.regions] == [True] * 3
    assert all(r.num_head_slots is None for r in plan.regions)
    if family == "deepseek_v3_fp8":
        assert plan.regions[0].dtypes == ("uint8",)
        assert plan.regions[0].kv_quant_modes != ("NONE",)


def test_deepseek_v32_mla_plus_indexer() -> None:
    plan, base = _plan("deepseek_v32")
    mla, idx = 64 * 656, 64 * 132  # fp8_ds_mla latent; indexer 128 + 4 scale bytes
    assert plan.region_names == [
        f"model.layers.{i}.self_attn.{c}" for i in range(3) for c in ("attn", "indexer.k_cache")
    ]
    assert [r.block_len for r in plan.regions] == [mla, idx] * 3
    # One UniformType group, one KVCacheTensor per spec: MLA layers, then indexers.
    assert _offsets(plan, base) == [
        v for i in range(3) for v in (i * NB * mla, 3 * NB * mla + i * NB * idx)
    ]
    assert [r.replicated for r in plan.regions] == [True] * 6


def test_deepseek_v4_shared_row_takes_longest_page() -> None:
    """BLHNC: each block row holds every group's pages; groups alias from byte 0, so the
    four layer-0 caches share one base. Pages: MLA 16 states x 584 B -> 9344 padded to
    576 -> 9792; sparse SWA (fp8_ds_mla) 64 x 584 B = 37376 padded to 576 -> 37440; ring
    8 x 4096 B = 32768; indexer 16 x 132 -> 2304. The row is the widest group: 2 x 37440
    (hand-computed from vLLM's page formulas; the SWA page was 65664 when this test's
    layout used a bfloat16 SWA-MLA cache vLLM does not build)."""
    plan, base = _plan("deepseek_v4")
    row = 2 * 37440
    r0 = plan.regions[0]
    assert set(r0.layers) == {
        f"model.layers.0.attn.{c}"
        for c in ("compressor.ring", "compressor.swa", "indexer.k_cache", "mla")
    }
    assert r0.base_addr == base and r0.block_stride == row
    # vLLM 0.32 keeps the block length of the last MLA-classed member registered at
    # the base; DeepSeek-V4 (a ring model) registers in kv_caches dict order, so that is
    # the indexer page (2304 here; the differential test shows it against upstream's
    # worker) and most of the SWA page would be dropped. Every member's page must fit.
    assert r0.block_len == 37440
    assert r0.group_id == SHARED_REGION_GROUP_ID and r0.group_ids == (0, 1, 2, 3)
    assert r0.replicated and r0.scratch
    assert set(r0.token_scopes) == {TokenScope.FULL, TokenScope.SLIDING_WINDOW, TokenScope.RING}
    rest = {r.name.rsplit(".", 1)[-1]: (r.base_addr - base, r.block_len) for r in plan.regions[1:]}
    assert rest == {
        "ring": (32768, 32768),
        "swa": (37440, 37440),
        "k_cache": (2304, 2304),
        "mla": (9792, 9792),
    }
    assert [r.index for r in plan.regions if r.scratch] == [0, 1]
    assert {r.block_stride for r in plan.regions} == {row}


def _alias_groups(
    first: tuple[str, object],
    second: tuple[str, object],
    layout: KVCacheLayout = KVCacheLayout.BLHNC,
) -> tuple[kvi.KVCacheConfig, dict[str, torch.Tensor]]:
    groups = [
        KVCacheGroupSpec([first[0]], first[1]),  # type: ignore[arg-type]
        KVCacheGroupSpec([second[0]], second[1]),  # type: ignore[arg-type]
    ]
    config = layouts.kv_cache_config(groups, NB, layout)
    return config, layouts.allocate(config, layout)


def test_ring_sharing_base_with_swa_mla_keeps_the_longer_block() -> None:
    """vLLM bug class: the ring registers first (name order) at the SWA-MLA cache's
    base; the region must move the SWA page, whichever layer came first."""
    specs = layouts.deepseek_v4_specs(1)
    ring, swa = specs["ring"][0], specs["swa"][0]
    for first, second in ((ring, swa), (swa, ring)):
        config, caches = _alias_groups(first, second)
        plan = plan_regions(caches, config)
        assert len(plan.regions) == 1
        region = plan.regions[0]
        assert region.name == ring[0]  # model order, not insertion order
        assert region.block_len == 37440  # SWA page, not the ring's 32768
        assert region.scratch and region.replicated
        assert region.group_id == SHARED_REGION_GROUP_ID


def test_separate_page_sizes_keep_overlaid_pages_of_other_sizes_apart() -> None:
    """vLLM 0.34 keys regions by (base, block_len): the ring and the SWA-MLA page at one
    base are two regions, each moving its own page (SWA 37440 B, ring 32768 B, as the
    test above computes them), at the same base and stride, in model order."""
    specs = layouts.deepseek_v4_specs(1)
    ring, swa = specs["ring"][0], specs["swa"][0]
    for first, second in ((ring, swa), (swa, ring)):
        config, caches = _alias_groups(first, second)
        plan = plan_regions(caches, config, layout=PlanLayout(separate_page_sizes=True))
        assert len(plan.regions) == 2
        by_name = {r.name: r for r in plan.regions}
        assert by_name[ring[0]].block_len == 32768
        assert by_name[swa[0]].block_len == 37440
        assert len({r.base_addr for r in plan.regions}) == 1
        assert len({r.block_stride for r in plan.regions}) == 1
        assert by_name[ring[0]].scratch and not by_name[swa[0]].scratch
        # Each region is its own group's (no shared-region group id).
        assert {r.group_id for r in plan.regions} == {0, 1}
        assert plan.region_names == [ring[0], swa[0]]  # model order
        assert sum(r.num_blocks for r in plan.regions) == 2 * NB


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC])
def test_pages_of_other_head_counts_at_one_base(layout: KVCacheLayout) -> None:
    """MiMo-V2-Flash's shape: full-attention layers of 4 KV heads (block 32) and
    sliding-window layers of 8 (block 16) page to equal bytes (vLLM's page_size_bytes:
    2 x 32 x 4 x 64 x 2 B = 2 x 16 x 8 x 64 x 2 B = 32768) and alias one base. Heads
    outermost in the page (LBHNC), one region whose block splits into gcd(4, 8) = 4
    slices holding whole heads of both; tokens outermost (LBNHC), no byte slice holds
    whole heads of both, so the region is refused by name."""
    full = (
        "model.layers.0.attn",
        kvi.FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.float16),
    )
    window = (
        "model.layers.1.attn",
        kvi.SlidingWindowSpec(
            block_size=16, num_kv_heads=8, head_size=64, dtype=torch.float16, sliding_window=128
        ),
    )
    assert (
        default_registry.traits_of(full[1]).page_size_bytes
        == default_registry.traits_of(window[1]).page_size_bytes
        == 32768
    )
    config, caches = _alias_groups(full, window, layout)
    if layout is KVCacheLayout.LBNHC:
        with pytest.raises(RegionConflictError, match="num_head_slots"):
            plan_regions(caches, config)
        return
    plan = plan_regions(caches, config)
    assert len(plan.regions) == 1
    region = plan.regions[0]
    assert region.layers == (full[0], window[0])
    assert region.block_len == 32768 and region.num_head_slots == 4
    assert not region.replicated and region.head_major


def test_mamba_registered_first_does_not_make_an_mla_region_head_sharded() -> None:
    """vLLM bug class: a Mamba-style layer (DeepSeek-V4's replicated PLE conv state)
    registered first decided the region's replication. Both members are REPLICATED by
    their traits, so the region is, in either order."""
    ple = MambaSpec(
        block_size=64, shapes=((4, 1024),), dtypes=(torch.bfloat16,), tp_replicated=True
    )
    mla = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16
    )
    a, b = ("model.layers.0.a_ple", ple), ("model.layers.0.attn", mla)
    for first, second in ((a, b), (b, a)):
        config, caches = _alias_groups(first, second)
        plan = plan_regions(caches, config)
        (region,) = plan.regions
        assert region.name == "model.layers.0.a_ple"
        assert region.replicated and region.tp_layout is TPLayout.REPLICATED
        assert region.state and region.state_tp_layout is TPLayout.REPLICATED
        assert region.block_len == 64 * 576 * 2  # the MLA page is the longer
        assert [r.index for r in plan.regions if r.replicated_state] == [0]
        assert [r.index for r in plan.regions if r.sharded_state] == []


def test_separate_page_sizes_give_a_wider_replicated_state_its_own_region() -> None:
    """vLLM 0.34 (CSA-linear PLE): a replicated state page (4 x 1024 x 2 B bf16 = 8192 B,
    MambaSpec's page) wider than the MLA page at its base (block 4 x 576 x 2 B = 4608 B)
    registers as its own region, so its blocks move the whole state page; keyed by base
    only (0.32/0.33) the two share one region."""
    ple = MambaSpec(block_size=4, shapes=((4, 1024),), dtypes=(torch.bfloat16,), tp_replicated=True)
    mla = MLAAttentionSpec(
        block_size=4, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16
    )
    config, caches = _alias_groups(("model.layers.0.a_ple", ple), ("model.layers.0.attn", mla))
    plan = plan_regions(caches, config, layout=PlanLayout(separate_page_sizes=True))
    assert [(r.name, r.block_len) for r in plan.regions] == [
        ("model.layers.0.a_ple", 8192),
        ("model.layers.0.attn", 4608),
    ]
    assert len({r.base_addr for r in plan.regions}) == 1
    assert [r.index for r in plan.regions if r.replicated_state] == [0]
    assert len(plan_regions(caches, config).regions) == 1


def test_replicated_page_sharing_a_sharded_state_refuses_a_tp_change() -> None:
    """An MLA page and a TP-sharded Mamba state on one base: the region is replicated
    (its paged member decides), but each rank's blocks hold that rank's shard of the
    state, so reading the whole block from one rank of another TP size would move half
    the state. Equal TP sizes read the same rank's block."""
    state = MambaSpec(block_size=64, shapes=((4, 1024),), dtypes=(torch.bfloat16,))
    mla = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16
    )
    config, caches = _alias_groups(("model.layers.0.attn", mla), ("model.layers.0.mamba", state))
    (region,) = plan_regions(caches, config, tp_size=2, tp_rank=1).regions
    assert region.replicated and region.state
    assert region.state_tp_layout is TPLayout.STATE_SHARDED
    # A block is a page of one group or a state of the other: the reads are asked per
    # group (lanes_of), never guessed for the region.
    with pytest.raises(UnsupportedLayoutError, match="ask tp_reads per group") as info:
        tp_reads(region, local_tp=1, local_rank=0, remote_tp=2)
    assert info.value.layer == "model.layers.0.attn"
    assert lanes_of(region) == ((0, False), (1, True))
    # The MLA group's blocks: the latent page, whole from one rank of the other size.
    assert tp_reads(region, local_tp=1, local_rank=0, remote_tp=2, states=False) == (
        Read(0, 0, 0, region.block_len),
    )
    # The state group's blocks: this bare MambaSpec (no mamba_type) does not say how its
    # state splits across ranks, so it is refused by name, never read whole.
    with pytest.raises(UnsupportedLayoutError, match="does not say how it splits"):
        tp_reads(region, local_tp=2, local_rank=1, remote_tp=1, states=True)
    assert tp_reads(region, local_tp=2, local_rank=1, remote_tp=2) == (
        Read(1, 0, 0, region.block_len),
    )


def test_a_replicated_member_of_a_split_region_is_read_in_slices() -> None:
    """An MLA page aliasing a head-sharded page (vLLM registers both in one region, as
    CSA-linear models share main-KV and ring pages): the region is SPLIT, as upstream
    makes it. Slices of an MLA-owned block read from several ranks are right, since
    every rank holds the same latent bytes; the reverse (REPLICATE over heads) would
    read one rank's heads only."""
    gqa = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=288, dtype=torch.bfloat16)
    mla = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16
    )
    config, caches = _alias_groups(
        ("model.layers.0.attn", mla), ("model.layers.0.gqa", gqa), KVCacheLayout.LBHNC
    )
    (region,) = plan_regions(caches, config).regions
    # One KV head: every rank holds the same bytes of it, so the latent decides.
    assert region.replicated and region.tp_layout is TPLayout.REPLICATED
    gqa2 = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=144, dtype=torch.bfloat16)
    config, caches = _alias_groups(
        ("model.layers.0.attn", mla), ("model.layers.0.gqa", gqa2), KVCacheLayout.LBHNC
    )
    (region,) = plan_regions(caches, config).regions
    assert not region.replicated and region.tp_layout is TPLayout.HEAD_SHARDED
    assert region.num_head_slots == 2  # the sharded member's


def test_gpt_oss_full_and_sliding_layers_share_regions() -> None:
    plan, base = _plan("gpt_oss")
    page = 16 * 8 * 128 * 2
    assert [r.layers for r in plan.regions] == [
        ("model.layers.0.attn", "model.layers.1.attn"),
        ("model.layers.2.attn", "model.layers.3.attn"),
    ]
    assert _offsets(plan, base) == [0, NB * page]
    assert plan.region_group_ids == [SHARED_REGION_GROUP_ID] * 2
    assert plan.regions[0].token_scopes == (TokenScope.FULL, TokenScope.SLIDING_WINDOW)
    assert [r.replicated for r in plan.regions] == [False, False]


def test_llama4_chunked_local() -> None:
    plan, _ = _plan("llama4")
    assert [r.layers for r in plan.regions] == [
        ("model.layers.0.attn", "model.layers.3.attn"),
        ("model.layers.1.attn",),
        ("model.layers.2.attn",),
    ]
    assert plan.region_group_ids == [SHARED_REGION_GROUP_ID, 0, 0]
    assert plan.regions[1].token_scopes == (TokenScope.CHUNKED,)
    assert [r.block_len for r in plan.regions] == [65536] * 3


@pytest.mark.parametrize(
    ("family", "conv", "ssm"),
    [
        ("qwen35", 6144 * 3 * 2, 16 * 128 * 128 * 2),  # GDN conv (3*2048, 3), ssm, bf16
        ("jamba", 512 * 3 * 4, 512 * 16 * 4),  # Mamba1 conv (512, 3), ssm (512, 16), fp32
    ],
)
def test_attention_plus_recurrent_state(family: str, conv: int, ssm: int) -> None:
    plan, _ = _plan(family)
    assert [r.index for r in plan.regions if r.sharded_state] == [0, 1, 2]
    for region in plan.regions:
        assert [(c.offset, c.nbytes) for c in region.state_components] == [(0, conv), (conv, ssm)]
        assert region.block_len == region.block_stride  # Mamba page padded to attention's
    shared = plan.regions[0]  # the attention layer aliases the first Mamba layer
    assert shared.paged and shared.state and shared.tp_layout is TPLayout.HEAD_SHARDED
    assert shared.state_tp_layout is TPLayout.STATE_SHARDED
    assert not plan.regions[1].paged and plan.regions[1].tp_layout is TPLayout.STATE_SHARDED
    states = build_state_descs(plan)
    assert states.shape == (6, 5)
    assert states[1, 0] - states[0, 0] == conv and states[1, 1] == ssm


def test_plan_is_independent_of_dict_order() -> None:
    config, caches = layouts.build("deepseek_v4", NB)
    shuffled = dict(reversed(list(caches.items())))
    assert plan_regions(caches, config) == plan_regions(shuffled, config)


def test_untransferable_group_is_skipped() -> None:
    config, caches = layouts.build("gpt_oss", NB)
    config.kv_cache_groups[1].enable_kv_transfer = False
    plan = plan_regions(caches, config)
    assert plan.skipped_layers == {
        "model.layers.1.attn": "its cache group has enable_kv_transfer=False",
        "model.layers.3.attn": "its cache group has enable_kv_transfer=False",
    }
    assert plan.region_group_ids == [0, 0]


def test_layer_with_a_spec_but_no_tensor_is_refused() -> None:
    """A transferable layer whose tensor is missing would vanish from the plan (its
    blocks never moved); the reverse, a tensor without a spec, is skipped as vLLM's
    worker skips it."""
    config, caches = layouts.build("llama_gqa", NB)
    lost = "model.layers.2.self_attn.attn"
    partial = {name: cache for name, cache in caches.items() if name != lost}
    with pytest.raises(MissingLayerError, match="no entry in kv_caches") as info:
        plan_regions(partial, config)
    assert info.value.layers == (lost,) and info.value.missing_from == "kv_caches"
    with pytest.raises(MissingLayerError):
        plan_regions(partial, specs={lost: config.kv_cache_groups[0].kv_cache_spec}, num_blocks=NB)
    extra = {**caches, "model.layers.9.shared": caches[lost]}
    plan = plan_regions(extra, config)
    assert plan.skipped_layers["model.layers.9.shared"] == "no KV cache spec for this layer"


def test_missing_inputs_are_named_errors() -> None:
    """No remote regions at all (was StopIteration), a remote rank that is needed but
    not given (a bare KeyError), a layer without a group id (a bare KeyError)."""
    one, _ = _plan("llama_gqa")
    name = one.region_names[0]
    with pytest.raises(MissingPeerError, match="needs remote TP rank 0") as info:
        transfer_items(one, {}, 1, [1])
    assert (info.value.region, info.value.remote_rank, info.value.given) == (name, 0, ())
    assert transfer_items(one, {}, 1, []) == []  # nothing requested, nothing needed
    two, _ = _plan("llama_gqa", tp=2, rank=1)
    with pytest.raises(MissingPeerError, match=r"rank 1, which was not given .*\[0\]"):
        transfer_items(two, {0: peer_regions(two)}, 2, [1])
    with pytest.raises(KeyError, match="rank 1"):  # still a KeyError, as it was
        transfer_items(one, {0: peer_regions(two)}, 2, [1])  # gathers from ranks 0, 1
    config, caches = layouts.build("gpt_oss", NB)
    specs = {layer: g.kv_cache_spec for g in config.kv_cache_groups for layer in g.layer_names}
    with pytest.raises(MissingLayerError, match="no entry in group_ids") as missing:
        plan_regions(
            caches,
            specs=specs,
            num_blocks=NB,
            group_ids={"model.layers.0.attn": 0, "model.layers.2.attn": 0},
        )
    assert missing.value.layers == ("model.layers.1.attn", "model.layers.3.attn")


def test_specs_mapping_form_matches_config_form() -> None:
    config, caches = layouts.build("llama_gqa", NB)
    spec = config.kv_cache_groups[0].kv_cache_spec
    assert plan_regions(caches, specs=dict.fromkeys(caches, spec), num_blocks=NB) == plan_regions(
        caches, config
    )


# -- descriptors -------------------------------------------------------------------------


def test_strided_descs_match_vllm_033_form() -> None:
    plan, _ = _plan("deepseek_v4")
    descs = build_block_descs(plan)
    # vLLM 0.33 _block_strided_descs, ratio 1: [[base, block_len, dev, stride, count]].
    expected = [[r.base_addr, r.block_len, 0, r.block_stride, NB] for r in plan.regions]
    assert descs.dtype == np.uint64 and descs.tolist() == expected
    ids = block_desc_ids(plan, [[1], [2], [3], [4]])
    # Shared region 0 takes every group's block; the others their own group's. Order of
    # vLLM's _compute_desc_ids with region-group mapping: group by group, each group's
    # regions (region_offsets[region_ids] + block) in region order; regions 1-4 are
    # groups 2, 1, 3, 0, so group 0 is regions 0 and 4, group 1 regions 0 and 2, ...
    assert ids.tolist() == [1, 4 * NB + 1, 2, 2 * NB + 2, 3, NB + 3, 4, 3 * NB + 4]


def test_merge_runs_only_where_both_sides_are_contiguous() -> None:
    dense, _ = _plan("llama_gqa")
    items = transfer_items(dense, {0: peer_regions(dense)}, 1, [1, 2, 3, 5])
    (merged,) = [merge_runs(i) for i in items]
    assert items[0].count == 16 and merged.count == 8  # runs 1-3 and 5, per layer
    assert merged.nbytes == items[0].nbytes
    packed, _ = _plan("deepseek_v4")  # block_len < block_stride: nothing merges
    # Distinct ids (region 0 takes every group's), no two consecutive: within a region
    # no block abuts the next requested one.
    ids = [[0, 2, 4], [], [], [6]]
    (raw,) = transfer_items(packed, {0: peer_regions(packed)}, 1, ids)
    assert merge_runs(raw).count == raw.count
    # Rows are group by group (vLLM's order). Group 1 (block 5) reads region 0's
    # 37440 bytes at the start of row 5, then layer 1's SWA page (the next 37440, the
    # end of the 74880-byte row); group 2 (block 6) starts with region 0 at the start
    # of row 6. Contiguous on both sides: one descriptor of 3 x 37440 bytes.
    (raw,) = transfer_items(packed, {0: peer_regions(packed)}, 1, [[1], [5], [6], []])
    assert merge_runs(raw).count == raw.count - 2
    assert 3 * 37440 in merge_runs(raw).local[:, 1].tolist()
    assert merge_runs(raw).nbytes == raw.nbytes


@pytest.mark.parametrize(
    ("local", "remote", "bad", "side"),
    [
        ([-1], None, -1, "local"),
        ([NB], None, NB, "local"),
        ([1], [-1], -1, "remote"),
        ([1], [NB], NB, "remote"),
    ],
)
def test_block_ids_outside_a_region_are_named(
    local: list[int], remote: list[int] | None, bad: int, side: str
) -> None:
    """A negative id would wrap to an address before the region (uint64); both
    descriptor paths check ids with one validator and name the region and the id."""
    plan, _ = _plan("llama_gqa")
    name = plan.region_names[0]
    with pytest.raises(BlockIdError, match=f"{side} block id {bad} ") as info:
        transfer_items(plan, {0: peer_regions(plan)}, 1, local, remote)
    assert (info.value.region, info.value.block_id) == (name, bad)
    counts = None if remote is None else [r.num_blocks for r in plan.regions]
    with pytest.raises(IndexError, match=f"region {name!r}: {side} block id {bad} "):
        block_desc_ids(plan, local if remote is None else remote, region_num_blocks=counts)


def test_tp_reads_split_and_gather_by_heads() -> None:
    one, _ = _plan("llama_gqa", tp=1)
    two, _ = _plan("llama_gqa", tp=2, rank=1)
    half = 32768
    # TP1 consumer gathers both halves; TP2 rank 1 reads the second half of the block.
    assert tp_reads(one.regions[0], local_tp=1, local_rank=0, remote_tp=2) == (
        Read(0, 0, 0, half),
        Read(1, half, 0, half),
    )
    assert tp_reads(two.regions[0], local_tp=2, local_rank=1, remote_tp=1) == (
        Read(0, 0, half, half),
    )
    mla, _ = _plan("deepseek_v3", tp=2, rank=1)
    assert tp_reads(mla.regions[0], local_tp=2, local_rank=1, remote_tp=4) == (
        Read(1, 0, 0, 73728),
    )


def test_a_state_whose_split_is_not_described_refuses_a_tp_change() -> None:
    # vLLM's default conv layout (SD) is not decomposed by its NIXL transfer, so the
    # adapter describes no tp_split: the state is refused by name between TP sizes.
    plan, _ = _plan("qwen35")
    with pytest.raises(UnsupportedLayoutError, match="does not say how it splits"):
        tp_reads(plan.regions[1], local_tp=1, local_rank=0, remote_tp=2, states=True)


# -- the shim never names a spec class: tests/test_no_spec_branches.py (the audit) checks
# the whole package; tests/test_import_graph.py that transfer/ imports no vLLM at run time.


def test_importing_the_shim_imports_neither_nixl_nor_vllm_nor_torch() -> None:
    code = (
        "import sys, kvspec_traits.nixl; "
        "print(sorted(m for m in ('nixl', 'nixl._api', 'vllm', 'torch') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_all_rows_make_one_region_per_block_outermost_storage() -> None:
    """vLLM 0.32 push workers register padded DeepSeek-V4 rows whole (base = storage,
    block_len = block_stride = row); Rows.ALL plans that form: one descriptor per
    block (DeepSeek-V4 has a ring, so its default rows are Rows.NONE)."""
    config, caches = layouts.build("deepseek_v4", NB)
    pages = plan_regions(caches, config)
    rows = plan_regions(caches, config, layout=PlanLayout(rows=Rows.ALL))
    row = 2 * 37440
    (region,) = rows.regions
    assert region.base_addr == rows.registrations[0].base
    assert (region.block_len, region.block_stride, region.num_blocks) == (row, row, NB)
    assert set(region.layers) == set(caches)
    assert region.replicated and region.scratch and not region.head_major
    assert region.group_id == SHARED_REGION_GROUP_ID
    assert (
        sum(r.num_blocks for r in rows.regions) == NB
        and sum(r.num_blocks for r in pages.regions) == 5 * NB
    )
    assert [list(r.layers) for r in rows.regions] == [list(region.layers)]
    # Layer-outer storages are not rows: nothing changes.
    config, caches = layouts.build("llama_gqa", NB)
    every = PlanLayout(rows=Rows.SCATTERED | Rows.ALL)  # the default rows, and ALL
    assert plan_regions(caches, config, layout=every) == plan_regions(caches, config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PluginLatentSpec(FullAttentionSpec):
    """A plugin's spec class that neither vLLM nor the shim has seen."""


def test_every_decision_follows_the_registry() -> None:
    """A third-party adapter says the plugin's cache is one replicated ring: the plan
    follows it (replicated, scratch), with no class list anywhere in the shim."""
    registry = default_registry.copy(name="plugin")
    fields = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}

    declared = registry.registrations()[FullAttentionSpec]  # the fields it reads too

    @registry.adapter(_PluginLatentSpec, reads=declared.reads, ignores=declared.ignores)
    def _adapt(spec: _PluginLatentSpec) -> LayoutTraits:
        base = registry.traits_of(FullAttentionSpec(**fields))  # type: ignore[arg-type]
        if not isinstance(base, LayoutTraits):
            raise TypeError(base)
        return dataclasses.replace(
            base,
            spec_name="_PluginLatentSpec",
            tp_layout=TPLayout.REPLICATED,
            tp_shards=1,
            token_scope=TokenScope.RING,
            window_tokens=16,
            token_paged=False,
            keeps_prompt=False,
        )

    spec = _PluginLatentSpec(**fields)  # type: ignore[arg-type]
    groups = [KVCacheGroupSpec(["model.layers.0.plugin"], spec)]
    config = layouts.kv_cache_config(groups, NB, KVCacheLayout.LBHNC)
    caches = layouts.allocate(config, KVCacheLayout.LBHNC)
    (region,) = plan_regions(caches, config, registry=registry).regions
    assert region.replicated and region.scratch
    assert region.token_scopes == (TokenScope.RING,)
    (plain,) = plan_regions(caches, config).regions  # the default registry: its parent
    assert not plain.replicated and not plain.scratch


def test_vllm_field_view() -> None:
    from kvspec_traits.vllm_connector._seam import worker_fields

    plan, _ = _plan("qwen35")
    fields = worker_fields(plan)
    assert fields["block_len_per_layer"] == [r.block_len for r in plan.regions]
    assert fields["_region_is_mla"] == [False] * 3
    assert fields["_ssm_region_indices"] == [0, 1, 2]
    assert fields["_ple_region_index"] is None
    assert fields["num_regions"] == 3 and fields["num_descs"] == 3 * NB
    assert fields["region_mem_types"] == ["DRAM"] * 3
    v4, _ = _plan("deepseek_v4")
    assert worker_fields(v4)["_scratch_region_indices"] == [0, 1]


@pytest.mark.parametrize(("family", "kernel"), [("llama_gqa", 8), ("qwen35", 16)])
def test_kernel_block_splitting_plans_manager_blocks(family: str, kernel: int) -> None:
    """Kernel-block views (vLLM's create_kv_cache_views with kernel_block_size) give
    the same regions in manager blocks, so an attention layer can share a region with
    an unsplit Mamba state (Qwen3.5's attention blocks of 1024 tokens run kernels of 16)."""
    config, caches = layouts.build(family, NB)
    whole = plan_regions(caches, config)
    config, split = layouts.build(family, NB, kernel_block_size=kernel)
    attn = next(c for n, c in split.items() if "attn" in n and "linear" not in n)
    assert attn.shape[0] > NB  # rows are kernel blocks
    plan = plan_regions(split, config)
    assert [r.block_len for r in plan.regions] == [r.block_len for r in whole.regions]
    assert [r.block_stride for r in plan.regions] == [r.block_stride for r in whole.regions]
    assert [r.num_blocks for r in plan.regions] == [NB] * len(plan.regions)
    assert [r.layers for r in plan.regions] == [r.layers for r in whole.regions]
    # vLLM's worker granularity: kernel blocks of page / ratio, ratio times as many;
    # a recurrent state sharing the region is registered the same way (vLLM's worker
    # reads it back whole, ratio kernel blocks apart).
    ratio = attn.shape[0] // NB
    kernel_plan = plan_regions(split, config, layout=PlanLayout(sub_blocks=ratio))
    assert [r.block_len for r in kernel_plan.regions] == [
        r.block_len // ratio for r in whole.regions
    ]
    assert [r.block_stride for r in kernel_plan.regions] == [
        r.block_stride // ratio for r in whole.regions
    ]
    assert [r.num_blocks for r in kernel_plan.regions] == [ratio * NB] * len(whole.regions)
    with pytest.raises(UnsupportedLayoutError, match="not split into the worker's"):
        plan_regions(split, config, layout=PlanLayout(sub_blocks=2 * ratio))


def test_the_planner_takes_layout_arguments_only() -> None:
    """No parameter of plan_regions names how a vLLM series registers memory: the
    choices between valid plans of the same bytes are one neutral PlanLayout (vLLM's
    are vllm_connector/_policy.py's)."""
    assert list(inspect.signature(plan_regions).parameters) == [
        "kv_caches",
        "kv_cache_config",
        "specs",
        "group_ids",
        "num_blocks",
        "tp_size",
        "tp_rank",
        "registry",
        "layout",
        "total_kv_heads",  # a model fact (vLLM's get_total_num_kv_heads), not a layout choice
    ]
    with pytest.raises(ValueError, match="sub_blocks 0 must be >= 1"):
        PlanLayout(sub_blocks=0)


def test_untransferable_specs_get_no_region() -> None:
    """Cross-attention caches (encoder outputs) are not transferable by their traits:
    the layer is skipped with the reason, and region indices stay vLLM's."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec(["model.decoder.layers.0.self_attn"], full),
        KVCacheGroupSpec(["model.decoder.layers.0.encoder_attn"], cross),
    ]
    config = layouts.kv_cache_config(groups, NB, KVCacheLayout.LBHNC)
    plan = plan_regions(layouts.allocate(config, KVCacheLayout.LBHNC), config)
    assert plan.region_names == ["model.decoder.layers.0.self_attn"]
    assert plan.skipped_layers == {
        "model.decoder.layers.0.encoder_attn": (
            "CrossAttentionSpec is not transferable (scope encoder)"
        )
    }


def test_skipped_layers_are_read_only() -> None:
    """The plan is frozen; its skipped layers were a mutable dict inside it."""
    config, caches = layouts.build("gpt_oss", NB)
    config.kv_cache_groups[1].enable_kv_transfer = False
    plan = plan_regions(caches, config)
    with pytest.raises(TypeError):
        plan.skipped_layers["model.layers.9.attn"] = "edited"  # type: ignore[index]
    assert "model.layers.9.attn" not in plan.skipped_layers
    assert plan == plan_regions(caches, config)
    assert not hasattr(plan.regions[0], "transferable")  # always True: removed


def test_public_names_are_sorted_and_exported() -> None:
    """``__all__`` in isort order (constants, classes, functions; ruff's RUF022 form)."""
    import kvspec_traits.nixl as shim

    def kind(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    assert shim.__all__ == sorted(shim.__all__, key=kind)
    assert all(hasattr(shim, name) for name in shim.__all__)


# vLLM 0.34's _compute_desc_ids takes (regions, keys) pairs and always goes group by
# group (0.32 goes region-major when every region is shared); installed is 0.32.
@pytest.mark.vllm032_only
@pytest.mark.parametrize(
    "family", ["llama_gqa", "deepseek_v32", "gpt_oss", "llama4", "deepseek_v4"]
)
def test_desc_ids_equal_upstream_compute_desc_ids(family: str) -> None:
    """Our descriptor ids are vLLM 0.32's own ``_compute_desc_ids`` output (its
    all-attention path, called on a worker holding only the attributes it reads),
    local and remote, for one group, groups sharing every region, and groups with
    their own regions next to a shared one."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )

    plan, _ = _plan(family)
    worker = object.__new__(NixlBaseConnectorWorker)
    worker._has_mamba = False
    worker._conv_decomp = None
    worker._ssm_region_indices = []
    worker._transfer_layer_group_ids = ()
    worker.block_len_per_layer = [r.block_len for r in plan.regions]
    worker.num_regions = len(plan.regions)
    worker.region_group_ids = plan.region_group_ids
    mapped = len(set(plan.region_group_ids)) > 1
    worker._uses_region_group_mapping = mapped
    block_ids = [[7 - g, g] for g in range(plan.num_groups)]  # distinct across groups
    for counts in (None, [NB + 4] * len(plan.regions)):
        ours = block_desc_ids(plan, block_ids, region_num_blocks=counts)
        upstream = worker._compute_desc_ids(
            block_ids=block_ids,
            dst_num_blocks=NB,
            block_size_ratio=None,
            physical_blocks_per_logical=1,
            region_num_blocks=counts or [r.num_blocks for r in plan.regions],
            region_group_ids=plan.region_group_ids,
            uses_region_group_mapping=mapped,
        )
        assert ours.tolist() == upstream.tolist()


def test_a_replicated_state_apart_is_a_replicate_region_moving_its_content() -> None:
    """A TP-replicated Mamba state (vLLM's ``MambaSpec(tp_replicated=True)``: conv 4 x 8
    and SSM 2 x 8 float32 = 192 B of content) padded to the full-attention page it
    overlays (2 heads x 32 tokens x (32 + 32) x 4 B = 16384 B, vLLM's hybrid allocator):
    by default one region of both layers, SPLIT by the attention's heads; named in
    ``replicated_states_apart``, a region of its own at the same base and stride,
    REPLICATE, moving the 192 B of content, the attention region SPLIT."""
    full = (
        "model.layers.1.attn",
        kvi.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32),
    )
    state = (
        "model.layers.0.mamba",
        kvi.MambaSpec(
            block_size=32,
            shapes=((4, 8), (2, 8)),
            dtypes=(torch.float32, torch.float32),
            page_size_padded=16384,
            tp_replicated=True,
        ),
    )
    assert full[1].page_size_bytes == state[1].page_size_bytes == 16384
    config, caches = _alias_groups(state, full, KVCacheLayout.LBHNC)
    (shared,) = plan_regions(caches, config).regions
    assert (shared.layers, shared.replicated, shared.block_len) == (
        (state[0], full[0]),
        False,
        16384,
    )
    plan = plan_regions(
        caches, config, layout=PlanLayout(replicated_states_apart=frozenset({state[0]}))
    )
    (mine,) = (r for r in plan.regions if state[0] in r.layers)
    (attn,) = (r for r in plan.regions if full[0] in r.layers)
    assert (mine.layers, attn.layers) == ((state[0],), (full[0],))
    assert (mine.base_addr, mine.block_stride) == (attn.base_addr, attn.block_stride)
    assert (mine.replicated, mine.block_len, mine.group_id) == (True, (32 + 16) * 4, 0)
    assert (attn.replicated, attn.block_len, attn.group_id) == (False, 16384, 1)
