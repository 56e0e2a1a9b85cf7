"""Descriptor building: regions + block ids -> NIXL descriptor arrays (numpy, no NIXL).

Two forms:

- :func:`build_block_descs`: NIXL's strided ``Nx5`` form, ``(addr, len, device_id,
  stride, count)``, one row per region covering all its blocks, as vLLM 0.33's
  ``_build_fa_local`` prepares them once at registration; a request then selects
  blocks by flat descriptor id (:func:`block_desc_ids`), one descriptor per block.
- :func:`transfer_items`: per request, ``Nx3`` ``(addr, len, device_id)`` rows for
  both sides, with tensor-parallel head splitting applied (:func:`tp_reads`);
  :func:`merge_runs` then merges rows that are contiguous on both sides, so a run of
  consecutive block ids in a dense region is one descriptor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import cast

import numpy as np
import numpy.typing as npt

from kvspec_traits._traits import TPLayout
from kvspec_traits.nixl._errors import BlockIdError, MissingPeerError, UnsupportedLayoutError
from kvspec_traits.nixl._handshake import PeerRegion
from kvspec_traits.nixl._plan import Region, RegionPlan, shard_count

__all__ = [
    "BlockIds",
    "Read",
    "TransferItems",
    "block_desc_ids",
    "build_block_descs",
    "build_state_descs",
    "merge_runs",
    "peer_regions",
    "tp_reads",
    "transfer_items",
]

U64 = npt.NDArray[np.uint64]
BlockIds = Sequence[int] | Sequence[Sequence[int]]
"""Block ids of one request: one list for every region, or one list per cache group
(indexed by group id; a shared region takes every group's blocks)."""


def build_block_descs(regions: RegionPlan | Sequence[Region] | Sequence[PeerRegion]
                      ) -> U64:
    """Strided ``Nx5`` descriptors, one row per region: ``(base, block_len, device_id,
    block_stride, num_blocks)``. Flat descriptor id of block ``b`` of region ``i`` is
    ``sum(num_blocks of regions before i) + b``."""
    rows: Sequence[Region | PeerRegion] = (
        regions.regions if isinstance(regions, RegionPlan) else regions)
    out = np.empty((len(rows), 5), dtype=np.uint64)
    for i, r in enumerate(rows):
        out[i] = (r.base_addr, r.block_len, r.device_id, r.block_stride, r.num_blocks)
    return out


def build_state_descs(plan: RegionPlan) -> U64:
    """Strided ``Nx5`` sub-region descriptors of every recurrent-state component
    (vLLM's conv/SSM sub-regions), in region then component order."""
    rows = [(r.base_addr + c.offset, c.nbytes, r.device_id, r.block_stride, r.num_blocks)
            for r in plan.regions if r.state for c in r.state_components]
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


def _region_blocks(region_group_ids: Sequence[int], block_ids: BlockIds,
                   index: int) -> npt.NDArray[np.int64]:
    if not block_ids or not isinstance(block_ids[0], Sequence):
        return np.asarray(block_ids, dtype=np.int64)
    groups = cast(Sequence[Sequence[int]], block_ids)  # one list per group: checked above
    wanted = region_group_ids[index]
    if wanted < 0:  # shared by several groups: every group's blocks live here
        return np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
    return np.asarray(groups[wanted], dtype=np.int64)


def _check_block_ids(region: str, blocks: npt.NDArray[np.int64], num_blocks: int,
                     side: str) -> None:
    """Every id in ``blocks`` is a block of the region; :class:`BlockIdError` if not
    (a negative id would otherwise wrap to an address before the region)."""
    if not blocks.size:
        return
    low, high = int(blocks.min()), int(blocks.max())
    if low < 0:
        raise BlockIdError(region, low, num_blocks, side)
    if high >= num_blocks:
        raise BlockIdError(region, high, num_blocks, side)


def block_desc_ids(plan: RegionPlan, block_ids: BlockIds, *,
                   region_num_blocks: Sequence[int] | None = None) -> npt.NDArray[np.int64]:
    """Flat ids into :func:`build_block_descs` for a request's blocks, region-major
    (the order vLLM's ``_compute_desc_ids`` uses).

    For a peer's list pass its ``region_num_blocks`` (its block counts may differ from
    ours); group membership is ours (the handshake made the region lists equal).
    """
    counts_list = (plan.region_num_blocks if region_num_blocks is None
                   else list(region_num_blocks))
    if len(counts_list) != len(plan.regions):
        raise ValueError(f"{len(counts_list)} block counts for {len(plan.regions)} regions")
    counts = np.array(counts_list, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    parts = []
    for i, region in enumerate(plan.regions):
        blocks = _region_blocks(plan.region_group_ids, block_ids, i)
        _check_block_ids(region.name, blocks, int(counts[i]),
                         "local" if region_num_blocks is None else "remote")
        parts.append(offsets[i] + blocks)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Read:
    """One piece of a local block read from one remote rank."""

    remote_rank: int
    local_offset: int
    remote_offset: int
    length: int


def tp_reads(region: Region, *, local_tp: int, local_rank: int, remote_tp: int,
             remote_block_len: int | None = None) -> tuple[Read, ...]:
    """Where this rank's block of ``region`` comes from when the peer has ``remote_tp``
    ranks: a replicated region whole from one rank; a head-sharded region split or
    gathered by heads (its head slice must be contiguous, :attr:`Region.head_major`);
    a TP-sharded recurrent state only between equal TP sizes (also where it shares a
    region with a replicated page: the block holds this rank's shard of the state).

    Raises :class:`UnsupportedLayoutError` when the region cannot move between these
    TP sizes.
    """
    if region.sharded_state and local_tp != remote_tp:
        raise UnsupportedLayoutError(
            region.name, f"its blocks hold a TP-sharded recurrent state, which cannot "
                         f"move between TP {remote_tp} and TP {local_tp}; run producer and "
                         f"consumer with equal TP sizes")
    if region.replicated:
        return (Read(local_rank % remote_tp, 0, 0, region.block_len),)
    local_shards = shard_count(region, local_tp)
    remote_shards = shard_count(region, remote_tp)
    local_shard = local_rank // (local_tp // local_shards)
    if local_shards == remote_shards:
        return (Read(local_shard * (remote_tp // remote_shards), 0, 0, region.block_len),)
    if region.state or region.tp_layout is not TPLayout.HEAD_SHARDED:
        raise UnsupportedLayoutError(
            region.name, f"a {region.tp_layout.value} region with a recurrent state "
                         f"cannot move between TP {remote_tp} and TP {local_tp}")
    if not region.head_major or region.head_segment is not None:
        raise UnsupportedLayoutError(
            region.name, "its head slices are not contiguous within a block, so it cannot "
                         f"be split between TP {remote_tp} and TP {local_tp}")
    total = region.block_len * local_shards
    if remote_block_len is not None and remote_block_len * remote_shards != total:
        raise UnsupportedLayoutError(
            region.name, f"local block {region.block_len} B x {local_shards} shards != "
                         f"remote {remote_block_len} B x {remote_shards} shards")
    lo, hi = Fraction(local_shard, local_shards), Fraction(local_shard + 1, local_shards)
    reads = []
    for rs in range(remote_shards):
        r_lo, r_hi = Fraction(rs, remote_shards), Fraction(rs + 1, remote_shards)
        a, b = max(lo, r_lo), min(hi, r_hi)
        if a >= b:
            continue
        parts = ((a - lo) * total, (a - r_lo) * total, (b - a) * total)
        if any(p.denominator != 1 for p in parts):
            raise UnsupportedLayoutError(region.name, "head split is not byte-aligned")
        reads.append(Read(rs * (remote_tp // remote_shards), int(parts[0]), int(parts[1]),
                          int(parts[2])))
    return tuple(reads)


@dataclass(frozen=True, slots=True)
class TransferItems:
    """Matching ``Nx3`` descriptor rows for one remote rank: row ``i`` of ``local`` and
    of ``remote`` move the same bytes."""

    remote_rank: int
    local: U64
    remote: U64

    @property
    def count(self) -> int:
        return int(self.local.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum()) if self.count else 0


def peer_regions(plan: RegionPlan) -> tuple[PeerRegion, ...]:
    """A plan's own regions as a peer sees them (for loopback and tests)."""
    return tuple(PeerRegion(base_addr=r.base_addr, block_len=r.block_len,
                            block_stride=r.block_stride, num_blocks=r.num_blocks,
                            device_id=r.device_id, mem_type=r.mem_type)
                 for r in plan.regions)


def transfer_items(local: RegionPlan, remotes: Mapping[int, Sequence[PeerRegion]],
                   remote_tp: int, local_block_ids: BlockIds,
                   remote_block_ids: BlockIds | None = None) -> list[TransferItems]:
    """Per remote rank, the descriptor rows that fill ``local_block_ids`` of every
    region from the peer's ``remote_block_ids`` (default: the same ids).

    ``remotes`` maps each remote TP rank that may be read to its regions (in the same
    order as ours, which the handshake guarantees). Rows are region-major, then in
    block order, so :func:`merge_runs` can merge consecutive blocks.

    Raises :class:`MissingPeerError` when a region needs a remote rank that is not in
    ``remotes``, :class:`BlockIdError` for an id outside a region, ``ValueError`` when a
    remote rank's region list does not match the plan's.
    """
    for rank, regions in remotes.items():
        if len(regions) != len(local.regions):
            raise ValueError(
                f"remote rank {rank} has {len(regions)} regions, the plan "
                f"{len(local.regions)}; pass the regions of a peer whose handshake "
                f"matched (check_handshake)")
    any_remote = next(iter(remotes.values()), None)
    remote_ids = local_block_ids if remote_block_ids is None else remote_block_ids
    per_rank: dict[int, tuple[list[U64], list[U64]]] = {}
    for i, region in enumerate(local.regions):
        lblocks = _region_blocks(local.region_group_ids, local_block_ids, i)
        rblocks = _region_blocks(local.region_group_ids, remote_ids, i)
        if lblocks.shape != rblocks.shape:
            raise ValueError(f"region {region.name!r}: {lblocks.size} local blocks but "
                             f"{rblocks.size} remote blocks")
        if not lblocks.size:
            continue
        _check_block_ids(region.name, lblocks, region.num_blocks, "local")
        for read in tp_reads(region, local_tp=local.tp_size, local_rank=local.tp_rank,
                             remote_tp=remote_tp,
                             remote_block_len=None if any_remote is None
                             else any_remote[i].block_len):
            if read.remote_rank not in remotes:
                raise MissingPeerError(region.name, read.remote_rank, sorted(remotes))
            peer = remotes[read.remote_rank][i]
            _check_block_ids(region.name, rblocks, peer.num_blocks, "remote")
            n = lblocks.size
            lrows = np.empty((n, 3), dtype=np.uint64)
            lrows[:, 0] = (region.base_addr + read.local_offset
                           + lblocks.astype(np.uint64) * np.uint64(region.block_stride))
            lrows[:, 1] = read.length
            lrows[:, 2] = region.device_id
            rrows = np.empty((n, 3), dtype=np.uint64)
            rrows[:, 0] = (peer.base_addr + read.remote_offset
                           + rblocks.astype(np.uint64) * np.uint64(peer.block_stride))
            rrows[:, 1] = read.length
            rrows[:, 2] = peer.device_id
            bucket = per_rank.setdefault(read.remote_rank, ([], []))
            bucket[0].append(lrows)
            bucket[1].append(rrows)
    return [TransferItems(rank, np.concatenate(lp), np.concatenate(rp))
            for rank, (lp, rp) in sorted(per_rank.items())]


def merge_runs(items: TransferItems) -> TransferItems:
    """Merge neighbouring rows that are contiguous on both sides (and on one device)
    into one descriptor each; the bytes moved are unchanged."""
    if items.count < 2:
        return items
    loc, rem = items.local, items.remote
    joins = ((loc[:-1, 0] + loc[:-1, 1] == loc[1:, 0])
             & (rem[:-1, 0] + rem[:-1, 1] == rem[1:, 0])
             & (loc[:-1, 2] == loc[1:, 2]) & (rem[:-1, 2] == rem[1:, 2]))
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    lengths = np.add.reduceat(loc[:, 1], starts)
    new_local = loc[starts].copy()
    new_remote = rem[starts].copy()
    new_local[:, 1] = lengths
    new_remote[:, 1] = lengths
    return TransferItems(items.remote_rank, new_local, new_remote)
