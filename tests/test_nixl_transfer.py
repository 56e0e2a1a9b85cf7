"""Registration and transfer through real NIXL agents (UCX on DRAM), in one process.

Agents run without progress threads (each would spin a core); the consumer progresses
the producers while it waits. Every byte is compared against vLLM's own per-layer
views (nixl_helpers/checks.py), and pages of blocks not requested must stay zero.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


import pytest
import torch

from kvspec_traits.nixl import (
    DescMode,
    MissingPeerError,
    TraitsNixlAgent,
    TransferFailedError,
    _request,
    encode_metadata,
)
from kvspec_traits.transfer import (
    HandshakeMismatchError,
    MalformedMetadataError,
    MemoryTypeMismatchError,
    PlanLayout,
    Rows,
    plan_regions,
)
from tests.nixl_helpers import checks, layouts

NB = 16


def _agent(pool: list[TraitsNixlAgent]) -> TraitsNixlAgent:
    agent = TraitsNixlAgent()
    pool.append(agent)
    return agent


@pytest.mark.parametrize("family", sorted(layouts.FAMILIES))
def test_request_blocks_arrive_byte_exact(
    family: str, agents: list[TraitsNixlAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    config_p, caches_p = layouts.build(family, NB)
    config_d, caches_d = layouts.build(family, NB)
    layouts.fill_pattern(caches_p, seed=11)
    plan_p = plan_regions(caches_p, config_p)
    plan_d = plan_regions(caches_d, config_d)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_p)
    consumer.register_plan(plan_d)
    peer = consumer.connect(producer.metadata())
    block_ids = checks.request_blocks(config_d)
    per_block = sum(len(ids) for ids in block_ids)
    # "merged" at its default posts this small request's ids (fewer descriptors than
    # MERGE_MIN_DESCRIPTORS); "rows" is merged mode with that bound at 0, so rows move
    # real bytes too.
    for mode in ("prepped", "per_block", "merged", "rows"):
        layouts.backing(caches_d).zero_()
        with monkeypatch.context() as patched:
            if mode == "rows":
                patched.setattr(_request, "MERGE_MIN_DESCRIPTORS", 0)
            result = consumer.read_blocks(
                peer,
                block_ids,
                mode="merged" if mode == "rows" else mode,  # type: ignore[arg-type]
                timeout=20,
                progress=producer.progress,
            )
        assert checks.assert_transferred(caches_p, caches_d, config_d, block_ids) > 0
        # One descriptor per block per region, whichever group(s) the region serves.
        expected = sum(
            per_block if r.group_id < 0 else len(block_ids[r.group_id]) for r in plan_d.regions
        )
        assert result.per_block_descriptors == expected
        if mode == "rows":
            dense = all(r.block_len == r.block_stride for r in plan_d.regions)
            # Runs of 3 consecutive ids merge where a region's blocks abut; where
            # they do not, rows may still merge where one region's page ends at the
            # next row's first page (DeepSeek-V4 rows, read group by group).
            assert result.descriptors < expected if dense else (result.descriptors <= expected)
        else:
            assert result.descriptors == expected


def test_mismatched_layout_is_refused_before_anything_is_written(
    agents: list[TraitsNixlAgent],
) -> None:
    config_p, caches_p = layouts.build("deepseek_v3_fp8", NB)
    config_d, caches_d = layouts.build("deepseek_v3", NB)
    layouts.fill_pattern(caches_p, seed=3)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_regions(caches_p, config_p))
    consumer.register_plan(plan_regions(caches_d, config_d))
    with pytest.raises(HandshakeMismatchError) as info:
        consumer.connect(producer.metadata())
    assert info.value.region_name == "model.layers.0.self_attn.attn"
    assert {d[0] for d in info.value.diffs} >= {"block_len", "dtype", "kv_quant_mode"}
    # NIXL never learnt of the producer, so no descriptor could name it ...
    assert not consumer.knows(producer.name)
    # ... and the consumer's memory is untouched.
    assert not bool(layouts.backing(caches_d).any())


def test_corrupt_nixl_blob_is_a_named_error(agents: list[TraitsNixlAgent]) -> None:
    config, caches = layouts.build("llama_gqa", 4)
    plan = plan_regions(caches, config)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan)
    config_d, caches_d = layouts.build("llama_gqa", 4)
    consumer.register_plan(plan_regions(caches_d, config_d))
    good = producer.metadata()
    header_end = len(good) - len(producer._agent.get_agent_metadata())
    bad = good[:header_end] + bytes(len(good) - header_end)
    with pytest.raises(MalformedMetadataError, match="NIXL refused"):
        consumer.connect(bad)
    with pytest.raises(RuntimeError, match="after metadata"):
        producer.register_plan(plan)


def test_unknown_mode_is_refused(agents: list[TraitsNixlAgent]) -> None:
    config, caches_p = layouts.build("llama_gqa", 4)
    _, caches_d = layouts.build("llama_gqa", 4)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_regions(caches_p, config))
    consumer.register_plan(plan_regions(caches_d, config))
    peer = consumer.connect(producer.metadata())
    with pytest.raises(ValueError, match=r"'merge'.*'prepped', 'per_block', 'merged'"):
        consumer.read_blocks(
            peer,
            [1],
            mode="merge",  # type: ignore[arg-type]
            timeout=5,
            progress=producer.progress,
        )


def test_refused_plan_leaves_the_agent_unchanged(agents: list[TraitsNixlAgent]) -> None:
    """A plan whose regions span DRAM and VRAM is refused before any memory is
    registered or the plan is kept, so the agent can still take a valid plan."""
    config, caches = layouts.build("llama_gqa", 4)
    plan = plan_regions(caches, config)
    mixed = dataclasses.replace(
        plan, regions=(dataclasses.replace(plan.regions[0], mem_type="VRAM"), *plan.regions[1:])
    )
    agent = _agent(agents)
    with pytest.raises(MemoryTypeMismatchError, match=r"\['DRAM', 'VRAM'\]") as info:
        agent.register_plan(mixed)
    assert info.value.region is None and info.value.mem_types == ("DRAM", "VRAM")
    with pytest.raises(RuntimeError, match="register_plan"):
        _ = agent.plan
    agent.register_plan(plan)
    assert agent.plan is plan


def test_peer_on_another_memory_type_is_refused(agents: list[TraitsNixlAgent]) -> None:
    """A producer whose regions are VRAM (its metadata says so) against DRAM caches:
    refused in connect, before NIXL learns of the peer; descriptors were tagged with
    the local memory type for both sides."""
    config, caches_p = layouts.build("llama_gqa", 4)
    _, caches_d = layouts.build("llama_gqa", 4)
    plan_p = plan_regions(caches_p, config)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_p)
    consumer.register_plan(plan_regions(caches_d, config))
    vram = dataclasses.replace(
        plan_p, regions=tuple(dataclasses.replace(r, mem_type="VRAM") for r in plan_p.regions)
    )
    metadata = encode_metadata(vram, producer.name, bytes(producer._agent.get_agent_metadata()))
    with pytest.raises(MemoryTypeMismatchError, match="holds it in 'VRAM'") as info:
        consumer.connect(metadata)
    assert info.value.region == plan_p.region_names[0]
    assert info.value.mem_types == ("DRAM", "VRAM")
    assert not consumer.knows(producer.name)
    peer = consumer.connect(producer.metadata())  # the true (DRAM) metadata connects
    assert peer.mem_type == "DRAM"


def _slice_heads(
    src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], rank: int, tp: int
) -> None:
    """Give ``dst`` (a TP ``tp`` rank's caches) rank ``rank``'s heads of ``src``."""
    for layer, cache in dst.items():
        heads = cache.shape[1]
        full = src[layer].view(torch.uint8)
        if heads == full.shape[1]:  # replicated: the same bytes on every rank
            cache.view(torch.uint8).copy_(full)
        else:
            cache.view(torch.uint8).copy_(full[:, rank * heads : (rank + 1) * heads])
    del tp


@pytest.mark.parametrize("family", ["llama_gqa", "deepseek_v3", "gpt_oss"])
def test_producer_tp2_to_consumer_tp1(family: str, agents: list[TraitsNixlAgent]) -> None:
    """Head-sharded regions are gathered from both ranks; replicated ones read from one
    rank (rank 1 holds different bytes, which must not appear)."""
    truth_config, truth = layouts.build(family, NB)
    layouts.fill_pattern(truth, seed=5)
    producers, peers = [], {}
    config_d, caches_d = layouts.build(family, NB)
    consumer = _agent(agents)
    consumer.register_plan(plan_regions(caches_d, config_d))
    keep = []
    for rank in range(2):
        config_p, caches_p = layouts.build(family, NB, tp=2)
        _slice_heads(truth, caches_p, rank, 2)
        plan_p = plan_regions(caches_p, config_p, tp_size=2, tp_rank=rank)
        if rank == 1 and plan_p.regions[0].replicated:
            layouts.fill_pattern(caches_p, seed=99)
        producer = _agent(agents)
        producer.register_plan(plan_p)
        producers.append(producer)
        peers[rank] = consumer.connect(producer.metadata())
        keep.append(caches_p)
    block_ids = [[2, 3, 9], [4, 5]][: len(truth_config.transfer_groups)]

    def progress() -> None:
        for producer in producers:
            producer.progress()

    consumer.read_blocks(peers, block_ids, timeout=20, progress=progress)
    checks.assert_transferred(truth, caches_d, truth_config, block_ids)


@pytest.mark.parametrize(
    ("family", "nbytes"),
    [
        ("llama_gqa", 4 * 4 * 32768),  # 4 layers x 4 blocks x half a 64 KiB page
        ("deepseek_v3", 3 * 4 * 73728),  # 3 layers x 4 blocks x the whole replicated page
    ],
)
def test_producer_tp1_to_consumer_tp2(
    family: str, nbytes: int, agents: list[TraitsNixlAgent]
) -> None:
    """Each TP-2 rank reads its half of the heads of the TP-1 producer's blocks (or the
    whole block of a replicated region)."""
    config_p, caches_p = layouts.build(family, NB)
    layouts.fill_pattern(caches_p, seed=8)
    producer = _agent(agents)
    producer.register_plan(plan_regions(caches_p, config_p))
    metadata = producer.metadata()
    block_ids = [[0, 5, 6, 7]]
    alive = []  # registered memory stays allocated while its agent may use it
    for rank in range(2):
        config_d, caches_d = layouts.build(family, NB, tp=2)
        alive.append(caches_d)
        consumer = _agent(agents)
        consumer.register_plan(plan_regions(caches_d, config_d, tp_size=2, tp_rank=rank))
        peer = consumer.connect(metadata)
        result = consumer.read_blocks({0: peer}, block_ids, timeout=20, progress=producer.progress)
        assert result.nbytes == nbytes
        expected_config, expected = layouts.build(family, NB, tp=2)
        _slice_heads(caches_p, expected, rank, 2)
        checks.assert_transferred(expected, caches_d, expected_config, block_ids)


@pytest.mark.parametrize("mode", ["prepped", "per_block", "merged"])
def test_peer_of_another_tp_rank_is_refused(mode: DescMode, agents: list[TraitsNixlAgent]) -> None:
    """Consumer rank 1 of TP 2 given producer rank 0: rank 0 holds the other half of
    the heads. ``prepped`` read them silently; the others raised a bare KeyError."""
    config_p, caches_p = layouts.build("llama_gqa", NB, tp=2)
    config_d, caches_d = layouts.build("llama_gqa", NB, tp=2)
    layouts.fill_pattern(caches_p, seed=6)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_regions(caches_p, config_p, tp_size=2, tp_rank=0))
    consumer.register_plan(plan_regions(caches_d, config_d, tp_size=2, tp_rank=1))
    peer = consumer.connect(producer.metadata())
    with pytest.raises(MissingPeerError, match="needs remote TP rank 1") as info:
        consumer.read_blocks(peer, [1, 2], mode=mode, timeout=20, progress=producer.progress)
    assert info.value.remote_rank == 1 and info.value.given == (0,)
    assert not bool(layouts.backing(caches_d).any())


def test_replicated_regions_may_come_from_any_rank_in_prepped_mode(
    agents: list[TraitsNixlAgent],
) -> None:
    """MLA holds the same bytes on every rank: rank 1 may read rank 0's blocks."""
    config_p, caches_p = layouts.build("deepseek_v3", NB, tp=2)
    config_d, caches_d = layouts.build("deepseek_v3", NB, tp=2)
    layouts.fill_pattern(caches_p, seed=7)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_regions(caches_p, config_p, tp_size=2, tp_rank=0))
    consumer.register_plan(plan_regions(caches_d, config_d, tp_size=2, tp_rank=1))
    peer = consumer.connect(producer.metadata())
    block_ids = [[1, 2]]
    consumer.read_blocks(peer, block_ids, mode="prepped", timeout=20, progress=producer.progress)
    checks.assert_transferred(caches_p, caches_d, config_d, block_ids)


def test_packed_rows_move_whole_rows(
    agents: list[TraitsNixlAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V4 rows as one region: one descriptor per block (runs merge), and every
    requested page still arrives while unrequested blocks stay zero. (Merged mode
    writes rows for requests this small only with MERGE_MIN_DESCRIPTORS lowered.)"""
    monkeypatch.setattr(_request, "MERGE_MIN_DESCRIPTORS", 0)
    config_p, caches_p = layouts.build("deepseek_v4", NB)
    config_d, caches_d = layouts.build("deepseek_v4", NB)
    layouts.fill_pattern(caches_p, seed=12)
    producer, consumer = _agent(agents), _agent(agents)
    rows = PlanLayout(rows=Rows.ALL)
    producer.register_plan(plan_regions(caches_p, config_p, layout=rows))
    consumer.register_plan(plan_regions(caches_d, config_d, layout=rows))
    peer = consumer.connect(producer.metadata())
    block_ids = checks.request_blocks(config_d)  # four runs of three
    result = consumer.read_blocks(peer, block_ids, timeout=20, progress=producer.progress)
    assert (result.per_block_descriptors, result.descriptors) == (12, 1)
    checks.assert_transferred(caches_p, caches_d, config_d, block_ids)


def test_unprogressed_producer_times_out_without_marking(agents: list[TraitsNixlAgent]) -> None:
    """Nobody progresses the producer (no thread, no ``progress=``): the read cannot
    finish, and the bounded wait reports it instead of hanging."""
    config, caches_p = layouts.build("llama_gqa", 4)
    _, caches_d = layouts.build("llama_gqa", 4)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_regions(caches_p, config))
    consumer.register_plan(plan_regions(caches_d, config))
    peer = consumer.connect(producer.metadata())
    received = []
    with pytest.raises(TransferFailedError, match="deadline") as info:
        received.append(consumer.read_blocks(peer, [1, 2], timeout=0.5))
    assert info.value.state == "PROC" and received == []


@pytest.mark.parametrize("mode", ["prepped", "merged"])
def test_remote_block_ids_and_block_counts_may_differ(
    mode: DescMode, agents: list[TraitsNixlAgent]
) -> None:
    """The producer has 16 blocks, the consumer 12; consumer blocks 1, 2, 3 are filled
    from producer blocks 10, 11, 15 (descriptor ids use each side's block counts)."""
    config_p, caches_p = layouts.build("gpt_oss", NB)
    config_d, caches_d = layouts.build("gpt_oss", 12)
    layouts.fill_pattern(caches_p, seed=4)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_regions(caches_p, config_p))
    consumer.register_plan(plan_regions(caches_d, config_d))
    peer = consumer.connect(producer.metadata())
    local, remote = [[1, 2], [3]], [[10, 11], [15]]
    consumer.read_blocks(peer, local, remote, mode=mode, timeout=20, progress=producer.progress)
    src, dst = layouts.backing(caches_p), layouts.backing(caches_d)
    for gid, group in enumerate(config_d.transfer_groups):
        for layer in group.layer_names:
            for lb, rb in zip(local[gid], remote[gid], strict=True):
                d, s = caches_d[layer][lb], caches_p[layer][rb]
                d_off = d.data_ptr() - dst.data_ptr()
                s_off = s.data_ptr() - src.data_ptr()
                assert torch.equal(dst[d_off : d_off + d.nbytes], src[s_off : s_off + s.nbytes])
    untouched = [b for b in range(12) if b not in (1, 2, 3)]
    for layer, cache in caches_d.items():
        for b in untouched:
            assert not bool(cache[b].view(torch.uint8).any()), (layer, b)


def test_kernel_split_hybrid_transfers_manager_blocks(agents: list[TraitsNixlAgent]) -> None:
    """Qwen3.5 with attention kernel blocks of 16 tokens inside 1024-token blocks: the
    shared attention/GDN region moves whole manager blocks."""
    config_p, caches_p = layouts.build("qwen35", 6, kernel_block_size=16)
    config_d, caches_d = layouts.build("qwen35", 6, kernel_block_size=16)
    layouts.fill_pattern(caches_p, seed=2)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_regions(caches_p, config_p))
    consumer.register_plan(plan_regions(caches_d, config_d))
    peer = consumer.connect(producer.metadata())
    block_ids = [[1], [3, 4]]  # GDN group, attention group
    consumer.read_blocks(peer, block_ids, timeout=20, progress=producer.progress)
    checks.assert_transferred(caches_p, caches_d, config_d, block_ids)
