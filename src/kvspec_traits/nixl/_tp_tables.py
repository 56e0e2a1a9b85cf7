"""Prepared descriptor lists for reads between TP sizes: for one remote rank, every
(region, read) of the peer's read table (:func:`~kvspec_traits.transfer.tp_reads`, per
cache group as :class:`~kvspec_traits.nixl._items.ReadTable` buckets them), one row per
block on each side, prepared once per remote rank as vLLM prepares its split
descriptors at the handshake; a request then names descriptor ids (NIXL's
``make_prepped_xfer``) and builds no rows.

Pure: numpy only, no NIXL and no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvspec_traits.nixl._descs import U64
from kvspec_traits.nixl._items import Groups, ReadTable
from kvspec_traits.transfer import PeerRegion, RegionPlan

__all__ = ["TPTable", "tp_table", "tp_table_ids"]

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
