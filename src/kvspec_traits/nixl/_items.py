"""Per-request transfer rows: the peer's read table (:class:`ReadTable`, one bucket per
cache group and remote rank) from which :func:`~kvspec_traits.nixl._checked.transfer_items`
gives, per remote rank, ``Nx3`` ``(addr, len, device_id)`` rows for both sides, with
tensor-parallel head splitting applied (:func:`~kvspec_traits.transfer.tp_reads`);
:func:`merge_runs` then merges rows that are contiguous on both sides, so a run of
consecutive block ids in a dense region is one descriptor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

import numpy as np
import numpy.typing as npt

from kvspec_traits.nixl._descs import INT64_MAX, U64, Request, desc_index
from kvspec_traits.nixl._errors import MissingPeerError
from kvspec_traits.transfer import (
    PeerRegion,
    Read,
    RegionPlan,
    UnsupportedLayoutError,
    tp_reads,
)
from kvspec_traits.transfer._blocks import check_paired

__all__ = [
    "ReadCache",
    "TransferItems",
    "check_lengths",
    "merge_runs",
]


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


class ReadCache:
    """:func:`tp_reads` of each region of a plan against one peer's TP size and block
    lengths, computed on a region's first use and kept (one per connected peer, not
    one per region per request). A region that cannot move raises on every use."""

    __slots__ = ("_block_lens", "_plan", "_reads", "_remote_tp", "tables")

    def __init__(
        self, plan: RegionPlan, remote_tp: int, remote_regions: Sequence[PeerRegion] | None
    ) -> None:
        self._plan = plan
        self._remote_tp = remote_tp
        self._block_lens: tuple[int | None, ...] = (
            (None,) * len(plan.regions)
            if remote_regions is None
            else tuple(r.block_len for r in remote_regions)
        )
        self._reads: dict[tuple[int, bool | None], tuple[Read, ...]] = {}
        self.tables: dict[tuple[tuple[int, int], ...], ReadTable] = {}

    def __call__(self, index: int, states: bool | None = None) -> tuple[Read, ...]:
        """The reads of region ``index``'s blocks (``states``: of a region holding token
        pages and a state, which of the two the group keeps there, :func:`lanes_of`)."""
        reads = self._reads.get((index, states))
        if reads is None:
            plan = self._plan
            reads = self._reads[index, states] = tp_reads(
                plan.regions[index],
                local_tp=plan.tp_size,
                local_rank=plan.tp_rank,
                remote_tp=self._remote_tp,
                remote_block_len=self._block_lens[index],
                states=states,
            )
        return reads


_Row = tuple[int, int, int, int, int, int, int, int, int, int]
"""(region, local base, local stride, remote base, remote stride, length, local device,
remote device, remote block count, local block count) of one (region, read)."""
_U64_END: Final = 1 << 64
_U64_MASK: Final = _U64_END - 1


def _join_class(row: _Row) -> tuple[int, int, int] | None:
    """Which neighbouring blocks of one (region, read) row can merge: ``None`` when
    none ever can, ``(0, 0, 0)`` when exactly consecutive ids on both sides do (a
    dense row: stride == length on both sides), else the row's ``(local stride,
    remote stride, length)``, which the exact ``uint64`` test of :func:`merge_runs`
    needs.

    Blocks ``a`` then ``b`` abut on a side with stride ``s`` and length ``n`` iff
    ``s * (b - a) == n (mod 2**64)``, with ``|b - a|`` below that side's block count
    ``c`` (ids are bounds-checked first). If ``s > n > 0`` and ``s * c + n < 2**64``
    no such difference exists (positive ones overshoot ``n``, negative ones wrap to
    above it, zero gives 0). If ``s == n > 0`` and ``s * c < 2**64`` only ``b - a ==
    1`` does."""
    _, _, lstride, _, rstride, length, _, _, rcount, lcount = row
    sides = ((lstride, lcount), (rstride, rcount))
    if length > 0 and any(s > length and s * c + length < _U64_END for s, c in sides):
        return None
    if length > 0 and all(s == length and s * c < _U64_END for s, c in sides):
        return (0, 0, 0)
    return (lstride, rstride, length)


def seam_may_join(a: _Row, b: _Row) -> bool:
    """Whether a descriptor of row ``a`` (one block, or a run of them) may end where one
    of row ``b`` starts, on both sides and on the same devices, for any ids within the
    rows' block counts (ids are bounds-checked first): a conservative interval test,
    ``False`` only when no request can make the two merge (``merge_runs``' test, in
    uint64, which matches integer arithmetic while every address stays below 2**64)."""
    _, la, ls, ra, rs, length, ld, rd, rc, lc = a
    _, lb, lsb, rb, rsb, _, ldb, rdb, rcb, lcb = b
    if ld != ldb or rd != rdb:
        return False
    ends = ((la, la + (ls + length) * lc), (ra, ra + (rs + length) * rc))
    starts = ((lb, lb + lsb * lcb), (rb, rb + rsb * rcb))
    if any(hi >= _U64_END for _, hi in ends + starts):
        return True
    return all(
        e_lo <= s_hi and s_lo <= e_hi
        for (e_lo, e_hi), (s_lo, s_hi) in zip(ends, starts, strict=True)
    )


class _Bucket:
    """The reads of one cache group's regions from one remote rank, as columns: row
    ``i`` is one (region, read) pair, in region order. Rows are also sorted by how
    their neighbouring blocks merge (:func:`_join_class`), for the run-level merge
    (``nixl/_runs.py``)."""

    __slots__ = (
        "bases",
        "classes",
        "count_limit",
        "devices",
        "edges",
        "factors",
        "inner_seams",
        "lbase",
        "ldev",
        "length",
        "lstride",
        "offsets",
        "one_class",
        "rbase",
        "rdev",
        "regions",
        "row_bytes",
        "rstride",
        "steps",
        "template_offsets",
        "uniform_params",
    )

    def __init__(self, rows: list[_Row]) -> None:
        cols = np.asarray(rows, dtype=np.uint64).reshape(-1, 10)
        self.regions = cols[:, 0].astype(np.int64)
        self.lbase, self.lstride = cols[:, 1:2].copy(), cols[:, 2:3].copy()
        self.rbase, self.rstride = cols[:, 3:4].copy(), cols[:, 4:5].copy()
        self.length, self.ldev, self.rdev = (
            cols[:, 5:6].copy(),
            cols[:, 6:7].copy(),
            cols[:, 7:8].copy(),
        )
        self.count_limit = int(cols[:, 8].min()) if len(rows) else INT64_MAX
        members: dict[tuple[int, int, int] | None, list[int]] = {}
        for i, row in enumerate(rows):
            members.setdefault(_join_class(row), []).append(i)
        self.classes: tuple[tuple[tuple[int, int, int] | None, npt.NDArray[np.intp]], ...] = tuple(
            (key, np.asarray(idx, dtype=np.intp)) for key, idx in members.items()
        )
        """Per join class, the rows (bucket indices, ascending) of that class."""
        # Both sides' rows as one product and sum (nixl/_runs.py's one-class path): row
        # (side, i) of run (first id f, n ids) is factors * (f, n, 0) + offsets, i.e.
        # (base + stride * f, length * n, device).
        k = len(rows)
        self.factors = np.zeros((2, k, 1, 3), dtype=np.uint64)
        self.offsets = np.zeros((2, k, 1, 3), dtype=np.uint64)
        self.factors[0, :, 0, 0], self.factors[1, :, 0, 0] = cols[:, 2], cols[:, 4]
        self.factors[:, :, 0, 1] = cols[:, 5]
        self.offsets[0, :, 0, 0], self.offsets[1, :, 0, 0] = cols[:, 1], cols[:, 3]
        self.offsets[0, :, 0, 2], self.offsets[1, :, 0, 2] = cols[:, 6], cols[:, 7]
        classes = [cls for cls, _ in self.classes]
        self.one_class: tuple[int, int, int] | bool | None = (
            classes[0] if len(classes) == 1 and classes[0] in (None, (0, 0, 0)) else False
        )
        """The bucket's one join class when it is dense or never (``None``), else False:
        those buckets take nixl/_runs.py's one-class path."""
        uniform = bool(k) and all(
            row[2] == rows[0][2] and row[4] == rows[0][4] and row[5:8] == rows[0][5:8]
            for row in rows
        )
        self.uniform_params = (rows[0][2], rows[0][4], rows[0][5]) if k else (0, 0, 0)
        self.devices = (rows[0][6], rows[0][7]) if k else (0, 0)
        self.row_bytes = sum(row[5] for row in rows)
        """Bytes one block moves over every row."""
        """(local stride, remote stride, length) of every row of a uniform bucket."""
        self.steps: frozenset[tuple[int, int]] | None = (
            frozenset(
                ((b[1] - a[1]) & _U64_MASK, (b[3] - a[3]) & _U64_MASK) for a, b in pairwise(rows)
            )
            if uniform
            else None
        )
        """A uniform bucket (rows differing only in their bases): the base differences
        (mod 2**64, per side) of neighbouring rows; ``None`` otherwise. A request's last
        run of a row ends where the next row's first run begins only if that offset is
        one of these."""
        self.bases = self.offsets[..., 0].copy()  # (side, row, 1)
        self.template_offsets = self.offsets[:, :1].copy()
        self.template_offsets[..., 0] = 0
        self.inner_seams = any(seam_may_join(a, b) for a, b in pairwise(rows))
        """Whether the runs of one row may join those of the next (their bytes can abut
        on both sides): only then must a request's rows be tested at those seams."""
        self.edges: tuple[_Row, _Row] | None = (rows[0], rows[-1]) if rows else None
        """The first and the last row, for the seams between buckets."""


class ReadTable:
    """Every (region, read) of a plan against one set of remote ranks, bucketed by
    cache group (as :class:`DescIndex` groups regions) and remote rank: a request is
    then a few broadcast operations per bucket, not a loop over regions. A region
    that cannot move (or needs a rank that was not given) raises when a request
    names blocks of its group."""

    __slots__ = ("buckets", "errors", "mapped", "uniform")

    def __init__(
        self, plan: RegionPlan, remotes: Mapping[int, Sequence[PeerRegion]], reads: ReadCache
    ) -> None:
        index = desc_index(plan)
        self.mapped = index.mapped
        self.buckets: list[dict[int, _Bucket]] = []
        self.errors: list[Exception | None] = []
        for key, members in enumerate(index.by_group):
            rows: dict[int, list[_Row]] = {}
            error: Exception | None = None
            for i in members.tolist():
                region = plan.regions[i]
                # A region of token pages and a state (a hybrid's shared tensors) is read
                # per group, as what the group keeps there (DescIndex maps such plans).
                mixed = index.mapped and region.state and region.paged
                try:
                    region_reads = reads(i, key in region.state_group_ids if mixed else None)
                except UnsupportedLayoutError as exc:
                    error = error or exc
                    continue
                for read in region_reads:
                    if read.remote_rank not in remotes:
                        error = error or MissingPeerError(
                            region.name, read.remote_rank, sorted(remotes)
                        )
                        continue
                    peer = remotes[read.remote_rank][i]
                    rows.setdefault(read.remote_rank, []).append(
                        (
                            i,
                            region.base_addr + read.local_offset,
                            region.block_stride,
                            peer.base_addr + read.remote_offset,
                            peer.block_stride,
                            read.length,
                            region.device_id,
                            peer.device_id,
                            peer.num_blocks,
                            region.num_blocks,
                        )
                    )
            self.buckets.append({rank: _Bucket(r) for rank, r in sorted(rows.items())})
            self.errors.append(error)
        every = [b for buckets in self.buckets for b in buckets.values()]
        params = {(b.uniform_params, b.devices) for b in every if b.steps is not None}
        self.uniform: tuple[U64, U64] | None = None
        """Every bucket uniform with the same strides, length and devices: ``(side, 1,
        (stride, length))`` and ``(side, 1, (device,))``, so a run's row but for its base
        is the same in every bucket (nixl/_runs.py writes it once a request)."""
        if every and len(params) == 1 and all(b.steps is not None for b in every):
            ((lstride, rstride, length), (ldev, rdev)) = params.pop()
            self.uniform = (
                np.array([[[lstride, length]], [[rstride, length]]], dtype=np.uint64),
                np.array([[[ldev]], [[rdev]]], dtype=np.uint64),
            )


def read_table(
    plan: RegionPlan, remotes: Mapping[int, Sequence[PeerRegion]], reads: ReadCache
) -> ReadTable:
    key = tuple(sorted((rank, id(regions)) for rank, regions in remotes.items()))
    table = reads.tables.get(key)
    if table is None:
        table = reads.tables[key] = ReadTable(plan, remotes, reads)
    return table


Groups = list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]
"""Per bucket key of a :class:`ReadTable`: the request's (local, remote) block ids."""


def check_lengths(lreq: Request, rreq: Request) -> None:
    """Local and remote ids pair up: the same count in every group
    (:func:`~kvspec_traits.transfer._blocks.check_paired`)."""
    if lreq is not rreq:
        check_paired([g.size for g in lreq.groups], [g.size for g in rreq.groups])


def merge_runs(items: TransferItems) -> TransferItems:
    """Merge neighbouring rows that are contiguous on both sides (and on one device)
    into one descriptor each; the bytes moved are unchanged. Returns ``items`` itself
    when nothing merges."""
    n = items.count
    if n < 2:
        return items
    loc, rem = items.local, items.remote
    laddr, raddr = loc[:, 0], rem[:, 0]
    joins = laddr[:-1] + loc[:-1, 1] == laddr[1:]
    joins &= raddr[:-1] + loc[:-1, 1] == raddr[1:]
    joins &= loc[:-1, 2] == loc[1:, 2]
    joins &= rem[:-1, 2] == rem[1:, 2]
    if not joins.any():
        return items
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lasts = np.empty_like(starts)
    lasts[:-1] = starts[1:] - 1
    lasts[-1] = n - 1
    first_local = laddr.take(starts)
    lengths = laddr.take(lasts) + loc[:, 1].take(lasts) - first_local
    new_local = np.empty((starts.size, 3), dtype=np.uint64)
    new_remote = np.empty((starts.size, 3), dtype=np.uint64)
    new_local[:, 0] = first_local
    new_remote[:, 0] = raddr.take(starts)
    new_local[:, 1] = lengths
    new_remote[:, 1] = lengths
    new_local[:, 2] = loc[:, 2].take(starts)
    new_remote[:, 2] = rem[:, 2].take(starts)
    return TransferItems(items.remote_rank, new_local, new_remote)
