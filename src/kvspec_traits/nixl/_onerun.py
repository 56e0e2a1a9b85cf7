"""Merged transfer rows for the common table: every bucket's rows in one join class
(dense, or never merging), found for all cache groups at once from the block ids and
written bucket by bucket with one broadcast copy and one add of the bases. Equal, row for
row, to :func:`~kvspec_traits.nixl._runs.merged_rows` of the general path and to
``merge_runs(transfer_items(...))`` (tests/test_nixl_runs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from kvspec_traits.nixl._descs import Request
from kvspec_traits.nixl._items import ReadTable, TransferItems, _Bucket, merge_runs
from kvspec_traits.nixl._runs import _merge_seams

__all__ = ["OneClassRuns", "one_class_rows", "one_class_runs"]


_DENSE = (0, 0, 0)
_U64: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class OneClassRuns:
    """A validated request on a table whose every bucket it touches has one join class,
    dense or never (the usual case: same-TP reads of a layout's own pages): its runs
    found for every group at once, from the request's flat ids."""

    table: ReadTable
    local: npt.NDArray[np.int64]
    remote: npt.NDArray[np.int64]
    keys: list[tuple[int, int]]
    """Per bucket key: the (first, end) position of its ids in the flat arrays."""
    starts: npt.NDArray[np.intp] | None
    """Positions (in the flat arrays) of the ids that start a run (``None``: no bucket
    touched is dense)."""
    cuts: list[int]
    """Per bucket key, where its runs begin in ``starts`` (and one past the last)."""
    count: int
    per_block: int
    nbytes: int
    """Bytes the rows move (each id moves every row's length)."""


def _keys(table: ReadTable, lreq: Request) -> tuple[list[tuple[int, int]], bool, int, int] | None:
    # Per bucket key, the (first, end) position of its ids; whether a bucket touched is
    # dense; the ids' rows per block and bytes. None: a bucket touched is strided.
    sizes = [g.size for g in lreq.groups] if table.mapped else [lreq.all.size]
    keys: list[tuple[int, int]] = []
    pos, dense, per_block, nbytes = 0, False, 0, 0
    for key, size in enumerate(sizes):
        keys.append((pos, pos + size))
        pos += size
        if size:
            for bucket in table.buckets[key].values():
                if bucket.one_class is False:
                    return None
                dense |= bucket.one_class is not None
                per_block += bucket.regions.size * size
                nbytes += bucket.row_bytes * size
    return keys, dense, per_block, nbytes


def _run_starts(
    lreq: Request, rreq: Request, keys: list[tuple[int, int]], n: int
) -> tuple[npt.NDArray[np.intp], list[int]]:
    # A run breaks where an id is not its predecessor + 1, on either side, and
    # where a group starts; brk[n] closes the last run (starts[1:] - starts[:-1]
    # are then the runs' lengths).
    local, remote = lreq.all, rreq.all
    brk = np.empty(n + 1, dtype=np.bool_)
    if n > 1:
        pair = lreq.pair
        if pair is not None:  # both sides in one pass
            steps = pair[:, 1:] - pair[:, :-1] != 1
            np.bitwise_or(steps[0], steps[1], out=brk[1:n])
        else:
            np.not_equal(local[1:] - local[:-1], 1, out=brk[1:n])
            if remote is not local:
                brk[1:n] |= remote[1:] - remote[:-1] != 1
    for a, b in keys:
        if b > a:  # a run never spans two groups
            brk[a] = True
    brk[n] = True
    starts = brk.nonzero()[0]
    return starts, starts.searchsorted([a for a, _ in keys] + [n]).tolist()


def one_class_runs(table: ReadTable, lreq: Request, rreq: Request) -> OneClassRuns | None:
    """The runs of a request checked by
    :func:`~kvspec_traits.nixl._checked.checked_request`, or ``None`` when a bucket it
    touches mixes join classes or has a strided one (then :func:`request_runs`)."""
    found = _keys(table, lreq)
    if found is None:
        return None
    keys, dense, per_block, nbytes = found
    n = keys[-1][1] if keys else 0
    starts = None
    cuts: list[int] = []
    if dense:
        starts, cuts = _run_starts(lreq, rreq, keys, n)
    count = 0
    for key, (a, b) in enumerate(keys):
        if b > a:
            for bucket in table.buckets[key].values():
                runs = b - a if bucket.one_class is None else cuts[key + 1] - cuts[key]
                count += bucket.regions.size * runs
    return OneClassRuns(table, lreq.all, rreq.all, keys, starts, cuts, count, per_block, nbytes)


_Ends = tuple[int, int, int, int, int]
"""A bucket's (first local id, first remote id, last run's local and remote first ids,
its length)."""
_Planned = tuple[_Bucket, int, int, int, _Ends]
"""A bucket, its remote rank, its first run (or id), how many, and its ends."""


def _planned(
    runs: OneClassRuns, local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64]
) -> tuple[list[_Planned], dict[int, int]]:
    # Every touched bucket's runs, and the rows each remote rank gets.
    plans: list[_Planned] = []
    sizes: dict[int, int] = {}
    for key, (a, b) in enumerate(runs.keys):
        if b == a:
            continue
        # (first local id, first remote id, last run's local and remote first ids, its
        # length) of the key's runs: one id each, or the runs found.
        lf, rf = int(local[a]), int(remote[a])
        never = (lf, rf, int(local[b - 1]), int(remote[b - 1]), 1)
        dense = never
        if runs.starts is not None:
            p = int(runs.starts[runs.cuts[key + 1] - 1])
            dense = (lf, rf, int(local[p]), int(remote[p]), b - p)
        for rank, bucket in runs.table.buckets[key].items():
            if bucket.one_class is None:
                first, r, ends = a, b - a, never
            else:
                first, r, ends = runs.cuts[key], runs.cuts[key + 1] - runs.cuts[key], dense
            plans.append((bucket, rank, first, r, ends))
            sizes[rank] = sizes.get(rank, 0) + bucket.regions.size * r
    return plans, sizes


def _per_id(
    n: int,
    local: npt.NDArray[np.uint64],
    remote: npt.NDArray[np.uint64],
    uniform: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None,
) -> npt.NDArray[np.uint64]:
    """``(side, id, 3)``: each id as a run of one, (id, 1, -), or on a uniform table its
    whole row but for the base."""
    per_id = np.empty((2, n, 3), dtype=np.uint64)
    per_id[0, :, 0], per_id[1, :, 0] = local, remote
    per_id[:, :, 1] = 1
    if uniform is not None:
        per_id[:, :, :2] *= uniform[0]
        per_id[:, :, 2:] = uniform[1]
    return per_id


def _seam(before: tuple[_Bucket, _Ends] | None, bucket: _Bucket, ends: _Ends, k: int) -> str | None:
    # "rows" (merge the rows) or "test" (test every seam) once a seam may join.
    if before is not None and _joins(before[0], before[1], bucket, ends):
        return "rows"
    if k > 1 and bucket.steps is None and bucket.inner_seams:
        return "test"  # not uniform: its seams tested on the rows
    if k > 1 and bucket.steps and _step(bucket, ends) in bucket.steps:
        return "rows"
    return None


def one_class_rows(runs: OneClassRuns) -> list[TransferItems]:
    """:func:`merged_rows` of one-class runs: per bucket, both sides' rows written by
    :func:`_write_runs`, run-major within each (region, read) row. Rows are merged
    across rows only where a seam joins, which is tested on Python ints from the first
    and the last run of each bucket (``_Bucket.steps``), not on the rows."""
    n = runs.keys[-1][1]
    local, remote = runs.local.view(np.uint64), runs.remote.view(np.uint64)
    uniform = runs.table.uniform
    per_run: npt.NDArray[np.uint64] | None = None  # (side, run, (first id, ids, -))
    per_id: npt.NDArray[np.uint64] | None = None  # (side, id, (id, 1, -))
    plans, sizes = _planned(runs, local, remote)
    out = {rank: np.empty((2, size, 3), dtype=np.uint64) for rank, size in sorted(sizes.items())}
    pos = dict.fromkeys(out, 0)
    last: dict[int, tuple[_Bucket, _Ends]] = {}
    seams: dict[int, str] = {}  # rank -> "rows" (merge the rows) or "test" (test every seam)
    placed: dict[int, list[tuple[int, int, int]]] = {rank: [] for rank in out}
    for bucket, rank, first, r, ends in plans:
        if bucket.one_class is None:
            if per_id is None:
                per_id = _per_id(n, local, remote, uniform)
            source = per_id
        else:
            if per_run is None:
                per_run = _per_run(runs, local, remote, uniform)
            source = per_run
        k, at = bucket.regions.size, pos[rank]
        rows = out[rank][:, at : at + k * r]
        if uniform is not None:  # source rows are whole rows but for the bases
            rows.view(_ROW).reshape(2, k, r)[...] = source[:, first : first + r].view(_ROW)[
                :, None, :, 0
            ]
            rows[:, :, 0].reshape(2, k, r)[...] += bucket.bases
        else:
            _write_runs(rows, bucket, source[:, None, first : first + r], k, r)
        pos[rank] = at + k * r
        placed[rank].append((at, k, r))
        if rank not in seams and (seam := _seam(last.get(rank), bucket, ends, k)) is not None:
            seams[rank] = seam
        last[rank] = (bucket, ends)
    items = [TransferItems(rank, buf[0], buf[1]) for rank, buf in out.items()]
    return [
        i
        if i.remote_rank not in seams
        else merge_runs(i)
        if seams[i.remote_rank] == "rows"
        else _merge_seams(i, [np.arange(at, at + k * r, r) for at, k, r in placed[i.remote_rank]])
        for i in items
    ]


def _per_run(
    runs: OneClassRuns,
    local: npt.NDArray[np.uint64],
    remote: npt.NDArray[np.uint64],
    uniform: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None,
) -> npt.NDArray[np.uint64]:
    """``(side, run, 3)``: each run's (first id, ids, -), or, on a uniform table, its
    whole row but for the base (stride * first id, length * ids, device)."""
    starts = runs.starts
    if starts is None:  # pragma: no cover - set whenever a bucket is dense
        raise RuntimeError("dense bucket without runs")
    heads = starts[:-1]
    out = np.empty((2, heads.size, 3), dtype=np.uint64)
    out[0, :, 0], out[1, :, 0] = local[heads], remote[heads]
    out[:, :, 1] = starts[1:] - heads
    if uniform is not None:
        out[:, :, :2] *= uniform[0]
        out[:, :, 2:] = uniform[1]
    return out


def _step(bucket: _Bucket, ends: tuple[int, int, int, int, int]) -> tuple[int, int]:
    """What the bases of two neighbouring rows of a uniform bucket must differ by (mod
    2**64, per side) for the row's last run to end where the next row's first begins."""
    lfirst, rfirst, llast, rlast, n = ends
    lstride, rstride, length = bucket.uniform_params
    tail = length * n
    return (
        (lstride * (llast - lfirst) + tail) & _U64,
        (rstride * (rlast - rfirst) + tail) & _U64,
    )


def _joins(
    a: _Bucket,
    a_ends: tuple[int, int, int, int, int],
    b: _Bucket,
    b_ends: tuple[int, int, int, int, int],
) -> bool:
    """Whether the last row of bucket ``a`` (its last run) and the first row of ``b``
    (its first run) merge: ``merge_runs``' test on Python ints."""
    if a.edges is None or b.edges is None:
        return False
    _, la, ls, ra, rs, length, ld, rd, _, _ = a.edges[1]
    _, lb, lsb, rb, rsb, _, ldb, rdb, _, _ = b.edges[0]
    _, _, llast, rlast, n = a_ends
    lfirst, rfirst, _, _, _ = b_ends
    return (
        ld == ldb
        and rd == rdb
        and (la + ls * llast + length * n - lb - lsb * lfirst) & _U64 == 0
        and (ra + rs * rlast + length * n - rb - rsb * rfirst) & _U64 == 0
    )


def _write_runs(
    rows: npt.NDArray[np.uint64], bucket: _Bucket, runs: npt.NDArray[np.uint64], k: int, r: int
) -> None:
    """Both sides' rows ``(side, k * r, 3)`` of ``bucket`` for ``r`` runs given as
    ``(side, 1, r, (first id, ids, -))``, row-major. A uniform bucket writes one row per
    run once (bases left out), copies it to every row as a 24-byte item and adds the
    bases (numpy's loops then run over runs, not over a row's three columns)."""
    if bucket.steps is not None:
        template = np.multiply(bucket.factors[:, :1], runs)
        template += bucket.template_offsets
        rows.view(_ROW).reshape(2, k, r)[...] = template.view(_ROW).reshape(2, 1, r)
        rows[:, :, 0].reshape(2, k, r)[...] += bucket.bases
        return
    shaped = rows.reshape(2, k, r, 3)
    np.multiply(bucket.factors, runs, out=shaped)
    shaped += bucket.offsets


_ROW = np.dtype((np.void, 24))
"""One ``(addr, len, device)`` row as a single item, for row copies."""
