"""Merged transfer rows built from runs of block ids: what :func:`merge_runs` of
:func:`transfer_items` gives, without writing a row per block first.

Within one (region, read) row of a :class:`ReadTable` bucket, whether two neighbouring
blocks merge depends only on their ids and the row's strides and length
(:func:`~kvspec_traits.nixl._items._join_class`), so a cache group's runs are found
once per join class (usually one per group: dense or never) from the block ids, in
``O(blocks)``, and each row then gets one descriptor per run instead of one per block.
A final :func:`merge_runs` over those rows merges what abuts across rows (one region's
page ending where the next region's starts). The result equals
``[merge_runs(i) for i in transfer_items(...)]`` row for row
(tests/test_nixl_runs.py), at a cost that follows the merged count, not the block count.
The common case of one join class per bucket has its own faster path in
:mod:`~kvspec_traits.nixl._onerun`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvspec_traits.nixl._descs import U64
from kvspec_traits.nixl._items import (
    Groups,
    ReadTable,
    TransferItems,
    _Bucket,
    merge_runs,
)

__all__ = ["Runs", "merged_rows", "request_runs"]

_Starts = npt.NDArray[np.intp] | None
"""Indices of the blocks that start a run; ``None``: every block is its own run."""
_ZERO = np.zeros(1, dtype=np.intp)


@dataclass(frozen=True, slots=True)
class Runs:
    """A validated request's runs: per bucket key, each join class's run starts."""

    table: ReadTable
    groups: Groups
    starts: list[dict[tuple[int, int, int] | None, _Starts]]
    count: int
    """Descriptors before merging across rows (an upper bound of the merged count)."""
    per_block: int
    """Descriptors at one per block per (region, read)."""


def _class_starts(
    key: tuple[int, int, int] | None, lb: npt.NDArray[np.int64], rb: npt.NDArray[np.int64]
) -> _Starts:
    if key is None:
        return None
    if lb.size == 1:
        return _ZERO
    ld = lb[1:] - lb[:-1]
    rd = None if rb is lb else rb[1:] - rb[:-1]
    if key == (0, 0, 0):  # dense: exactly consecutive ids on both sides
        breaks = ld != 1
        if rd is not None:
            breaks |= rd != 1
    else:  # merge_runs' uint64 test, on the id differences
        lstride, rstride, length = (np.uint64(v) for v in key)
        breaks = ld.view(np.uint64) * lstride != length
        breaks |= (ld if rd is None else rd).view(np.uint64) * rstride != length
    at = np.flatnonzero(breaks)
    starts = np.empty(at.size + 1, dtype=np.intp)
    starts[0] = 0
    np.add(at, 1, out=starts[1:])
    return starts


def request_runs(table: ReadTable, groups: Groups) -> Runs:
    """The runs of a request already validated by
    :func:`~kvspec_traits.nixl._checked.checked_request`: per bucket key, the run starts
    of every join class among its buckets (computed once per key and class)."""
    starts: list[dict[tuple[int, int, int] | None, _Starts]] = []
    count = per_block = 0
    for key, (lblocks, rblocks) in enumerate(groups):
        found: dict[tuple[int, int, int] | None, _Starts] = {}
        starts.append(found)
        n = lblocks.size
        if not n:
            continue
        for bucket in table.buckets[key].values():
            per_block += bucket.regions.size * n
            for cls, rows in bucket.classes:
                if cls not in found:
                    found[cls] = _class_starts(cls, lblocks, rblocks)
                runs = found[cls]
                count += rows.size * (n if runs is None else runs.size)
    return Runs(table, groups, starts, count, per_block)


def _runs_of(starts: _Starts, lb: U64, rb: U64) -> tuple[U64, U64, U64 | None]:
    """(first local id, first remote id, local span in ids or ``None``) of each run."""
    if starts is None:
        return lb, rb, None
    if starts.size == lb.size:  # nothing joins: one run per block, lengths unchanged
        return lb, rb, None
    lasts = np.empty_like(starts)
    lasts[:-1] = starts[1:] - 1
    lasts[-1] = lb.size - 1
    first = lb.take(starts)
    return first, rb.take(starts), lb.take(lasts) - first


def _write(
    lrows: U64,
    rrows: U64,
    at: slice | npt.NDArray[np.intp],
    shape: tuple[int, int],
    bucket: _Bucket,
    rows: slice | npt.NDArray[np.intp],
    runs: tuple[U64, U64, U64 | None],
) -> None:
    """Rows ``rows`` of ``bucket`` for each run, row-major, at positions ``at`` (a
    slice: computed in place in reshaped column views; an index grid: scattered)."""
    first_l, first_r, span = runs
    lstride, length = bucket.lstride[rows], bucket.length[rows]
    if isinstance(at, slice):
        lblock, rblock = lrows[at], rrows[at]
        addr, lens = lblock[:, 0].reshape(shape), lblock[:, 1].reshape(shape)
        np.multiply(lstride, first_l, out=addr)
        addr += bucket.lbase[rows]
        raddr = rblock[:, 0].reshape(shape)
        np.multiply(bucket.rstride[rows], first_r, out=raddr)
        raddr += bucket.rbase[rows]
        if span is None:
            lens[...] = length
        else:
            np.multiply(lstride, span, out=lens)
            lens += length
        rblock[:, 1] = lblock[:, 1]
        lblock[:, 2].reshape(shape)[...] = bucket.ldev[rows]
        rblock[:, 2].reshape(shape)[...] = bucket.rdev[rows]
        return
    lrows[at, 0] = lstride * first_l + bucket.lbase[rows]
    rrows[at, 0] = bucket.rstride[rows] * first_r + bucket.rbase[rows]
    lrows[at, 1] = rrows[at, 1] = length if span is None else lstride * span + length
    lrows[at, 2] = bucket.ldev[rows]
    rrows[at, 2] = bucket.rdev[rows]


def merged_rows(runs: Runs) -> list[TransferItems]:
    """Per remote rank, the merged ``Nx3`` rows of both sides: one per run per
    (region, read), then merged across rows."""
    table, groups = runs.table, runs.groups
    sizes: dict[int, int] = {}
    plans: list[tuple[int, _Bucket, int, list[tuple[npt.NDArray[np.intp], int, _Starts]]]] = []
    for key, (lblocks, _) in enumerate(groups):
        n = lblocks.size
        if not n:
            continue
        for rank, bucket in table.buckets[key].items():
            parts = []
            for cls, rows in bucket.classes:
                starts = runs.starts[key][cls]
                parts.append((rows, n if starts is None else starts.size, starts))
            plans.append((key, bucket, rank, parts))
            sizes[rank] = sizes.get(rank, 0) + sum(rows.size * r for rows, r, _ in parts)
    out: dict[int, tuple[U64, U64]] = {
        rank: (np.empty((size, 3), dtype=np.uint64), np.empty((size, 3), dtype=np.uint64))
        for rank, size in sorted(sizes.items())
    }
    pos = dict.fromkeys(out, 0)
    # Where one (region, read) row's runs end and the next row's begin: within a row
    # runs are maximal, so only there can neighbouring descriptors still merge.
    seams: dict[int, list[npt.NDArray[np.intp]]] = {rank: [] for rank in out}
    converted: dict[int, tuple[U64, U64]] = {}
    for key, bucket, rank, parts in plans:
        if key not in converted:
            lblocks, rblocks = groups[key]
            lb = lblocks.astype(np.uint64)
            converted[key] = (lb, lb if rblocks is lblocks else rblocks.astype(np.uint64))
        lb, rb = converted[key]
        lrows, rrows = out[rank]
        start = pos[rank]
        if len(parts) == 1:  # one join class: one contiguous block, region-major
            rows, r, starts = parts[0]
            k = rows.size
            _write(
                lrows,
                rrows,
                slice(start, start + k * r),
                (k, r),
                bucket,
                slice(None),
                _runs_of(starts, lb, rb),
            )
            pos[rank] = start + k * r
            seams[rank].append(np.arange(start, start + k * r, r, dtype=np.intp))
            continue
        counts = np.empty(bucket.regions.size, dtype=np.intp)
        for rows, r, _ in parts:
            counts[rows] = r
        offsets = np.cumsum(counts) - counts + start
        for rows, r, starts in parts:
            at = offsets[rows][:, None] + np.arange(r, dtype=np.intp)
            _write(lrows, rrows, at, (rows.size, r), bucket, rows, _runs_of(starts, lb, rb))
        pos[rank] = start + int(counts.sum())
        seams[rank].append(offsets)
    return [
        _merge_seams(TransferItems(rank, lr, rr), seams[rank]) for rank, (lr, rr) in out.items()
    ]


def _merge_seams(items: TransferItems, seams: list[npt.NDArray[np.intp]]) -> TransferItems:
    """:func:`merge_runs` of ``items``, whose rows can only join at ``seams`` (the
    first row of each (region, read)): those are tested first (``O(regions)``), and the
    whole merge runs only if one of them joins."""
    at = np.concatenate(seams) if seams else np.zeros(0, dtype=np.intp)
    at = at[at > 0]
    if not at.size:
        return items
    loc, rem = items.local, items.remote
    before, after = loc[at - 1], loc[at]
    joins = before[:, 0] + before[:, 1] == after[:, 0]
    joins &= rem[at - 1, 0] + before[:, 1] == rem[at, 0]
    joins &= before[:, 2] == after[:, 2]
    joins &= rem[at - 1, 2] == rem[at, 2]
    return merge_runs(items) if bool(joins.any()) else items
