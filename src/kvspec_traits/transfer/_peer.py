"""A peer's regions, and the one set of checks every transfer backend runs on them
before it builds a descriptor or copies a byte (:func:`check_peer`): the layout
handshake, the geometry the peer's fingerprint implies, the memory type, and where
each region lies (inside its own registration, not overlapping where ours do not).

Pure (no NIXL, numpy or vLLM). The NIXL agent, the vLLM connector and the Mooncake
backend call these functions; none has a check of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvspec_traits.transfer._errors import MalformedMetadataError, MemoryTypeMismatchError
from kvspec_traits.transfer._fingerprint import (
    PlanFingerprint,
    fingerprint_of,
    pair_stages,
    record_page,
)

if TYPE_CHECKING:
    from kvspec_traits.transfer._region_plan import RegionPlan

__all__ = [
    "PeerRegion",
    "PeerRegistration",
    "check_peer",
    "check_peer_geometry",
    "check_peer_mem_types",
    "check_peer_placement",
    "check_region_bounds",
    "peer_regions",
    "peer_registrations",
]

_U64_END: Final = 1 << 64


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
class PeerRegistration:
    """One memory range a peer registers, and where each layer's cache lies in it
    (``(layer, first byte, bytes spanned)``)."""

    base: int
    length: int
    device_id: int
    mem_type: str
    layers: tuple[tuple[str, int, int], ...]


def peer_registrations(plan: RegionPlan) -> tuple[PeerRegistration, ...]:
    """A plan's registrations as a peer sees them (with the layers each holds)."""
    return tuple(
        PeerRegistration(
            base=r.base,
            length=r.length,
            device_id=r.device_id,
            mem_type=r.mem_type,
            layers=r.layers,
        )
        for r in plan.registrations
    )


def peer_regions(plan: RegionPlan) -> tuple[PeerRegion, ...]:
    """A plan's own regions as a peer sees them (what a backend in the same process, a
    loopback or a test hands the other side)."""
    return tuple(
        PeerRegion(
            base_addr=r.base_addr,
            block_len=r.block_len,
            block_stride=r.block_stride,
            num_blocks=r.num_blocks,
            device_id=r.device_id,
            mem_type=r.mem_type,
        )
        for r in plan.regions
    )


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
        page = record_page(record, index, tp_size)
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


def check_peer(
    plan: RegionPlan,
    fingerprint: PlanFingerprint,
    regions: Sequence[PeerRegion],
    tp_size: int,
    *,
    registrations: Sequence[PeerRegistration] | None = None,
    peer: str = "the peer",
    pp: tuple[int, int] = (0, 1),
    block_ratio: bool = False,
) -> tuple[tuple[int, int], ...]:
    """Every check a peer's regions pass before a backend uses them, in order:

    1. :func:`~kvspec_traits.transfer._fingerprint.pair_stages`: the same layout,
       region by region (:class:`HandshakeMismatchError`); where ``pp`` (our
       ``(pp_rank, pp_size)``) or the peer's fingerprint names a pipeline stage, the
       stage's regions with the peer's of the same layers (:class:`StageLayersError`
       for a layer one side lacks);
    2. :func:`check_peer_geometry`: the addresses are what that layout implies at the
       peer's TP size (:class:`MalformedMetadataError`);
    3. :func:`check_peer_mem_types`: each region on the memory type of ours
       (:class:`MemoryTypeMismatchError`);
    4. :func:`check_peer_placement`: each region inside its own registration, and no
       overlap ours lacks (:class:`MalformedMetadataError`).

    ``registrations`` are the peer's (where its wire carries them; ``None`` skips the
    binding of regions to registrations). ``peer`` names it in the messages. Returns
    the pairs ``(our region index, the peer's)``; checks 3 and 4 run on them.
    ``block_ratio``: the backend reads between other block sizes (check 1 per token).
    """
    pairs = pair_stages(fingerprint_of(plan, pp=pp), fingerprint, block_ratio=block_ratio)
    check_peer_geometry(fingerprint, regions, tp_size)
    staged = pp[1] > 1 or fingerprint.pp[1] > 1
    ours = plan.subset([i for i, _ in pairs]) if staged else plan
    theirs = [regions[j] for _, j in pairs] if staged else regions
    check_peer_mem_types(ours, theirs, peer)
    # A stage's peer holds other layers between ours in its rows: where each region
    # lies in a row is not compared (each region is addressed from its own base).
    check_peer_placement(
        ours, theirs, tp_size, registrations=registrations, peer=peer, rows=not staged
    )
    return pairs


def check_peer_mem_types(plan: RegionPlan, regions: Sequence[PeerRegion], peer: str) -> None:
    """Each peer region lies on the memory type of the local region it pairs with
    (only like to like is moved): :class:`MemoryTypeMismatchError` otherwise, for a
    device type, an empty or an unknown one alike."""
    for local, remote in zip(plan.regions, regions, strict=True):
        if local.mem_type != remote.mem_type:
            raise MemoryTypeMismatchError(
                local.name,
                [local.mem_type, remote.mem_type],
                f"{peer} holds it in {remote.mem_type!r}, this side in "
                f"{local.mem_type!r}; place both caches on the same memory type",
            )


def _extent(region: PeerRegion) -> int:
    return region.block_stride * (region.num_blocks - 1) + region.block_len


def _check_registrations(
    plan: RegionPlan,
    regions: Sequence[PeerRegion],
    registrations: Sequence[PeerRegistration],
    peer: str,
) -> None:
    """Each region lies whole inside one registration of its memory type and device,
    and its first block meets the memory of one of its own member layers there (both
    sides know the layer names): a base swapped with another region's, shifted onto
    another layer, past its allocation's end or into memory the peer never registered
    is refused."""
    for reg in registrations:
        if reg.length < 1 or not 0 <= reg.base < _U64_END - reg.length:
            raise MalformedMetadataError(
                f"{peer} registers {reg.length} bytes at {reg.base}: not a memory range"
            )
        for layer, start, span in reg.layers:
            if start < reg.base or start + span > reg.base + reg.length:
                raise MalformedMetadataError(
                    f"{peer} places layer {layer!r} at {start} (+{span} bytes), outside "
                    f"the memory range it registers at {reg.base} (+{reg.length} bytes)"
                )
    for index, (local, region) in enumerate(zip(plan.regions, regions, strict=True)):
        end = region.base_addr + _extent(region)
        holders = [
            reg
            for reg in registrations
            if (reg.mem_type, reg.device_id) == (region.mem_type, region.device_id)
            and reg.base <= region.base_addr
            and end <= reg.base + reg.length
        ]
        if not holders:
            raise MalformedMetadataError(
                f"region {index} ({local.name!r}) of {peer}: base {region.base_addr} + "
                f"{_extent(region)} bytes ({region.num_blocks} blocks) lies in no memory "
                f"range {peer} registers"
            )
        own = set(local.layers)
        spans = [(layer, start, span) for reg in holders for layer, start, span in reg.layers]
        first_block = (region.base_addr, region.base_addr + region.block_len)
        if spans and not any(
            layer in own and start < first_block[1] and first_block[0] < start + span
            for layer, start, span in spans
        ):
            found = sorted(
                layer for layer, start, span in spans if start <= region.base_addr < start + span
            )
            raise MalformedMetadataError(
                f"region {index} ({local.name!r}, layers {list(local.layers)}) of {peer}: "
                f"its base {region.base_addr} lies in the memory of layers {found}, not of "
                f"its own: a region base is swapped or shifted"
            )


def check_peer_placement(
    plan: RegionPlan,
    regions: Sequence[PeerRegion],
    tp_size: int,
    *,
    registrations: Sequence[PeerRegistration] | None = None,
    peer: str = "the peer",
    rows: bool = True,
) -> None:
    """Where a peer's regions lie, against its registrations and our plan (after
    :func:`check_handshake`): a shifted or swapped base is refused before a
    descriptor is built.

    - With ``registrations``: each region inside one, the one holding its layers.
    - Regions that share a byte on the peer must share one in our plan too (a base
      shifted onto a neighbour region is refused); regions of aliasing cache groups
      legitimately overlap, on both sides alike.
    - At equal TP sizes (and ``rows``), regions that our plan interleaves in one
      storage at one stride (block-outermost rows) sit at the same offsets within the
      peer's rows.

    Raises :class:`MalformedMetadataError` naming the regions.
    """
    names = plan.region_names
    if registrations is not None:
        _check_registrations(plan, regions, registrations, peer)
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
            for r in regions
        ]
    )
    extra = sorted(theirs - ours)
    if extra:
        i, j = extra[0]
        raise MalformedMetadataError(
            f"regions {i} and {j} ({names[i]!r}, {names[j]!r}) share bytes on {peer} "
            f"(bases {regions[i].base_addr} and {regions[j].base_addr}) but not here: "
            f"a region base is shifted"
        )
    if tp_size != plan.tp_size or not rows:
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
        anchor = anchors.setdefault((storage, region.block_stride), index)
        if anchor == index:
            continue
        peer_a, peer_r = regions[anchor], regions[index]
        stride = region.block_stride
        if peer_a.block_stride != stride or peer_r.block_stride != stride:
            continue
        mine = (region.base_addr - plan.regions[anchor].base_addr) % stride
        got = (peer_r.base_addr - peer_a.base_addr) % stride
        if mine != got:
            raise MalformedMetadataError(
                f"region {index} ({names[index]!r}) lies {got} bytes into the {stride}-byte "
                f"rows of {peer} after region {anchor} ({names[anchor]!r}), here {mine}: "
                f"a region base is shifted"
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
