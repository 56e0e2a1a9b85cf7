"""A request's descriptors, as :meth:`TraitsNixlAgent.read_blocks` posts them (pure
numpy: no NIXL call here), so its whole per-request work can be timed on its own
(benchmarks/bench_descriptors.py).

``mode="merged"`` (the default) builds merged ``Nx3`` rows only where merging pays:
from the request's runs (``nixl/_runs.py``, ``O(blocks)`` per cache group) it knows
how many rows merging leaves before writing any; when that is more than
``1 / MERGE_PAYS`` of one descriptor per block and the peer has a prepared list this
request may use (one peer of our TP size: vLLM's path), it selects descriptor ids in
the prepared lists instead, which costs less per descriptor than a row (and goes
there without looking for runs when no row can take ``MERGE_PAYS`` blocks). Either way
the same bytes move.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy.typing as npt

from kvspec_traits.nixl._checked import checked_request, transfer_items_of
from kvspec_traits.nixl._descs import BlockIds, desc_index, request_pair
from kvspec_traits.nixl._errors import MissingPeerError
from kvspec_traits.nixl._items import (
    ReadCache,
    TransferItems,
)
from kvspec_traits.nixl._onerun import OneClassRuns, one_class_rows, one_class_runs
from kvspec_traits.nixl._peer import (
    DescMode,
    RemotePeer,
    check_prepped_rank,
    prepped_ids_of,
)
from kvspec_traits.nixl._runs import Runs, merged_rows, request_runs
from kvspec_traits.transfer import RegionPlan

__all__ = ["MERGE_MIN_DESCRIPTORS", "MERGE_PAYS", "RequestDescs", "request_descs"]

MERGE_PAYS: Final = 3
"""Merged mode writes ``Nx3`` rows when merging cuts the descriptors at least this many
times; otherwise it selects ids in the prepared lists. A row is ``2 x 3`` uint64
against ``2`` int32 ids and takes a few more numpy calls per cache group (about 0.1 ms
more per request; with runs of 8 blocks rows cost about what vLLM's ids do at 1,000
blocks per group and up: benchmarks/bench_descriptors.py), while NIXL posts and
completes a fraction of the descriptors (benchmarks/bench_nixl.py)."""

MERGE_MIN_DESCRIPTORS: Final = 16_384
"""Where a prepared list may be used, merged mode writes rows only for requests of at
least this many descriptors (one per block per region). Writing rows costs a request
about 20-30 us more than selecting ids whatever its size, while what fewer descriptors
save is per descriptor: raw NIXL over UCX on this host posted 147 rows and 1,024 ids in
the same CPU time (benchmarks/bench_nixl.py), and a NIC's work requests are saved only in
number. From 16,384 descriptors up (Llama-4's 60 regions at 256 blocks per group and
more) rows cost less than vLLM's own ids (benchmarks/bench_descriptors.py); below, the
prepared lists' ids do."""


@dataclass(frozen=True, slots=True)
class RequestDescs:
    """What one request posts: prepared-list descriptor ids (``local_ids`` and
    ``remote_ids``, into the peer's prepared list), or ``Nx3`` rows per remote rank."""

    local_ids: npt.NDArray[Any] | None
    remote_ids: npt.NDArray[Any] | None
    items: list[TransferItems]
    per_block: int
    nbytes: int

    @property
    def descriptors(self) -> int:
        if self.local_ids is not None:
            return int(self.local_ids.size)
        return sum(i.count for i in self.items)


def _prepped_peer(plan: RegionPlan, by_rank: Mapping[int, RemotePeer]) -> RemotePeer | None:
    """The one peer whose prepared list this request may select from, if any."""
    if len(by_rank) != 1:
        return None
    peer = next(iter(by_rank.values()))
    if peer.prepped is None or peer.meta.tp_size != plan.tp_size:
        return None
    try:
        check_prepped_rank(plan, peer)
    except MissingPeerError:
        return None
    return peer


def request_descs(
    plan: RegionPlan,
    by_rank: Mapping[int, RemotePeer],
    block_ids: BlockIds,
    remote_block_ids: BlockIds | None,
    mode: DescMode,
) -> RequestDescs:
    """Validate a request and build what ``read_blocks(mode=mode)`` posts for it
    (``by_rank``: the remote ranks by TP rank, checked by the caller). Raises the
    block-id errors and :class:`MissingPeerError` before anything is built."""
    lreq, rreq = request_pair(block_ids, remote_block_ids, plan.num_groups)
    if mode == "prepped":
        if len(by_rank) != 1 or next(iter(by_rank.values())).meta.tp_size != plan.tp_size:
            raise ValueError("mode='prepped' needs one peer of the same TP size")
        peer = next(iter(by_rank.values()))
        check_prepped_rank(plan, peer)
        local_ids, remote_ids, nbytes = prepped_ids_of(plan, peer, lreq, rreq)
        return RequestDescs(local_ids, remote_ids, [], int(local_ids.size), nbytes)
    first = next(iter(by_rank.values()))
    if first.reads is None:
        first.reads = ReadCache(plan, first.meta.tp_size, first.meta.regions)
    remotes = {rank: p.meta.regions for rank, p in by_rank.items()}
    if mode == "per_block":
        items = transfer_items_of(plan, remotes, lreq, rreq, first.reads)
        per_block = sum(i.count for i in items)
        return RequestDescs(None, None, items, per_block, sum(i.nbytes for i in items))
    prepped = _prepped_peer(plan, by_rank)
    index = desc_index(plan)
    # The most blocks one (region, read) row takes (a plan whose regions all take
    # every group's blocks reads them together).
    longest = max(g.size for g in lreq.groups) if index.mapped else lreq.all.size
    if (
        prepped is not None
        and longest > 0
        and (longest < MERGE_PAYS or index.count(lreq) < MERGE_MIN_DESCRIPTORS)
    ):
        # Every row keeps a run at least, so merging cannot cut MERGE_PAYS times; or the
        # request is too small for fewer descriptors to repay writing rows.
        local_ids, remote_ids, nbytes = prepped_ids_of(plan, prepped, lreq, rreq)
        return RequestDescs(local_ids, remote_ids, [], int(local_ids.size), nbytes)
    table, groups = checked_request(plan, remotes, lreq, rreq, first.reads)
    simple = one_class_runs(table, lreq, rreq)
    runs = request_runs(table, groups) if simple is None else None
    counted: OneClassRuns | Runs = simple or cast("Runs", runs)
    if prepped is not None and counted.count * MERGE_PAYS > counted.per_block:
        # The local ids were checked with the runs (bounds, distinct destinations).
        local_ids, remote_ids, nbytes = prepped_ids_of(
            plan, prepped, lreq, rreq, local_checked=True
        )
        return RequestDescs(local_ids, remote_ids, [], counted.per_block, nbytes)
    if simple is not None:
        return RequestDescs(None, None, one_class_rows(simple), simple.per_block, simple.nbytes)
    items = merged_rows(cast("Runs", runs))
    return RequestDescs(None, None, items, counted.per_block, sum(i.nbytes for i in items))
