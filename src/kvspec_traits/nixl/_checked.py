"""A request checked against a peer's read table, and its rows written from it:
:func:`checked_request` validates the block ids (paired lengths, bounds on both sides,
distinct destinations, every region it touches able to move) before anything is built,
and :func:`transfer_items_of` writes one row per block and (region, read), group by group
into one array per remote rank and side (what :func:`~kvspec_traits.nixl._items.merge_runs`
then merges; the merged paths are :mod:`~kvspec_traits.nixl._runs` and
:mod:`~kvspec_traits.nixl._onerun`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvspec_traits.nixl._descs import U64, BlockIds, Request, desc_index
from kvspec_traits.nixl._items import (
    Groups,
    ReadCache,
    ReadTable,
    TransferItems,
    _Bucket,
    check_lengths,
    read_table,
)
from kvspec_traits.transfer import PeerRegion, RegionPlan
from kvspec_traits.transfer._blocks import check_block_range

__all__ = ["checked_request", "transfer_items", "transfer_items_of"]


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
    request = Request(local_block_ids, local.num_groups, "local")
    return transfer_items_of(
        local,
        remotes,
        request,
        request
        if remote_block_ids is None
        else Request(remote_block_ids, local.num_groups, "remote"),
        ReadCache(local, remote_tp, next(iter(remotes.values()), None)),
    )


def checked_request(
    local: RegionPlan,
    remotes: Mapping[int, Sequence[PeerRegion]],
    lreq: Request,
    rreq: Request,
    reads: ReadCache,
) -> tuple[ReadTable, Groups]:
    """Validate a request against the plan and the remote ranks (one list per group of
    paired lengths, bounds on both sides, distinct destinations, every region it
    touches able to move) before anything is built; the peer's read table and the
    request's ids per bucket key."""
    check_lengths(lreq, rreq)
    desc_index(local).check(lreq, "local")  # bounds, then distinct destinations
    table = read_table(local, remotes, reads)
    groups = (
        [(lreq.all, rreq.all)]
        if not table.mapped
        else list(zip(lreq.groups, rreq.groups, strict=True))
    )
    for key, (lblocks, _) in enumerate(groups):
        if not lblocks.size:
            continue
        error = table.errors[key]
        if error is not None:
            raise error
        bounds = rreq.bounds(key if table.mapped else -1)
        for rank, bucket in table.buckets[key].items():
            check_block_range(
                bounds,
                bucket.count_limit,
                (
                    (local.regions[i].name, remotes[rank][i].num_blocks)
                    for i in bucket.regions.tolist()
                ),
                "remote",
            )
    return table, groups


def transfer_items_of(
    local: RegionPlan,
    remotes: Mapping[int, Sequence[PeerRegion]],
    lreq: Request,
    rreq: Request,
    reads: ReadCache,
) -> list[TransferItems]:
    """:func:`transfer_items` with the request's ids converted and the TP reads of
    the peer kept across requests: validated first (:func:`checked_request`), then
    rows written group by group and rank by rank into one array per rank and side."""
    table, groups = checked_request(local, remotes, lreq, rreq, reads)
    sizes: dict[int, int] = {}
    for key, (lblocks, _) in enumerate(groups):
        if lblocks.size:
            for rank, bucket in table.buckets[key].items():
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
