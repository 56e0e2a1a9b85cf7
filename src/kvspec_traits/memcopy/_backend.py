"""An in-process transfer backend on :mod:`kvspec_traits.transfer` alone.

Pure Python (``ctypes.memmove``): no NIXL, numpy or vLLM. Every check a network backend
needs runs here too, on the same functions: the peer checks of
:func:`~kvspec_traits.transfer.check_peer` at :meth:`MemcopyBackend.connect` (the
fingerprint handshake, the geometry its fingerprint implies, host memory, each region
inside its own registration), the TP reads of each region once per connection, and
every block id of a request (parsed and bounded by :mod:`kvspec_traits.transfer`'s
block-id functions, as the NIXL shim's are) before the first byte moves (nothing is
half-written). A producer plan that passes is as trusted as a NIXL peer that passes:
see the trust boundary in ``docs/nixl.md``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Final, TypeAlias

from kvspec_traits._errors import KVSpecTraitsError
from kvspec_traits.transfer import (
    DuplicateBlockIdError,
    Read,
    RegionPlan,
    UnsupportedLayoutError,
    check_peer,
    peer_regions,
    peer_registrations,
    tp_reads,
)
from kvspec_traits.transfer._blocks import (
    IdLists,
    check_block_range,
    check_id_list,
    check_paired,
    group_lists,
)

__all__ = ["HOST_MEMORY", "BlockIdLists", "MemcopyBackend", "NotConnectedError"]

HOST_MEMORY: Final = "DRAM"
"""The only memory type this backend copies (``Region.mem_type`` of a CPU tensor)."""

BlockIdLists: TypeAlias = IdLists
"""One list of block ids per cache group (``RegionPlan.num_groups`` lists), or, for a
plan of one group, that group's list alone; a list is Python ints (not ``bool``) or a
1-D integer array (numpy's: read with ``tolist()``, numpy is not imported)."""

_Copy: TypeAlias = tuple[int, int, int]  # (destination address, source address, bytes)


class NotConnectedError(KVSpecTraitsError, RuntimeError):
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

        Each plan must pass :func:`~kvspec_traits.transfer.check_peer`, as a NIXL
        peer does: the handshake (the same layout traits region by region), the
        geometry its own fingerprint implies, host memory (``"DRAM"``, the memory type
        of our regions: a device, empty or unknown type is
        :class:`~kvspec_traits.transfer.MemoryTypeMismatchError`), and each region
        whole inside the registered allocation that holds its own layers (a shifted,
        swapped, overlapping or foreign base, or more blocks than the allocation
        holds, is :class:`~kvspec_traits.transfer.MalformedMetadataError`); each
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
            check_peer(
                self.plan,
                remote.fingerprint(),
                peer_regions(remote),
                remote.tp_size,
                registrations=peer_registrations(remote),
                peer=f"producer rank {rank}",
            )
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
        check_paired([len(g) for g in local], [len(g) for g in remote])
        copies: list[_Copy] = []
        for region, reads in zip(self.plan.regions, self._reads, strict=True):
            mine = _blocks_of(local, region.group_id)
            theirs = _blocks_of(remote, region.group_id)
            check_block_range(
                _bounds(mine), region.num_blocks, [(region.name, region.num_blocks)], "local"
            )
            _check_distinct(mine, None if region.group_id < 0 or groups == 1 else region.group_id)
            sources = [self._remotes[read.remote_rank].regions[region.index] for read in reads]
            for source in sources:
                check_block_range(
                    _bounds(theirs),
                    source.num_blocks,
                    [(source.name, source.num_blocks)],
                    "remote",
                )
            for block, source_block in zip(mine, theirs, strict=True):
                dst = region.base_addr + block * region.block_stride
                for read, source in zip(reads, sources, strict=True):
                    src = source.base_addr + source_block * source.block_stride
                    copies.append((dst + read.local_offset, src + read.remote_offset, read.length))
        for dst, src, length in copies:
            ctypes.memmove(dst, src, length)
        return sum(length for _, _, length in copies)


def _per_group(block_ids: object, groups: int, side: str) -> list[list[int]]:
    """One list of Python ints per group, by the rules every backend shares."""
    return [
        list(ids.tolist()) if check_id_list(ids, side) else list(ids)
        for ids in group_lists(block_ids, groups, side)
    ]


def _bounds(blocks: list[int]) -> tuple[int, int] | None:
    return (min(blocks), max(blocks)) if blocks else None


def _blocks_of(per_group: list[list[int]], group_id: int) -> list[int]:
    # A region shared by several groups (group id < 0) serves every group's blocks.
    return per_group[group_id] if group_id >= 0 else [b for ids in per_group for b in ids]


def _check_distinct(blocks: list[int], group: int | None) -> None:
    seen: set[int] = set()
    for block in blocks:
        if block in seen:
            raise DuplicateBlockIdError(block, group)
        seen.add(block)
