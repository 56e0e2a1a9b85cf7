"""KV blocks between two processes through Mooncake's transfer engine over loopback TCP
(kvspec_traits.mooncake), planned by kvspec_traits.transfer alone.

One peer process (mooncake_helpers/peer.py) serves the whole module: it builds TP ranks'
caches, registers each with its own engine and serves its record on the backend's side
channel; this process fetches the record there, connects, and reads from or writes into
it. Every rank holds its slice of one seeded TP-1 truth (mooncake_helpers/ranks.py, vLLM's
head split), so the expected bytes are computed from the truth, never from the plan:
each requested page equals the truth's (or the rank's slice of it), each page of a block
no group requested is still zero (nixl_helpers/checks.py, the NIXL tests' check).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kvspec_traits.mooncake import (
    MissingPeerError,
    TraitsMooncakeEngine,
    TransferFailedError,
    fetch_record,
)
from kvspec_traits.transfer import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    DuplicateBlockIdError,
    HandshakeMismatchError,
    MalformedMetadataError,
    UnsupportedLayoutError,
    plan_regions,
)
from tests.mooncake_helpers.ranks import rank_caches, slice_heads
from tests.mooncake_helpers.remote import Remote
from tests.nixl_helpers import checks, layouts

# Mooncake logs at INFO to stderr; it reads the level when the first engine starts.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
NB, SEED = 16, 11
HOST = "127.0.0.1"
# GQA, MLA (and its fp8 and sparse variants), DeepSeek-V4 rows with their rings, sliding
# windows, chunked attention, and the Mamba and GDN hybrids.
FAMILIES = sorted(layouts.FAMILIES)
TP_FAMILIES = ["deepseek_v3", "deepseek_v4", "gpt_oss", "llama_gqa"]
HYBRIDS = ["jamba", "qwen35"]


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    peer = Remote(tmp_path_factory.mktemp("mooncake"))
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def engines() -> Iterator[list[TraitsMooncakeEngine]]:
    """Engines a test makes in this process (append them); closed after the test."""
    made: list[TraitsMooncakeEngine] = []
    yield made
    for engine in made:
        engine.close()


def _engine(
    pool: list[TraitsMooncakeEngine],
    caches: dict[str, torch.Tensor],
    config: object,
    tp: int = 1,
    rank: int = 0,
) -> TraitsMooncakeEngine:
    engine = TraitsMooncakeEngine(HOST)
    engine.register_plan(plan_regions(caches, config, tp_size=tp, tp_rank=rank))  # type: ignore[arg-type]
    pool.append(engine)
    return engine


def _truth(family: str) -> dict[str, torch.Tensor]:
    _, truth = layouts.build(family, NB)
    layouts.fill_pattern(truth, SEED)
    return truth


def _expected(family: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What consumer rank ``rank`` of TP ``tp`` holds after a transfer of its blocks:
    its slice of the truth (the whole truth at TP 1)."""
    if tp == 1:
        return _truth(family)
    _, caches = layouts.build(family, NB, tp=tp)
    slice_heads(_truth(family), caches, rank)
    return caches


@pytest.mark.parametrize("family", FAMILIES)
def test_p1_d1_read_and_write_byte_exact(
    family: str, remote: Remote, engines: list[TraitsMooncakeEngine]
) -> None:
    """Read: the peer process's seeded producer into our zeroed consumer. Write: our
    seeded producer into the peer process's zeroed consumer. Each moves the request's
    blocks of every group whole (equal TP), nothing else."""
    config, consumer_caches = rank_caches(family, NB, 1, 0, None)
    consumer = _engine(engines, consumer_caches, config)
    _, producer_peer = remote.connect(consumer, family, NB, 1, 0, SEED)
    block_ids = checks.request_blocks(config)
    read = consumer.read_blocks(producer_peer, block_ids)
    assert checks.assert_transferred(_truth(family), consumer_caches, config, block_ids) > 0
    # Equal TP: one whole block per requested id per region; a region shared by every
    # group takes every group's ids (runs of consecutive ids merge where blocks abut).
    per_block = sum(len(ids) for ids in block_ids)
    plan = consumer.plan
    assert read.nbytes == sum(
        r.block_len * (per_block if r.group_id < 0 else len(block_ids[r.group_id]))
        for r in plan.regions
    )
    assert (
        0
        < read.entries
        <= sum(per_block if r.group_id < 0 else len(block_ids[r.group_id]) for r in plan.regions)
    )

    _, producer_caches = rank_caches(family, NB, 1, 0, SEED)
    producer = _engine(engines, producer_caches, config)
    key, consumer_peer = remote.connect(producer, family, NB, 1, 0, None)
    written = producer.write_blocks(consumer_peer, block_ids)
    assert written.nbytes == read.nbytes
    received = remote.caches(key, family, NB, 1)
    assert checks.assert_transferred(producer_caches, received, config, block_ids) > 0


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_p2_d1_read_and_write_byte_exact(
    family: str, remote: Remote, engines: list[TraitsMooncakeEngine]
) -> None:
    """Two producer ranks, one consumer: head-sharded regions gathered from both ranks,
    replicated ones from rank 0 only (rank 1's replicated pages hold other bytes,
    which must not arrive). Read: the ranks in the peer process. Write: both ranks
    here, each pushing its part."""
    truth = _truth(family)
    config, consumer_caches = rank_caches(family, NB, 1, 0, None)
    consumer = _engine(engines, consumer_caches, config)
    peers = {rank: remote.connect(consumer, family, NB, 2, rank, SEED)[1] for rank in range(2)}
    # Disjoint runs per group, with a gap: 2, 3 | 4, 5 | ... (non-adjacent pairs for
    # one-group families: 2, 3, 9).
    block_ids = checks.request_blocks(config, per_group=2, start=2)
    if len(block_ids) == 1:
        block_ids = [[2, 3, 9]]
    consumer.read_blocks(peers, block_ids)
    checks.assert_transferred(truth, consumer_caches, config, block_ids)

    key, port = remote.build(family, NB, 1, 0, None)
    record = fetch_record(HOST, port)
    kept = []
    for rank in range(2):
        config_p, caches_p = rank_caches(family, NB, 2, rank, SEED)
        kept.append(caches_p)
        producer = _engine(engines, caches_p, config_p, tp=2, rank=rank)
        producer.write_blocks({0: producer.connect(record, HOST)}, block_ids)
    checks.assert_transferred(truth, remote.caches(key, family, NB, 1), config, block_ids)


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_p1_d2_read_and_write_byte_exact(
    family: str, remote: Remote, engines: list[TraitsMooncakeEngine]
) -> None:
    """One producer, two consumer ranks: each consumer rank gets its half of the heads
    (or the whole page of a replicated region). Read: the producer in the peer
    process. Write: the producer here, pushing each rank's part."""
    groups = len(layouts.build(family, 1)[0].transfer_groups)
    block_ids = [[0, 5, 6, 7]] + [[8 + 2 * g, 9 + 2 * g] for g in range(groups - 1)]
    _, port = remote.build(family, NB, 1, 0, SEED)
    record = fetch_record(HOST, port)
    for rank in range(2):
        config_d, caches_d = rank_caches(family, NB, 2, rank, None)
        consumer = _engine(engines, caches_d, config_d, tp=2, rank=rank)
        consumer.read_blocks({0: consumer.connect(record, HOST)}, block_ids)
        checks.assert_transferred(_expected(family, 2, rank), caches_d, config_d, block_ids)

    config_p, caches_p = rank_caches(family, NB, 1, 0, SEED)
    producer = _engine(engines, caches_p, config_p)
    keys, peers = {}, {}
    for rank in range(2):
        keys[rank], peers[rank] = remote.connect(producer, family, NB, 2, rank, None)
    producer.write_blocks(peers, block_ids)
    for rank in range(2):
        config_d = layouts.build(family, NB, tp=2)[0]
        got = remote.caches(keys[rank], family, NB, 2)
        checks.assert_transferred(_expected(family, 2, rank), got, config_d, block_ids)


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(2, 1), (1, 2)])
def test_an_undescribed_state_split_between_tp_sizes_is_refused_at_connect(
    family: str,
    producer_tp: int,
    consumer_tp: int,
    remote: Remote,
    engines: list[TraitsMooncakeEngine],
) -> None:
    """A Mamba or GDN state is split by TP; in vLLM's default conv layout (SD) its traits
    do not say how (no tp_split), so its shards cannot be re-cut between TP sizes (as for
    NIXL): the peer is refused by name when it connects, nothing moves. The DS layout,
    whose split is described, moves: tests/test_tp_matrix.py."""
    config, caches = rank_caches(family, NB, consumer_tp, 0, None)
    consumer = _engine(engines, caches, config, tp=consumer_tp)
    _, port = remote.build(family, NB, producer_tp, 0, SEED, whole=True)
    with pytest.raises(UnsupportedLayoutError, match="does not say how it splits") as info:
        consumer.connect(fetch_record(HOST, port), HOST)
    assert "mamba" in info.value.layer or "linear_attn" in info.value.layer
    assert not bool(layouts.backing(caches).any())


def test_a_mismatched_layout_is_refused_before_anything_moves(
    remote: Remote, engines: list[TraitsMooncakeEngine]
) -> None:
    config, caches = rank_caches("deepseek_v3", NB, 1, 0, None)
    consumer = _engine(engines, caches, config)
    with pytest.raises(HandshakeMismatchError) as info:
        remote.connect(consumer, "deepseek_v3_fp8", NB, 1, 0, SEED)
    assert info.value.region_name == "model.layers.0.self_attn.attn"
    assert {d[0] for d in info.value.diffs} >= {"block_len", "dtype", "kv_quant_mode"}
    assert not bool(layouts.backing(caches).any())


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize(
    ("local", "remote_ids", "error", "match"),
    [
        ([[1, NB]], None, BlockIdError, f"local block id {NB} is not in 0..{NB - 1}"),
        ([[1, 2]], [[1, NB + 3]], BlockIdError, f"remote block id {NB + 3}"),
        ([[1, -1]], None, BlockIdError, "local block id -1"),
        ([[1, True]], None, BlockIdTypeError, "True is a bool, not an int"),
        ([[1, 2.0]], None, BlockIdTypeError, "2.0 is a float"),
        ([[1], [2]], None, BlockIdShapeError, "2 lists for a plan of 1 cache groups"),
        ([[1, 2]], [[1]], BlockIdShapeError, "2 local but 1 remote ids"),
    ],
)
def test_bad_block_ids_are_named_and_nothing_moves(
    write: bool,
    local: list[list[object]],
    remote_ids: list[list[object]] | None,
    error: type[Exception],
    match: str,
    remote: Remote,
    engines: list[TraitsMooncakeEngine],
) -> None:
    """Block 1 is valid and comes first: a backend moving as it validates would have
    moved it before meeting the bad id."""
    config, caches = rank_caches("llama_gqa", NB, 1, 0, None if not write else SEED)
    engine = _engine(engines, caches, config)
    key, peer = remote.connect(engine, "llama_gqa", NB, 1, 0, SEED if not write else None)
    move = engine.write_blocks if write else engine.read_blocks
    with pytest.raises(error, match=match):
        move(peer, local, remote_ids)  # type: ignore[arg-type]
    target = remote.caches(key, "llama_gqa", NB, 1) if write else caches
    assert not bool(layouts.backing(target).any())


def test_a_destination_named_twice_is_refused_on_its_side(
    remote: Remote, engines: list[TraitsMooncakeEngine]
) -> None:
    """Reading, our blocks are the destinations; writing, the peer's are (two sources
    into one peer block), and remote ids may repeat only on a read."""
    config, caches = rank_caches("llama_gqa", NB, 1, 0, SEED)
    engine = _engine(engines, caches, config)
    key, peer = remote.connect(engine, "llama_gqa", NB, 1, 0, None)
    with pytest.raises(DuplicateBlockIdError, match="remote block id 4 appears more than once"):
        engine.write_blocks(peer, [[1, 2]], [[4, 4]])
    with pytest.raises(DuplicateBlockIdError, match="local block id 3 appears more than once"):
        engine.read_blocks(peer, [[3, 3]], [[1, 2]])
    assert not bool(layouts.backing(remote.caches(key, "llama_gqa", NB, 1)).any())
    engine.read_blocks(peer, [[1, 2]], [[5, 5]])  # one remote block into two of ours


def test_a_rank_not_given_is_named(remote: Remote, engines: list[TraitsMooncakeEngine]) -> None:
    """A TP-1 consumer given producer rank 0 of 2 only: the head-sharded regions need
    rank 1 too."""
    config, caches = rank_caches("llama_gqa", NB, 1, 0, None)
    consumer = _engine(engines, caches, config)
    _, peer = remote.connect(consumer, "llama_gqa", NB, 2, 0, SEED)
    with pytest.raises(MissingPeerError, match="needs remote TP rank 1") as info:
        consumer.read_blocks({0: peer}, [[1, 2]])
    assert info.value.given == (0,)
    with pytest.raises(MissingPeerError, match="passed as rank 1 of 2"):
        consumer.read_blocks({1: peer}, [[1, 2]])
    assert not bool(layouts.backing(caches).any())


def test_a_peer_gone_fails_the_transfer_by_name(
    remote: Remote, engines: list[TraitsMooncakeEngine]
) -> None:
    """The producer's engine unregisters its memory (closes) after the handshake:
    Mooncake's server refuses the read, which is a TransferFailedError, not a return
    value to forget."""
    config, caches = rank_caches("llama_gqa", NB, 1, 0, None)
    consumer = _engine(engines, caches, config)
    key, peer = remote.connect(consumer, "llama_gqa", NB, 1, 0, SEED)
    consumer.read_blocks(peer, [[1]])
    remote.command("close", key=key)
    with pytest.raises(TransferFailedError, match="batch_transfer_sync_read") as info:
        consumer.read_blocks(peer, [[2, 3]])
    assert info.value.code != 0


def test_no_peer_connects_twice_or_to_itself(
    remote: Remote, engines: list[TraitsMooncakeEngine]
) -> None:
    config, caches = rank_caches("llama_gqa", NB, 1, 0, None)
    engine = _engine(engines, caches, config)
    _, port = remote.build("llama_gqa", NB, 1, 0, SEED)
    record = fetch_record(HOST, port)
    engine.connect(record, HOST)
    with pytest.raises(MalformedMetadataError, match="already connected"):
        engine.connect(record, HOST)
    with pytest.raises(MalformedMetadataError, match="already connected"):
        engine.connect(engine.record(), HOST)
    with pytest.raises(RuntimeError, match="after record"):
        engine.register_plan(engine.plan)


def test_the_peer_process_never_loaded_the_nixl_shim(remote: Remote) -> None:
    """Every rank of this module's peer process planned, registered, served its record
    and moved bytes with kvspec_traits.transfer and .mooncake alone (run last: after
    the others)."""
    assert remote.command("modules")["nixl"] == []
