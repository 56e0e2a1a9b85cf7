"""Tensor parallelism: how many shards a layout has across a TP group, and where one
rank's block of a region comes from when producer and consumer TP sizes differ.

Pure: imports neither NIXL, numpy nor vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from kvspec_traits._traits import TPLayout
from kvspec_traits.transfer._errors import UnsupportedLayoutError
from kvspec_traits.transfer._region import Region

__all__ = [
    "Read",
    "check_tp_pair",
    "lane_groups",
    "lanes_of",
    "peer_view",
    "shard_count",
    "state_content",
    "tp_reads",
    "with_kv_heads",
]


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


def with_kv_heads(region: Region, total_kv_heads: int | None) -> Region:
    """``region`` with the model's KV head count as its shard count, where the region
    is head-sharded and its specs leave the count unset.

    vLLM's attention specs carry a rank's heads, ``max(1, total // tp)``, and no
    ``max_tp_shards``: one KV head of one at TP 2 and one head of two at TP 2 are the
    same spec. The model's total (``model_config.get_total_num_kv_heads()``, what vLLM's
    own ``TransferTopology`` reads) tells them apart: ``min(total, tp)`` distinct shards,
    each held by ``tp // total`` ranks when there are fewer heads than ranks. ``None``
    (unknown) keeps one shard per rank. Raises ``ValueError`` for a count below 1.
    """
    if total_kv_heads is None:
        return region
    if isinstance(total_kv_heads, bool) or not isinstance(total_kv_heads, int):
        raise TypeError(f"total_kv_heads must be an int or None, got {total_kv_heads!r}")
    if total_kv_heads < 1:
        raise ValueError(f"total_kv_heads {total_kv_heads} must be >= 1 (or None)")
    if region.replicated or region.tp_layout is not TPLayout.HEAD_SHARDED:
        return region
    if region.tp_shards is not None or not region.paged:
        return region
    return replace(region, tp_shards=total_kv_heads)


def peer_view(region: Region, *, tp: int, peer_tp: int, peer_block_len: int) -> Region:
    """``region`` (of a rank of TP ``tp``) as a rank of TP ``peer_tp`` holds it: its
    block length the peer's, a head-sharded page's head slots the peer's share, a
    TP-sharded state's components scaled by ``tp / peer_tp`` (every rank holds ``1 /
    tp`` of each run). What a producer asks
    :func:`tp_reads` with, to see a consumer's reads from its own side (a write).
    Raises :class:`UnsupportedLayoutError` where a component does not scale whole."""
    viewed = replace(region, block_len=peer_block_len)
    if tp != peer_tp and region.paged and not region.replicated:
        # A head-sharded page holds the peer's share of the heads there.
        mine = shard_count(region.tp_layout, region.tp_shards, tp)
        theirs = shard_count(region.tp_layout, region.tp_shards, peer_tp)
        viewed = replace(
            viewed,
            page_head_slots=tuple(n * mine // theirs for n in region.page_head_slots),
            num_head_slots=None
            if region.num_head_slots is None
            else region.num_head_slots * mine // theirs,
        )
    if not region.sharded_state or tp == peer_tp:
        return viewed
    scale = Fraction(tp, peer_tp)

    def scaled(n: int, what: str) -> int:
        value = n * scale
        if value.denominator != 1:
            raise UnsupportedLayoutError(
                region.name, f"its state's {what} of {n} B does not split into TP {peer_tp}"
            )
        return int(value)

    return replace(
        viewed,
        state_components=tuple(
            replace(
                c,
                offset=scaled(c.offset, f"{c.name} offset"),
                nbytes=scaled(c.nbytes, c.name),
                runs=None if c.runs is None else tuple(scaled(r, f"{c.name} run") for r in c.runs),
            )
            for c in region.state_components
        ),
    )


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
    states: bool | None = None,
) -> tuple[Read, ...]:
    """Where this rank's block of ``region`` comes from when the peer has ``remote_tp``
    ranks: a replicated region whole from one rank; a head-sharded region split or
    gathered by heads (its head slice must be contiguous, :attr:`Region.head_major`),
    from the first rank holding each head where heads are replicated (fewer KV heads
    than ranks, :func:`with_kv_heads`); a TP-sharded recurrent state whole between
    equal TP sizes, and between others run by run of each component
    (:attr:`StateComponent.runs`).

    ``states``: whether the block is one of the region's state blocks
    (:attr:`Region.state_group_ids`) or a token page; ``None`` where the region holds
    only one kind (a region shared by a paged group and a TP-sharded state group must
    be asked per group between TP sizes).

    Raises :class:`UnsupportedLayoutError` when the region cannot move between these
    TP sizes.
    """
    if region.sharded_state and local_tp == remote_tp:
        # Each rank's blocks hold its own shard of the state (and its pages).
        return (Read(local_rank, 0, 0, region.block_len),)
    if states is None:
        if region.state and region.paged and local_tp != remote_tp:
            raise UnsupportedLayoutError(
                region.name,
                "its blocks hold token pages of one group and a recurrent state of "
                "another; ask tp_reads per group (states=True or False)",
            )
        states = region.state and not region.paged
    if states and region.sharded_state:
        return _state_reads(region, local_tp, local_rank, remote_tp)
    if states and local_tp != remote_tp:
        # A replicated state: the same content on every rank, padded to a page whose
        # size may follow the TP size (a hybrid's unified page): the content alone.
        return (Read(local_rank % remote_tp, 0, 0, state_content(region)),)
    if region.replicated or states:
        return (Read(local_rank % remote_tp, 0, 0, region.block_len),)
    return _paged_reads(region, local_tp, local_rank, remote_tp, remote_block_len)


def _paged_reads(
    region: Region, local_tp: int, local_rank: int, remote_tp: int, remote_block_len: int | None
) -> tuple[Read, ...]:
    """A head-sharded token page: from the rank holding the same heads, or split and
    gathered by heads between shard counts."""
    local_shards = shard_count(region.tp_layout, region.tp_shards, local_tp, region=region.name)
    remote_shards = shard_count(region.tp_layout, region.tp_shards, remote_tp, region=region.name)
    local_shard = local_rank // (local_tp // local_shards)
    if local_shards == remote_shards:
        return (Read(local_shard * (remote_tp // remote_shards), 0, 0, region.block_len),)
    if region.tp_layout is not TPLayout.HEAD_SHARDED:
        raise UnsupportedLayoutError(
            region.name,
            f"a {region.tp_layout.value} region cannot move between TP {remote_tp} "
            f"and TP {local_tp}",
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


def _state_reads(
    region: Region, local_tp: int, local_rank: int, remote_tp: int
) -> tuple[Read, ...]:
    """A TP-sharded state block between TP sizes: each component's runs, every rank
    holding ``1 / tp`` of each run in rank order, the components back to back from the
    page's first byte on both sides (vLLM's ``MambaConvSplitInfo`` layout: conv
    sub-projections, then the temporal state); trailing padding is not moved."""
    parts = _state_parts(region, local_tp, remote_tp)
    reads: list[Read] = []
    for local_base, remote_base, run in parts:
        remote_run = run * local_tp // remote_tp
        lo, hi = local_rank * run, (local_rank + 1) * run  # in the run's global bytes
        for rank in range(lo // remote_run, (hi - 1) // remote_run + 1):
            a, b = max(lo, rank * remote_run), min(hi, (rank + 1) * remote_run)
            reads.append(
                Read(rank, local_base + a - lo, remote_base + a - rank * remote_run, b - a)
            )
    return tuple(reads)


def state_content(region: Region) -> int:
    """Bytes of a state page up to its last component that is not padding (the whole
    block where the components do not say)."""
    content = [c for c in region.state_components if not c.name.startswith("pad")]
    return content[-1].offset + content[-1].nbytes if content else region.block_len


def _state_parts(region: Region, local_tp: int, remote_tp: int) -> list[tuple[int, int, int]]:
    """``(local offset, remote offset, local bytes)`` of every run of the region's
    state components; :class:`UnsupportedLayoutError` where the traits do not say how a
    component splits, or a run does not divide between the TP sizes."""
    found: list[tuple[int, int, int]] = []
    local = remote = 0
    components = list(region.state_components)
    while components and components[-1].runs is None and components[-1].name.startswith("pad"):
        components.pop()  # padding to the unified page: nobody's bytes
    for component in components:
        if component.runs is None and component.name.startswith("pad"):
            raise UnsupportedLayoutError(
                region.name,
                f"its TP-sharded state pads between components ({component.name!r}), and "
                f"the padding at TP {remote_tp} is not described, so it cannot move "
                f"between TP {remote_tp} and TP {local_tp}; run producer and consumer "
                f"with equal TP sizes",
            )
        if component.runs is None or component.offset != local:
            raise UnsupportedLayoutError(
                region.name,
                f"its TP-sharded state's component {component.name!r} does not say how "
                f"it splits across TP ranks (no tp_split in its traits), so it cannot "
                f"move between TP {remote_tp} and TP {local_tp}; run producer and "
                f"consumer with equal TP sizes",
            )
        for run in component.runs:
            if (run * local_tp) % remote_tp:
                raise UnsupportedLayoutError(
                    region.name,
                    f"a {run}-byte run of state component {component.name!r} does not "
                    f"split into TP {remote_tp} shards",
                )
            found.append((local, remote, run))
            local += run
            remote += run * local_tp // remote_tp
    return found


def lanes_of(region: Region) -> tuple[tuple[int, bool | None], ...]:
    """The ``(group id, states)`` a region's blocks are read by: one lane for the
    region's group (every group's, for a shared region), or, where a region holds both
    token pages and a recurrent state (a hybrid allocator's shared tensors), one lane
    per group, reading each group's blocks as what that group keeps there
    (:func:`~kvspec_traits.transfer.tp_reads`' ``states``)."""
    if region.state and region.paged:
        return tuple((g, g in region.state_group_ids) for g in region.group_ids)
    return ((region.group_id, None),)


def lane_groups(region: Region, group_id: int) -> tuple[int, ...]:
    """The cache groups whose blocks a lane of ``region`` (:func:`lanes_of`) moves: its
    group, or, for the lane of a region shared by several groups (group id < 0), the
    region's own groups (:attr:`Region.group_ids`), never a group none of whose layers
    uses the region's pages (:attr:`RegionPlan.group_regions` is the same answer per
    group)."""
    return (group_id,) if group_id >= 0 else region.group_ids


def check_tp_pair(regions: Sequence[Region], *, local_tp: int, remote_tp: int) -> None:
    """Refuse, before any byte moves, a pair of TP sizes some region cannot move
    between: :func:`tp_reads` of every lane of every region, for every local rank
    (the one decision every backend applies). Raises :class:`UnsupportedLayoutError`
    naming the region and why."""
    if local_tp == remote_tp:
        return
    for region in regions:
        for _, states in lanes_of(region):
            for rank in range(local_tp):
                tp_reads(
                    region, local_tp=local_tp, local_rank=rank, remote_tp=remote_tp, states=states
                )
