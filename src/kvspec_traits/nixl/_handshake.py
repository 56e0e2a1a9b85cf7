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
from collections.abc import Mapping, Sequence
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
    "check_peer_geometry",
    "check_peer_layout",
    "check_region_bounds",
    "decode_fingerprint",
    "decode_metadata",
    "encode_metadata",
    "fingerprint_of",
    "load_json",
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


# Bounds on decoded JSON: a peer's header is small and flat, so anything deeper or any
# integer outside 64 bits is hostile or corrupt (and would otherwise surface later as
# RecursionError or OverflowError).
_MAX_DEPTH: Final = 16
_INT_MIN: Final = -(1 << 63)
_U64_END: Final = 1 << 64


def _no_constant(name: str) -> object:
    raise MalformedMetadataError(f"JSON constant {name} is not allowed")


def load_json(data: str | bytes | bytearray | memoryview, what: str) -> object:
    """Decode untrusted JSON: :class:`MalformedMetadataError` for anything that is not
    UTF-8 JSON nested at most 16 deep with integers in 64 bits (never a
    ``RecursionError``, ``UnicodeDecodeError``, ``ValueError`` or ``TypeError``)."""
    try:
        raw = bytes(data) if isinstance(data, (bytearray, memoryview)) else data
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        if not isinstance(raw, str):
            raise TypeError(f"a {type(data).__name__} is not JSON text")
        value = json.loads(raw, parse_constant=_no_constant)
    except MalformedMetadataError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError, TypeError) as exc:
        raise MalformedMetadataError(
            f"{what} is not JSON ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    _check_json(value, what)
    return value


def _check_json(value: object, what: str) -> None:
    """Depth and integer bounds of decoded JSON, without recursion."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            if (
                isinstance(item, int)
                and not isinstance(item, bool)
                and not _INT_MIN <= item < _U64_END
            ):
                raise MalformedMetadataError(
                    f"{what} holds an integer outside 64 bits ({str(item)[:40]}...)"
                )
            continue
        if depth >= _MAX_DEPTH:
            raise MalformedMetadataError(f"{what} is nested deeper than {_MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True, slots=True)
class PlanFingerprint:
    """Canonical traits of every region, in region order, for one TP group size."""

    version: int
    tp_size: int
    regions: tuple[Mapping[str, Any], ...]

    def payload(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "tp_size": self.tp_size,
            "regions": [dict(r) for r in self.regions],
        }

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
        version, tp_size, regions = (
            payload.get("v"),
            payload.get("tp_size"),
            payload.get("regions"),
        )
        if not isinstance(version, int) or isinstance(version, bool):
            raise MalformedMetadataError("fingerprint has no integer version 'v'")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise MalformedMetadataError("fingerprint has no positive 'tp_size'")
        if not isinstance(regions, list) or not all(isinstance(r, dict) for r in regions):
            raise MalformedMetadataError("fingerprint 'regions' is not a list of objects")
        return cls(version=version, tp_size=tp_size, regions=tuple(regions))


def decode_fingerprint(data: str | bytes | bytearray | memoryview) -> PlanFingerprint:
    """A peer's fingerprint from its JSON text (as vLLM's connector carries it);
    :class:`MalformedMetadataError` for anything hostile or malformed."""
    return PlanFingerprint.from_payload(load_json(data, "layout fingerprint"))


def fingerprint_of(plan: RegionPlan) -> PlanFingerprint:
    """The fingerprint of a plan (what :meth:`RegionPlan.fingerprint` returns)."""
    records = tuple(r.traits_record(plan.tp_size) for r in plan.regions)
    # Round-trip through JSON so local and decoded remote values compare alike
    # (tuples become lists, enums their values).
    return PlanFingerprint(
        version=FINGERPRINT_VERSION,
        tp_size=plan.tp_size,
        regions=tuple(json.loads(_canonical(list(records)))),
    )


def check_handshake(local: PlanFingerprint | RegionPlan, remote: PlanFingerprint) -> None:
    """Refuse a peer whose layout differs from ours.

    Raises :class:`HandshakeMismatchError` naming the first differing region (its index,
    name and layers) and every trait that differs there, with both values; or, with
    ``region=None``, a differing fingerprint version or region count. TP sizes may
    differ: split sizes are normalised to the whole TP group.
    """
    mine = local if isinstance(local, PlanFingerprint) else local.fingerprint()
    if mine.version != remote.version:
        raise HandshakeMismatchError(
            None, "fingerprint version", (), [("version", mine.version, remote.version)]
        )
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
            for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key)
        ]
        layers = a.get("layers")
        raise HandshakeMismatchError(
            index,
            str(a.get("name")),
            [str(x) for x in layers] if isinstance(layers, list) else (),
            region_diffs,
        )


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
    header = _canonical(
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


def _record_page(record: Mapping[str, Any], index: int, tp_size: int) -> int:
    """The block length a rank of ``tp_size`` holds for a region whose fingerprint
    record is ``record`` (the inverse of :meth:`Region.traits_record`'s scaling)."""
    from kvspec_traits._traits import TPLayout
    from kvspec_traits.nixl._plan import _shard_count

    def layout(key: str) -> TPLayout | None:
        value = record.get(key)
        if value is None:
            return None
        try:
            return TPLayout(value)
        except ValueError:
            raise MalformedMetadataError(
                f"fingerprint record {index}: {key} {value!r} is not a TP layout"
            ) from None

    whole, shards_field = record.get("block_len"), record.get("tp_shards")
    flags = [record.get(k) for k in ("replicated", "paged")]
    if (
        not isinstance(whole, int)
        or isinstance(whole, bool)
        or whole < 1
        or not (
            shards_field is None
            or (
                isinstance(shards_field, int)
                and not isinstance(shards_field, bool)
                and shards_field >= 1
            )
        )
        or not all(isinstance(f, bool) for f in flags)
    ):
        raise MalformedMetadataError(
            f"fingerprint record {index} lacks block_len / tp_shards / replicated / paged"
        )
    tp_layout, state_layout = layout("tp_layout"), layout("state_tp_layout")
    if tp_layout is None:
        raise MalformedMetadataError(f"fingerprint record {index} has no tp_layout")
    replicated, paged = flags
    shards = _shard_count(tp_layout, shards_field, tp_size)
    state_shards = 1 if state_layout is None else _shard_count(state_layout, None, tp_size)
    scale = (1 if replicated else shards) if paged else state_shards
    if whole % scale:
        raise MalformedMetadataError(
            f"fingerprint record {index}: block_len {whole} does not split into {scale} TP shards"
        )
    return whole // scale


def check_peer_geometry(
    fingerprint: PlanFingerprint, regions: Sequence[PeerRegion], tp_size: int
) -> None:
    """Refuse region geometry a peer's own fingerprint contradicts, before any
    descriptor is built from it (:func:`decode_metadata` calls it).

    For every region: the block length is the page its fingerprint record implies at
    the peer's TP size, at least one block, a stride of at least one block (blocks do
    not overlap; stride 0 would read block 0 for every block), and the last byte
    addressable in 64 bits. Raises :class:`MalformedMetadataError` naming the region
    and the values. :func:`check_peer_layout` then compares the regions' placement
    with the local plan's.
    """
    if len(fingerprint.regions) != len(regions):
        raise MalformedMetadataError(
            f"{len(regions)} regions but {len(fingerprint.regions)} fingerprint records"
        )
    for index, (record, region) in enumerate(zip(fingerprint.regions, regions, strict=True)):
        page = _record_page(record, index, tp_size)
        if region.block_len != page:
            raise MalformedMetadataError(
                f"region {index} ({record.get('name')!r}): block_len {region.block_len} "
                f"but its fingerprint implies {page} bytes per block at TP {tp_size}"
            )
    check_region_bounds(regions, [str(r.get("name")) for r in fingerprint.regions])


def check_region_bounds(regions: Sequence[PeerRegion], names: Sequence[str] | None = None) -> None:
    """Refuse region geometry that addresses nothing sane, whatever layout it claims:
    a block of at least one byte, at least one block, a stride of at least one block
    (blocks do not overlap; stride 0 would read block 0 for every block), and the last
    byte addressable in 64 bits. :class:`MalformedMetadataError` names the region and
    the values. :func:`check_peer_geometry` runs it after the fingerprint's checks; the
    connector runs it alone for a peer that sent no fingerprint."""
    for index, region in enumerate(regions):
        where = f"region {index}" + (f" ({names[index]!r})" if names is not None else "")
        if region.block_len < 1 or region.num_blocks < 1:
            raise MalformedMetadataError(
                f"{where}: block_len {region.block_len}, num_blocks {region.num_blocks}"
            )
        if region.num_blocks > 1 and region.block_stride < region.block_len:
            raise MalformedMetadataError(
                f"{where}: block_stride {region.block_stride} < block_len "
                f"{region.block_len} (its blocks would overlap)"
            )
        end = region.base_addr + max(
            region.block_stride * region.num_blocks,
            region.block_stride * (region.num_blocks - 1) + region.block_len,
        )
        if region.base_addr < 0 or end >= _U64_END or not 0 <= region.device_id < _U64_END:
            raise MalformedMetadataError(
                f"{where}: base {region.base_addr} + stride {region.block_stride} x "
                f"{region.num_blocks} blocks does not fit in 64 bits"
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
    ours = plan._desc_index.get(("overlaps",))
    if ours is None:
        ours = plan._desc_index[("overlaps",)] = _overlaps(
            [
                (r.base_addr, r.block_len, r.block_stride, r.num_blocks, (r.mem_type, r.device_id))
                for r in plan.regions
            ]
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
