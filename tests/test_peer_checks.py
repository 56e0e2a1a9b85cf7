"""One set of peer checks for every backend (issue 21 item 2, issue 24 items 1-3 and 6).

``kvspec_traits.transfer.check_peer`` (handshake, geometry, memory type, placement with
each region bound to its own layers' memory) runs for the NIXL agent, the Mooncake
backend and the vLLM connector alike; block ids are parsed and bounded by one set of
functions. Real NIXL agents (UCX, DRAM, no progress thread) and real vLLM cache
allocations (tests/nixl_helpers/layouts.py: vLLM's allocate_kv_cache on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL reads its log level at import

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvspec_traits.mooncake import TraitsMooncakeEngine, encode_record
from kvspec_traits.nixl import (
    MissingPeerError,
    TraitsNixlAgent,
    block_desc_ids,
    decode_metadata,
    encode_metadata,
)
from kvspec_traits.nixl._wire import WIRE_VERSION
from kvspec_traits.transfer import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    HandshakeMismatchError,
    MalformedMetadataError,
    MemoryTypeMismatchError,
    PlanFingerprint,
    RegionPlan,
    check_handshake,
    plan_regions,
)
from tests.nixl_helpers import checks, layouts

NB = 8
# llama_gqa (tests/nixl_helpers/layouts.py): pages of 16 tokens x 8 KV heads x 128 x
# K,V x 2 B (bf16) = 65,536 B at TP 1 (vLLM's FullAttentionSpec.page_size_bytes).
PAGE = 16 * 8 * 128 * 2 * 2


def _agent(agents: list[TraitsNixlAgent]) -> TraitsNixlAgent:
    agent = TraitsNixlAgent()
    agents.append(agent)
    return agent


def _rewrite(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """A handshake message with its JSON header edited (the agent metadata kept)."""
    size = struct.unpack_from("<I", data, 10)[0]
    md = data[18 + size :]
    header: dict[str, Any] = json.loads(data[18 : 18 + size])
    edit(header)
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<8sHII", b"KVSTNIXL", WIRE_VERSION, len(body), len(md)) + body + md


def _swap_bases(i: int, j: int) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        rows = header["regions"]
        rows[i][0], rows[j][0] = rows[j][0], rows[i][0]

    return edit


# -- item 1: swapped region bases (NIXL) --------------------------------------------------


@pytest.mark.parametrize("producer_tp", [1, 2])
def test_swapped_region_bases_are_refused_before_nixl_learns_of_the_peer(
    producer_tp: int, agents: list[TraitsNixlAgent]
) -> None:
    """Failure mode (issue 24 item 1): a header whose regions 0 and 1 have their bases
    swapped (what a producer registering in another order sends) matched the
    fingerprint, ``connect`` accepted it, and ``read_blocks`` returned 786432 B of the
    wrong layers, in the merged and prepped modes, at equal TP and at 2 -> 1. Now each
    region's base must lie in the memory of its own layers (the header carries where
    each layer's cache lies in each registered range): refused before any descriptor is
    built or NIXL adds the peer, and no destination byte changes."""
    config_d, caches_d = layouts.build("llama_gqa", NB)
    consumer = _agent(agents)
    consumer.register_plan(plan_regions(caches_d, config_d))
    config_p, caches_p = layouts.build("llama_gqa", NB, tp=producer_tp)
    layouts.fill_pattern(caches_p, seed=3)
    rank = producer_tp - 1
    plan_p = plan_regions(caches_p, config_p, tp_size=producer_tp, tp_rank=rank)
    producer = _agent(agents)
    producer.register_plan(plan_p)
    # Regions 0 and 1 are layers 0 and 1, one region per layer, one page per block.
    assert plan_p.regions[0].layers != plan_p.regions[1].layers
    assert plan_p.regions[0].block_len == PAGE // producer_tp
    forged = _rewrite(producer.metadata(), _swap_bases(0, 1))
    with pytest.raises(MalformedMetadataError, match="swapped or shifted") as refused:
        consumer.connect(forged)
    assert "region 0 ('model.layers.0.self_attn.attn'" in str(refused.value)
    assert not consumer.knows(producer.name)
    assert not bool(layouts.backing(caches_d).any())
    # The true header of the same producer still connects.
    peer = consumer.connect(producer.metadata())
    if producer_tp == 1:
        moved = consumer.read_blocks(peer, [1, 2], mode="prepped", progress=producer.progress)
        assert moved.nbytes == 2 * PAGE * len(plan_p.regions)


def test_a_region_outside_its_registered_memory_is_refused(
    agents: list[TraitsNixlAgent],
) -> None:
    """Failure mode: a registration record (the header's claim of what the peer
    registered) whose layer spans lie outside it, or a region past every registered
    range, was never compared with the regions: both are named now."""
    config, caches_p = layouts.build("llama_gqa", NB)
    plan_p = plan_regions(caches_p, config)
    producer = _agent(agents)
    producer.register_plan(plan_p)
    consumer = _agent(agents)
    consumer.register_plan(plan_regions(layouts.build("llama_gqa", NB)[1], config))

    def stray_layer(header: dict[str, Any]) -> None:
        header["registrations"][0][4][0][1] = header["registrations"][0][0] - 4096

    def no_registration(header: dict[str, Any]) -> None:
        header["registrations"] = []

    with pytest.raises(MalformedMetadataError, match="outside the memory range it registers"):
        consumer.connect(_rewrite(producer.metadata(), stray_layer))
    with pytest.raises(MalformedMetadataError, match="'registrations' is not a non-empty"):
        consumer.connect(_rewrite(producer.metadata(), no_registration))
    assert not consumer.knows(producer.name)


# -- item 2: the second backend trusts the producer's plan no more than NIXL does -------
# (issue 24 found these in memcopy, the in-process copy Mooncake replaced: its connect
# checked only the consumer's plan; every backend now runs check_peer on the peer.)


@pytest.fixture
def engines() -> Iterator[list[TraitsMooncakeEngine]]:
    made: list[TraitsMooncakeEngine] = []
    yield made
    for engine in made:
        engine.close()


def _mooncake_pair(
    engines: list[TraitsMooncakeEngine], family: str = "llama_gqa"
) -> tuple[TraitsMooncakeEngine, TraitsMooncakeEngine, RegionPlan, RegionPlan, Any]:
    """A seeded producer engine and a zeroed consumer engine (two Mooncake engines of
    this process, over loopback TCP)."""
    config_p, caches_p = layouts.build(family, NB)
    config_d, caches_d = layouts.build(family, NB)
    layouts.fill_pattern(caches_p, seed=7)
    plan_p, plan_d = plan_regions(caches_p, config_p), plan_regions(caches_d, config_d)
    producer, consumer = TraitsMooncakeEngine(), TraitsMooncakeEngine()
    engines += [producer, consumer]
    producer.register_plan(plan_p)
    consumer.register_plan(plan_d)
    return consumer, producer, plan_p, plan_d, (caches_p, caches_d)


def _edit(plan: RegionPlan, index: int, **changes: object) -> RegionPlan:
    regions = list(plan.regions)
    regions[index] = dataclasses.replace(regions[index], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(plan, regions=tuple(regions))


@pytest.mark.parametrize("mem_type", ["VRAM", "", "garbage"])
def test_mooncake_refuses_a_producer_off_host_memory(
    mem_type: str, engines: list[TraitsMooncakeEngine]
) -> None:
    """A producer region on "VRAM" (a device address), "" or garbage: Mooncake's TCP
    transport would read it as host memory. :class:`MemoryTypeMismatchError` at
    ``connect``, as the NIXL agent raises; the peer is not kept."""
    consumer, producer, plan_p, _, (_, caches_d) = _mooncake_pair(engines)
    record = encode_record(_edit(plan_p, 1, mem_type=mem_type), producer.rpc_port)
    with pytest.raises(MemoryTypeMismatchError, match=f"holds it in {mem_type!r}"):
        consumer.connect(record, "127.0.0.1")
    assert not consumer.knows(producer.session)
    assert not bool(layouts.backing(caches_d).any())


def _placement_forgeries(plan: RegionPlan, plan_d: RegionPlan) -> dict[str, tuple[RegionPlan, str]]:
    first, second, last = plan.regions[0], plan.regions[1], plan.regions[-1]
    swapped = dataclasses.replace(
        plan,
        regions=(
            dataclasses.replace(first, base_addr=second.base_addr),
            dataclasses.replace(second, base_addr=first.base_addr),
            *plan.regions[2:],
        ),
    )
    return {
        # Layer 0's region moved 64 bytes: it now runs into layer 1's memory.
        "shifted": (_edit(plan, 0, base_addr=first.base_addr + 64), "share bytes"),
        # Layer 1's region on layer 0's base: the same bytes twice.
        "overlapping": (_edit(plan, 1, base_addr=first.base_addr), "swapped or shifted"),
        "swapped": (swapped, "swapped or shifted"),
        # A base in memory the producer does not hold (the consumer's own cache).
        "foreign": (_edit(plan, 1, base_addr=plan_d.regions[1].base_addr), "no memory range"),
        # More blocks than the allocation holds: the last ones past its end.
        "num_blocks beyond the allocation": (
            _edit(plan, len(plan.regions) - 1, num_blocks=last.num_blocks * 4),
            "no memory range",
        ),
    }


@pytest.mark.parametrize(
    "case", ["shifted", "overlapping", "swapped", "foreign", "num_blocks beyond the allocation"]
)
def test_mooncake_refuses_a_producer_plan_that_misplaces_its_regions(
    case: str, engines: list[TraitsMooncakeEngine]
) -> None:
    """Shifted, overlapping, swapped or foreign bases and ``num_blocks`` beyond the
    allocation (memcopy once reported success with wrong bytes, or died with SIGSEGV):
    refused by :func:`~kvspec_traits.transfer.check_peer` at ``connect``; the true
    record then connects and moves the right bytes."""
    consumer, producer, plan_p, plan_d, (caches_p, caches_d) = _mooncake_pair(engines)
    forged, message = _placement_forgeries(plan_p, plan_d)[case]
    with pytest.raises(MalformedMetadataError, match=message):
        consumer.connect(encode_record(forged, producer.rpc_port), "127.0.0.1")
    assert not consumer.knows(producer.session)
    assert not bool(layouts.backing(caches_d).any())
    peer = consumer.connect(producer.record(), "127.0.0.1")
    # Two blocks of one page in every region (one region per layer).
    assert consumer.read_blocks(peer, [1, 2]).nbytes == 2 * PAGE * len(plan_p.regions)
    config = layouts.build("llama_gqa", NB)[0]
    assert checks.assert_transferred(caches_p, caches_d, config, [[1, 2]]) > 0


# -- block ids: one parser, one bounds check ---------------------------------------------


def test_mooncake_takes_the_1d_integer_array_its_message_recommends(
    engines: list[TraitsMooncakeEngine],
) -> None:
    """Both backends parse ids with the same functions, so an integer array moves the
    same bytes as the list (memcopy once refused the array its message recommended)."""
    consumer, producer, plan_p, _, (caches_p, caches_d) = _mooncake_pair(engines)
    peer = consumer.connect(producer.record(), "127.0.0.1")
    moved = consumer.read_blocks(peer, [np.array([1, 3], dtype=np.int32)])
    assert moved.nbytes == 2 * PAGE * len(plan_p.regions)
    config = layouts.build("llama_gqa", NB)[0]
    assert checks.assert_transferred(caches_p, caches_d, config, [[1, 3]]) > 0
    with pytest.raises(BlockIdTypeError, match="dtype float64 is not block ids"):
        consumer.read_blocks(peer, [np.array([1.0])])


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        ([[1, NB]], BlockIdError, f"local block id {NB} is not in 0..{NB - 1}"),
        ([[-1]], BlockIdError, "local block id -1"),
        ([[1, True]], BlockIdTypeError, "True is a bool, not an int"),
        ([[1, 2.0]], BlockIdTypeError, "2.0 is a float"),
        ([np.zeros((1, 1), dtype=np.int64)], BlockIdTypeError, r"shape \(1, 1\)"),
        ([[1], [2]], BlockIdShapeError, "2 lists for a plan of 1 cache groups"),
        ("12", BlockIdTypeError, "a str is not block ids"),
    ],
)
def test_both_backends_refuse_block_ids_alike(
    ids: Any, error: type, match: str, engines: list[TraitsMooncakeEngine]
) -> None:
    """Parsing and bounds were written twice once (NIXL's descriptor ids, memcopy) with
    copied messages; now one set of functions in ``transfer``: the same error type and
    message from NIXL's descriptor ids and Mooncake's reads."""
    consumer, producer, _, plan_d, _ = _mooncake_pair(engines)
    peer = consumer.connect(producer.record(), "127.0.0.1")
    with pytest.raises(error, match=match) as by_mooncake:
        consumer.read_blocks(peer, ids)
    with pytest.raises(error, match=match) as by_nixl:
        block_desc_ids(plan_d, ids)
    assert str(by_mooncake.value) == str(by_nixl.value)


# -- item 6: loose errors -----------------------------------------------------------------


@pytest.mark.parametrize("data", [None, "KVSTNIXL", 12, ["bytes"]])
def test_decode_metadata_of_no_bytes_is_named(data: object) -> None:
    """Failure mode: ``decode_metadata(None)`` and ``decode_metadata(str)`` raised a
    bare ``TypeError`` from ``bytes()``."""
    with pytest.raises(MalformedMetadataError, match="is not a handshake message"):
        decode_metadata(data)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [("top", "tp_size", True), ("record", "block_len", 65536.0), ("record", "replicated", 0)],
)
def test_a_fingerprint_of_other_json_types_is_not_equal(
    where: str, key: str, value: object
) -> None:
    """Failure mode: a fingerprint with ``tp_size: true``, ``block_len: 65536.0`` or
    ``replicated: 0`` was accepted and compared equal to the real one (Python's
    ``True == 1``, ``65536.0 == 65536``, ``0 == False``). Exact JSON types now."""
    config, caches = layouts.build("llama_gqa", NB)
    plan = plan_regions(caches, config)
    payload = plan.fingerprint().payload()
    assert payload["tp_size"] == 1 and payload["regions"][0]["block_len"] == PAGE
    assert payload["regions"][0]["replicated"] is False
    if where == "top":
        payload[key] = value
        with pytest.raises(MalformedMetadataError, match="positive 'tp_size'"):
            PlanFingerprint.from_payload(payload)
        return
    payload["regions"][0][key] = value
    with pytest.raises(HandshakeMismatchError, match=f"{key}: local="):
        check_handshake(plan, PlanFingerprint.from_payload(payload))


@pytest.fixture(scope="module")
def nixl_pair() -> Iterator[SimpleNamespace]:
    config, caches_p = layouts.build("llama_gqa", NB)
    _, caches_d = layouts.build("llama_gqa", NB)
    layouts.fill_pattern(caches_p, seed=9)
    producer, consumer = TraitsNixlAgent(), TraitsNixlAgent()
    producer.register_plan(plan_regions(caches_p, config))
    consumer.register_plan(plan_regions(caches_d, config))
    peer = consumer.connect(producer.metadata())
    yield SimpleNamespace(producer=producer, consumer=consumer, peer=peer, caches_d=caches_d)
    consumer.close()
    producer.close()


def test_a_peer_under_another_rank_is_a_missing_peer(nixl_pair: SimpleNamespace) -> None:
    """Failure mode: a peer passed under the wrong rank (``{1: rank-0 peer}``) gave a
    bare ``ValueError``; docs/nixl.md says :class:`MissingPeerError` (rank 1 was not
    given), before anything is posted."""
    with pytest.raises(MissingPeerError, match="needs remote TP rank 1") as missing:
        nixl_pair.consumer.read_blocks(
            {1: nixl_pair.peer}, [1], progress=nixl_pair.producer.progress
        )
    assert missing.value.region is None and missing.value.given == (0,)
    assert not bool(layouts.backing(nixl_pair.caches_d).any())


@pytest.mark.parametrize("mode", ["prepped", "per_block", "merged"])
def test_an_empty_request_moves_nothing_in_every_mode(
    mode: str, nixl_pair: SimpleNamespace
) -> None:
    """Failure mode: an empty request in prepped mode failed with NIXL's
    ``NIXL_ERR_INVALID_PARAM`` (an empty prepared transfer), while the other modes
    returned 0 B."""
    result = nixl_pair.consumer.read_blocks(
        nixl_pair.peer, [], mode=mode, progress=nixl_pair.producer.progress
    )
    assert (result.nbytes, result.descriptors) == (0, 0)


def test_encode_then_decode_keeps_every_layer_span() -> None:
    """The registrations a header carries are the plan's: each layer's cache view, as
    the tensor spans it (llama_gqa: one vLLM allocation, one view per layer of NB pages),
    so the binding has what it checks."""
    config, caches = layouts.build("llama_gqa", NB)
    plan = plan_regions(caches, config)
    meta = decode_metadata(encode_metadata(plan, "p", b"md"))
    assert len(meta.registrations) == 1
    spans = {layer: (start, size) for layer, start, size in meta.registrations[0].layers}
    for region in plan.regions:
        start, size = spans[region.layers[0]]
        assert start == region.base_addr == caches[region.layers[0]].data_ptr()
        assert size == NB * PAGE  # the view's blocks, one page each, no padding
