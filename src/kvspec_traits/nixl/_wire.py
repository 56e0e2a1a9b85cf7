"""The handshake message of the NIXL shim (its wire format) and the placement check of
a peer's regions against the local plan.

Pure (no NIXL): the consumer decodes the producer's metadata, checks the fingerprint in
it (:func:`~kvspec_traits.transfer.check_handshake`) and the placement of its regions in
the memory ranges it registers (:func:`check_peer_layout`) before it adds the peer or
builds a single descriptor.

Wire format (all integers little-endian)::

    magic  8 bytes  b"KVSTNIXL"
    version         u16   (WIRE_VERSION)
    header_len      u32
    agent_md_len    u32
    header          header_len bytes of canonical JSON
    agent_md        agent_md_len bytes (nixl_agent.get_agent_metadata())

Nothing may follow. The header holds the agent name and the plan record every backend
sends (``transfer/_record.py``): TP rank/size, the fingerprint, each region's address
geometry and each registered memory range with the layers whose caches it holds
(version 2: what binds a region's base to its own layers' memory).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from kvspec_traits.transfer import (
    MalformedMetadataError,
    PeerRegion,
    PeerRegistration,
    PlanFingerprint,
    RegionPlan,
    check_peer,
)
from kvspec_traits.transfer._fingerprint import canonical_json, load_json
from kvspec_traits.transfer._record import decode_plan_record, plan_record

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
    header = canonical_json({"agent": agent_name, **plan_record(plan)})
    return (
        _PREFIX.pack(_MAGIC, WIRE_VERSION, len(header), len(agent_metadata))
        + header
        + agent_metadata
    )


def decode_metadata(data: bytes | bytearray | memoryview) -> PeerMetadata:
    """Parse a peer's handshake; :class:`MalformedMetadataError` on anything but a
    complete, well-formed message of a known version (``bytes``, ``bytearray`` or
    ``memoryview``: anything else, ``None`` or text included, is refused too). The plan
    in it is checked as every backend checks one
    (:func:`~kvspec_traits.transfer._record.decode_plan_record`)."""
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
    agent_md = raw[_PREFIX.size + header_len :]
    if not agent_md:
        raise MalformedMetadataError("no NIXL agent metadata")
    record = decode_plan_record(header)
    return PeerMetadata(
        agent_name=agent,
        tp_rank=record.tp_rank,
        tp_size=record.tp_size,
        num_blocks=record.num_blocks,
        fingerprint=record.fingerprint,
        regions=record.regions,
        registrations=record.registrations,
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
