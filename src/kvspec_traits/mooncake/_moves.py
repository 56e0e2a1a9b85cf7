"""What one request moves, as Mooncake's batch calls take it: per remote rank, three
lists (our addresses, the peer's, lengths), validated before any is built.

Pure (no Mooncake, numpy or vLLM). Where a block comes from is
:func:`~kvspec_traits.transfer.tp_reads`, computed once per connection
(:func:`pieces_of`); the block ids are parsed and bounded by ``transfer/_blocks.py``,
as every backend's are. Moves contiguous on both sides are merged, so a run of
consecutive blocks of a dense region is one entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvspec_traits.mooncake._errors import MissingPeerError
from kvspec_traits.mooncake._ratio_moves import (
    Parts,
    RatioRoute,
    SlotParts,
    ratio_route,
    reader_pairs,
)
from kvspec_traits.transfer import (
    DuplicateBlockIdError,
    PeerRegion,
    Region,
    RegionPlan,
    UnsupportedLayoutError,
    block_reads,
    lanes_of,
    peer_view,
    tp_reads,
)
from kvspec_traits.transfer._blocks import (
    IdLists,
    check_block_range,
    check_id_list,
    check_paired,
    group_lists,
    place_tail,
)
from kvspec_traits.transfer._tp import lane_groups

__all__ = ["Moves", "Piece", "Route", "parts_of", "pieces_of", "request_moves", "routes_of"]

Piece = tuple[int, int, int, int]
"""``(remote rank, offset in our block, offset in the peer's block, bytes)``."""


@dataclass(frozen=True, slots=True)
class Moves:
    """One batch call's lists for one remote rank: entry ``i`` of ``local`` and
    ``remote`` move ``lengths[i]`` bytes."""

    remote_rank: int
    local: list[int]
    remote: list[int]
    lengths: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


def pieces_of(
    plan: RegionPlan,
    remote_tp: int,
    remote_regions: Mapping[int, Sequence[PeerRegion]],
    *,
    write: bool,
    remote_tokens: Sequence[int | None] | None = None,
    slot_parts: SlotParts | None = None,
) -> tuple[tuple[Piece, ...], ...]:
    """Per lane of each region of ``plan`` (:func:`lanes_of`, in region order), the
    pieces a block moves between our block and the peers' (``remote_regions``: each
    given remote rank's regions).

    A read fills our block from the ranks :func:`tp_reads` names. A write is the
    consumer's read seen from this (producer) side: for each consumer rank, its reads of
    our region from our rank, with the offsets swapped; the consumer's region is ours
    with the consumer's block length (the handshake proved every other trait equal).
    A lane whose blocks hold other token counts than the peer's (``remote_tokens``: per
    region, the peer's tokens per block) has no one-to-one pieces: it is checked here
    (:func:`~kvspec_traits.transfer.block_reads`) and moved by a :class:`RatioRoute`,
    with ``slot_parts[i]`` saying how region ``i``'s head slots hold their tokens (its
    ``parts``; None: rows of token bytes): the writer's attention kernel decides it, so a
    lane of another block size without ``slot_parts`` is refused (:func:`parts_of`).

    Raises :class:`~kvspec_traits.transfer.UnsupportedLayoutError` for a region that
    cannot move between the two TP sizes or block sizes.
    """
    out: list[tuple[Piece, ...]] = []
    some = next(iter(remote_regions.values()))
    for index, region in enumerate(plan.regions):
        tokens = _ratio_tokens(region, remote_tokens)
        for _, states in lanes_of(region):
            if tokens is not None:
                parts = parts_of(region, slot_parts)
                _check_ratio(plan, region, remote_tp, remote_regions, (tokens, parts), write)
                out.append(())
                continue
            out.append(
                _lane_pieces(plan, region, remote_tp, remote_regions, some[index], states, write)
            )
    return tuple(out)


def _ratio_tokens(region: Region, remote_tokens: Sequence[int | None] | None) -> int | None:
    """The peer's tokens per block of ``region`` where they differ from ours."""
    if remote_tokens is None:
        return None
    theirs = remote_tokens[region.index]
    if theirs is None or region.block_sizes == (theirs,):
        return None
    return theirs


def parts_of(region: Region, slot_parts: SlotParts | None) -> Parts | None:
    """How ``region``'s head slots hold their tokens (``block_reads``' ``parts``), as the
    engine's owner declared it (``slot_parts``, one entry per region). A page's interior
    is the attention kernel's choice, not a layout fact of its spec: vLLM-CPU's keeps
    each head's K transposed before V, where rows of token bytes would move every token
    to the wrong place. Without a declaration there is nothing to read between block
    sizes by: :class:`~kvspec_traits.transfer.UnsupportedLayoutError`."""
    if slot_parts is None:
        raise UnsupportedLayoutError(
            region.name,
            "how its blocks hold their tokens is the attention kernel's choice (vLLM-CPU's "
            "keeps each head's K transposed), which the plan does not know; declare it with "
            "register_plan(plan, slot_parts=...) (one entry per region, None for rows of "
            "token bytes), or run prefill and decode with the same --block-size",
        )
    if region.index >= len(slot_parts):
        raise ValueError(
            f"slot_parts has {len(slot_parts)} entries, none for region {region.index} "
            f"({region.name!r}); give one per region of the plan (None for token rows)"
        )
    declared = slot_parts[region.index]
    return None if declared is None else tuple(declared)


def _check_ratio(
    plan: RegionPlan,
    region: Region,
    remote_tp: int,
    remote_regions: Mapping[int, Sequence[PeerRegion]],
    theirs: tuple[int, Parts | None],
    write: bool,
) -> None:
    tokens, parts = theirs
    mine = region.block_sizes[0] if len(region.block_sizes) == 1 else 0
    if not write:
        block_reads(
            region, local_tp=plan.tp_size, local_rank=plan.tp_rank, remote_tp=remote_tp,
            local_tokens=mine, remote_tokens=tokens, parts=parts,
        )  # fmt: skip
        return
    for rank, regions in remote_regions.items():
        viewed = peer_view(
            region,
            tp=plan.tp_size,
            peer_tp=remote_tp,
            peer_block_len=regions[region.index].block_len,
        )
        block_reads(
            dataclasses.replace(viewed, block_sizes=(tokens,)), local_tp=remote_tp,
            local_rank=rank, remote_tp=plan.tp_size, local_tokens=tokens, remote_tokens=mine,
            parts=parts,
        )  # fmt: skip


def _lane_pieces(
    plan: RegionPlan,
    region: Region,
    remote_tp: int,
    remote_regions: Mapping[int, Sequence[PeerRegion]],
    some: PeerRegion,
    states: bool | None,
    write: bool,
) -> tuple[Piece, ...]:
    if not write:
        reads = tp_reads(
            region,
            local_tp=plan.tp_size,
            local_rank=plan.tp_rank,
            remote_tp=remote_tp,
            remote_block_len=some.block_len,
            states=states,
        )
        return tuple((r.remote_rank, r.local_offset, r.remote_offset, r.length) for r in reads)
    pieces: list[Piece] = []
    for rank, regions in sorted(remote_regions.items()):
        theirs = peer_view(
            region,
            tp=plan.tp_size,
            peer_tp=remote_tp,
            peer_block_len=regions[region.index].block_len,
        )
        reads = tp_reads(
            theirs,
            local_tp=remote_tp,
            local_rank=rank,
            remote_tp=plan.tp_size,
            remote_block_len=region.block_len,
            states=states,
        )
        pieces += [
            (rank, r.remote_offset, r.local_offset, r.length)
            for r in reads
            if r.remote_rank == plan.tp_rank
        ]
    return tuple(pieces)


@dataclass(frozen=True, slots=True)
class Route:
    """One region's moves for one lane (:func:`lanes_of`) against a set of peers,
    flattened for the per-request loop: our region's numbers, and per piece the peer
    rank's region geometry."""

    name: str
    group_id: int
    num_blocks: int
    base: int
    stride: int
    pieces: tuple[tuple[int, int, int, int, int, int, int], ...]
    groups: tuple[int, ...]
    """The groups whose blocks the lane moves (:func:`lane_groups`)."""
    """``(rank, our offset, peer's offset, bytes, peer's base, peer's stride, peer's
    block count)`` per piece."""


def routes_of(
    plan: RegionPlan,
    remote_tp: int,
    remote_regions: Mapping[int, Sequence[PeerRegion]],
    *,
    write: bool,
    remote_tokens: Sequence[int | None] | None = None,
    slot_parts: SlotParts | None = None,
) -> tuple[Route | RatioRoute, ...]:
    """:func:`pieces_of` with the geometry of both sides, per lane of each region (what
    a set of peers keeps across requests). :class:`MissingPeerError` names a rank a
    piece needs that ``remote_regions`` lacks."""
    lanes = [(region, group) for region in plan.regions for group, _ in lanes_of(region)]
    routes: list[Route | RatioRoute] = []
    for (region, group), pieces in zip(
        lanes,
        pieces_of(
            plan,
            remote_tp,
            remote_regions,
            write=write,
            remote_tokens=remote_tokens,
            slot_parts=slot_parts,
        ),
        strict=True,
    ):
        tokens = _ratio_tokens(region, remote_tokens)
        if tokens is not None:
            routes.append(
                ratio_route(
                    plan,
                    region,
                    group,
                    remote_tp,
                    remote_regions,
                    tokens,
                    write=write,
                    parts=parts_of(region, slot_parts),
                )
            )
            continue
        flat = []
        for rank, ours, theirs, length in pieces:
            if rank not in remote_regions:
                raise MissingPeerError(region.name, rank, sorted(remote_regions))
            peer = remote_regions[rank][region.index]
            flat.append(
                (rank, ours, theirs, length, peer.base_addr, peer.block_stride, peer.num_blocks)
            )
        routes.append(
            Route(
                region.name,
                group,
                region.num_blocks,
                region.base_addr,
                region.block_stride,
                tuple(flat),
                lane_groups(region, group),
            )
        )
    return tuple(routes)


def _per_group(block_ids: object, groups: int, side: str) -> list[list[int]]:
    """One list of Python ints per group, by the rules every backend shares."""
    return [
        ids.tolist() if check_id_list(ids, side) else ids if type(ids) is list else list(ids)
        for ids in group_lists(block_ids, groups, side)
    ]


def _blocks_of(per_group: list[list[int]], groups: tuple[int, ...]) -> list[int]:
    # A lane of a region shared by several groups serves those groups' blocks (and no
    # other group's: their pages are not in the region's tensors).
    return per_group[groups[0]] if len(groups) == 1 else [b for g in groups for b in per_group[g]]


def _check_distinct(blocks: list[int], group: int | None, side: str) -> None:
    if len(set(blocks)) != len(blocks):
        seen: set[int] = set()
        for block in blocks:
            if block in seen:
                raise DuplicateBlockIdError(block, group, side)
            seen.add(block)


def request_moves(
    routes: Sequence[Route | RatioRoute],
    num_groups: int,
    local_block_ids: IdLists,
    remote_block_ids: IdLists | None,
    *,
    write: bool,
    request_tokens: int | None = None,
    windows: Sequence[int | None] | None = None,
) -> list[Moves]:
    """The moves of one request over ``routes`` (:func:`routes_of`), one
    :class:`Moves` per remote rank that takes part.

    Every id is checked before a list is built: :class:`BlockIdTypeError`,
    :class:`BlockIdShapeError` (not one list per group; local and remote lists of
    different lengths), :class:`BlockIdError` (outside a region, either side),
    :class:`DuplicateBlockIdError` (a destination block named twice: ours for a read,
    the peer's for a write). Between block sizes, ``request_tokens`` (the request's
    tokens, where known) places lists shorter than the request, a sliding window's
    tails, end-aligned (:func:`~kvspec_traits.transfer._blocks.place_tail`, with
    ``windows[g]`` the tokens group ``g``'s window keeps).
    """
    local = _per_group(local_block_ids, num_groups, "local")
    remote = (
        local if remote_block_ids is None else _per_group(remote_block_ids, num_groups, "remote")
    )
    ratio_groups = {r.group_id for r in routes if isinstance(r, RatioRoute)}
    if ratio_groups:
        even = [g for g in range(len(local)) if g not in ratio_groups and -1 not in ratio_groups]
        check_paired([len(local[g]) for g in even], [len(remote[g]) for g in even])
    else:
        check_paired([len(g) for g in local], [len(g) for g in remote])
    todo: list[tuple[Route, list[int], list[int]]] = []
    by_rank: dict[int, Moves] = {}
    for route in routes:
        if isinstance(route, RatioRoute):
            _ratio_moves(route, local, remote, num_groups, by_rank, request_tokens, windows)
            continue
        mine = _blocks_of(local, route.groups)
        if not mine:
            continue
        theirs = _blocks_of(remote, route.groups)
        check_block_range(
            (min(mine), max(mine)), route.num_blocks, [(route.name, route.num_blocks)], "local"
        )
        group = None if route.group_id < 0 or num_groups == 1 else route.group_id
        _check_distinct(theirs if write else mine, group, "remote" if write else "local")
        bounds = (min(theirs), max(theirs))
        for piece in route.pieces:
            check_block_range(bounds, piece[6], [(route.name, piece[6])], "remote")
        todo.append((route, mine, theirs))
    for route, mine, theirs in todo:
        base, stride = route.base, route.stride
        for rank, our_offset, their_offset, length, r_base, r_stride, _ in route.pieces:
            moves = by_rank.get(rank)
            if moves is None:
                moves = by_rank[rank] = Moves(rank, [], [], [])
            local_addrs, remote_addrs, lengths = moves.local, moves.remote, moves.lengths
            add_local, add_remote, add_length = (
                local_addrs.append,
                remote_addrs.append,
                lengths.append,
            )
            end_l = end_r = -1
            if lengths:
                end_l = local_addrs[-1] + lengths[-1]
                end_r = remote_addrs[-1] + lengths[-1]
            src0, dst0 = base + our_offset, r_base + their_offset
            for block, other in zip(mine, theirs, strict=True):
                src = src0 + block * stride
                dst = dst0 + other * r_stride
                if src == end_l and dst == end_r:
                    lengths[-1] += length
                else:
                    add_local(src)
                    add_remote(dst)
                    add_length(length)
                end_l, end_r = src + length, dst + length
    return [by_rank[rank] for rank in sorted(by_rank)]


def _ratio_moves(
    route: RatioRoute,
    local: list[list[int]],
    remote: list[list[int]],
    num_groups: int,
    by_rank: dict[int, Moves],
    request_tokens: int | None = None,
    windows: Sequence[int | None] | None = None,
) -> None:
    """One request's moves over a lane read between block sizes: the reader's ``a``-th
    block takes phase ``a % k``'s pieces, each from the source's ``a * reader_tokens //
    source_tokens + q``-th block (skipped past the source's list: a request's last,
    partly filled block; before it: a window's tail, tokens no window step reads). A
    region of several groups (pools that alias) places each of its groups' lists
    (``route.groups``) on their own, since each may be a tail of its own length."""
    mine, theirs = _blocks_of(local, route.groups), _blocks_of(remote, route.groups)
    if not mine and not theirs:
        return
    groups = list(route.groups)
    placed = []
    for g in groups:
        readers, sources = (remote[g], local[g]) if route.write else (local[g], remote[g])
        if not readers and not sources:
            continue
        first, skipped = place_tail(
            f"region {route.name!r} group {g}", route.reader_tokens, route.source_tokens,
            0, len(readers), len(sources), request_tokens, windows[g] if windows else None,
            may_be_tail=route.may_be_tail and not windows,  # the caller's windows say
        )  # fmt: skip
        reader_pairs(route, first + len(readers), skipped + len(sources))
        placed.append((readers, sources, first, skipped))
    check_block_range(
        (min(mine), max(mine)), route.num_blocks, [(route.name, route.num_blocks)], "local"
    )
    for phase in route.phases:
        for piece in phase:
            check_block_range(
                (min(theirs), max(theirs)), piece[7], [(route.name, piece[7])], "remote"
            )
    group = None if route.group_id < 0 or num_groups == 1 else route.group_id
    _check_distinct(theirs if route.write else mine, group, "remote" if route.write else "local")
    for readers, sources, first, skipped in placed:
        for a, reader in enumerate(readers, start=first):
            start = a * route.reader_tokens // route.source_tokens - skipped
            for rank, ours, peers, length, q, r_base, r_stride, _ in route.phases[
                a % len(route.phases)
            ]:
                if not 0 <= start + q < len(sources):
                    continue
                source = sources[start + q]
                local_block, remote_block = (source, reader) if route.write else (reader, source)
                moves = by_rank.get(rank)
                if moves is None:
                    moves = by_rank[rank] = Moves(rank, [], [], [])
                moves.local.append(route.base + local_block * route.stride + ours)
                moves.remote.append(r_base + remote_block * r_stride + peers)
                moves.lengths.append(length)
