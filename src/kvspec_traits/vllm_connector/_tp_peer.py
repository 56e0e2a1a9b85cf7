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
from kvspec_traits.nixl._items import ReadCache, ReadTable
from kvspec_traits.nixl._tp_tables import TPTable, TPWrites, request_ids, tp_table, tp_writes
from kvspec_traits.transfer import PeerRegion, RegionPlan, UnsupportedLayoutError
from kvspec_traits.vllm_connector._fields import peer_regions_of
from kvspec_traits.vllm_connector._log import logger
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME
from kvspec_traits.vllm_connector._reads import post_reads

__all__ = ["TPConsumer", "TPPeer", "read_tp_request", "reads_tp_peer", "write_tp_request"]


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
                _release(worker, handle)


@dataclass
class TPConsumer:
    """A push consumer engine of another TP size whose blocks hold our token counts:
    per handshaken consumer rank, what this rank writes into it (its reads of us,
    planned from its side, :func:`~kvspec_traits.nixl._tp_tables.tp_writes`) and the
    lists prepared for it (ours, its)."""

    plan: RegionPlan
    remote_tp: int
    writes: dict[int, tuple[TPWrites, int | None, int | None]] = field(default_factory=dict)
    remote_blocks_per_logical: int = 1
    unread: set[int] | None = None
    """The consumer ranks not handshaken that would read from this rank (checked once
    on the first request: each would miss its bytes)."""
    stand_in: list[PeerRegion] | None = None
    """A handshaken consumer rank's regions (every rank's geometry is the same)."""

    def keep_rank(self, worker: Any, rank: int, metadata: Any, agent_name: str) -> None:
        """Keep consumer rank ``rank`` (its NIXL agent ``agent_name``)."""
        self.remote_blocks_per_logical = int(metadata.physical_blocks_per_logical_kv_block or 1)
        regions = peer_regions_of(metadata)
        self.stand_in = self.stand_in or regions
        writes = tp_writes(self.plan, self.remote_tp, rank, regions)
        ours = theirs = None
        if writes.table.local.size:
            agent = worker.nixl_wrapper
            mem = {r.mem_type for r in writes.reader.regions}
            ours = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                agent.get_xfer_descs(writes.table.remote, worker.nixl_memory_type),
            )
            theirs = agent.prep_xfer_dlist(
                agent_name, agent.get_xfer_descs(writes.table.local, mem.pop())
            )
        self.release(worker, rank)
        self.writes[rank] = (writes, ours, theirs)
        self.unread = None

    def release(self, worker: Any, rank: int | None = None) -> None:
        """Release the prepared lists of ``rank`` (every rank's: ``None``)."""
        for key in list(self.writes) if rank is None else [rank]:
            kept = self.writes.pop(key, None)
            for handle in kept[1:] if kept is not None else ():
                if handle is not None:
                    _release(worker, handle)

    def check_every_reader(self) -> None:
        """Refuse (:class:`~kvspec_traits.transfer.UnsupportedLayoutError`) where a
        consumer rank vLLM did not hand this rank would read from it (a handshaken
        rank's regions standing in for its own)."""
        if self.unread is None:
            some = self.stand_in or []
            self.unread = {
                rank
                for rank in range(self.remote_tp)
                if rank not in self.writes
                and tp_writes(self.plan, self.remote_tp, rank, some).table.local.size
            }
        if self.unread:
            name = self.plan.regions[0].name if self.plan.regions else "(none)"
            raise UnsupportedLayoutError(
                name,
                f"consumer ranks {sorted(self.unread)} read from rank {self.plan.tp_rank}, "
                f"which vLLM's push mapping does not hand them (only ranks "
                f"{sorted(self.writes)}); run prefill and decode with the same TP size",
            )


def _release(worker: Any, handle: int) -> None:
    try:
        worker.nixl_wrapper.release_dlist_handle(handle)
    except Exception as err:  # NIXL's untyped errors: a handle already gone
        logger.debug("%s: dlist %s not released: %r", CONNECTOR_NAME, handle, err)


def reads_tp_peer(
    worker: Any, metadata: Any, remote_tp: int, remote_dcp: int, plan: RegionPlan | None
) -> bool:
    """Whether the connector reads (pull) or writes (push) peer ``metadata`` (of
    ``remote_tp`` ranks) itself: a peer of another TP size whose regions pair with ours
    one to one and whose blocks split into as many kernel blocks as ours, with neither
    pipeline nor decode-context parallelism, nor a host buffer or mixed memory types on
    this side.
    The rest is vLLM's path: a hybrid whose state page follows the TP size splits its
    blocks into other kernel-block counts on the two sides, and vLLM addresses its
    state slots and kernel pages in those regions by per-side rules the plan does not
    hold."""
    return (
        plan is not None
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
            worker.physical_blocks_per_logical_kv_block,
            peer.remote_blocks_per_logical,
        )
        tables = [table for table, _, _ in peer.tables.values()]
        ids = request_ids(plan, peer.ranks, local, remote, peer.reads, tables)
    except KVSpecTraitsError as err:
        logger.error("%s: request %s not read: %s", CONNECTOR_NAME, req_id, err)
        worker.fail_read(req_id)
        return
    agent = worker.nixl_wrapper

    def make(rank: int, name: str, notif: bytes) -> int:
        _, local_handle, remote_handle = peer.tables[rank]
        local_ids, remote_ids = ids[rank]
        handle: int = agent.make_prepped_xfer(
            "READ", local_handle, local_ids, remote_handle, remote_ids, notif_msg=notif
        )
        return handle

    post_reads(worker, req_id, meta, ids.keys(), make)


def write_tp_request(worker: Any, peer: TPConsumer, meta: Any, handles: list[int]) -> None:
    """Write one request (vLLM's push ``ReqMeta``: our blocks, the consumer's registered
    ones) into ``peer``: per handshaken consumer rank, what it would read from this
    rank, one NIXL WRITE carrying vLLM's completion notification, which a rank this one
    writes nothing to gets alone (vLLM's consumer counts one per producer rank). Each
    WRITE posted is appended to ``handles`` at once. Ids that do not pair, and a
    consumer rank vLLM's mapping leaves out that would read from this rank
    (:class:`~kvspec_traits.KVSpecTraitsError`), raise before any WRITE is posted."""
    peer.check_every_reader()
    theirs, ours = worker.pair_uncomputed(
        worker.logical_to_kernel_block_ids(meta.remote.block_ids, peer.remote_blocks_per_logical),
        meta.local_physical_block_ids,
        peer.remote_blocks_per_logical,
        worker.physical_blocks_per_logical_kv_block,
    )
    ids = {rank: writes.ids(theirs, ours) for rank, (writes, _, _) in peer.writes.items()}
    notif = f"{meta.remote.request_id}:{worker.world_size}".encode()
    agent = worker.nixl_wrapper
    for (_, rank), name in sorted(worker.remote_agents[meta.remote.engine_id].items()):
        got = ids.get(rank)
        if got is None or not got[0].size:
            agent.send_notif(name, notif_msg=notif)
            continue
        _, ours_handle, theirs_handle = peer.writes[rank]
        their_ids, our_ids = got
        handle = agent.make_prepped_xfer(
            "WRITE", ours_handle, our_ids, theirs_handle, their_ids, notif_msg=notif
        )
        handles.append(handle)
        agent.transfer(handle)
