"""The handshake message of the NIXL shim (its wire format) and the placement check of
a peer's regions against the local plan.

Pure (no NIXL): the consumer decodes the producer's metadata, checks the fingerprint in
it (:func:`~kvspec_traits.transfer.check_handshake`) and the placement
and the placement of its regions in the memory ranges it registers
(:func:`check_peer_layout`) before it adds the peer or builds a single descriptor.

Wire format (all integers little-endian)::

    magic  8 bytes  b"KVSTNIXL"
    version         u16   (WIRE_VERSION)
    header_len      u32
    agent_md_len    u32
    header          header_len bytes of canonical JSON
    agent_md        agent_md_len bytes (nixl_agent.get_agent_metadata())

Nothing may follow. The header holds the agent name, TP rank/size, the fingerprint,
each region's address geometry and each registered memory range with the layers whose
caches it holds (version 2: what binds a region's base to its own layers' memory).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvspec_traits.transfer import (
    MalformedMetadataError,
    PeerRegion,
    PeerRegistration,
    PlanFingerprint,
    RegionPlan,
    check_peer,
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

WIRE_VERSION: Final = 2
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
    registrations: tuple[PeerRegistration, ...] = ()
    """The memory ranges the peer registers (none: every region is refused by
    :func:`check_peer_layout`, which binds each region to one)."""


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
            "registrations": [
                [m.base, m.length, m.device_id, m.mem_type, [list(span) for span in m.layers]]
                for m in plan.registrations
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


def _registration_field(row: object, index: int) -> PeerRegistration:
    if (
        not isinstance(row, list)
        or len(row) != 5
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row[:3])
        or not isinstance(row[3], str)
        or not isinstance(row[4], list)
        or not all(
            isinstance(span, list)
            and len(span) == 3
            and isinstance(span[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in span[1:])
            for span in row[4]
        )
    ):
        raise MalformedMetadataError(
            f"registration {index} is not [base, length, device_id, mem_type, "
            f"[[layer, first byte, bytes spanned], ...]]"
        )
    return PeerRegistration(
        base=row[0],
        length=row[1],
        device_id=row[2],
        mem_type=row[3],
        layers=tuple((span[0], span[1], span[2]) for span in row[4]),
    )


def decode_metadata(data: bytes | bytearray | memoryview) -> PeerMetadata:
    """Parse a peer's handshake; :class:`MalformedMetadataError` on anything but a
    complete, well-formed message of a known version (``bytes``, ``bytearray`` or
    ``memoryview``: anything else, ``None`` or text included, is refused too)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMetadataError(
            f"a {type(data).__name__} is not a handshake message; pass the bytes the "
            f"peer's TraitsNixlAgent.metadata() returned"
        )
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
    reg_rows = header.get("registrations")
    if not isinstance(reg_rows, list) or not reg_rows:
        raise MalformedMetadataError("header field 'registrations' is not a non-empty list")
    registrations = tuple(_registration_field(row, i) for i, row in enumerate(reg_rows))
    return PeerMetadata(
        agent_name=agent,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_blocks=_int_field(header, "num_blocks", 1),
        fingerprint=fingerprint,
        regions=regions,
        registrations=registrations,
        agent_metadata=agent_md,
    )


def check_peer_layout(plan: RegionPlan, meta: PeerMetadata) -> None:
    """The transfer checks every backend runs on a peer
    (:func:`~kvspec_traits.transfer.check_peer`: handshake, geometry, memory type,
    placement with each region bound to its own registration), on a decoded message.
    Raises what :func:`~kvspec_traits.transfer.check_peer` raises."""
    check_peer(
        plan,
        meta.fingerprint,
        meta.regions,
        meta.tp_size,
        registrations=meta.registrations,
        peer=f"peer {meta.agent_name}",
    )
