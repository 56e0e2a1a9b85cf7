"""The handshake message of the NIXL shim (its wire format) and the placement check of
a peer's regions against the local plan.

Pure (no NIXL): the consumer decodes the producer's metadata, checks the fingerprint in
it (:func:`~kvspec_traits.transfer.check_handshake`) and the placement
(:func:`check_peer_layout`) before it adds the peer or builds a single descriptor.

Wire format (all integers little-endian)::

    magic  8 bytes  b"KVSTNIXL"
    version         u16   (WIRE_VERSION)
    header_len      u32
    agent_md_len    u32
    header          header_len bytes of canonical JSON
    agent_md        agent_md_len bytes (nixl_agent.get_agent_metadata())

Nothing may follow. The header holds the agent name, TP rank/size, the fingerprint and
each region's address geometry.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvspec_traits.transfer import (
    MalformedMetadataError,
    PeerRegion,
    PlanFingerprint,
    RegionPlan,
    check_peer_geometry,
)
from kvspec_traits.transfer._fingerprint import canonical_json, load_json

__all__ = [
    "WIRE_VERSION",
    "PeerMetadata",
    "check_peer_layout",
    "decode_metadata",
    "encode_metadata",
]

WIRE_VERSION: Final = 1
_MAGIC: Final = b"KVSTNIXL"
_PREFIX: Final = struct.Struct("<8sHII")
# Hard bounds so a corrupt length field cannot make a reader allocate gigabytes.
_MAX_HEADER: Final = 64 << 20
_MAX_AGENT_MD: Final = 64 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerMetadata:
    """What a peer sends: its NIXL agent metadata, fingerprint and region geometry."""

    agent_name: str
    tp_rank: int
    tp_size: int
    num_blocks: int
    fingerprint: PlanFingerprint
    regions: tuple[PeerRegion, ...]
    agent_metadata: bytes


def encode_metadata(plan: RegionPlan, agent_name: str, agent_metadata: bytes) -> bytes:
    """Serialise ``plan``'s handshake for a peer (see the module docstring)."""
    header = canonical_json(
        {
            "agent": agent_name,
            "tp_rank": plan.tp_rank,
            "tp_size": plan.tp_size,
            "num_blocks": plan.num_blocks,
            "fingerprint": plan.fingerprint().payload(),
            "regions": [
                [r.base_addr, r.block_len, r.block_stride, r.num_blocks, r.device_id, r.mem_type]
                for r in plan.regions
            ],
        }
    )
    return (
        _PREFIX.pack(_MAGIC, WIRE_VERSION, len(header), len(agent_metadata))
        + header
        + agent_metadata
    )


def _int_field(header: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MalformedMetadataError(f"header field {key!r} is not an integer >= {minimum}")
    return value


def _region_field(row: object, index: int) -> PeerRegion:
    if (
        not isinstance(row, list)
        or len(row) != 6
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row[:5])
        or not isinstance(row[5], str)
    ):
        raise MalformedMetadataError(
            f"region {index} is not [base, block_len, block_stride, num_blocks, "
            f"device_id, mem_type]"
        )
    return PeerRegion(
        base_addr=row[0],
        block_len=row[1],
        block_stride=row[2],
        num_blocks=row[3],
        device_id=row[4],
        mem_type=row[5],
    )


def decode_metadata(data: bytes | bytearray | memoryview) -> PeerMetadata:
    """Parse a peer's handshake; :class:`MalformedMetadataError` on anything but a
    complete, well-formed message of a known version."""
    raw = bytes(data)
    if len(raw) < _PREFIX.size:
        raise MalformedMetadataError(
            f"truncated: {len(raw)} bytes, the fixed prefix alone is {_PREFIX.size}"
        )
    magic, version, header_len, md_len = _PREFIX.unpack_from(raw)
    if magic != _MAGIC:
        raise MalformedMetadataError(f"bad magic {magic!r} (expected {_MAGIC!r})")
    if version != WIRE_VERSION:
        raise MalformedMetadataError(
            f"wire version {version}, this reader understands {WIRE_VERSION}"
        )
    if header_len > _MAX_HEADER or md_len > _MAX_AGENT_MD:
        raise MalformedMetadataError(
            f"implausible lengths (header {header_len}, agent metadata {md_len})"
        )
    expected = _PREFIX.size + header_len + md_len
    if len(raw) != expected:
        raise MalformedMetadataError(
            f"{'truncated' if len(raw) < expected else 'trailing bytes'}: "
            f"{len(raw)} bytes, the prefix announces {expected}"
        )
    header = load_json(raw[_PREFIX.size : _PREFIX.size + header_len], "header")
    if not isinstance(header, dict):
        raise MalformedMetadataError("header is not a JSON object")
    agent = header.get("agent")
    if not isinstance(agent, str) or not agent:
        raise MalformedMetadataError("header field 'agent' is not a non-empty string")
    tp_size = _int_field(header, "tp_size", 1)
    tp_rank = _int_field(header, "tp_rank")
    if tp_rank >= tp_size:
        raise MalformedMetadataError(f"tp_rank {tp_rank} >= tp_size {tp_size}")
    rows = header.get("regions")
    if not isinstance(rows, list):
        raise MalformedMetadataError("header field 'regions' is not a list")
    regions = tuple(_region_field(row, i) for i, row in enumerate(rows))
    fingerprint = PlanFingerprint.from_payload(header.get("fingerprint"))
    if len(fingerprint.regions) != len(regions):
        raise MalformedMetadataError(
            f"{len(regions)} regions but {len(fingerprint.regions)} fingerprint records"
        )
    check_peer_geometry(fingerprint, regions, tp_size)
    agent_md = raw[_PREFIX.size + header_len :]
    if not agent_md:
        raise MalformedMetadataError("no NIXL agent metadata")
    return PeerMetadata(
        agent_name=agent,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_blocks=_int_field(header, "num_blocks", 1),
        fingerprint=fingerprint,
        regions=regions,
        agent_metadata=agent_md,
    )


def check_peer_layout(plan: RegionPlan, meta: PeerMetadata) -> None:
    """Compare where a peer's regions lie with where ours do (after
    :func:`check_handshake`): a shifted base is refused before NIXL learns of the peer.

    - Regions that share a byte on the peer must share one in our plan too (a base
      shifted onto a neighbour region is refused); regions of aliasing cache groups
      legitimately overlap, on both sides alike.
    - At equal TP sizes, regions that our plan interleaves in one storage at one
      stride (block-outermost rows) sit at the same offsets within the peer's rows.

    Raises :class:`MalformedMetadataError` naming the regions.
    """
    names = plan.region_names
    ours = plan.memo(
        ("overlaps",),
        lambda: _overlaps(
            [
                (r.base_addr, r.block_len, r.block_stride, r.num_blocks, (r.mem_type, r.device_id))
                for r in plan.regions
            ]
        ),
    )
    theirs = _overlaps(
        [
            (r.base_addr, r.block_len, r.block_stride, r.num_blocks, (r.mem_type, r.device_id))
            for r in meta.regions
        ]
    )
    extra = sorted(theirs - ours)
    if extra:
        i, j = extra[0]
        raise MalformedMetadataError(
            f"regions {i} and {j} ({names[i]!r}, {names[j]!r}) share bytes on peer "
            f"{meta.agent_name} (bases {meta.regions[i].base_addr} and "
            f"{meta.regions[j].base_addr}) but not here: a region base is shifted"
        )
    if meta.tp_size != plan.tp_size:
        return
    anchors: dict[tuple[int, int], int] = {}
    for index, region in enumerate(plan.regions):
        storage = next(
            (
                k
                for k, reg in enumerate(plan.registrations)
                if reg.base <= region.base_addr < reg.base + reg.length
            ),
            -1,
        )
        key = (storage, region.block_stride)
        anchor = anchors.setdefault(key, index)
        if anchor == index:
            continue
        peer_a, peer_r = meta.regions[anchor], meta.regions[index]
        stride = region.block_stride
        if peer_a.block_stride != stride or peer_r.block_stride != stride:
            continue
        mine = (region.base_addr - plan.regions[anchor].base_addr) % stride
        got = (peer_r.base_addr - peer_a.base_addr) % stride
        if mine != got:
            raise MalformedMetadataError(
                f"region {index} ({names[index]!r}) lies {got} bytes into the peer's "
                f"{stride}-byte rows after region {anchor} ({names[anchor]!r}), here "
                f"{mine}: a region base is shifted"
            )


_Span = tuple[int, int, int, int, tuple[str, int]]
"""``(base, block_len, block_stride, num_blocks, (mem_type, device_id))``."""


def _overlaps(regions: Sequence[_Span]) -> frozenset[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, of regions that share a byte: a sweep over regions
    sorted by first byte, comparing each with those whose span it starts inside."""
    order = sorted(range(len(regions)), key=lambda i: (regions[i][4], regions[i][0]))
    pairs: set[tuple[int, int]] = set()
    active: list[tuple[int, int]] = []  # (end, index)
    for index in order:
        base, length, stride, count, where = regions[index]
        active = [
            (end, other) for end, other in active if end > base and regions[other][4] == where
        ]
        for _, other in active:
            if _blocks_meet(regions[other], regions[index]):
                pairs.add((min(other, index), max(other, index)))
        active.append((base + stride * (count - 1) + length, index))
    return frozenset(pairs)


def _blocks_meet(a: _Span, b: _Span) -> bool:
    """Whether two regions whose spans overlap have a byte in common."""
    a_base, a_len, a_stride, a_count, _ = a
    b_base, b_len, b_stride, b_count, _ = b
    if a_count > 1 and b_count > 1 and a_stride == b_stride:
        # b's blocks start `delta` into a's period: they meet unless b fits in a's gap.
        delta = (b_base - a_base) % a_stride
        return delta < a_len or delta + b_len > a_stride
    if a_count > 1 and b_count > 1:
        return True  # different strides over one span: counted as sharing
    (s_base, s_len, _, _, _), (o_base, o_len, o_stride, o_count, _) = (
        (a, b) if a_count == 1 else (b, a)
    )
    if o_count == 1:
        return s_base < o_base + o_len and o_base < s_base + s_len
    first = max(0, (s_base - o_base - o_len) // o_stride)
    for i in range(first, min(first + 2 + s_len // o_stride, o_count)):
        block = o_base + i * o_stride
        if block < s_base + s_len and s_base < block + o_len:
            return True
    return False
