"""A peer's region geometry, and the checks that it addresses what its fingerprint says.

Pure (no NIXL, numpy or vLLM): run on a peer's regions before any descriptor is built
from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvspec_traits.transfer._errors import MalformedMetadataError
from kvspec_traits.transfer._fingerprint import PlanFingerprint, record_page

if TYPE_CHECKING:
    from kvspec_traits.transfer._region import RegionPlan

__all__ = ["PeerRegion", "check_peer_geometry", "check_region_bounds", "peer_regions"]

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
