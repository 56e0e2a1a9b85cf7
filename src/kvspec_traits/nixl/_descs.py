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
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from kvspec_traits._traits import TPLayout
from kvspec_traits.nixl._errors import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    DuplicateBlockIdError,
    MissingPeerError,
    UnsupportedLayoutError,
)
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
_INT64_MAX: Final = np.iinfo(np.int64).max
_LISTS = (list, tuple, range)


def _as_ids(value: object, side: str) -> npt.NDArray[np.int64]:
    """One list of block ids as int64: Python ints (not ``bool``) or a 1-D integer
    numpy array; :class:`BlockIdTypeError` for anything else. One pass over a list
    (the type check) plus numpy's conversion; an array is only cast."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise BlockIdTypeError(
                side, value.dtype, f"an array of dtype {value.dtype} is not block ids"
            )
        if value.ndim != 1:
            raise BlockIdTypeError(
                side, value.shape, f"an array of shape {value.shape} is not one list of ids"
            )
        if value.dtype.kind == "u" and value.size and int(value.max()) > _INT64_MAX:
            raise BlockIdTypeError(
                side, int(value.max()), f"id {int(value.max())} does not fit in int64"
            )
        return value.astype(np.int64, copy=False)
    if isinstance(value, _LISTS):
        if not value:
            return _EMPTY
        if set(map(type, value)) != {int}:
            bad = next(v for v in value if type(v) is not int)
            raise BlockIdTypeError(side, bad, f"{bad!r} is a {type(bad).__name__}, not an int")
        try:
            return np.fromiter(value, dtype=np.int64, count=len(value))
        except OverflowError:
            big = max(value, key=abs)
            raise BlockIdTypeError(side, big, f"id {big} does not fit in int64") from None
    raise BlockIdTypeError(side, value, f"a {type(value).__name__} is not a list of ids")


class _Request:
    """One request's block ids, validated and converted once (not once per region):
    one int64 array per cache group, with each array's bounds.

    Takes one list (or 1-D integer array) per cache group, a 2-D integer array (one
    row per group), or, for a plan of one group, that group's list alone. Raises
    :class:`BlockIdTypeError` / :class:`BlockIdShapeError` before anything is built.
    """

    __slots__ = ("_all", "_bounds", "groups", "side")

    def __init__(self, block_ids: BlockIds, num_groups: int, side: str = "local") -> None:
        self.side = side
        self._all: npt.NDArray[np.int64] | None = None
        self._bounds: dict[int, tuple[int, int] | None] = {}
        groups: list[npt.NDArray[np.int64]]
        if isinstance(block_ids, np.ndarray) and block_ids.ndim == 2:
            if block_ids.dtype.kind not in "iu":
                raise BlockIdTypeError(
                    side, block_ids.dtype, f"an array of dtype {block_ids.dtype} is not block ids"
                )
            groups = [_as_ids(row, side) for row in block_ids]
        elif (
            isinstance(block_ids, _LISTS)
            and block_ids
            and isinstance(block_ids[0], (*_LISTS, np.ndarray))
        ):
            groups = [_as_ids(g, side) for g in block_ids]
        elif isinstance(block_ids, (*_LISTS, np.ndarray)):
            if num_groups != 1:
                raise BlockIdShapeError(
                    side,
                    num_groups,
                    1,
                    f"one flat list for a plan of {num_groups} cache groups; pass one list "
                    f"per group (vLLM's block_ids[group])",
                )
            groups = [_as_ids(block_ids, side)]
        else:
            raise BlockIdTypeError(
                side, block_ids, f"a {type(block_ids).__name__} is not block ids"
            )
        if len(groups) != num_groups:
            raise BlockIdShapeError(
                side,
                num_groups,
                len(groups),
                f"{len(groups)} lists for a plan of {num_groups} cache groups; pass exactly "
                f"one list per group (an empty one for a group with no blocks)",
            )
        self.groups = groups

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
        blocks = self.blocks(group_id)
        bounds = (int(blocks.min()), int(blocks.max())) if blocks.size else None
        self._bounds[group_id] = bounds
        return bounds

    def check_distinct(self, shared: bool) -> None:
        """No destination block twice: within each group, and across groups where a
        region takes every group's blocks (``shared``). Call after the bounds check
        (:meth:`_DescIndex.check`: ids are then non-negative and bounded, so a mask is
        cheap)."""
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
        if hi - lo < 8 * n + 4096:  # one vectorised pass over a bounded mask
            seen = np.zeros(hi - lo + 1, dtype=np.bool_)
            shifted = blocks - lo if lo else blocks
            seen[shifted] = True
            if int(np.count_nonzero(seen)) == n:
                return
        else:
            ordered = np.sort(blocks)
            if not bool((ordered[1:] == ordered[:-1]).any()):
                return
        ordered = np.sort(blocks)
        repeated = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
        raise DuplicateBlockIdError(
            repeated, None if group_id < 0 or len(self.groups) == 1 else group_id
        )


class _DescIndex:
    """What a request needs of one strided descriptor list (a plan's, or a peer's with
    its block counts), computed once per list: per cache group, the flat id of block 0
    of every region its blocks land in (a column, so a request is one broadcast add
    per group), the smallest block count among them, and bytes per block.

    Order matches vLLM's ``_compute_desc_ids``: region-major over every group's blocks
    when all regions take every group's blocks (one group, or only shared regions);
    otherwise group-major, each group's regions in region order.
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
        gids = np.asarray(plan._group_ids, dtype=np.int64)
        off = np.asarray(offsets, dtype=np.int64)
        nb = np.asarray(counts, dtype=np.int64)
        lens = np.asarray([r.block_len for r in plan.regions], dtype=np.int64)
        self.names = tuple(r.name for r in plan.regions)
        self.counts = tuple(int(c) for c in counts)
        self.shared = bool((gids < 0).any())
        self.mapped = plan.num_groups > 1 and not bool((gids < 0).all())
        keys = range(plan.num_groups) if self.mapped else (-1,)
        self.by_group: list[npt.NDArray[np.intp]] = []
        self.columns: list[npt.NDArray[np.int64]] = []
        self.limits: list[int] = []
        self.bytes_per_block: list[int] = []
        for key in keys:
            members = (
                np.flatnonzero((gids == key) | (gids < 0)) if key >= 0 else np.arange(gids.size)
            )
            self.by_group.append(members)
            self.columns.append(off[members][:, None].copy())
            self.limits.append(int(nb[members].min()) if members.size else _INT64_MAX)
            self.bytes_per_block.append(int(lens[members].sum()))
        # NIXL selects prepared descriptors by int32 index: a list short enough for
        # that gets int32 columns, so ids are built at half the memory traffic.
        fits = int(nb.sum()) < (1 << 31)
        self.columns32 = [c.astype(np.int32) for c in self.columns] if fits else None

    def check(self, request: _Request, side: str) -> None:
        """Bounds of every id against every region it lands in (and, for the local
        side, distinct destinations): :class:`BlockIdError` naming the first region
        an id is outside of."""
        for key, limit in enumerate(self.limits):
            gid = key if self.mapped else -1
            bounds = request.bounds(gid)
            if bounds is None or (bounds[0] >= 0 and bounds[1] < limit):
                continue
            bad = bounds[0] if bounds[0] < 0 else bounds[1]
            region = next(int(i) for i in self.by_group[key] if bad < 0 or bad >= self.counts[i])
            raise BlockIdError(self.names[region], bad, self.counts[region], side)
        if side == "local":
            request.check_distinct(self.shared or not self.mapped)

    def desc_ids(self, request: _Request, int32: bool = False) -> npt.NDArray[Any]:
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

    def nbytes(self, request: _Request) -> int:
        if not self.mapped:
            return request.all.size * self.bytes_per_block[0]
        return sum(b.size * n for b, n in zip(request.groups, self.bytes_per_block, strict=True))


def _desc_index(plan: RegionPlan, counts: Sequence[int] | None = None) -> _DescIndex:
    """The plan's :class:`_DescIndex` for its own list (``counts=None``) or a peer's
    with ``counts`` blocks per region, kept on the plan."""
    key: tuple[object, ...] = ("own",) if counts is None else tuple(counts)
    index = plan._desc_index.get(key)
    if index is None:
        nb = [r.num_blocks for r in plan.regions] if counts is None else list(counts)
        if len(nb) != len(plan.regions):
            raise ValueError(f"{len(nb)} block counts for {len(plan.regions)} regions")
        index = plan._desc_index[key] = _DescIndex(plan, nb, desc_offsets(nb))
    return cast(_DescIndex, index)


def _desc_ids(
    index: _DescIndex, request: _Request, side: str, int32: bool = False
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
    index = _desc_index(plan, region_num_blocks)
    return _desc_ids(index, _Request(block_ids, plan.num_groups, side), side)


@dataclass(frozen=True, slots=True)
class Read:
    """One piece of a local block read from one remote rank."""

    remote_rank: int
    local_offset: int
    remote_offset: int
    length: int


def tp_reads(
    region: Region,
    *,
    local_tp: int,
    local_rank: int,
    remote_tp: int,
    remote_block_len: int | None = None,
) -> tuple[Read, ...]:
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
            region.name,
            f"its blocks hold a TP-sharded recurrent state, which cannot "
            f"move between TP {remote_tp} and TP {local_tp}; run producer and "
            f"consumer with equal TP sizes",
        )
    if region.replicated:
        return (Read(local_rank % remote_tp, 0, 0, region.block_len),)
    local_shards = shard_count(region, local_tp)
    remote_shards = shard_count(region, remote_tp)
    local_shard = local_rank // (local_tp // local_shards)
    if local_shards == remote_shards:
        return (Read(local_shard * (remote_tp // remote_shards), 0, 0, region.block_len),)
    if region.state or region.tp_layout is not TPLayout.HEAD_SHARDED:
        raise UnsupportedLayoutError(
            region.name,
            f"a {region.tp_layout.value} region with a recurrent state "
            f"cannot move between TP {remote_tp} and TP {local_tp}",
        )
    if not region.head_major or region.head_segment is not None:
        raise UnsupportedLayoutError(
            region.name,
            "its head slices are not contiguous within a block, so it cannot "
            f"be split between TP {remote_tp} and TP {local_tp}",
        )
    total = region.block_len * local_shards
    if remote_block_len is not None and remote_block_len * remote_shards != total:
        raise UnsupportedLayoutError(
            region.name,
            f"local block {region.block_len} B x {local_shards} shards != "
            f"remote {remote_block_len} B x {remote_shards} shards",
        )
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
        reads.append(
            Read(rs * (remote_tp // remote_shards), int(parts[0]), int(parts[1]), int(parts[2]))
        )
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


class _ReadCache:
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
        self._reads: list[tuple[Read, ...] | None] = [None] * len(plan.regions)
        self.tables: dict[tuple[tuple[int, int], ...], _ReadTable] = {}

    def __call__(self, index: int) -> tuple[Read, ...]:
        reads = self._reads[index]
        if reads is None:
            plan = self._plan
            reads = self._reads[index] = tp_reads(
                plan.regions[index],
                local_tp=plan.tp_size,
                local_rank=plan.tp_rank,
                remote_tp=self._remote_tp,
                remote_block_len=self._block_lens[index],
            )
        return reads


def _check_remotes(local: RegionPlan, remotes: Mapping[int, Sequence[PeerRegion]]) -> None:
    for rank, regions in remotes.items():
        if len(regions) != len(local.regions):
            raise ValueError(
                f"remote rank {rank} has {len(regions)} regions, the plan "
                f"{len(local.regions)}; pass the regions of a peer whose handshake "
                f"matched (check_handshake)"
            )


def transfer_items(
    local: RegionPlan,
    remotes: Mapping[int, Sequence[PeerRegion]],
    remote_tp: int,
    local_block_ids: BlockIds,
    remote_block_ids: BlockIds | None = None,
) -> list[TransferItems]:
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
    request = _Request(local_block_ids, local.num_groups, "local")
    return _transfer_items(
        local,
        remotes,
        request,
        request
        if remote_block_ids is None
        else _Request(remote_block_ids, local.num_groups, "remote"),
        _ReadCache(local, remote_tp, next(iter(remotes.values()), None)),
    )


class _Bucket:
    """The reads of one cache group's regions from one remote rank, as columns: row
    ``i`` is one (region, read) pair, in region order."""

    __slots__ = (
        "count_limit",
        "lbase",
        "ldev",
        "length",
        "lstride",
        "rbase",
        "rdev",
        "regions",
        "rstride",
    )

    def __init__(self, rows: list[tuple[int, int, int, int, int, int, int, int, int]]) -> None:
        cols = np.asarray(rows, dtype=np.uint64).reshape(-1, 9)
        self.regions = cols[:, 0].astype(np.int64)
        self.lbase, self.lstride = cols[:, 1:2].copy(), cols[:, 2:3].copy()
        self.rbase, self.rstride = cols[:, 3:4].copy(), cols[:, 4:5].copy()
        self.length, self.ldev, self.rdev = (
            cols[:, 5:6].copy(),
            cols[:, 6:7].copy(),
            cols[:, 7:8].copy(),
        )
        self.count_limit = int(cols[:, 8].min()) if len(rows) else _INT64_MAX


class _ReadTable:
    """Every (region, read) of a plan against one set of remote ranks, bucketed by
    cache group (as :class:`_DescIndex` groups regions) and remote rank: a request is
    then a few broadcast operations per bucket, not a loop over regions. A region
    that cannot move (or needs a rank that was not given) raises when a request
    names blocks of its group."""

    __slots__ = ("buckets", "errors", "mapped")

    def __init__(
        self, plan: RegionPlan, remotes: Mapping[int, Sequence[PeerRegion]], reads: _ReadCache
    ) -> None:
        index = _desc_index(plan)
        self.mapped = index.mapped
        self.buckets: list[dict[int, _Bucket]] = []
        self.errors: list[Exception | None] = []
        for members in index.by_group:
            rows: dict[int, list[tuple[int, int, int, int, int, int, int, int, int]]] = {}
            error: Exception | None = None
            for i in members.tolist():
                region = plan.regions[i]
                try:
                    region_reads = reads(i)
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
                        )
                    )
            self.buckets.append({rank: _Bucket(r) for rank, r in sorted(rows.items())})
            self.errors.append(error)


def _read_table(
    plan: RegionPlan, remotes: Mapping[int, Sequence[PeerRegion]], reads: _ReadCache
) -> _ReadTable:
    key = tuple(sorted((rank, id(regions)) for rank, regions in remotes.items()))
    table = reads.tables.get(key)
    if table is None:
        table = reads.tables[key] = _ReadTable(plan, remotes, reads)
    return table


def _fill(out: U64, pos: int, bucket: _Bucket, blocks: npt.NDArray[np.uint64], local: bool) -> None:
    """Write ``(addr, len, dev)`` rows of every (region, read) of ``bucket`` for
    ``blocks`` into ``out[pos:]``, region-major, in place."""
    k, n = bucket.regions.size, blocks.size
    rows = out[pos : pos + k * n]
    addr = rows[:, 0].reshape(k, n)
    np.multiply(bucket.lstride if local else bucket.rstride, blocks, out=addr)
    addr += bucket.lbase if local else bucket.rbase
    rows[:, 1].reshape(k, n)[...] = bucket.length
    rows[:, 2].reshape(k, n)[...] = bucket.ldev if local else bucket.rdev


def _transfer_items(
    local: RegionPlan,
    remotes: Mapping[int, Sequence[PeerRegion]],
    lreq: _Request,
    rreq: _Request,
    reads: _ReadCache,
) -> list[TransferItems]:
    """:func:`transfer_items` with the request's ids converted and the TP reads of
    the peer kept across requests: validated first (one list per group of paired
    lengths, bounds on both sides, distinct destinations), then rows written group by
    group and rank by rank into one array per rank and side."""
    _check_lengths(lreq, rreq)
    _desc_index(local).check(lreq, "local")  # bounds, then distinct destinations
    table = _read_table(local, remotes, reads)
    groups = (
        [(lreq.all, rreq.all)]
        if not table.mapped
        else list(zip(lreq.groups, rreq.groups, strict=True))
    )
    sizes: dict[int, int] = {}
    for key, (lblocks, _) in enumerate(groups):
        if not lblocks.size:
            continue
        error = table.errors[key]
        if error is not None:
            raise error
        for rank, bucket in table.buckets[key].items():
            bounds = rreq.bounds(key if table.mapped else -1)
            if bounds is not None and (bounds[0] < 0 or bounds[1] >= bucket.count_limit):
                bad = bounds[0] if bounds[0] < 0 else bounds[1]
                for i in bucket.regions.tolist():
                    count = remotes[rank][i].num_blocks
                    if bad < 0 or bad >= count:
                        raise BlockIdError(local.regions[i].name, bad, count, "remote")
            sizes[rank] = sizes.get(rank, 0) + bucket.regions.size * lblocks.size
    out: dict[int, tuple[U64, U64]] = {
        rank: (np.empty((size, 3), dtype=np.uint64), np.empty((size, 3), dtype=np.uint64))
        for rank, size in sorted(sizes.items())
    }
    pos = dict.fromkeys(out, 0)
    for key, (lblocks, rblocks) in enumerate(groups):
        if not lblocks.size:
            continue
        lb, rb = lblocks.astype(np.uint64), rblocks.astype(np.uint64)
        for rank, bucket in table.buckets[key].items():
            lrows, rrows = out[rank]
            _fill(lrows, pos[rank], bucket, lb, local=True)
            _fill(rrows, pos[rank], bucket, rb, local=False)
            pos[rank] += bucket.regions.size * lb.size
    return [TransferItems(rank, lrows, rrows) for rank, (lrows, rrows) in out.items()]


def _check_lengths(lreq: _Request, rreq: _Request) -> None:
    """Local and remote ids pair up: the same count in every group."""
    if lreq is rreq:
        return
    for gid, (lb, rb) in enumerate(zip(lreq.groups, rreq.groups, strict=True)):
        if lb.size != rb.size:
            raise BlockIdShapeError(
                "both",
                lb.size,
                rb.size,
                f"cache group {gid} has {lb.size} local but {rb.size} remote ids; each "
                f"local block is filled from the remote block at the same position",
            )


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
