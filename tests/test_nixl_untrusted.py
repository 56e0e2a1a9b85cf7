"""Peer metadata and block ids are untrusted input (issue 8, items 6 and 7).

Geometry a peer sends is checked against its own traits fingerprint and against where
our plan puts the same regions, before any descriptor is built; a refused or failed
connect leaves no peer in NIXL; hostile JSON is a named error on every path. Block ids
are Python ints or integer numpy arrays, one list per cache group, distinct
destinations: anything else is a named error before any transfer.

Real NIXL agents (UCX, DRAM, no progress threads) wherever bytes move.
"""

from __future__ import annotations

import json
import os
import struct

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from collections.abc import Iterator  # NIXL reads its log level at import
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvspec_traits.nixl import (
    TraitsNixlAgent,
    block_desc_ids,
    check_peer_layout,
    decode_metadata,
    encode_metadata,
    transfer_items,
)
from kvspec_traits.nixl._wire import WIRE_VERSION
from kvspec_traits.transfer import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    DuplicateBlockIdError,
    HandshakeMismatchError,
    MalformedMetadataError,
    PlanLayout,
    RegionPlan,
    Rows,
    check_handshake,
    decode_fingerprint,
    peer_regions,
    plan_regions,
)
from tests.nixl_helpers import checks, layouts

NB = 8


def _agent(pool: list[TraitsNixlAgent]) -> TraitsNixlAgent:
    agent = TraitsNixlAgent()
    pool.append(agent)
    return agent


_FIELDS = ("base_addr", "block_len", "block_stride", "num_blocks", "device_id")


def _forged(
    plan: RegionPlan,
    name: str,
    agent_md: bytes,
    changes: dict[int, dict[str, int]],
    extra_registrations: tuple[list[object], ...] = (),
) -> bytes:
    """``plan``'s true handshake (fingerprint included) with the geometry of some
    regions changed, and ``extra_registrations`` claimed too: what a forged or corrupt
    header says."""
    header = _header(encode_metadata(plan, name, agent_md))
    for index, fields in changes.items():
        row = header["regions"][index]
        for key, value in fields.items():
            row[_FIELDS.index(key)] = value
    header["registrations"].extend(extra_registrations)
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return (
        struct.pack("<8sHII", b"KVSTNIXL", WIRE_VERSION, len(body), len(agent_md)) + body + agent_md
    )


def _metadata(
    agent: TraitsNixlAgent, plan: RegionPlan, changes: dict[int, dict[str, int]]
) -> bytes:
    """``agent``'s handshake (its real NIXL agent metadata) with forged geometry."""
    return _forged(plan, agent.name, bytes(agent._agent.get_agent_metadata()), changes)


def _header(data: bytes) -> dict[str, Any]:
    size = struct.unpack_from("<I", data, 10)[0]
    header: dict[str, Any] = json.loads(data[18 : 18 + size])
    return header


# -- item 6: geometry against the fingerprint (pure) --------------------------------------


def _region_cases(plan: RegionPlan) -> list[tuple[str, dict[str, int], str]]:
    r = plan.regions[0]
    return [
        ("stride 0", {"block_stride": 0}, "block_stride 0 < block_len"),
        ("stride below the block", {"block_stride": r.block_len - 1}, "would overlap"),
        ("block length of another TP size", {"block_len": r.block_len * 2}, "fingerprint implies"),
        ("no blocks", {"num_blocks": 0}, "num_blocks 0"),
        ("base 2^64", {"base_addr": 1 << 64}, "outside 64 bits"),
        (
            "end past 2^64",
            {"base_addr": (1 << 64) - r.block_stride * NB},
            "does not fit in 64 bits",
        ),
    ]


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
@pytest.mark.parametrize("case", range(6))
def test_forged_region_geometry_is_refused_by_decode(tp: int, rank: int, case: int) -> None:
    """Same-TP (TP 1) and hetero-TP (a TP-2 rank, as a TP-1 consumer reads it)
    metadata whose region 0 contradicts its fingerprint: llama GQA pages are
    16 tokens x 8/tp heads x 128 x 2 (K, V) x 2 B = 65536/tp bytes (vLLM's
    FullAttentionSpec.page_size_bytes), so any other block length is forged."""
    config, caches = layouts.build("llama_gqa", NB, tp=tp)
    plan = plan_regions(caches, config, tp_size=tp, tp_rank=rank)
    assert plan.regions[0].block_len == 65536 // tp
    name, changes, message = _region_cases(plan)[case]
    with pytest.raises(MalformedMetadataError, match=message):
        decode_metadata(_forged(plan, "p", b"md", {0: changes}))
    del name


def _wire(header: object, raw: bytes | None = None) -> bytes:
    body = json.dumps(header).encode() if raw is None else raw
    return struct.pack("<8sHII", b"KVSTNIXL", WIRE_VERSION, len(body), 2) + body + b"md"


def _hostile() -> list[tuple[str, bytes]]:
    config, caches = layouts.build("llama_gqa", 2)
    header = _header(encode_metadata(plan_regions(caches, config), "p", b"md"))
    deep = "[" * 100_000 + "]" * 100_000
    huge = json.dumps(dict(header, num_blocks="H")).replace(
        '"H"', "9" * 5000
    )  # past CPython's 4300-digit limit for int()
    nested: list[object] = []
    for _ in range(20):
        nested = [nested]
    in_record = json.dumps(dict(header, regions="X")).replace('"X"', "[" * 5000 + "]" * 5000)
    return [
        ("deeply nested", _wire(None, deep.encode())),
        ("deeply nested in the regions", _wire(None, in_record.encode())),
        ("non-UTF-8", _wire(None, b'{"agent": "\xff\xfe"}')),
        ("huge integer", _wire(None, huge.encode())),
        ("integer past 64 bits", _wire(dict(header, tp_size=1 << 70))),
        ("NaN", _wire(None, b'{"agent": NaN}')),
        (
            "fingerprint nested 20 deep",
            _wire(dict(header, fingerprint=dict(header["fingerprint"], x=nested))),
        ),
    ]


@pytest.mark.parametrize("case", range(7))
def test_hostile_metadata_is_a_named_error(case: int) -> None:
    name, data = _hostile()[case]
    with pytest.raises(MalformedMetadataError):
        decode_metadata(data)
    del name


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        b"\xff\xfe{}",
        "1" * 5000,
        str(1 << 64),
        '{"v": NaN}',
        '{"v": 3, "tp_size": 1, "regions": [' + "[" * 50 + "]" * 50 + "]}",
        42,
    ],
)
def test_hostile_fingerprint_is_a_named_error_on_the_connector_path(text: object) -> None:
    """vLLM's connector carries the fingerprint as JSON text inside its own agent
    metadata; ``decode_fingerprint`` (which ``check_remote_fingerprint`` calls) and the
    connector method itself name every hostile input."""
    with pytest.raises(MalformedMetadataError):
        decode_fingerprint(text)  # type: ignore[arg-type]
    from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker

    config, caches = layouts.build("llama_gqa", 2)
    worker = object.__new__(TraitsNixlConnectorWorker)
    worker.region_plan = plan_regions(caches, config)
    peer = SimpleNamespace(kvspec_traits_fingerprint=text, engine_id="e")
    with pytest.raises(MalformedMetadataError):
        worker.check_remote_fingerprint(peer)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", sorted(layouts.FAMILIES))
def test_true_geometry_of_every_family_passes(family: str) -> None:
    """The checks refuse nothing our planner produces: every family, packed rows or
    not, every pair of TP 1 / TP 2 ranks and of 8 / 13 blocks whose handshake
    matches (the placement check compares structure, not addresses or counts)."""
    for layout in (None, PlanLayout(rows=Rows.SCATTERED | Rows.ALL)):
        plans, keep = [], []
        for tp in (1, 2):
            for num_blocks in (NB, 13):
                config, caches = layouts.build(family, num_blocks, tp=tp)
                keep.append(caches)
                plans += [
                    plan_regions(caches, config, tp_size=tp, tp_rank=rank, layout=layout)
                    for rank in range(tp)
                ]
        checked = 0
        for producer in plans:
            meta = decode_metadata(encode_metadata(producer, "p", b"md"))
            assert meta.regions == peer_regions(producer)
            for consumer in plans:
                try:
                    check_handshake(consumer, meta.fingerprint)
                except HandshakeMismatchError:
                    continue  # a TP change this layout cannot make
                check_peer_layout(consumer, meta)
                checked += 1
        assert checked >= len(plans) * 2


# -- item 6: forged geometry with real agents ---------------------------------------------


def _tp2_producers(
    pool: list[TraitsNixlAgent], family: str
) -> tuple[list[TraitsNixlAgent], list[RegionPlan], list[Any]]:
    producers, plans, keep = [], [], []
    for rank in range(2):
        config, caches = layouts.build(family, NB, tp=2)
        layouts.fill_pattern(caches, seed=40 + rank)
        plan = plan_regions(caches, config, tp_size=2, tp_rank=rank)
        producer = _agent(pool)
        producer.register_plan(plan)
        producers.append(producer)
        plans.append(plan)
        keep.append(caches)
    return producers, plans, keep


def test_hetero_tp_forged_stride_is_refused_before_nixl_learns_of_the_peer(
    agents: list[TraitsNixlAgent],
) -> None:
    """A TP-2 producer rank advertising block_stride 0 to a TP-1 consumer. Before:
    connect accepted it and read_blocks reported success while every local block held
    producer block 0. Now connect refuses it and NIXL never knows the peer."""
    producers, plans, keep = _tp2_producers(agents, "llama_gqa")
    config_d, caches_d = layouts.build("llama_gqa", NB)
    consumer = _agent(agents)
    consumer.register_plan(plan_regions(caches_d, config_d))
    consumer.connect(producers[0].metadata())
    forged = {i: {"block_stride": 0} for i in range(len(plans[1].regions))}
    with pytest.raises(MalformedMetadataError, match="block_stride 0"):
        consumer.connect(_metadata(producers[1], plans[1], forged))
    assert not consumer.knows(producers[1].name)
    assert not bool(layouts.backing(caches_d).any())
    del keep


@pytest.mark.parametrize("which", ["first", "last"])
def test_hetero_tp_shifted_base_is_refused(which: str, agents: list[TraitsNixlAgent]) -> None:
    """A TP-2 rank whose region base is moved by one page. The first region then
    overlaps the second (layer-major storage: our regions do not), the last reaches
    past the memory the peer registered with NIXL; both refused, no peer left."""
    producers, plans, keep = _tp2_producers(agents, "llama_gqa")
    config_d, caches_d = layouts.build("llama_gqa", NB)
    consumer = _agent(agents)
    consumer.register_plan(plan_regions(caches_d, config_d))
    index = 0 if which == "first" else len(plans[1].regions) - 1
    region = plans[1].regions[index]
    forged = {index: {"base_addr": region.base_addr + region.block_len}}
    message = "share bytes" if which == "first" else "lies in no memory range"
    with pytest.raises(MalformedMetadataError, match=message):
        consumer.connect(_metadata(producers[1], plans[1], forged))
    assert not consumer.knows(producers[1].name)
    del keep


def test_same_tp_shifted_row_offset_is_refused(agents: list[TraitsNixlAgent]) -> None:
    """DeepSeek-V4 rows (block-outermost): layer 1's MLA page moved within the row.
    It still lies inside the row and inside registered memory, but not where our own
    row puts it (vLLM's compute_layout_strides places pages identically at equal TP)."""
    config, caches_p = layouts.build("deepseek_v4", NB)
    _, caches_d = layouts.build("deepseek_v4", NB)
    plan_p = plan_regions(caches_p, config)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_p)
    consumer.register_plan(plan_regions(caches_d, config))
    index = plan_p.region_names.index("model.layers.1.attn.mla")
    forged = {index: {"base_addr": plan_p.regions[index].base_addr + 64}}
    with pytest.raises(MalformedMetadataError, match="a region base is shifted"):
        consumer.connect(_metadata(producer, plan_p, forged))
    assert not consumer.knows(producer.name)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_failed_connect_after_nixl_added_the_peer_removes_it(
    tp: int, agents: list[TraitsNixlAgent]
) -> None:
    """Geometry that passes every check NIXL is not needed for (the whole last region
    moved past the producer's allocation, overlapping nothing, with the header's record
    of that allocation moved alike: a consistent lie) is refused by NIXL's view of the
    peer's registered memory, after add_remote_agent: the peer is removed again.
    Before: a failure there (OverflowError, nixlNotFoundError) left the peer
    registered, and close() never removed it."""
    config, caches_p = layouts.build("llama_gqa", NB, tp=tp)
    _, caches_d = layouts.build("llama_gqa", NB, tp=tp)
    plan_p = plan_regions(caches_p, config, tp_size=tp)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_p)
    consumer.register_plan(plan_regions(caches_d, config, tp_size=tp))
    last = plan_p.regions[-1]
    shift = 4 * last.block_stride * NB
    forged = {len(plan_p.regions) - 1: {"base_addr": last.base_addr + shift}}
    length = last.block_stride * NB
    spans = [[layer, last.base_addr + shift, length] for layer in last.layers]
    claimed = [last.base_addr + shift, length, 0, "DRAM", spans]
    agent_md = bytes(producer._agent.get_agent_metadata())
    for _ in range(2):  # and again: nothing of the first attempt is left to collide
        with pytest.raises(MalformedMetadataError, match="outside the memory"):
            consumer.connect(_forged(plan_p, producer.name, agent_md, forged, (claimed,)))
        assert not consumer.knows(producer.name)
    peer = consumer.connect(producer.metadata())  # the true metadata still connects
    consumer.read_blocks(peer, [1, 2], timeout=20, progress=producer.progress)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base_addr": 1 << 64}, "outside 64 bits"),  # before: OverflowError, peer left in NIXL
        ({"block_stride": 0}, "block_stride 0"),  # before: raw nixlNotFoundError, peer left
    ],
)
def test_same_tp_forged_geometry_leaves_no_peer(
    change: dict[str, int], message: str, agents: list[TraitsNixlAgent]
) -> None:
    config, caches_p = layouts.build("deepseek_v3", NB)
    _, caches_d = layouts.build("deepseek_v3", NB)
    plan_p = plan_regions(caches_p, config)
    producer, consumer = _agent(agents), _agent(agents)
    producer.register_plan(plan_p)
    consumer.register_plan(plan_regions(caches_d, config))
    with pytest.raises(MalformedMetadataError, match=message):
        consumer.connect(_metadata(producer, plan_p, {1: change}))
    assert not consumer.knows(producer.name)
    consumer.close()  # nothing half-connected to release
    assert not consumer.knows(producer.name)


# -- item 7: block ids --------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> Iterator[SimpleNamespace]:
    """A gpt-oss producer/consumer pair (two cache groups, regions shared by both)."""
    config, caches_p = layouts.build("gpt_oss", NB)
    _, caches_d = layouts.build("gpt_oss", NB)
    layouts.fill_pattern(caches_p, seed=9)
    producer, consumer = TraitsNixlAgent(), TraitsNixlAgent()
    producer.register_plan(plan_regions(caches_p, config))
    consumer.register_plan(plan_regions(caches_d, config))
    peer = consumer.connect(producer.metadata())
    yield SimpleNamespace(
        config=config, src=caches_p, dst=caches_d, producer=producer, consumer=consumer, peer=peer
    )
    consumer.close()
    producer.close()


def _read(pair: SimpleNamespace, local: Any, remote: Any = None, mode: str = "merged") -> Any:
    layouts.backing(pair.dst).zero_()
    return pair.consumer.read_blocks(
        pair.peer, local, remote, mode=mode, timeout=20, progress=pair.producer.progress
    )


MODES = ["prepped", "per_block", "merged"]


@pytest.mark.parametrize("mode", MODES)
def test_duplicate_destination_ids_are_refused(mode: str, pair: SimpleNamespace) -> None:
    """[1, 1, 1] <- [2, 3, 4]: three reads into one block (before: success, block 1
    holding block 4). Refused before anything is posted."""
    with pytest.raises(DuplicateBlockIdError) as info:
        _read(pair, [[1, 1, 1], []], [[2, 3, 4], []], mode)
    assert info.value.block_id == 1
    assert not bool(layouts.backing(pair.dst).any())


@pytest.mark.parametrize("mode", MODES)
def test_one_id_in_two_groups_is_refused_where_regions_are_shared(
    mode: str, pair: SimpleNamespace
) -> None:
    """gpt-oss's full and sliding layers share every region: group 0 block 3 and
    group 1 block 3 are one destination."""
    assert all(r.group_id < 0 for r in pair.consumer.plan.regions)
    with pytest.raises(DuplicateBlockIdError, match="id 3 appears more than once"):
        _read(pair, [[3, 4], [3]], None, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("ids", "bad"),
    [
        ([[-0.5, 2.7], []], -0.5),  # before: truncated to blocks 0 and 2
        ([[True, False], []], True),  # before: blocks 1 and 0
        ([["3"], []], "3"),  # before: block 3
        ([[1, 2.0], []], 2.0),
        ([[np.int64(1)], []], np.int64(1)),
    ],
)
def test_ids_that_are_not_ints_are_refused(
    mode: str, ids: Any, bad: object, pair: SimpleNamespace
) -> None:
    with pytest.raises(BlockIdTypeError) as info:
        _read(pair, ids, None, mode)
    assert info.value.value == bad and type(info.value.value) is type(bad)
    assert isinstance(info.value, TypeError)
    assert not bool(layouts.backing(pair.dst).any())


@pytest.mark.parametrize(
    "ids",
    [
        [np.array([1.0, 2.0]), []],
        [np.array([True]), []],
        np.array([[0.5], [1.5]]),
        [np.array([[1, 2]]), []],
        3,
        "12",
        [[1], 2],
        [[2**70], []],
    ],
)
def test_arrays_and_containers_that_are_not_id_lists_are_refused(
    ids: Any, pair: SimpleNamespace
) -> None:
    with pytest.raises(BlockIdTypeError):
        _read(pair, ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("ids", "expected", "got"),
    [
        ([[1, 2]], 2, 1),  # before: IndexError
        ([[1], [2], [3]], 2, 3),  # before: the third list ignored
        ([1, 2], 2, 1),  # one flat list for two groups
        ([], 2, 1),
    ],
)
def test_not_one_list_per_group_is_refused(
    mode: str, ids: Any, expected: int, got: int, pair: SimpleNamespace
) -> None:
    with pytest.raises(BlockIdShapeError) as info:
        _read(pair, ids, None, mode)
    assert (info.value.expected, info.value.got) == (expected, got)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("mode", MODES)
def test_local_and_remote_lists_must_pair_up(mode: str, pair: SimpleNamespace) -> None:
    with pytest.raises(BlockIdShapeError, match="2 local but 1 remote"):
        _read(pair, [[1, 2], [3]], [[4], [5]], mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", ["arrays", "2-D array", "uint32 arrays"])
def test_integer_arrays_move_the_right_bytes(mode: str, form: str, pair: SimpleNamespace) -> None:
    """Multi-element numpy arrays (before: 'truth value ... is ambiguous')."""
    if form == "arrays":
        local: Any = [np.array([1, 2, 3]), np.array([5, 6])]
    elif form == "2-D array":
        local = np.array([[1, 2], [5, 6]])
    else:
        local = [np.array([1, 2, 3], dtype=np.uint32), np.array([6], dtype=np.uint32)]
    result = _read(pair, local, None, mode)
    block_ids = [[int(b) for b in group] for group in local]
    assert checks.assert_transferred(pair.src, pair.dst, pair.config, block_ids) > 0
    assert result.nbytes > 0


def test_python_int_lists_still_move_the_right_bytes(pair: SimpleNamespace) -> None:
    block_ids = [[7, 0], [4]]
    for mode in MODES:
        _read(pair, block_ids, None, mode)
        checks.assert_transferred(pair.src, pair.dst, pair.config, block_ids)


def test_remote_ids_may_repeat(pair: SimpleNamespace) -> None:
    """Only destinations must be distinct: two local blocks may copy one remote block."""
    _read(pair, [[1, 2], []], [[5, 5], []])
    dst, src = layouts.backing(pair.dst), layouts.backing(pair.src)
    for layer in pair.config.transfer_groups[0].layer_names:
        s = pair.src[layer][5]
        s_bytes = src[s.data_ptr() - src.data_ptr() :][: s.nbytes]
        for block in (1, 2):
            d = pair.dst[layer][block]
            assert torch.equal(dst[d.data_ptr() - dst.data_ptr() :][: d.nbytes], s_bytes)


def test_pure_descriptor_functions_validate_alike() -> None:
    """block_desc_ids and transfer_items take the same ids with the same errors."""
    config, caches = layouts.build("llama_gqa", NB)
    plan = plan_regions(caches, config)
    remotes = {0: peer_regions(plan)}
    cases: list[tuple[Any, type[Exception]]] = [
        ([1, 1], DuplicateBlockIdError),
        ([0.5], BlockIdTypeError),
        ([[1], [2]], BlockIdShapeError),
        ([NB], BlockIdError),
    ]
    for ids, error in cases:
        with pytest.raises(error):
            block_desc_ids(plan, ids)
        with pytest.raises(error):
            transfer_items(plan, remotes, 1, ids)
    # One group: its list alone, as a list, an array, or a one-row 2-D array.
    expected = block_desc_ids(plan, [[3, 1]]).tolist()
    assert block_desc_ids(plan, [3, 1]).tolist() == expected
    assert block_desc_ids(plan, np.array([3, 1])).tolist() == expected
    assert block_desc_ids(plan, np.array([[3, 1]])).tolist() == expected
    # vLLM's region-major order for one group: region r's blocks at r * NB + b.
    assert expected == [r * NB + b for r in range(len(plan.regions)) for b in (3, 1)]
    # Remote ids (another peer's list) may repeat; they are bounds-checked.
    counts = [r.num_blocks for r in plan.regions]
    assert block_desc_ids(plan, [2, 2], region_num_blocks=counts).tolist()[:2] == [2, 2]
