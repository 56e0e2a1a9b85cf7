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
from kvspec_traits.nixl._plan import Region, RegionPlan, desc_offsets, shard_count

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


class _Request:
    """One request's block ids, converted once (not once per region): one array for
    every region, or one per cache group, with each array's bounds."""

    __slots__ = ("_all", "_bounds", "_flat", "_groups")

    def __init__(self, block_ids: BlockIds) -> None:
        self._flat: npt.NDArray[np.int64] | None = None
        self._groups: list[npt.NDArray[np.int64]] = []
        self._all: npt.NDArray[np.int64] | None = None
        self._bounds: dict[int, tuple[int, int]] = {}
        if not block_ids or not isinstance(block_ids[0], Sequence):
            self._flat = np.asarray(block_ids, dtype=np.int64)
        else:
            groups = cast(Sequence[Sequence[int]], block_ids)  # one list per group
            self._groups = [np.asarray(g, dtype=np.int64) for g in groups]

    def blocks(self, group_id: int) -> npt.NDArray[np.int64]:
        """The blocks of a region of ``group_id`` (a shared region, group id < 0,
        takes every group's blocks)."""
        if self._flat is not None:
            return self._flat
        if group_id >= 0:
            return self._groups[group_id]
        if self._all is None:
            self._all = (np.concatenate(self._groups) if self._groups
                         else np.zeros(0, dtype=np.int64))
        return self._all

    def check(self, region: str, group_id: int, num_blocks: int, side: str) -> None:
        """Every id a region of ``group_id`` takes is one of its ``num_blocks``;
        :class:`BlockIdError` if not (a negative id would otherwise wrap to an address
        before the region). The one block-id check of both descriptor paths."""
        key = -1 if self._flat is not None else group_id
        bounds = self._bounds.get(key)
        if bounds is None:
            blocks = self.blocks(group_id)
            if not blocks.size:
                return
            bounds = self._bounds[key] = (int(blocks.min()), int(blocks.max()))
        if bounds[0] < 0:
            raise BlockIdError(region, bounds[0], num_blocks, side)
        if bounds[1] >= num_blocks:
            raise BlockIdError(region, bounds[1], num_blocks, side)


def _desc_ids(plan: RegionPlan, request: _Request, counts: Sequence[int] | None,
              offsets: Sequence[int], side: str) -> npt.NDArray[np.int64]:
    """:func:`block_desc_ids` with the offsets precomputed (``counts=None``: the
    plan's own block counts)."""
    parts = []
    for i, (region, group_id) in enumerate(zip(plan.regions, plan._group_ids, strict=True)):
        request.check(region.name, group_id,
                      region.num_blocks if counts is None else counts[i], side)
        parts.append(request.blocks(group_id) + offsets[i])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def block_desc_ids(plan: RegionPlan, block_ids: BlockIds, *,
                   region_num_blocks: Sequence[int] | None = None) -> npt.NDArray[np.int64]:
    """Flat ids into :func:`build_block_descs` for a request's blocks, region-major
    (the order vLLM's ``_compute_desc_ids`` uses).

    For a peer's list pass its ``region_num_blocks`` (its block counts may differ from
    ours); group membership is ours (the handshake made the region lists equal).
    Raises :class:`BlockIdError` for an id outside a region.
    """
    if region_num_blocks is None:
        return _desc_ids(plan, _Request(block_ids), None, plan._desc_offsets, "local")
    if len(region_num_blocks) != len(plan.regions):
        raise ValueError(f"{len(region_num_blocks)} block counts for "
                         f"{len(plan.regions)} regions")
    return _desc_ids(plan, _Request(block_ids), region_num_blocks,
                     desc_offsets(region_num_blocks), "remote")


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


class _ReadCache:
    """:func:`tp_reads` of each region of a plan against one peer's TP size and block
    lengths, computed on a region's first use and kept (one per connected peer, not
    one per region per request). A region that cannot move raises on every use."""

    __slots__ = ("_block_lens", "_plan", "_reads", "_remote_tp")

    def __init__(self, plan: RegionPlan, remote_tp: int,
                 remote_regions: Sequence[PeerRegion] | None) -> None:
        self._plan = plan
        self._remote_tp = remote_tp
        self._block_lens: tuple[int | None, ...] = (
            (None,) * len(plan.regions) if remote_regions is None
            else tuple(r.block_len for r in remote_regions))
        self._reads: list[tuple[Read, ...] | None] = [None] * len(plan.regions)

    def __call__(self, index: int) -> tuple[Read, ...]:
        reads = self._reads[index]
        if reads is None:
            plan = self._plan
            reads = self._reads[index] = tp_reads(
                plan.regions[index], local_tp=plan.tp_size, local_rank=plan.tp_rank,
                remote_tp=self._remote_tp, remote_block_len=self._block_lens[index])
        return reads


def _check_remotes(local: RegionPlan, remotes: Mapping[int, Sequence[PeerRegion]]) -> None:
    for rank, regions in remotes.items():
        if len(regions) != len(local.regions):
            raise ValueError(
                f"remote rank {rank} has {len(regions)} regions, the plan "
                f"{len(local.regions)}; pass the regions of a peer whose handshake "
                f"matched (check_handshake)")


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
    _check_remotes(local, remotes)
    request = _Request(local_block_ids)
    return _transfer_items(
        local, remotes, request,
        request if remote_block_ids is None else _Request(remote_block_ids),
        _ReadCache(local, remote_tp, next(iter(remotes.values()), None)))


def _transfer_items(local: RegionPlan, remotes: Mapping[int, Sequence[PeerRegion]],
                    lreq: _Request, rreq: _Request, reads: _ReadCache
                    ) -> list[TransferItems]:
    """:func:`transfer_items` with the request's ids converted and the TP reads of
    the peer kept across requests."""
    per_rank: dict[int, tuple[list[U64], list[U64]]] = {}
    for i, (region, group_id) in enumerate(zip(local.regions, local._group_ids,
                                               strict=True)):
        lblocks = lreq.blocks(group_id)
        rblocks = rreq.blocks(group_id)
        if lblocks.shape != rblocks.shape:
            raise ValueError(f"region {region.name!r}: {lblocks.size} local blocks but "
                             f"{rblocks.size} remote blocks")
        if not lblocks.size:
            continue
        lreq.check(region.name, group_id, region.num_blocks, "local")
        local_addrs = lblocks.astype(np.uint64) * np.uint64(region.block_stride)
        local_addrs += np.uint64(region.base_addr)
        for read in reads(i):
            if read.remote_rank not in remotes:
                raise MissingPeerError(region.name, read.remote_rank, sorted(remotes))
            peer = remotes[read.remote_rank][i]
            rreq.check(region.name, group_id, peer.num_blocks, "remote")
            n = lblocks.size
            lrows = np.empty((n, 3), dtype=np.uint64)
            lrows[:, 0] = local_addrs + np.uint64(read.local_offset)
            lrows[:, 1] = read.length
            lrows[:, 2] = region.device_id
            rrows = np.empty((n, 3), dtype=np.uint64)
            rrows[:, 0] = (np.uint64(peer.base_addr + read.remote_offset)
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
