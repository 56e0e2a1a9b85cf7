"""NIXL descriptors for reads between blocks of other token counts (a block-size ratio
between prefill and decode, issue 48): per region, the pieces
:func:`~kvspec_traits.transfer.block_reads` plans, and per request the local and remote
``(address, length, device)`` rows they name, one pair of lists per remote rank.

The mirror of ``mooncake/_ratio_moves.py`` for NIXL: a pull consumer reads
(:func:`ratio_lanes`, :func:`ratio_reads`); a push producer writes what each consumer
rank would read from it (:func:`ratio_write_lanes`, :func:`ratio_writes`: the consumer's
own reads, planned by the same :func:`~kvspec_traits.transfer.block_reads` from its side,
turned around). Pure: numpy only, no NIXL and no vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvspec_traits.transfer import (
    BlockIdShapeError,
    BlockRead,
    PeerRegion,
    Region,
    RegionPlan,
    UnsupportedLayoutError,
    block_reads,
    peer_regions,
    peer_view,
)
from kvspec_traits.transfer._blocks import check_block_range, place_tail

__all__ = [
    "RatioLane",
    "RatioReads",
    "ratio_lanes",
    "ratio_reads",
    "ratio_write_lanes",
    "ratio_writes",
]


@dataclass(frozen=True, slots=True)
class RatioLane:
    """One region read from peers whose blocks hold ``remote_tokens`` tokens (ours
    ``local_tokens``): the ``a``-th block of a request takes ``phases[a % len(phases)]``,
    each piece from the peer's ``a * local_tokens // remote_tokens + q``-th block."""

    name: str
    index: int
    group_ids: tuple[int, ...]
    base: int
    stride: int
    num_blocks: int
    device_id: int
    local_tokens: int
    remote_tokens: int
    phases: tuple[tuple[BlockRead, ...], ...]


def ratio_lanes(
    plan: RegionPlan,
    remote_tp: int,
    remote_tokens: Sequence[int],
    parts: Sequence[Sequence[tuple[int, int]] | None] | None = None,
) -> tuple[RatioLane, ...]:
    """The lanes of every region of ``plan`` against a peer of ``remote_tp`` ranks whose
    region ``i`` holds ``remote_tokens[i]`` tokens a block (``parts[i]``: how a head slot
    of region ``i`` keeps its tokens, :func:`~kvspec_traits.transfer.block_reads`'
    ``parts``; default token rows). Raises
    :class:`~kvspec_traits.transfer.UnsupportedLayoutError` (naming the region and why)
    where the planner cannot read a region between the two block sizes: a recurrent
    state, a ring, members of several block sizes, sizes of which neither divides the
    other."""
    if len(remote_tokens) != len(plan.regions):
        raise UnsupportedLayoutError(
            plan.regions[0].name if plan.regions else "(none)",
            f"the peer names block sizes for {len(remote_tokens)} regions, this rank "
            f"registers {len(plan.regions)}",
        )
    lanes = []
    kept = list(parts) if parts is not None else [None] * len(plan.regions)
    for region, theirs, layout in zip(plan.regions, remote_tokens, kept, strict=True):
        # A region of several block sizes is refused by the planner, naming them.
        mine = region.block_sizes[0] if region.block_sizes else 0
        phases = block_reads(
            region, local_tp=plan.tp_size, local_rank=plan.tp_rank, remote_tp=remote_tp,
            local_tokens=mine, remote_tokens=theirs, parts=layout,
        )  # fmt: skip
        lanes.append(_lane(region, region, mine, theirs, phases))
    return tuple(lanes)


def ratio_write_lanes(
    plan: RegionPlan,
    reader_tp: int,
    reader_rank: int,
    reader_regions: Sequence[PeerRegion],
    reader_tokens: Sequence[int],
    parts: Sequence[Sequence[tuple[int, int]] | None] | None = None,
) -> tuple[RatioLane, ...]:
    """What consumer rank ``reader_rank`` (of ``reader_tp``, its regions
    ``reader_regions``, region ``i`` holding ``reader_tokens[i]`` tokens a block) would
    read from this rank (``plan``), as lanes in the reader's blocks: each region of
    ``plan`` as the reader holds it (:func:`~kvspec_traits.transfer.peer_view`), its
    :func:`~kvspec_traits.transfer.block_reads` from the reader's side, the pieces this
    rank serves. A lane's geometry is the reader's region; its pieces' remote side is
    ours. Raises :class:`~kvspec_traits.transfer.UnsupportedLayoutError` as
    :func:`ratio_lanes` does (the reader's block sizes: the ones this peer names)."""
    if len(reader_tokens) != len(plan.regions) or len(reader_regions) != len(plan.regions):
        raise UnsupportedLayoutError(
            plan.regions[0].name if plan.regions else "(none)",
            f"the peer names block sizes for {len(reader_tokens)} regions and addresses "
            f"{len(reader_regions)}, this rank registers {len(plan.regions)}",
        )
    kept = list(parts) if parts is not None else [None] * len(plan.regions)
    lanes = []
    for region, theirs, peer, layout in zip(
        plan.regions, reader_tokens, reader_regions, kept, strict=True
    ):
        # A region of several block sizes is refused by the producer's own read lanes
        # (ratio_lanes, in the handshake) by name; here 0 fails the planner's check.
        mine = region.block_sizes[0] if len(region.block_sizes) == 1 else 0
        viewed = dataclasses.replace(
            peer_view(region, tp=plan.tp_size, peer_tp=reader_tp, peer_block_len=peer.block_len),
            block_sizes=(theirs,),
        )
        phases = block_reads(
            viewed, local_tp=reader_tp, local_rank=reader_rank, remote_tp=plan.tp_size,
            local_tokens=theirs, remote_tokens=mine, parts=layout,
        )  # fmt: skip
        served = tuple(
            tuple(piece for piece in phase if piece.remote_rank == plan.tp_rank) for phase in phases
        )
        lanes.append(_lane(region, peer, theirs, mine, served))
    return tuple(lanes)


def _lane(
    region: Region,
    blocks: Region | PeerRegion,
    local_tokens: int,
    remote_tokens: int,
    phases: tuple[tuple[BlockRead, ...], ...],
) -> RatioLane:
    """``region``'s lane over the blocks of ``blocks`` (the region itself for our reads,
    the reader's region for the writes mirroring them)."""
    return RatioLane(
        name=region.name,
        index=region.index,
        group_ids=region.group_ids,
        base=blocks.base_addr,
        stride=blocks.block_stride,
        num_blocks=blocks.num_blocks,
        device_id=blocks.device_id,
        local_tokens=local_tokens,
        remote_tokens=remote_tokens,
        phases=phases,
    )


def ratio_writes(
    plan: RegionPlan,
    lanes: Sequence[RatioLane],
    our_ids: Sequence[Sequence[int]],
    reader_ids: Sequence[Sequence[int]],
    reader_starts: Sequence[int] | None = None,
    request_tokens: int | None = None,
    windows: Sequence[int | None] | None = None,
) -> RatioReads:
    """What this rank (``plan``) writes of one request into one consumer rank
    (``lanes``: :func:`ratio_write_lanes`): the reads that rank would make from us
    (:func:`ratio_reads`, with ``reader_ids`` from its ``reader_starts`` on and our
    whole request's ``our_ids``), turned around: ``local`` rows ours, ``remote`` its.
    Raises what :func:`ratio_reads` raises, before a row is built."""
    reads = ratio_reads(
        lanes, {plan.tp_rank: peer_regions(plan)}, reader_ids, our_ids, reader_starts,
        request_tokens, windows,
    )  # fmt: skip
    got = reads.get(plan.tp_rank)
    return RatioReads([], []) if got is None else RatioReads(got.remote, got.local)


@dataclass
class RatioReads:
    """One remote rank's part of a request: rows ``(address, length, device)``."""

    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]

    def arrays(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """The rows as NIXL's ``get_xfer_descs`` takes them."""
        return (
            np.array(self.local, dtype=np.uint64).reshape(-1, 3),
            np.array(self.remote, dtype=np.uint64).reshape(-1, 3),
        )


def ratio_reads(
    lanes: Sequence[RatioLane],
    peers: Mapping[int, Sequence[PeerRegion]],
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    local_starts: Sequence[int] | None = None,
    request_tokens: int | None = None,
    windows: Sequence[int | None] | None = None,
) -> dict[int, RatioReads]:
    """What one request reads from each remote rank (``peers``: each handshaken rank's
    regions). ``local_ids[g]`` are the request's blocks of group ``g`` from its
    ``local_starts[g]``-th block on (the blocks a prefix-cache hit left to read; default
    0), ``remote_ids[g]`` the peer's blocks of the whole request (of ``request_tokens``
    tokens). A piece past the peer's list (a last, partly filled block) is skipped.

    A list that ends before the request's last block, a sliding window's tail as vLLM
    clips it (``blocks[-n:]`` on each side, ``n`` from each side's block size), is
    placed end-aligned where ``request_tokens`` is known: its last block holds the
    request's last token (``transfer._blocks.place_tail``). The tokens both tails hold
    are read. Where ``request_tokens`` is not known, lists are taken from the request's
    first block; a tail is refused where the peer's starts after a token the window
    needs. ``windows[g]`` is the tokens group ``g``'s window keeps (``None``, or no
    ``windows``: every token of our blocks is needed); with it, the tokens from
    ``request_tokens - windows[g]`` on are needed, and tokens of our blocks before the
    peer's tail, which no attention step reads, are left as they were.

    Every id is checked before a row is built: :class:`~kvspec_traits.transfer.
    BlockIdError` outside a region, :class:`~kvspec_traits.transfer.BlockIdShapeError`
    where the lists do not cover the same tokens; a rank a piece needs that ``peers``
    lacks is an :class:`~kvspec_traits.transfer.UnsupportedLayoutError`."""
    if len(remote_ids) != len(local_ids):
        raise BlockIdShapeError(
            "remote", len(local_ids), len(remote_ids), "not one list per cache group"
        )
    starts = list(local_starts) if local_starts is not None else [0] * len(local_ids)
    todo: list[tuple[RatioLane, int, int, int]] = []
    for lane in lanes:
        for group in lane.group_ids:
            mine, theirs = local_ids[group], remote_ids[group]
            if not mine:
                continue
            window = windows[group] if windows is not None else None
            start, skipped = _place(
                lane, group, starts[group], len(mine), theirs, request_tokens, window
            )
            _check_lists(lane, group, start, len(mine), skipped, theirs, peers)
            todo.append((lane, group, start, skipped))
    out: dict[int, RatioReads] = {}
    for lane, group, start, skipped in todo:
        _lane_rows(lane, start, skipped, local_ids[group], remote_ids[group], peers, out)
    return {rank: out[rank] for rank in sorted(out)}


def _place(
    lane: RatioLane,
    group: int,
    start: int,
    count: int,
    theirs: Sequence[int],
    request_tokens: int | None,
    window: int | None,
) -> tuple[int, int]:
    return place_tail(
        f"region {lane.name!r} group {group}", lane.local_tokens, lane.remote_tokens,
        start, count, len(theirs), request_tokens, window,
    )  # fmt: skip


def _check_lists(
    lane: RatioLane,
    group: int,
    start: int,
    count: int,
    skipped: int,
    theirs: Sequence[int],
    peers: Mapping[int, Sequence[PeerRegion]],
) -> None:
    """Our blocks ``start .. start + count`` of a request are covered by the peer's
    list (its blocks ``skipped ..``): each has a token in it, and the list ends within
    our last block."""
    mine_t, theirs_t = lane.local_tokens, lane.remote_tokens
    low = ((start + count - 1) * mine_t) // theirs_t + 1
    high = -(-(start + count) * mine_t // theirs_t)
    if not low <= skipped + len(theirs) <= high:
        raise BlockIdShapeError(
            "both",
            low,
            skipped + len(theirs),
            f"region {lane.name!r} group {group}: blocks {start}..{start + count - 1} of "
            f"{mine_t} tokens are covered by {low}..{high} blocks of {theirs_t} tokens, "
            f"not {skipped + len(theirs)}",
        )
    for rank in {piece.remote_rank for phase in lane.phases for piece in phase}:
        if rank not in peers:
            raise UnsupportedLayoutError(
                lane.name, f"it reads from remote rank {rank}, not handshaken ({sorted(peers)})"
            )
        peer = peers[rank][lane.index]
        check_block_range(
            (min(theirs), max(theirs)), peer.num_blocks, [(lane.name, peer.num_blocks)], "remote"
        )


def _lane_rows(
    lane: RatioLane,
    start: int,
    skipped: int,
    mine: Sequence[int],
    theirs: Sequence[int],
    peers: Mapping[int, Sequence[PeerRegion]],
    out: dict[int, RatioReads],
) -> None:
    check_block_range(
        (min(mine), max(mine)), lane.num_blocks, [(lane.name, lane.num_blocks)], "local"
    )
    for i, block in enumerate(mine):
        a = start + i
        # The peer's list starts at its block ``skipped`` (a tail); a piece before it
        # holds tokens no window step reads (_place refused the request otherwise).
        first = a * lane.local_tokens // lane.remote_tokens - skipped
        local_at = lane.base + block * lane.stride
        for piece in lane.phases[a % len(lane.phases)]:
            if not 0 <= first + piece.remote_block < len(theirs):
                continue
            peer = peers[piece.remote_rank][lane.index]
            source = theirs[first + piece.remote_block]
            reads = out.get(piece.remote_rank)
            if reads is None:
                reads = out[piece.remote_rank] = RatioReads([], [])
            reads.local.append((local_at + piece.local_offset, piece.length, lane.device_id))
            reads.remote.append(
                (
                    peer.base_addr + source * peer.block_stride + piece.remote_offset,
                    piece.length,
                    peer.device_id,
                )
            )
