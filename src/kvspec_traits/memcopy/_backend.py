"""An in-process transfer backend on :mod:`kvspec_traits.transfer` alone.

Pure Python (``ctypes.memmove``): no NIXL, numpy or vLLM. Every check a network backend
needs runs here too, on the same functions: the fingerprint handshake and the peer's
geometry against its own fingerprint at :meth:`MemcopyBackend.connect`, the TP reads of
each region once per connection, and every block id of a request before the first byte
moves (nothing is half-written).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Final, TypeAlias

from kvspec_traits.transfer import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    DuplicateBlockIdError,
    Read,
    RegionPlan,
    UnsupportedLayoutError,
    check_handshake,
    check_peer_geometry,
    peer_regions,
    tp_reads,
)

__all__ = ["HOST_MEMORY", "BlockIdLists", "MemcopyBackend", "NotConnectedError"]

HOST_MEMORY: Final = "DRAM"
"""The only memory type this backend copies (``Region.mem_type`` of a CPU tensor)."""

BlockIdLists: TypeAlias = Sequence[Sequence[int]] | Sequence[int]
"""One list of block ids per cache group (``RegionPlan.num_groups`` lists), or, for a
plan of one group, that group's list alone."""

_Copy: TypeAlias = tuple[int, int, int]  # (destination address, source address, bytes)


class NotConnectedError(RuntimeError):
    """:meth:`MemcopyBackend.read_blocks` before :meth:`MemcopyBackend.connect`."""

    def __init__(self) -> None:
        super().__init__(
            "read_blocks before connect: call connect(producer_plans) first, with one "
            "RegionPlan per producer TP rank"
        )


class MemcopyBackend:
    """The consumer side: fills its own plan's blocks from a producer's plans."""

    def __init__(self, plan: RegionPlan) -> None:
        for region in plan.regions:
            if region.mem_type != HOST_MEMORY:
                raise UnsupportedLayoutError(
                    region.name,
                    f"its memory is {region.mem_type}; the memcopy backend copies host "
                    f"({HOST_MEMORY}) memory only: use kvspec_traits.nixl for device memory",
                )
        self.plan = plan
        self._remotes: tuple[RegionPlan, ...] = ()
        self._reads: tuple[tuple[Read, ...], ...] = ()

    def connect(self, producer_plans: Sequence[RegionPlan]) -> None:
        """Accept a producer: its plans, one per TP rank in rank order.

        Each plan must pass the handshake (the same layout traits region by region,
        :func:`~kvspec_traits.transfer.check_handshake`) and address what its own
        fingerprint says (:func:`~kvspec_traits.transfer.check_peer_geometry`); each
        region's TP reads are computed here, so a region that cannot move between the
        two TP sizes is refused now, not at the first request. A refused producer leaves
        the previous connection as it was.
        """
        if not producer_plans:
            raise ValueError("connect needs the producer's plans, one per TP rank (got none)")
        remote_tp = len(producer_plans)
        for rank, remote in enumerate(producer_plans):
            if (remote.tp_size, remote.tp_rank) != (remote_tp, rank):
                raise ValueError(
                    f"plan {rank} is rank {remote.tp_rank} of TP {remote.tp_size}; pass one "
                    f"plan per producer rank, in rank order ({remote_tp} plans: TP {remote_tp})"
                )
            fingerprint = remote.fingerprint()
            check_handshake(self.plan, fingerprint)
            check_peer_geometry(fingerprint, peer_regions(remote), remote.tp_size)
        reads = tuple(
            tp_reads(
                region,
                local_tp=self.plan.tp_size,
                local_rank=self.plan.tp_rank,
                remote_tp=remote_tp,
                remote_block_len=producer_plans[0].regions[index].block_len,
            )
            for index, region in enumerate(self.plan.regions)
        )
        self._remotes, self._reads = tuple(producer_plans), reads

    def read_blocks(
        self, local_block_ids: BlockIdLists, remote_block_ids: BlockIdLists | None = None
    ) -> int:
        """Fill ``local_block_ids`` of every region from the producer's
        ``remote_block_ids`` (default: the same ids); returns the bytes copied.

        A region of cache group ``g`` takes the ``g``-th lists; a region shared by
        several groups takes every group's blocks, in group order. Raises, before any
        byte moves: :class:`BlockIdTypeError` (not a list of ints), :class:`BlockIdShapeError`
        (not one list per group, or local and remote lists of different lengths),
        :class:`BlockIdError` (an id outside a region, either side),
        :class:`DuplicateBlockIdError` (a destination block named twice),
        :class:`NotConnectedError`.
        """
        if not self._remotes:
            raise NotConnectedError
        groups = self.plan.num_groups
        local = _per_group(local_block_ids, groups, "local")
        remote = (
            local if remote_block_ids is None else _per_group(remote_block_ids, groups, "remote")
        )
        for group, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
            if len(mine) != len(theirs):
                raise BlockIdShapeError(
                    "both",
                    len(mine),
                    len(theirs),
                    f"cache group {group} has {len(mine)} local and {len(theirs)} remote "
                    f"ids; name one producer block per local block",
                )
        copies: list[_Copy] = []
        for region, reads in zip(self.plan.regions, self._reads, strict=True):
            mine = _blocks_of(local, region.group_id)
            theirs = _blocks_of(remote, region.group_id)
            _check_distinct(mine, None if region.group_id < 0 or groups == 1 else region.group_id)
            sources = [self._remotes[read.remote_rank].regions[region.index] for read in reads]
            for block, source_block in zip(mine, theirs, strict=True):
                _check_in(region.name, block, region.num_blocks, "local")
                dst = region.base_addr + block * region.block_stride
                for read, source in zip(reads, sources, strict=True):
                    _check_in(source.name, source_block, source.num_blocks, "remote")
                    src = source.base_addr + source_block * source.block_stride
                    copies.append((dst + read.local_offset, src + read.remote_offset, read.length))
        for dst, src, length in copies:
            ctypes.memmove(dst, src, length)
        return sum(length for _, _, length in copies)


def _ids(value: object, side: str) -> list[int]:
    if not isinstance(value, (list, tuple, range)):
        raise BlockIdTypeError(side, value, f"a {type(value).__name__} is not a list of ids")
    for item in value:
        if type(item) is not int:
            raise BlockIdTypeError(side, item, f"{item!r} is a {type(item).__name__}, not an int")
    return list(value)


def _per_group(block_ids: object, groups: int, side: str) -> list[list[int]]:
    if not isinstance(block_ids, (list, tuple)):
        raise BlockIdTypeError(side, block_ids, f"a {type(block_ids).__name__} is not block ids")
    if block_ids and not isinstance(block_ids[0], (list, tuple, range)):
        if groups != 1:
            raise BlockIdShapeError(
                side,
                groups,
                1,
                f"one flat list for a plan of {groups} cache groups; pass one list per group",
            )
        return [_ids(block_ids, side)]
    if len(block_ids) != groups:
        raise BlockIdShapeError(
            side,
            groups,
            len(block_ids),
            f"{len(block_ids)} lists for a plan of {groups} cache groups; pass exactly one "
            f"list per group (an empty one for a group with no blocks)",
        )
    return [_ids(ids, side) for ids in block_ids]


def _blocks_of(per_group: list[list[int]], group_id: int) -> list[int]:
    # A region shared by several groups (group id < 0) serves every group's blocks.
    return per_group[group_id] if group_id >= 0 else [b for ids in per_group for b in ids]


def _check_distinct(blocks: list[int], group: int | None) -> None:
    seen: set[int] = set()
    for block in blocks:
        if block in seen:
            raise DuplicateBlockIdError(block, group)
        seen.add(block)


def _check_in(region: str, block: int, num_blocks: int, side: str) -> None:
    if not 0 <= block < num_blocks:
        raise BlockIdError(region, block, num_blocks, side)
