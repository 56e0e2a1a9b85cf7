"""Moves between blocks of other token counts (a block-size ratio between the two
sides, issue 48): per lane of a region, the pieces :func:`~kvspec_traits.transfer.
block_reads` gives, and per request the addresses they name.

Pure (no Mooncake, numpy or vLLM). Kept apart from ``_moves``' per-request loop, which
pairs block ids one to one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvspec_traits._traits import TokenScope
from kvspec_traits.transfer import (
    BlockIdShapeError,
    PeerRegion,
    Region,
    RegionPlan,
    block_reads,
    peer_view,
)
from kvspec_traits.transfer._tp import lane_groups

__all__ = ["Parts", "RatioRoute", "SlotParts", "ratio_route", "reader_pairs"]

Parts = tuple[tuple[int, int], ...]
"""How a head slot keeps its tokens' bytes (:func:`~kvspec_traits.transfer.block_reads`'
``parts``)."""
SlotParts = Sequence[Sequence[tuple[int, int]] | None]
"""Per region of a plan, its :data:`Parts` (None: rows of token bytes)."""


@dataclass(frozen=True, slots=True)
class RatioRoute:
    """One lane of a region read between block sizes: the reader's blocks (ours for a
    read, the peer's for a write) hold ``reader_tokens``, the source's
    ``source_tokens``; ``phases[a % k]`` are the pieces of the reader's ``a``-th block,
    each ``(peer rank, our offset, the peer's offset, bytes, source block step)`` with
    the geometry of both sides."""

    name: str
    group_id: int
    num_blocks: int
    base: int
    stride: int
    write: bool
    reader_tokens: int
    source_tokens: int
    phases: tuple[tuple[tuple[int, int, int, int, int, int, int, int], ...], ...]
    """``(rank, our offset, peer's offset, bytes, q, peer's base, peer's stride, peer's
    block count)``."""
    groups: tuple[int, ...]
    """The groups whose blocks the lane moves (:func:`lane_groups`)."""
    may_be_tail: bool = False
    """Whether the region's pages keep fewer than all of a request's tokens (a window),
    so that a group's lists may be its tail (:func:`~kvspec_traits.transfer._blocks.
    place_tail`)."""


def ratio_route(
    plan: RegionPlan,
    region: Region,
    group: int,
    remote_tp: int,
    remote_regions: Mapping[int, Sequence[PeerRegion]],
    remote_tokens: int,
    *,
    write: bool,
    parts: Parts | None = None,
) -> RatioRoute:
    """The route of ``region``'s lane ``group`` against peers whose blocks hold
    ``remote_tokens`` tokens. Raises :class:`~kvspec_traits.transfer.
    UnsupportedLayoutError` where the region's blocks are not addressed by token."""
    local_tokens = region.block_sizes[0] if len(region.block_sizes) == 1 else 0
    phases: list[list[tuple[int, int, int, int, int, int, int, int]]] = []
    readers = [plan.tp_rank] if not write else sorted(remote_regions)
    for reader in readers:
        if write:  # the consumer's reads of our blocks, seen from here
            theirs = remote_regions[reader][region.index]
            viewed = replace(
                peer_view(
                    region, tp=plan.tp_size, peer_tp=remote_tp, peer_block_len=theirs.block_len
                ),
                block_sizes=(remote_tokens,),
            )
            got = block_reads(
                viewed, local_tp=remote_tp, local_rank=reader, remote_tp=plan.tp_size,
                local_tokens=remote_tokens, remote_tokens=local_tokens, parts=parts,
            )  # fmt: skip
        else:
            got = block_reads(
                region, local_tp=plan.tp_size, local_rank=plan.tp_rank, remote_tp=remote_tp,
                local_tokens=local_tokens, remote_tokens=remote_tokens, parts=parts,
            )  # fmt: skip
        while len(phases) < len(got):
            phases.append([])
        for phase, reads in enumerate(got):
            for r in reads:
                if write and r.remote_rank != plan.tp_rank:
                    continue
                rank = reader if write else r.remote_rank
                peer = remote_regions[rank][region.index]
                ours, peers = (
                    (r.remote_offset, r.local_offset)
                    if write
                    else (r.local_offset, r.remote_offset)
                )
                phases[phase].append(
                    (
                        rank,
                        ours,
                        peers,
                        r.length,
                        r.remote_block,
                        peer.base_addr,
                        peer.block_stride,
                        peer.num_blocks,
                    )
                )
    return RatioRoute(
        name=region.name,
        group_id=group,
        num_blocks=region.num_blocks,
        base=region.base_addr,
        stride=region.block_stride,
        write=write,
        reader_tokens=remote_tokens if write else local_tokens,
        source_tokens=local_tokens if write else remote_tokens,
        phases=tuple(tuple(p) for p in phases),
        groups=lane_groups(region, group),
        may_be_tail=any(scope is not TokenScope.FULL for scope in region.token_scopes),
    )


def reader_pairs(route: RatioRoute, readers: int, sources: int) -> None:
    """A request's lists pair at this ratio: ``sources`` blocks cover the tokens of
    ``readers`` blocks (:class:`BlockIdShapeError` otherwise)."""
    r, s = route.reader_tokens, route.source_tokens
    low = ((readers - 1) * r) // s + 1 if readers else 0
    high = -(-readers * r // s)
    if not low <= sources <= high:
        raise BlockIdShapeError(
            "both",
            readers,
            sources,
            f"region {route.name!r}: {readers} blocks of {r} tokens are covered by "
            f"{low}..{high} blocks of {s} tokens, not {sources}",
        )
