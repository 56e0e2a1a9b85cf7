"""Prepared descriptor lists for reads between TP sizes: for one remote rank, every
(region, read) of the peer's read table (:func:`~kvspec_traits.transfer.tp_reads`, per
cache group as :class:`~kvspec_traits.nixl._items.ReadTable` buckets them), one row per
block on each side, prepared once per remote rank as vLLM prepares its split
descriptors at the handshake; a request then names descriptor ids (NIXL's
``make_prepped_xfer``) and builds no rows. A push producer's writes are its consumer
ranks' reads of it, planned from their side (:func:`tp_writes`), turned around.

Pure: numpy only, no NIXL and no vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvspec_traits.nixl._checked import checked_request
from kvspec_traits.nixl._descs import U64, BlockIds, Request
from kvspec_traits.nixl._items import Groups, ReadCache, ReadTable
from kvspec_traits.transfer import (
    PeerRegion,
    RegionPlan,
    UnsupportedLayoutError,
    peer_regions,
    peer_view,
)

__all__ = ["TPTable", "TPWrites", "request_ids", "tp_table", "tp_table_ids", "tp_writes"]

Ids = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class TPTable:
    """One remote rank's prepared lists: ``local`` and ``remote`` ``(address, length,
    device)`` rows, and per cache-group key of the read table the first row of each of
    its (region, read) rows on each side (``None``: nothing read from this rank)."""

    rank: int
    local: U64
    remote: U64
    starts: tuple[tuple[Ids, Ids] | None, ...]


def tp_table(
    plan: RegionPlan, table: ReadTable, rank: int, regions: Sequence[PeerRegion]
) -> TPTable:
    """Rank ``rank``'s lists (its ``regions``) from ``table``'s buckets for that rank:
    each (region, read) row's blocks, block ``b`` at ``base + b * stride``, all of our
    region's blocks locally and all of the peer's remotely."""
    local: list[U64] = []
    remote: list[U64] = []
    starts: list[tuple[Ids, Ids] | None] = []
    at_l = at_r = 0
    for buckets in table.buckets:
        bucket = buckets.get(rank)
        if bucket is None:
            starts.append(None)
            continue
        firsts_l, firsts_r = [], []
        for j, index in enumerate(bucket.regions.tolist()):
            n_l, n_r = plan.regions[index].num_blocks, regions[index].num_blocks
            length = bucket.length[j, 0]
            local.append(
                _rows(bucket.lbase[j, 0], bucket.lstride[j, 0], n_l, length, bucket.ldev[j, 0])
            )
            remote.append(
                _rows(bucket.rbase[j, 0], bucket.rstride[j, 0], n_r, length, bucket.rdev[j, 0])
            )
            firsts_l.append(at_l)
            firsts_r.append(at_r)
            at_l, at_r = at_l + n_l, at_r + n_r
        starts.append((np.asarray(firsts_l, dtype=np.int64), np.asarray(firsts_r, dtype=np.int64)))
    empty = np.empty((0, 3), dtype=np.uint64)
    return TPTable(
        rank,
        np.concatenate(local) if local else empty,
        np.concatenate(remote) if remote else empty,
        tuple(starts),
    )


def _rows(
    base: np.uint64, stride: np.uint64, count: int, length: np.uint64, device: np.uint64
) -> U64:
    rows = np.empty((count, 3), dtype=np.uint64)
    rows[:, 0] = base + stride * np.arange(count, dtype=np.uint64)
    rows[:, 1] = length
    rows[:, 2] = device
    return rows


def request_ids(
    plan: RegionPlan,
    remotes: Mapping[int, Sequence[PeerRegion]],
    local_ids: BlockIds,
    remote_ids: BlockIds,
    reads: ReadCache,
    tables: Sequence[TPTable],
) -> dict[int, tuple[Ids, Ids]]:
    """:func:`tp_table_ids` of a request of ``plan``'s blocks ``local_ids`` paired with
    the remote ranks' ``remote_ids``, checked first as the shim checks a read
    (:func:`~kvspec_traits.nixl._checked.checked_request`: one list per group, paired,
    in bounds on both sides, distinct destinations, every region able to move)."""
    _, groups = checked_request(
        plan,
        remotes,
        Request(local_ids, plan.num_groups, "local"),
        Request(remote_ids, plan.num_groups, "remote"),
        reads,
    )
    return tp_table_ids(tables, groups)


def tp_table_ids(tables: Sequence[TPTable], groups: Groups) -> dict[int, tuple[Ids, Ids]]:
    """Per remote rank with something to read, a request's descriptor ids into its
    local and remote lists (``groups``: the request's checked ids per cache-group key,
    :func:`~kvspec_traits.nixl._checked.checked_request`), row-major: (region, read)
    by (region, read), block by block, alike on both sides."""
    out: dict[int, tuple[Ids, Ids]] = {}
    for table in tables:
        parts_l: list[Ids] = []
        parts_r: list[Ids] = []
        for key, (lblocks, rblocks) in enumerate(groups):
            start = table.starts[key] if key < len(table.starts) else None
            if start is None or not lblocks.size:
                continue
            parts_l.append((start[0][:, None] + lblocks[None, :]).ravel())
            parts_r.append((start[1][:, None] + rblocks[None, :]).ravel())
        if parts_l:
            out[table.rank] = (np.concatenate(parts_l), np.concatenate(parts_r))
    return out


@dataclass(frozen=True, slots=True)
class TPWrites:
    """What this rank writes into one consumer rank of another TP size: that rank's
    plan as it holds our regions (``reader``), its reads of them (``reads``, the
    planner's, from every rank of ours: this rank's regions stand in for the others')
    and its lists for the pieces this rank serves (``table``: ``local`` the reader's
    rows, ``remote`` ours)."""

    reader: RegionPlan
    reads: ReadCache
    stand_ins: dict[int, Sequence[PeerRegion]]
    table: TPTable

    def ids(self, reader_ids: BlockIds, our_ids: BlockIds) -> tuple[Ids, Ids] | None:
        """A request's ids into ``table`` (the reader's blocks ``reader_ids``, ours
        ``our_ids``, paired: one list per cache group of equal lengths), validated as
        the reader's own read would be; ``None`` where this rank serves none of it."""
        got = request_ids(
            self.reader, self.stand_ins, reader_ids, our_ids, self.reads, [self.table]
        )
        return got.get(self.table.rank)


def tp_writes(
    plan: RegionPlan, reader_tp: int, reader_rank: int, reader_regions: Sequence[PeerRegion]
) -> TPWrites:
    """What this rank (``plan``) writes into rank ``reader_rank`` of a consumer of
    ``reader_tp`` ranks (its regions ``reader_regions``): the reads that rank makes of
    every region (:func:`~kvspec_traits.transfer.peer_view`, then
    :func:`~kvspec_traits.transfer.tp_reads` from its side), the pieces this rank
    serves. Raises :class:`~kvspec_traits.transfer.UnsupportedLayoutError` where a
    region cannot move between the two TP sizes."""
    if len(reader_regions) != len(plan.regions):
        raise UnsupportedLayoutError(
            plan.regions[0].name if plan.regions else "(none)",
            f"the consumer registers {len(reader_regions)} regions, this rank {len(plan.regions)}",
        )
    regions = tuple(
        dataclasses.replace(
            peer_view(region, tp=plan.tp_size, peer_tp=reader_tp, peer_block_len=theirs.block_len),
            base_addr=theirs.base_addr,
            block_stride=theirs.block_stride,
            num_blocks=theirs.num_blocks,
            device_id=theirs.device_id,
            mem_type=theirs.mem_type,
        )
        for region, theirs in zip(plan.regions, reader_regions, strict=True)
    )
    reader = RegionPlan(
        regions=regions,
        registrations=(),
        num_blocks=plan.num_blocks,
        tp_size=reader_tp,
        tp_rank=reader_rank,
        num_groups=plan.num_groups,
    )
    ours = peer_regions(plan)
    reads = ReadCache(reader, plan.tp_size, ours)
    stand_ins: dict[int, Sequence[PeerRegion]] = dict.fromkeys(range(plan.tp_size), ours)
    table = tp_table(reader, ReadTable(reader, stand_ins, reads), plan.tp_rank, ours)
    return TPWrites(reader, reads, stand_ins, table)
