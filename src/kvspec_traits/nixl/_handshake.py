"""The per-region traits fingerprint, the handshake check, and the metadata wire format.

Pure (no NIXL): the consumer decodes the producer's metadata and calls
:func:`check_handshake` before it adds the peer or builds a single descriptor, so a
mismatch refuses the transfer while nothing has been written.

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

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvspec_traits.nixl._errors import (
    HandshakeMismatchError,
    MalformedMetadataError,
    TraitDiff,
)

if TYPE_CHECKING:
    from kvspec_traits.nixl._plan import RegionPlan

__all__ = [
    "FINGERPRINT_VERSION",
    "WIRE_VERSION",
    "PeerMetadata",
    "PeerRegion",
    "PlanFingerprint",
    "check_handshake",
    "decode_metadata",
    "encode_metadata",
    "fingerprint_of",
]

FINGERPRINT_VERSION: Final = 3
"""Version of :meth:`Region.traits_record`; 2 added ``head_major`` (the H/N/C order
inside a page), 3 ``kv_head_contiguous`` (the order of head slots inside a page)."""
WIRE_VERSION: Final = 1
_MAGIC: Final = b"KVSTNIXL"
_PREFIX: Final = struct.Struct("<8sHII")
# Hard bounds so a corrupt length field cannot make a reader allocate gigabytes.
_MAX_HEADER: Final = 64 << 20
_MAX_AGENT_MD: Final = 64 << 20


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode()


@dataclass(frozen=True, slots=True)
class PlanFingerprint:
    """Canonical traits of every region, in region order, for one TP group size."""

    version: int
    tp_size: int
    regions: tuple[Mapping[str, Any], ...]

    def payload(self) -> dict[str, Any]:
        return {"v": self.version, "tp_size": self.tp_size,
                "regions": [dict(r) for r in self.regions]}

    def canonical(self) -> bytes:
        """Sorted-key compact JSON: equal layouts give equal bytes."""
        return _canonical(self.payload())

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    @classmethod
    def from_payload(cls, payload: object) -> PlanFingerprint:
        """Validate a decoded payload; :class:`MalformedMetadataError` if not one."""
        if not isinstance(payload, dict):
            raise MalformedMetadataError("fingerprint is not a JSON object")
        version, tp_size, regions = (payload.get("v"), payload.get("tp_size"),
                                     payload.get("regions"))
        if not isinstance(version, int) or isinstance(version, bool):
            raise MalformedMetadataError("fingerprint has no integer version 'v'")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise MalformedMetadataError("fingerprint has no positive 'tp_size'")
        if not isinstance(regions, list) or not all(isinstance(r, dict) for r in regions):
            raise MalformedMetadataError("fingerprint 'regions' is not a list of objects")
        return cls(version=version, tp_size=tp_size, regions=tuple(regions))


def fingerprint_of(plan: RegionPlan) -> PlanFingerprint:
    """The fingerprint of a plan (what :meth:`RegionPlan.fingerprint` returns)."""
    records = tuple(r.traits_record(plan.tp_size) for r in plan.regions)
    # Round-trip through JSON so local and decoded remote values compare alike
    # (tuples become lists, enums their values).
    return PlanFingerprint(version=FINGERPRINT_VERSION, tp_size=plan.tp_size,
                           regions=tuple(json.loads(_canonical(list(records)))))


def check_handshake(local: PlanFingerprint | RegionPlan, remote: PlanFingerprint) -> None:
    """Refuse a peer whose layout differs from ours.

    Raises :class:`HandshakeMismatchError` naming the first differing region (its index,
    name and layers) and every trait that differs there, with both values; or, with
    ``region=None``, a differing fingerprint version or region count. TP sizes may
    differ: split sizes are normalised to the whole TP group.
    """
    mine = local if isinstance(local, PlanFingerprint) else local.fingerprint()
    if mine.version != remote.version:
        raise HandshakeMismatchError(None, "fingerprint version", (),
                                     [("version", mine.version, remote.version)])
    if len(mine.regions) != len(remote.regions):
        diffs: list[TraitDiff] = [("region count", len(mine.regions), len(remote.regions))]
        for i, (a, b) in enumerate(zip(mine.regions, remote.regions, strict=False)):
            if a.get("name") != b.get("name"):
                diffs.append((f"region {i} name", a.get("name"), b.get("name")))
                break
        mine_names = {str(r.get("name")) for r in mine.regions}
        theirs = {str(r.get("name")) for r in remote.regions}
        if mine_names - theirs:
            diffs.append(("regions only local", sorted(mine_names - theirs), None))
        if theirs - mine_names:
            diffs.append(("regions only remote", None, sorted(theirs - mine_names)))
        raise HandshakeMismatchError(None, "region count", (), diffs)
    for index, (a, b) in enumerate(zip(mine.regions, remote.regions, strict=True)):
        if a == b:
            continue
        region_diffs: list[TraitDiff] = [
            (key, a.get(key), b.get(key))
            for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)
        ]
        layers = a.get("layers")
        raise HandshakeMismatchError(
            index, str(a.get("name")),
            [str(x) for x in layers] if isinstance(layers, list) else (), region_diffs)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRegion:
    """Address geometry of one remote region."""

    base_addr: int
    block_len: int
    block_stride: int
    num_blocks: int
    device_id: int
    mem_type: str


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
    header = _canonical({
        "agent": agent_name,
        "tp_rank": plan.tp_rank,
        "tp_size": plan.tp_size,
        "num_blocks": plan.num_blocks,
        "fingerprint": plan.fingerprint().payload(),
        "regions": [[r.base_addr, r.block_len, r.block_stride, r.num_blocks, r.device_id,
                     r.mem_type] for r in plan.regions],
    })
    return (_PREFIX.pack(_MAGIC, WIRE_VERSION, len(header), len(agent_metadata))
            + header + agent_metadata)


def _int_field(header: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MalformedMetadataError(f"header field {key!r} is not an integer >= {minimum}")
    return value


def _region_field(row: object, index: int) -> PeerRegion:
    if (not isinstance(row, list) or len(row) != 6
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                       for v in row[:5])
            or not isinstance(row[5], str)):
        raise MalformedMetadataError(
            f"region {index} is not [base, block_len, block_stride, num_blocks, "
            f"device_id, mem_type]")
    return PeerRegion(base_addr=row[0], block_len=row[1], block_stride=row[2],
                      num_blocks=row[3], device_id=row[4], mem_type=row[5])


def decode_metadata(data: bytes | bytearray | memoryview) -> PeerMetadata:
    """Parse a peer's handshake; :class:`MalformedMetadataError` on anything but a
    complete, well-formed message of a known version."""
    raw = bytes(data)
    if len(raw) < _PREFIX.size:
        raise MalformedMetadataError(
            f"truncated: {len(raw)} bytes, the fixed prefix alone is {_PREFIX.size}")
    magic, version, header_len, md_len = _PREFIX.unpack_from(raw)
    if magic != _MAGIC:
        raise MalformedMetadataError(f"bad magic {magic!r} (expected {_MAGIC!r})")
    if version != WIRE_VERSION:
        raise MalformedMetadataError(
            f"wire version {version}, this reader understands {WIRE_VERSION}")
    if header_len > _MAX_HEADER or md_len > _MAX_AGENT_MD:
        raise MalformedMetadataError(
            f"implausible lengths (header {header_len}, agent metadata {md_len})")
    expected = _PREFIX.size + header_len + md_len
    if len(raw) != expected:
        raise MalformedMetadataError(
            f"{'truncated' if len(raw) < expected else 'trailing bytes'}: "
            f"{len(raw)} bytes, the prefix announces {expected}")
    try:
        header = json.loads(raw[_PREFIX.size:_PREFIX.size + header_len])
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedMetadataError(f"header is not JSON ({exc})") from exc
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
            f"{len(regions)} regions but {len(fingerprint.regions)} fingerprint records")
    agent_md = raw[_PREFIX.size + header_len:]
    if not agent_md:
        raise MalformedMetadataError("no NIXL agent metadata")
    return PeerMetadata(agent_name=agent, tp_rank=tp_rank, tp_size=tp_size,
                        num_blocks=_int_field(header, "num_blocks", 1),
                        fingerprint=fingerprint, regions=regions, agent_metadata=agent_md)
