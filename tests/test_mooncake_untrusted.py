"""A Mooncake peer's record is untrusted input, refused as a NIXL peer's metadata is:
the same checks (transfer/_record.py's decoding, transfer.check_peer) on the same
plan record, so every forged or hostile record meets the same named error with the same
message on both backends (peer names aside), and a refused record leaves no peer.

The cases are test_nixl_untrusted.py's: region geometry its own fingerprint
contradicts (same TP and a TP-2 rank), hostile JSON, a shifted base, a row offset moved,
a region claimed in memory the peer never registered. Records are built here from real
plans; the engine is a real Mooncake engine (no byte moves: every case is refused).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvspec_traits.mooncake import TraitsMooncakeEngine, decode_record, encode_record
from kvspec_traits.mooncake._wire import WIRE_VERSION as MOONCAKE_WIRE
from kvspec_traits.nixl import check_peer_layout, decode_metadata, encode_metadata
from kvspec_traits.nixl._wire import WIRE_VERSION as NIXL_WIRE
from kvspec_traits.transfer import MalformedMetadataError, RegionPlan, plan_regions
from tests.nixl_helpers import layouts

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
NB = 8
PORT = 4242
_FIELDS = ("base_addr", "block_len", "block_stride", "num_blocks", "device_id")
Header = dict[str, Any]


def _nixl(header: object, raw: bytes | None = None) -> bytes:
    body = json.dumps(header).encode() if raw is None else raw
    return struct.pack("<8sHII", b"KVSTNIXL", NIXL_WIRE, len(body), 2) + body + b"md"


def _mooncake(header: object, raw: bytes | None = None) -> bytes:
    body = json.dumps(header).encode() if raw is None else raw
    return struct.pack("<8sHI", b"KVSTMOON", MOONCAKE_WIRE, len(body)) + body


def _header(plan: RegionPlan) -> Header:
    """The plan record both backends send, with both envelopes' fields."""
    data = encode_record(plan, PORT)
    header: Header = {**json.loads(data[14:])}
    header["agent"] = "p"
    return header


def _forge(header: Header, changes: dict[int, dict[str, int]]) -> Header:
    forged: Header = json.loads(json.dumps(header))
    for index, fields in changes.items():
        for key, value in fields.items():
            forged["regions"][index][_FIELDS.index(key)] = value
    return forged


def _refusals(nixl: Callable[[], object], mooncake: Callable[[], object]) -> tuple[str, str]:
    """Both calls' MalformedMetadataError messages, the peer named alike."""
    messages = []
    for call in (nixl, mooncake):
        with pytest.raises(MalformedMetadataError) as info:
            call()
        messages.append(
            str(info.value).replace(f"peer 127.0.0.1:{PORT}", "PEER").replace("peer p", "PEER")
        )
    return messages[0], messages[1]


def test_a_true_record_round_trips() -> None:
    config, caches = layouts.build("deepseek_v4", NB)
    plan = plan_regions(caches, config)
    record = decode_record(encode_record(plan, PORT))
    nixl = decode_metadata(encode_metadata(plan, "p", b"md"))
    assert record.rpc_port == PORT
    assert record.plan.fingerprint == plan.fingerprint() == nixl.fingerprint
    assert (record.plan.regions, record.plan.registrations) == (nixl.regions, nixl.registrations)
    assert (record.plan.tp_rank, record.plan.tp_size, record.plan.num_blocks) == (0, 1, NB)


def _region_cases(plan: RegionPlan) -> list[tuple[dict[str, int], str]]:
    r = plan.regions[0]
    return [
        ({"block_stride": 0}, "block_stride 0 < block_len"),
        ({"block_stride": r.block_len - 1}, "would overlap"),
        ({"block_len": r.block_len * 2}, "fingerprint implies"),
        ({"num_blocks": 0}, "num_blocks 0"),
        ({"base_addr": 1 << 64}, "outside 64 bits"),
        ({"base_addr": (1 << 64) - r.block_stride * NB}, "does not fit in 64 bits"),
    ]


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
@pytest.mark.parametrize("case", range(6))
def test_forged_region_geometry_is_refused_alike(tp: int, rank: int, case: int) -> None:
    """Region 0 contradicting its own fingerprint (llama GQA pages: 16 tokens x 8/tp
    heads x 128 x 2 (K, V) x 2 B = 65536/tp bytes, vLLM's FullAttentionSpec)."""
    config, caches = layouts.build("llama_gqa", NB, tp=tp)
    plan = plan_regions(caches, config, tp_size=tp, tp_rank=rank)
    assert plan.regions[0].block_len == 65536 // tp
    changes, message = _region_cases(plan)[case]
    forged = _forge(_header(plan), {0: changes})
    nixl, mooncake = _refusals(
        lambda: decode_metadata(_nixl(forged)), lambda: decode_record(_mooncake(forged))
    )
    assert nixl == mooncake
    assert message in mooncake


def _hostile() -> list[tuple[Header | None, bytes | None]]:
    config, caches = layouts.build("llama_gqa", 2)
    header = _header(plan_regions(caches, config))
    deep = "[" * 100_000 + "]" * 100_000
    huge = json.dumps(dict(header, num_blocks="H")).replace('"H"', "9" * 5000)
    nested: list[object] = []
    for _ in range(20):
        nested = [nested]
    in_record = json.dumps(dict(header, regions="X")).replace('"X"', "[" * 5000 + "]" * 5000)
    return [
        (None, deep.encode()),
        (None, in_record.encode()),
        (None, b'{"agent": "\xff\xfe"}'),
        (None, huge.encode()),
        (dict(header, tp_size=1 << 70), None),
        (None, b'{"agent": NaN}'),
        (dict(header, fingerprint=dict(header["fingerprint"], x=nested)), None),
        (dict(header, tp_rank=1), None),
        (dict(header, registrations=[]), None),
        (dict(header, regions=header["regions"][:1]), None),
    ]


@pytest.mark.parametrize("case", range(10))
def test_hostile_records_are_refused_alike(case: int) -> None:
    """Deep nesting, non-UTF-8, integers past 64 bits, NaN, a rank outside its TP size,
    no registrations, fewer regions than records: one message on both backends."""
    header, raw = _hostile()[case]
    nixl, mooncake = _refusals(
        lambda: decode_metadata(_nixl(header, raw)), lambda: decode_record(_mooncake(header, raw))
    )
    assert nixl == mooncake


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"KVSTNIXL" + b"\x00" * 6, "bad magic"),
        (struct.pack("<8sHI", b"KVSTMOON", 99, 0), "wire version 99"),
        (struct.pack("<8sHI", b"KVSTMOON", MOONCAKE_WIRE, 1 << 30), "implausible"),
        (_mooncake({}) + b"\x00", "trailing bytes"),
        (_mooncake({})[:-1], "truncated"),
        (_mooncake([1]), "not a JSON object"),
        (_mooncake({"rpc_port": 0}), "'rpc_port' is not a TCP port"),
        (_mooncake({"rpc_port": True}), "'rpc_port' is not a TCP port"),
        (_mooncake({"rpc_port": 65536}), "'rpc_port' is not a TCP port"),
        ("text", "a str is not a handshake record"),
    ],
)
def test_a_malformed_envelope_is_named(data: object, reason: str) -> None:
    with pytest.raises(MalformedMetadataError, match=reason):
        decode_record(data)  # type: ignore[arg-type]


def test_every_truncation_is_a_named_error() -> None:
    config, caches = layouts.build("llama_gqa", 2)
    data = encode_record(plan_regions(caches, config), PORT)
    for cut in range(0, len(data), 7):
        with pytest.raises(MalformedMetadataError):
            decode_record(data[:cut])


@pytest.fixture
def engine() -> Iterator[TraitsMooncakeEngine]:
    made = TraitsMooncakeEngine("127.0.0.1")
    yield made
    made.close()


def _placement_cases() -> list[tuple[str, str, int, Callable[[RegionPlan], dict[int, Any]]]]:
    def shifted_first(plan: RegionPlan) -> dict[int, Any]:
        region = plan.regions[0]
        return {0: {"base_addr": region.base_addr + region.block_len}}

    def shifted_last(plan: RegionPlan) -> dict[int, Any]:
        index = len(plan.regions) - 1
        region = plan.regions[index]
        return {index: {"base_addr": region.base_addr + region.block_len}}

    def row_offset(plan: RegionPlan) -> dict[int, Any]:
        index = plan.region_names.index("model.layers.1.attn.mla")
        return {index: {"base_addr": plan.regions[index].base_addr + 64}}

    return [
        ("llama_gqa", "share bytes", 2, shifted_first),
        ("llama_gqa", "lies in no memory range", 2, shifted_last),
        ("deepseek_v4", "a region base is shifted", 1, row_offset),
    ]


@pytest.mark.parametrize("case", range(3))
def test_misplaced_regions_are_refused_alike_and_leave_no_peer(
    case: int, engine: TraitsMooncakeEngine
) -> None:
    """Geometry consistent with the fingerprint but not with where the peer's memory and
    our plan put the regions: refused by check_peer on both backends, before the
    Mooncake engine keeps the peer."""
    family, message, tp, change = _placement_cases()[case]
    config, caches_p = layouts.build(family, NB, tp=tp)
    plan_p = plan_regions(caches_p, config, tp_size=tp, tp_rank=tp - 1)
    config_d, caches_d = layouts.build(family, NB)
    plan_d = plan_regions(caches_d, config_d)
    engine.register_plan(plan_d)
    forged = _forge(_header(plan_p), change(plan_p))
    nixl, mooncake = _refusals(
        lambda: check_peer_layout(plan_d, decode_metadata(_nixl(forged))),
        lambda: engine.connect(_mooncake(forged), "127.0.0.1"),
    )
    assert nixl == mooncake
    assert message in mooncake
    assert not engine.knows(f"127.0.0.1:{PORT}")
    # The true record connects.
    engine.connect(encode_record(plan_p, PORT), "127.0.0.1")
    assert engine.knows(f"127.0.0.1:{PORT}")
    del caches_p, caches_d
