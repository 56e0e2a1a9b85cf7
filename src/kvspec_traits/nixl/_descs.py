"""Descriptor building: regions + block ids -> NIXL descriptor arrays (numpy, no NIXL).

- :func:`build_block_descs`: NIXL's strided ``Nx5`` form, ``(addr, len, device_id,
  stride, count)``, one row per region covering all its blocks, as vLLM 0.33's
  ``_build_fa_local`` prepares them once at registration; a request then selects
  blocks by flat descriptor id (:func:`block_desc_ids`), one descriptor per block.
- :class:`Request` / :class:`DescIndex`: a request's block ids validated once, and
  what a request needs of one strided list (kept on the plan, :meth:`RegionPlan.memo`).

The per-request ``Nx3`` form (with TP splitting) is ``nixl/_items.py``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from kvspec_traits.transfer import PeerRegion, Region, RegionPlan
from kvspec_traits.transfer._blocks import (
    INT64_MAX,
    check_block_range,
    check_id_list,
    group_lists,
)
from kvspec_traits.transfer._errors import BlockIdTypeError, DuplicateBlockIdError
from kvspec_traits.transfer._region import desc_offsets

__all__ = [
    "INT64_MAX",
    "U64",
    "BlockIds",
    "DescIndex",
    "Request",
    "block_desc_ids",
    "build_block_descs",
    "build_state_descs",
    "desc_ids_of",
    "desc_index",
    "request_pair",
]

U64 = npt.NDArray[np.uint64]
BlockIds = (
    Sequence[int]
    | Sequence[Sequence[int]]
    | Sequence[npt.NDArray[np.integer[Any]]]
    | npt.NDArray[np.integer[Any]]
)
"""Block ids of one request: one list per cache group (indexed by group id; a shared
region takes every group's blocks), each Python ints (not ``bool``) or a 1-D integer
numpy array, or a 2-D integer array of one row per group; for a plan of one group,
that group's list alone. Destination ids are distinct."""


def build_block_descs(regions: RegionPlan | Sequence[Region] | Sequence[PeerRegion]) -> U64:
    """Strided ``Nx5`` descriptors, one row per region: ``(base, block_len, device_id,
    block_stride, num_blocks)``. Flat descriptor id of block ``b`` of region ``i`` is
    ``sum(num_blocks of regions before i) + b``."""
    rows: Sequence[Region | PeerRegion] = (
        regions.regions if isinstance(regions, RegionPlan) else regions
    )
    out = np.empty((len(rows), 5), dtype=np.uint64)
    for i, r in enumerate(rows):
        out[i] = (r.base_addr, r.block_len, r.device_id, r.block_stride, r.num_blocks)
    return out


def build_state_descs(plan: RegionPlan) -> U64:
    """Strided ``Nx5`` sub-region descriptors of every recurrent-state component
    (vLLM's conv/SSM sub-regions), in region then component order."""
    rows = [
        (r.base_addr + c.offset, c.nbytes, r.device_id, r.block_stride, r.num_blocks)
        for r in plan.regions
        if r.state
        for c in r.state_components
    ]
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


_EMPTY: Final = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def _as_ids(value: object, side: str) -> npt.NDArray[np.int64]:
    """One list of block ids as int64, after :func:`check_id_list` (the rules every
    backend shares): an array is only cast, a list converted in one pass."""
    if check_id_list(value, side):
        return cast("npt.NDArray[Any]", value).astype(np.int64, copy=False)
    ids = cast("Sequence[int]", value)
    if not ids:
        return _EMPTY
    try:
        return np.fromiter(ids, dtype=np.int64, count=len(ids))
    except OverflowError:
        big = max(ids, key=abs)
        raise BlockIdTypeError(side, big, f"id {big} does not fit in int64") from None


class Request:
    """One request's block ids, validated and converted once (not once per region):
    one int64 array per cache group, with each array's bounds.

    Takes one list (or 1-D integer array) per cache group, a 2-D integer array (one
    row per group), or, for a plan of one group, that group's list alone. Raises
    :class:`BlockIdTypeError` / :class:`BlockIdShapeError` before anything is built.
    """

    __slots__ = ("_all", "_bounds", "distinct", "groups", "pair", "side")

    def __init__(self, block_ids: BlockIds, num_groups: int, side: str = "local") -> None:
        self.side = side
        self._all: npt.NDArray[np.int64] | None = None
        self._bounds: dict[int, tuple[int, int] | None] = {}
        self.distinct = False
        """Known to hold no id twice, in all groups together (else: not checked yet)."""
        self.pair: npt.NDArray[np.int64] | None = None
        """``(2, n)``: this request's ids (row 0) over the remote ones (row 1), when
        :func:`request_pair` converted both into one array."""
        self.groups: list[npt.NDArray[np.int64]] = [
            _as_ids(g, side) for g in group_lists(block_ids, num_groups, side)
        ]

    @classmethod
    def _of_flat(
        cls,
        side: str,
        flat: npt.NDArray[np.int64],
        sizes: list[int],
        bounds: list[tuple[int, int] | None],
    ) -> Request:
        """A request whose groups are consecutive slices of ``flat`` (so :attr:`all` is
        ``flat`` itself, no concatenate), with each group's bounds already known."""
        self = cls.__new__(cls)
        self.side = side
        self._all = flat
        self.distinct = False
        self.pair = None
        self.groups = []
        pos = 0
        for size in sizes:
            self.groups.append(flat[pos : pos + size])
            pos += size
        self._bounds = dict(enumerate(bounds))  # every group's: all's follow from them
        return self

    @property
    def all(self) -> npt.NDArray[np.int64]:
        """Every group's blocks, in group order (what a shared region takes)."""
        if self._all is None:
            self._all = self.groups[0] if len(self.groups) == 1 else np.concatenate(self.groups)
        return self._all

    def blocks(self, group_id: int) -> npt.NDArray[np.int64]:
        """The blocks of a region of ``group_id`` (a shared region, group id < 0,
        takes every group's blocks)."""
        return self.groups[group_id] if group_id >= 0 else self.all

    def bounds(self, group_id: int) -> tuple[int, int] | None:
        """``(min, max)`` of the blocks of ``group_id`` (``None`` if it has none)."""
        if group_id in self._bounds:
            return self._bounds[group_id]
        groups = range(len(self.groups))
        if group_id < 0 and all(g in self._bounds for g in groups):  # from every group's
            known = [b for g in groups if (b := self._bounds[g]) is not None]
            bounds = (min(b[0] for b in known), max(b[1] for b in known)) if known else None
        else:
            blocks = self.blocks(group_id)
            bounds = (int(blocks.min()), int(blocks.max())) if blocks.size else None
        self._bounds[group_id] = bounds
        return bounds

    def check_distinct(self, shared: bool) -> None:
        """No destination block twice: within each group, and across groups where a
        region takes every group's blocks (``shared``). Call after the bounds check
        (:meth:`DescIndex.check`: ids are then non-negative and bounded, so a mask is
        cheap)."""
        if self.distinct:
            return
        if shared and len(self.groups) > 1:
            self._distinct(self.all, -1)
        else:
            for gid, blocks in enumerate(self.groups):
                self._distinct(blocks, gid)

    def _distinct(self, blocks: npt.NDArray[np.int64], group_id: int) -> None:
        n = blocks.size
        if n < 2:
            return
        bounds = self.bounds(group_id)
        if bounds is None:
            return
        lo, hi = bounds
        # One vectorised pass over a mask of at most 32 bytes an id (4 KiB at least;
        # small lists were checked by a set when converted): below a request's own
        # descriptors' memory, and cheaper than a sort.
        if hi - lo < 32 * n + 4096:
            seen = np.zeros(hi - lo + 1, dtype=np.bool_)
            shifted = blocks - lo if lo else blocks
            seen[shifted] = True
            if int(np.count_nonzero(seen)) == n:
                return
        else:
            ordered = np.sort(blocks)
            if not np.count_nonzero(ordered[1:] == ordered[:-1]):  # not .any(): a Python call
                return
        ordered = np.sort(blocks)
        repeated = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
        raise DuplicateBlockIdError(
            repeated, None if group_id < 0 or len(self.groups) == 1 else group_id
        )


def request_pair(
    block_ids: BlockIds, remote_block_ids: BlockIds | None, num_groups: int
) -> tuple[Request, Request]:
    """Both sides of a request (the remote one is the local one when
    ``remote_block_ids`` is None), validated as :class:`Request` validates each, with
    the same errors in the same order. Python lists, as vLLM hands them, are converted
    in one pass into one array and their bounds taken for every group at once (two
    numpy calls for a request instead of two per group and side); a request holding
    an array goes group by group, as :class:`Request` does."""
    lists = group_lists(block_ids, num_groups, "local")
    arrays = [check_id_list(g, "local") for g in lists]
    rlists = None
    if remote_block_ids is not None:
        rlists = group_lists(remote_block_ids, num_groups, "remote")
        arrays += [check_id_list(g, "remote") for g in rlists]
    if any(arrays):
        lreq = Request(block_ids, num_groups, "local")
        if remote_block_ids is None:
            return lreq, lreq
        return lreq, Request(remote_block_ids, num_groups, "remote")
    every = lists if rlists is None else lists + rlists
    sizes = [len(g) for g in every]
    total = sum(sizes)
    flat = _flat_ids(every, total, len(lists))
    bounds = _bounds(every, sizes, flat, total)
    n = sum(sizes[:num_groups])
    lreq = Request._of_flat("local", flat[:n], sizes[:num_groups], bounds[:num_groups])
    if n <= _SMALL:  # a set of a few ids costs less than a numpy pass
        lreq.distinct = len(set(chain.from_iterable(lists))) == n
    if rlists is None:
        return lreq, lreq
    rreq = Request._of_flat("remote", flat[n:], sizes[num_groups:], bounds[num_groups:])
    if total == 2 * n:
        lreq.pair = rreq.pair = flat.reshape(2, n)
    return lreq, rreq


_SMALL: Final = 64


def _flat_ids(every: list[Sequence[int]], total: int, n_local: int) -> npt.NDArray[np.int64]:
    # Every group's ids, local then remote, in one int64 array (the first ``n_local``
    # lists are the local side's, named in an overflow's error).
    try:
        if total <= _SMALL:
            return np.fromiter(chain.from_iterable(every), dtype=np.int64, count=total)
        # array's list path converts a Python int in 13 ns, fromiter in 17
        buf = array("q", every[0])
        for g in every[1:]:
            buf.fromlist(g if type(g) is list else list(g))  # a tuple or range too
        return np.frombuffer(buf, dtype=np.int64)
    except OverflowError:
        for i, g in enumerate(every):  # raises for the first list with an id past int64
            _as_ids(g, "local" if i < n_local else "remote")
        raise


def _bounds(
    every: list[Sequence[int]], sizes: list[int], flat: npt.NDArray[np.int64], total: int
) -> list[tuple[int, int] | None]:
    # Each list's smallest and largest id (None for an empty one).
    if total <= _SMALL:  # Python's min and max of a few ints cost less than numpy calls
        return [(min(g), max(g)) if g else None for g in every]
    starts, pos = [], 0
    for size in sizes:
        if size:
            starts.append(pos)
        pos += size
    lows = np.minimum.reduceat(flat, starts).tolist() if starts else []
    highs = np.maximum.reduceat(flat, starts).tolist() if starts else []
    found = iter(zip(lows, highs, strict=True))
    return [next(found) if size else None for size in sizes]


class DescIndex:
    """What a request needs of one strided descriptor list (a plan's, or a peer's with
    its block counts), computed once per list: per cache group, the flat id of block 0
    of every region its blocks land in (a column, so a request is one broadcast add
    per group), the smallest block count among them, and bytes per block.

    Order matches vLLM's ``_compute_desc_ids``: region-major over every group's blocks
    when all regions take every group's blocks (one group, or every region shared by
    all groups); otherwise group-major, each group's regions
    (:attr:`RegionPlan.group_regions`) in region order.
    """

    __slots__ = (
        "by_group",
        "bytes_per_block",
        "columns",
        "columns32",
        "counts",
        "limits",
        "mapped",
        "names",
        "shared",
    )

    def __init__(self, plan: RegionPlan, counts: Sequence[int], offsets: Sequence[int]) -> None:
        gids = np.asarray(plan.region_group_ids, dtype=np.int64)
        off = np.asarray(offsets, dtype=np.int64)
        nb = np.asarray(counts, dtype=np.int64)
        lens = np.asarray([r.block_len for r in plan.regions], dtype=np.int64)
        self.names = tuple(r.name for r in plan.regions)
        self.counts = tuple(int(c) for c in counts)
        self.shared = bool((gids < 0).any())
        # Each group's blocks land in the regions of its own layers (the planner's
        # group_regions): a region shared by some groups takes only theirs.
        own = plan.group_regions
        # So are the groups of a region holding token pages and a recurrent state: its
        # blocks are read as what each group keeps there (tp_reads' states).
        self.mapped = plan.num_groups > 1 and (
            any(len(r) < gids.size for r in own) or any(r.state and r.paged for r in plan.regions)
        )
        keys = range(plan.num_groups) if self.mapped else (-1,)
        self.by_group: list[npt.NDArray[np.intp]] = []
        self.columns: list[npt.NDArray[np.int64]] = []
        self.limits: list[int] = []
        self.bytes_per_block: list[int] = []
        for key in keys:
            members = np.asarray(own[key], dtype=np.intp) if key >= 0 else np.arange(gids.size)
            self.by_group.append(members)
            self.columns.append(off[members][:, None].copy())
            self.limits.append(int(nb[members].min()) if members.size else INT64_MAX)
            self.bytes_per_block.append(int(lens[members].sum()))
        # NIXL selects prepared descriptors by int32 index: a list short enough for
        # that gets int32 columns, so ids are built at half the memory traffic.
        fits = int(nb.sum()) < (1 << 31)
        self.columns32 = [c.astype(np.int32) for c in self.columns] if fits else None

    def check(self, request: Request, side: str) -> None:
        """Bounds of every id against every region it lands in (and, for the local
        side, distinct destinations): :class:`BlockIdError` naming the first region
        an id is outside of."""
        for key, limit in enumerate(self.limits):
            gid = key if self.mapped else -1
            check_block_range(
                request.bounds(gid),
                limit,
                ((self.names[i], self.counts[i]) for i in self.by_group[key].tolist()),
                side,
            )
        if side == "local":
            request.check_distinct(self.shared or not self.mapped)

    def desc_ids(self, request: Request, int32: bool = False) -> npt.NDArray[Any]:
        """The ids (int64, or int32 for NIXL when the list allows), written group by
        group into one preallocated array (no per-group temporaries, no concatenate).
        Call after :meth:`check`."""
        columns: list[npt.NDArray[Any]] = self.columns
        dtype: type[np.signedinteger[Any]] = np.int64
        if int32 and self.columns32 is not None:
            columns, dtype = self.columns32, np.int32
        groups = [request.all] if not self.mapped else request.groups
        total = sum(c.shape[0] * b.size for c, b in zip(columns, groups, strict=True))
        out = np.empty(total, dtype=dtype)
        pos = 0
        for column, blocks in zip(columns, groups, strict=True):
            size = column.shape[0] * blocks.size
            if size:
                np.add(
                    column,
                    blocks.astype(dtype, copy=False),
                    out=out[pos : pos + size].reshape(column.shape[0], blocks.size),
                )
                pos += size
        return out

    def count(self, request: Request) -> int:
        """How many descriptors the request is, one per block per region (what the ids
        path posts), before anything is checked or built."""
        if not self.mapped:
            return int(self.by_group[0].size) * request.all.size
        return sum(m.size * b.size for m, b in zip(self.by_group, request.groups, strict=True))

    def nbytes(self, request: Request) -> int:
        if not self.mapped:
            return request.all.size * self.bytes_per_block[0]
        return sum(b.size * n for b, n in zip(request.groups, self.bytes_per_block, strict=True))


def desc_index(plan: RegionPlan, counts: Sequence[int] | None = None) -> DescIndex:
    """The plan's :class:`DescIndex` for its own list (``counts=None``) or a peer's
    with ``counts`` blocks per region, kept on the plan."""
    key: tuple[object, ...] = ("desc index", None if counts is None else tuple(counts))

    def build() -> DescIndex:
        nb = [r.num_blocks for r in plan.regions] if counts is None else list(counts)
        if len(nb) != len(plan.regions):
            raise ValueError(f"{len(nb)} block counts for {len(plan.regions)} regions")
        return DescIndex(plan, nb, desc_offsets(nb))

    return plan.memo(key, build)


def desc_ids_of(
    index: DescIndex, request: Request, side: str, int32: bool = False
) -> npt.NDArray[Any]:
    """:func:`block_desc_ids` with the list's index precomputed: validate, then one
    broadcast add per cache group."""
    index.check(request, side)
    return index.desc_ids(request, int32)


def block_desc_ids(
    plan: RegionPlan, block_ids: BlockIds, *, region_num_blocks: Sequence[int] | None = None
) -> npt.NDArray[np.int64]:
    """Flat ids into :func:`build_block_descs` for a request's blocks, in the order
    vLLM's ``_compute_desc_ids`` uses (region-major when every region takes every
    group's blocks, else group-major).

    For a peer's list pass its ``region_num_blocks`` (its block counts may differ from
    ours); group membership is ours (the handshake made the region lists equal).
    Raises :class:`BlockIdError` for an id outside a region,
    :class:`BlockIdTypeError` / :class:`BlockIdShapeError` for ids that are not one
    list of ints per cache group, and (for our own list: destinations)
    :class:`DuplicateBlockIdError` for an id named twice.
    """
    side = "local" if region_num_blocks is None else "remote"
    index = desc_index(plan, region_num_blocks)
    return desc_ids_of(index, Request(block_ids, plan.num_groups, side), side)
