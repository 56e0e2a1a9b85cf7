"""Tensor parallelism: how many shards a layout has across a TP group, and where one
rank's block of a region comes from when producer and consumer TP sizes differ.

Pure: imports neither NIXL, numpy nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvspec_traits._traits import TPLayout
from kvspec_traits.transfer._errors import UnsupportedLayoutError
from kvspec_traits.transfer._region import Region

__all__ = ["Read", "shard_count", "tp_reads"]


def shard_count(
    tp_layout: TPLayout, tp_shards: int | None, tp_size: int, *, region: str | None = None
) -> int:
    """Distinct shards of a cache of ``tp_layout`` (``tp_shards``: its shard count, if
    bounded) across ``tp_size`` ranks: 1 if replicated.

    With ``region`` (its name), ``ValueError`` unless the shards divide ``tp_size`` (a
    region whose shards do not divide the TP group cannot be planned or read).
    """
    if tp_layout is TPLayout.REPLICATED:
        shards = 1
    elif tp_shards is None:
        shards = tp_size
    else:
        shards = min(tp_shards, tp_size)
    if region is not None and tp_size % shards:
        raise ValueError(f"region {region!r}: {shards} shards do not divide TP size {tp_size}")
    return shards


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
    local_shards = shard_count(region.tp_layout, region.tp_shards, local_tp, region=region.name)
    remote_shards = shard_count(region.tp_layout, region.tp_shards, remote_tp, region=region.name)
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
