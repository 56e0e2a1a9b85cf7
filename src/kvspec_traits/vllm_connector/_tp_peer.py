"""Peers of another TP size at this worker's block size (issue 47): which remote rank
each byte of a request's blocks is read from is the planner's answer
(:func:`~kvspec_traits.transfer.tp_reads`, bucketed per cache group by the NIXL shim's
read table), the one the shim and the Mooncake backend apply: head-sharded pages split
or gathered by heads, replicas of fewer KV heads than ranks read from the first rank
holding them, replicated pages whole from one rank, TP-sharded recurrent states run by
run (their ``tp_split``), each group's blocks in the regions of its own layers only.

As vLLM does for its own split reads, each remote rank's descriptors (every block of
every (region, read) on both sides, :mod:`kvspec_traits.nixl._tp_tables`) are prepared
once, when the rank is handshaken; a request names descriptor ids
(``make_prepped_xfer``). vLLM keeps its bookkeeping of the peer (agents, TP mapping,
the notifications each producer rank expects, failure paths); its own descriptors for
the peer are built but not read from. Which of a request's blocks are read (the
uncomputed suffix a prefix-cache hit leaves, a state's slots) is vLLM's pairing rule
(``_apply_prefix_caching``, through the seam): the scheduler's contract, not a TP
decision. Peers at this worker's TP size, peers whose blocks split into other
kernel-block counts, and pairs with pipeline or decode-context parallelism, a host
buffer or mixed memory types, are read by vLLM's path (:func:`reads_tp_peer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvspec_traits._errors import KVSpecTraitsError
from kvspec_traits.nixl._checked import checked_request
from kvspec_traits.nixl._descs import Request
from kvspec_traits.nixl._items import ReadCache, ReadTable
from kvspec_traits.nixl._tp_tables import TPTable, tp_table, tp_table_ids
from kvspec_traits.transfer import PeerRegion, RegionPlan
from kvspec_traits.vllm_connector._fields import peer_regions_of
from kvspec_traits.vllm_connector._log import logger
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME
from kvspec_traits.vllm_connector._reads import post_reads

__all__ = ["TPPeer", "read_tp_request", "reads_tp_peer"]


@dataclass
class TPPeer:
    """A producer engine of another TP size whose blocks hold our token counts."""

    plan: RegionPlan
    remote_tp: int
    reads: ReadCache
    """The planner's reads of each region against the peer (its first rank's block
    lengths checked against ours), kept across requests."""
    ranks: dict[int, list[PeerRegion]] = field(default_factory=dict)
    """Each handshaken remote rank's regions, as its metadata placed them."""
    tables: dict[int, tuple[TPTable, int, int]] = field(default_factory=dict)
    """Per handshaken rank read from: its lists and their prepared NIXL handles
    (local, remote)."""
    remote_blocks_per_logical: int = 1

    @classmethod
    def of(cls, plan: RegionPlan, remote_tp: int, metadata: Any) -> TPPeer:
        """The peer whose first handshaken rank sent ``metadata``."""
        return cls(plan, remote_tp, ReadCache(plan, remote_tp, peer_regions_of(metadata)))

    def keep_rank(self, worker: Any, rank: int, metadata: Any, agent_name: str) -> None:
        """Keep remote rank ``rank`` (its NIXL agent ``agent_name``): its regions, and
        its lists prepared with ``worker``'s agent where this rank reads from it."""
        regions = self.ranks[rank] = peer_regions_of(metadata)
        self.remote_blocks_per_logical = int(metadata.physical_blocks_per_logical_kv_block or 1)
        table = tp_table(
            self.plan, ReadTable(self.plan, {rank: regions}, self.reads), rank, regions
        )
        if not table.local.size:
            return
        agent = worker.nixl_wrapper
        mem = {r.mem_type for r in regions}
        local = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", agent.get_xfer_descs(table.local, worker.nixl_memory_type)
        )
        remote = agent.prep_xfer_dlist(agent_name, agent.get_xfer_descs(table.remote, mem.pop()))
        self.release(worker, rank)
        self.tables[rank] = (table, local, remote)

    def release(self, worker: Any, rank: int | None = None) -> None:
        """Release the prepared lists of ``rank`` (every rank's: ``None``)."""
        for key in list(self.tables) if rank is None else [rank]:
            kept = self.tables.pop(key, None)
            if kept is None:
                continue
            for handle in kept[1:]:
                try:
                    worker.nixl_wrapper.release_dlist_handle(handle)
                except Exception as err:  # NIXL's untyped errors: a handle already gone
                    logger.debug("%s: dlist %s not released: %r", CONNECTOR_NAME, handle, err)


def reads_tp_peer(
    worker: Any, metadata: Any, remote_tp: int, remote_dcp: int, plan: RegionPlan | None
) -> bool:
    """Whether the connector reads peer ``metadata`` (of ``remote_tp`` ranks) itself: a
    pull worker's peer of another TP size whose regions pair with ours one to one and
    whose blocks split into as many kernel blocks as ours, with neither pipeline nor
    decode-context parallelism, nor a host buffer or mixed memory types on this side.
    The rest is vLLM's path: a hybrid whose state page follows the TP size splits its
    blocks into other kernel-block counts on the two sides, and vLLM addresses its
    state slots and kernel pages in those regions by per-side rules the plan does not
    hold."""
    return (
        plan is not None
        and worker.transfer_mode == "pull"
        and remote_tp != plan.tp_size
        and int(metadata.physical_blocks_per_logical_kv_block or 1)
        == worker.physical_blocks_per_logical_kv_block
        and worker.pp_size == 1
        and worker.dcp_size == 1
        and remote_dcp == 1
        and not worker.use_host_buffer
        and not worker.mixed_mem_types
        and len(metadata.kv_caches_base_addr) == len(plan.regions)
        and list(metadata.region_group_ids or plan.region_group_ids) == plan.region_group_ids
    )


def read_tp_request(worker: Any, peer: TPPeer, req_id: str, meta: Any) -> None:
    """Read request ``req_id`` (vLLM's ``ReqMeta``, some local blocks to fill) from
    ``peer``: the uncomputed blocks vLLM pairs with the peer's, each filled from the
    remote ranks the planner names. Ids that do not pair or lie outside a region, a
    region that cannot move, a rank the planner needs that was not handshaken
    (:class:`~kvspec_traits.KVSpecTraitsError`, each named) and a read NIXL refuses
    fail the request through vLLM's failed-read path, before any byte moves."""
    worker.engine_last_active[meta.remote.engine_id] = time.perf_counter()
    worker.recving_transfers.setdefault(req_id, [])
    plan = peer.plan
    try:
        local, remote = worker.pair_uncomputed(
            meta.local_physical_block_ids,
            worker.logical_to_kernel_block_ids(
                meta.remote.block_ids, peer.remote_blocks_per_logical
            ),
            peer.remote_blocks_per_logical,
        )
        _, groups = checked_request(
            plan,
            peer.ranks,
            Request(local, plan.num_groups, "local"),
            Request(remote, plan.num_groups, "remote"),
            peer.reads,
        )
    except KVSpecTraitsError as err:
        logger.error("%s: request %s not read: %s", CONNECTOR_NAME, req_id, err)
        worker.fail_read(req_id)
        return
    ids = tp_table_ids([table for table, _, _ in peer.tables.values()], groups)
    agent = worker.nixl_wrapper

    def make(rank: int, name: str, notif: bytes) -> int:
        _, local_handle, remote_handle = peer.tables[rank]
        local_ids, remote_ids = ids[rank]
        handle: int = agent.make_prepped_xfer(
            "READ", local_handle, local_ids, remote_handle, remote_ids, notif_msg=notif
        )
        return handle

    post_reads(worker, req_id, meta, ids.keys(), make)
