"""The second transfer backend (kvspec_traits.memcopy): blocks move between two real
vLLM cache allocations in one process, planned by kvspec_traits.transfer alone.

Every byte is compared against vLLM's own per-layer views (nixl_helpers/checks.py, the
same check the NIXL transfer tests use), and pages of blocks not requested must stay zero.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvspec_traits.memcopy import MemcopyBackend, NotConnectedError
from kvspec_traits.transfer import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    DuplicateBlockIdError,
    HandshakeMismatchError,
    UnsupportedLayoutError,
    plan_regions,
)
from tests.nixl_helpers import checks, layouts

NB = 16
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family", sorted(layouts.FAMILIES))
def test_request_blocks_arrive_byte_exact(family: str) -> None:
    config_p, caches_p = layouts.build(family, NB)
    config_d, caches_d = layouts.build(family, NB)
    layouts.fill_pattern(caches_p, seed=11)
    plan_d = plan_regions(caches_d, config_d)
    consumer = MemcopyBackend(plan_d)
    consumer.connect([plan_regions(caches_p, config_p)])
    block_ids = checks.request_blocks(config_d)
    moved = consumer.read_blocks(block_ids)
    assert checks.assert_transferred(caches_p, caches_d, config_d, block_ids) > 0
    # Equal TP: one whole block per requested id per region; a region shared by every
    # group takes every group's ids.
    per_block = sum(len(ids) for ids in block_ids)
    assert moved == sum(
        r.block_len * (per_block if r.group_id < 0 else len(block_ids[r.group_id]))
        for r in plan_d.regions
    )


def test_a_head_sharded_cache_is_gathered_from_two_producer_ranks() -> None:
    # llama_gqa: 8 KV heads, views [B, H, N, C] (heads outermost in a block). At TP 2
    # rank r holds heads 4r..4r+3, so the TP 1 consumer's block b of a layer is heads
    # 0-3 from rank 0's block b then heads 4-7 from rank 1's (vLLM's head split).
    producers = [layouts.build("llama_gqa", NB, tp=2) for _ in range(2)]
    for rank, (_, caches) in enumerate(producers):
        layouts.fill_pattern(caches, seed=20 + rank)
    plans = [
        plan_regions(caches, config, tp_size=2, tp_rank=rank)
        for rank, (config, caches) in enumerate(producers)
    ]
    config_d, caches_d = layouts.build("llama_gqa", NB)
    consumer = MemcopyBackend(plan_regions(caches_d, config_d))
    consumer.connect(plans)
    consumer.read_blocks([[2, 5]], [[7, 1]])
    for layer, view in caches_d.items():
        # Compared as raw 16-bit words: random bytes read as bfloat16 hold NaNs.
        raw = view.view(torch.int16)
        assert raw.shape[1] == 8
        for local, remote in ((2, 7), (5, 1)):
            for rank, (_, caches) in enumerate(producers):
                theirs = caches[layer].view(torch.int16)[remote]
                assert torch.equal(raw[local, 4 * rank : 4 * rank + 4], theirs)
        assert not bool(raw[0].any())


def test_a_mismatched_layout_is_refused_before_anything_is_written() -> None:
    config_p, caches_p = layouts.build("deepseek_v3_fp8", NB)
    config_d, caches_d = layouts.build("deepseek_v3", NB)
    layouts.fill_pattern(caches_p, seed=3)
    consumer = MemcopyBackend(plan_regions(caches_d, config_d))
    with pytest.raises(HandshakeMismatchError) as info:
        consumer.connect([plan_regions(caches_p, config_p)])
    assert info.value.region_name == "model.layers.0.self_attn.attn"
    assert {d[0] for d in info.value.diffs} >= {"block_len", "dtype", "kv_quant_mode"}
    with pytest.raises(NotConnectedError, match="connect"):
        consumer.read_blocks([[1]])
    assert not bool(layouts.backing(caches_d).any())


@pytest.mark.parametrize(
    ("local", "remote", "error", "match"),
    [
        ([[1, NB]], None, BlockIdError, f"local block id {NB} is not in 0..{NB - 1}"),
        ([[1, 2]], [[1, NB + 3]], BlockIdError, f"remote block id {NB + 3}"),
        ([[1, -1]], None, BlockIdError, "local block id -1"),
        ([[3, 4, 3]], None, DuplicateBlockIdError, "local block id 3 appears more than once"),
        ([[1, True]], None, BlockIdTypeError, "True is a bool, not an int"),
        ([[1, 2.0]], None, BlockIdTypeError, "2.0 is a float"),
        ([[1], [2]], None, BlockIdShapeError, "2 lists for a plan of 1 cache groups"),
        ([[1, 2]], [[1]], BlockIdShapeError, "2 local but 1 remote ids"),
    ],
)
def test_bad_block_ids_are_named_and_nothing_is_written(
    local: list[list[object]], remote: list[list[object]] | None, error: type, match: str
) -> None:
    # Block 1 is valid and comes first: a backend copying as it validates would have
    # written it before meeting the bad id.
    config_p, caches_p = layouts.build("llama_gqa", NB)
    config_d, caches_d = layouts.build("llama_gqa", NB)
    layouts.fill_pattern(caches_p, seed=5)
    consumer = MemcopyBackend(plan_regions(caches_d, config_d))
    consumer.connect([plan_regions(caches_p, config_p)])
    with pytest.raises(error, match=match):
        consumer.read_blocks(local, remote)  # type: ignore[arg-type]
    assert not bool(layouts.backing(caches_d).any())


def test_producer_plans_out_of_rank_order_are_refused() -> None:
    producers = [layouts.build("llama_gqa", NB, tp=2) for _ in range(2)]
    plans = [
        plan_regions(caches, config, tp_size=2, tp_rank=rank)
        for rank, (config, caches) in enumerate(producers)
    ]
    config_d, caches_d = layouts.build("llama_gqa", NB)
    consumer = MemcopyBackend(plan_regions(caches_d, config_d))
    with pytest.raises(ValueError, match="plan 0 is rank 1 of TP 2"):
        consumer.connect(plans[::-1])
    with pytest.raises(ValueError, match=r"plan 0 is rank 0 of TP 2; .* \(1 plans: TP 1\)"):
        consumer.connect(plans[:1])


def test_device_memory_is_refused_by_name() -> None:
    config, caches = layouts.build("llama_gqa", NB)
    plan = plan_regions(caches, config)
    region = plan.regions[0]
    # The plan of a GPU rank differs only in its regions' memory type (Region.mem_type
    # is read from the tensor's device: "VRAM" off the CPU).
    gpu_region = type(region)(
        **{f: getattr(region, f) for f in region.__dataclass_fields__} | {"mem_type": "VRAM"}
    )
    gpu_plan = type(plan)(
        regions=(gpu_region, *plan.regions[1:]),
        registrations=plan.registrations,
        num_blocks=plan.num_blocks,
    )
    with pytest.raises(UnsupportedLayoutError, match="its memory is VRAM"):
        MemcopyBackend(gpu_plan)


def test_a_transfer_runs_without_the_nixl_shim_loaded() -> None:
    # In a fresh interpreter (this one has imported the NIXL shim for other tests): plan
    # two real vLLM allocations, connect, copy; kvspec_traits.nixl, NIXL's package and
    # numpy-backed descriptors are never imported.
    script = textwrap.dedent(
        """
        import sys
        from tests.nixl_helpers import layouts, checks
        from kvspec_traits.memcopy import MemcopyBackend
        from kvspec_traits.transfer import plan_regions

        config_p, caches_p = layouts.build("deepseek_v4", 16)
        config_d, caches_d = layouts.build("deepseek_v4", 16)
        layouts.fill_pattern(caches_p, seed=9)
        consumer = MemcopyBackend(plan_regions(caches_d, config_d))
        consumer.connect([plan_regions(caches_p, config_p)])
        ids = checks.request_blocks(config_d)
        consumer.read_blocks(ids)
        assert checks.assert_transferred(caches_p, caches_d, config_d, ids) > 0
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "nixl"
                        or m.startswith("kvspec_traits.nixl"))
        print("LOADED", loaded)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED []" in done.stdout
