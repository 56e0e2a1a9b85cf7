"""A NIXL agent that registers a :class:`RegionPlan` and reads a request's blocks.

The only module of the shim that touches NIXL. NIXL's Python API is untyped, so it is
held as ``Any`` here and nowhere else; ``nixl._api`` is imported when an agent is built.

Protocol (consumer pulls, as vLLM's NIXL connector does)::

    producer = TraitsNixlAgent(); producer.register_plan(plan_p); send(producer.metadata())
    consumer = TraitsNixlAgent(); consumer.register_plan(plan_d)
    peer = consumer.connect(received)        # decode + check_handshake, then add the agent
    consumer.read_blocks(peer, block_ids)    # bounded wait; raises, never half-marks
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvspec_traits._deps import needs
from kvspec_traits.nixl._descs import BlockIds, build_block_descs
from kvspec_traits.nixl._errors import MissingPeerError, TransferFailedError
from kvspec_traits.nixl._items import ReadCache, TransferItems
from kvspec_traits.nixl._peer import (
    DESC_MODES,
    DescMode,
    RemotePeer,
    TransferResult,
    plan_mem_type,
)
from kvspec_traits.nixl._register import deregister_all, register_ranges
from kvspec_traits.nixl._request import request_descs
from kvspec_traits.nixl._wire import (
    PeerMetadata,
    check_peer_layout,
    decode_metadata,
    encode_metadata,
)
from kvspec_traits.transfer import MalformedMetadataError, RegionPlan

__all__ = ["TraitsNixlAgent"]


@dataclass(slots=True)
class _Posted:
    handle: Any
    peer: str
    extra: list[Any] = field(default_factory=list)


class TraitsNixlAgent:
    """One NIXL agent with one registered plan.

    ``progress_thread=False`` (the default) saves the core NIXL's progress thread would
    spin; this agent then progresses in :meth:`read_blocks` and :meth:`poll_notifs`.
    Names default to a fresh uuid (NIXL refuses a reused name for a new agent).
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = False,
    ) -> None:
        with needs("TraitsNixlAgent (kvspec_traits.nixl)"):
            from nixl._api import nixl_agent, nixl_agent_config

        self.name = name if name is not None else f"kvspec-{uuid.uuid4().hex}"
        self._backends = list(backends)
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
        self._agent: Any = nixl_agent(self.name, config)
        self._plan: RegionPlan | None = None
        self._local_mem_type = ""
        self._reg_descs: list[Any] = []
        self._local_prepped: Any = None
        self._published = False
        self._peers: dict[str, RemotePeer] = {}
        self._notifs: dict[str, list[bytes]] = {}

    # -- registration ------------------------------------------------------------------

    @property
    def plan(self) -> RegionPlan:
        if self._plan is None:
            raise RuntimeError(f"agent {self.name}: call register_plan() first")
        return self._plan

    def register_plan(self, plan: RegionPlan) -> None:
        """Register every storage range of ``plan`` and prepare its strided descriptor
        list. Must precede :meth:`metadata`: memory registered after the metadata was
        taken is invisible to peers."""
        if self._published:
            raise RuntimeError(
                f"agent {self.name}: register_plan() after metadata() would register "
                f"memory its peers cannot see; build a new agent"
            )
        if self._plan is not None:
            raise RuntimeError(f"agent {self.name}: a plan is already registered")
        # Validate everything before NIXL or this agent changes: a refused plan leaves
        # the agent as it was (no memory registered, no plan).
        mem_type = plan_mem_type(plan)
        local_descs = build_block_descs(plan)
        register_ranges(self._agent, plan.registrations, self._backends, self._reg_descs)
        try:
            self._local_prepped = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", local_descs, mem_type=mem_type
            )
        except BaseException:
            deregister_all(self._agent, self._reg_descs, self._backends)
            raise
        self._plan = plan
        self._local_mem_type = mem_type

    def metadata(self) -> bytes:
        """The handshake message for peers (NIXL agent metadata + fingerprint +
        region geometry). Freezes registration."""
        plan = self.plan
        self._published = True
        return encode_metadata(plan, self.name, bytes(self._agent.get_agent_metadata()))

    # -- peers -------------------------------------------------------------------------

    def connect(self, peer_metadata: bytes) -> RemotePeer:
        """Decode a producer's metadata, check its layout against ours, and only then
        add it as a NIXL peer.

        Raises :class:`MalformedMetadataError` (bad or hostile bytes, region geometry
        its own fingerprint contradicts, a shifted or swapped region base, a region
        outside the memory range that holds its layers),
        :class:`HandshakeMismatchError` (a region differs) or
        :class:`MemoryTypeMismatchError` (a peer region on another memory type than
        ours) before NIXL learns of the peer, so nothing can be transferred from it.
        Checks that need NIXL (regions inside the peer's registered memory, its
        prepared list) run after the peer is added; if one fails, the peer is removed
        from NIXL again before the error propagates: a refused or failed connect leaves
        no peer behind.
        """
        meta = decode_metadata(peer_metadata)  # geometry checked against the fingerprint
        # The checks every backend runs (transfer.check_peer): handshake, geometry,
        # memory type region by region, each region inside its own registration.
        check_peer_layout(self.plan, meta)
        mem_type = self._local_mem_type
        if meta.agent_name in self._peers or meta.agent_name == self.name:
            raise MalformedMetadataError(
                f"agent {meta.agent_name!r} is already connected (or is this agent)"
            )
        try:
            added = self._agent.add_remote_agent(meta.agent_metadata)
        except Exception as exc:  # NIXL raises its own exception types for bad blobs
            raise MalformedMetadataError(f"NIXL refused the agent metadata: {exc}") from exc
        added_name = added.decode() if isinstance(added, bytes) else str(added)
        prepped: Any = None
        try:
            if added_name != meta.agent_name:
                raise MalformedMetadataError(
                    f"header names agent {meta.agent_name!r}, NIXL metadata is {added_name!r}"
                )
            self._check_registered(meta, mem_type)
            peer = RemotePeer(
                meta, mem_type=mem_type, reads=ReadCache(self.plan, meta.tp_size, meta.regions)
            )
            if meta.tp_size == self.plan.tp_size:
                try:
                    prepped = self._agent.prep_xfer_dlist(
                        meta.agent_name, build_block_descs(meta.regions), mem_type=mem_type
                    )
                except Exception as exc:
                    raise MalformedMetadataError(
                        f"NIXL refused the peer's region descriptors: {exc}"
                    ) from exc
                peer.prepped = prepped
        except BaseException:
            # Refused or failed: NIXL forgets the peer, so nothing can name it.
            if prepped is not None:
                with contextlib.suppress(Exception):
                    self._agent.release_dlist_handle(prepped)
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(added_name)
            raise
        self._peers[meta.agent_name] = peer
        return peer

    def _check_registered(self, meta: PeerMetadata, mem_type: str) -> None:
        """Every byte of every peer region lies in memory the peer registered with
        NIXL (as its agent metadata tells NIXL)."""
        extents = [
            (r.base_addr, r.block_stride * (r.num_blocks - 1) + r.block_len, r.device_id)
            for r in meta.regions
        ]
        try:
            known = bool(
                self._agent.check_remote_metadata(
                    meta.agent_name, self._agent.get_xfer_descs(extents, mem_type)
                )
            )
        except Exception as exc:
            raise MalformedMetadataError(f"NIXL could not check the peer's regions: {exc}") from exc
        if not known:
            raise MalformedMetadataError(
                f"peer {meta.agent_name}'s regions reach outside the memory it registered with NIXL"
            )

    def knows(self, agent_name: str) -> bool:
        """Whether NIXL holds metadata of ``agent_name`` (i.e. could transfer with it)."""
        return bool(self._agent.check_remote_metadata(agent_name))

    # -- transfers ---------------------------------------------------------------------

    def read_blocks(
        self,
        peers: RemotePeer | Mapping[int, RemotePeer],
        block_ids: BlockIds,
        remote_block_ids: BlockIds | None = None,
        *,
        mode: DescMode = "merged",
        timeout: float = 30.0,
        notify: bytes = b"",
        progress: Callable[[], object] | None = None,
    ) -> TransferResult:
        """Read the blocks of one request into ours and wait (at most ``timeout`` s).

        ``peers`` is one peer of the same TP size, or the remote ranks by TP rank
        (heterogeneous TP: replicated regions come from one rank, head-sharded ones are
        split or gathered by heads). ``block_ids`` are local ids (one list, or one per
        cache group); ``remote_block_ids`` the peer's (default: the same).

        Without progress threads a peer in this process must be progressed too: pass
        ``progress=producer.progress``; a peer in another process progresses itself
        (:meth:`serve`).

        Returns only when every descriptor is DONE; raises
        :class:`TransferFailedError` on a NIXL error, a lost peer or the timeout, and
        :class:`MissingPeerError` before posting anything when a region needs a remote
        rank that ``peers`` lacks (in ``"prepped"`` mode: a peer of another TP rank,
        unless every region is replicated).
        """
        if mode not in DESC_MODES:
            raise ValueError(
                f"unknown mode {mode!r}; valid modes: {', '.join(repr(m) for m in DESC_MODES)}"
            )
        by_rank = {peers.tp_rank: peers} if isinstance(peers, RemotePeer) else dict(peers)
        if not by_rank:
            raise ValueError("read_blocks needs at least one peer")
        remote_tp = next(iter(by_rank.values())).meta.tp_size
        for rank, peer in by_rank.items():
            if peer.meta.tp_rank != rank or peer.meta.tp_size != remote_tp:
                # The rank the key names was not given: the peer under it is another.
                raise MissingPeerError(
                    None,
                    rank,
                    sorted(p.meta.tp_rank for p in by_rank.values()),
                    f": peer {peer.name} is TP rank {peer.meta.tp_rank} of "
                    f"{peer.meta.tp_size}, passed as rank {rank} of {remote_tp}",
                )
        start = time.perf_counter()
        posted: list[_Posted] = []
        try:
            descs = request_descs(self.plan, by_rank, block_ids, remote_block_ids, mode)
            ids = (descs.local_ids, descs.remote_ids)
            # An empty request moves nothing, as in the other modes (NIXL refuses an empty
            # prepared transfer with NIXL_ERR_INVALID_PARAM).
            if ids[0] is not None and ids[1] is not None and ids[0].size:
                peer = next(iter(by_rank.values()))
                handle = self._make_prepped(peer, ids[0], ids[1], notify)
                posted.append(_Posted(handle, peer.name))
            for items in descs.items:
                posted.append(self._post_items(by_rank[items.remote_rank], items, notify))
            for p in posted:
                state = self._checked(self._agent.transfer, p.handle)
                if state == "ERR":
                    raise TransferFailedError(f"posting a read from {p.peer} failed", "ERR")
            self._wait(posted, start + timeout, progress)
        except BaseException:
            self._release(posted)
            raise
        self._release(posted)
        return TransferResult(
            descriptors=descs.descriptors,
            per_block_descriptors=descs.per_block,
            nbytes=descs.nbytes,
            seconds=time.perf_counter() - start,
        )

    def _make_prepped(
        self,
        peer: RemotePeer,
        local_ids: npt.NDArray[Any],
        remote_ids: npt.NDArray[Any],
        notify: bytes,
    ) -> Any:
        if peer.prepped is None:
            raise ValueError(f"peer {peer.name} has no prepared descriptor list")
        return self._checked(
            self._agent.make_prepped_xfer,
            "READ",
            self._local_prepped,
            local_ids.astype(np.int32, copy=False),
            peer.prepped,
            remote_ids.astype(np.int32, copy=False),
            notify,
        )

    def _post_items(self, peer: RemotePeer, items: TransferItems, notify: bytes) -> _Posted:
        local = self._agent.get_xfer_descs(np.ascontiguousarray(items.local), self._local_mem_type)
        remote = self._agent.get_xfer_descs(np.ascontiguousarray(items.remote), peer.mem_type)
        handle = self._checked(
            self._agent.initialize_xfer, "READ", local, remote, peer.name, notify
        )
        return _Posted(handle, peer.name)

    def _checked(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except TransferFailedError:
            raise
        except Exception as exc:
            raise TransferFailedError(
                f"NIXL {getattr(fn, '__name__', fn)} failed: {exc}", str(exc)
            ) from exc

    def _wait(
        self, posted: list[_Posted], deadline: float, progress: Callable[[], object] | None
    ) -> None:
        # Runs per poll for the whole read: NIXL's errors are wrapped as _checked does,
        # but inline (a try costs nothing until it raises), and the calls are bound here.
        check, clock, pending, polls = self._agent.check_xfer_state, time.perf_counter, posted, 0
        while pending:
            if progress is not None:
                progress()
            polls += 1
            if polls > 1000:  # past the first ~ms, stop spinning a shared core
                time.sleep(50e-6)
            still = []
            for p in pending:
                try:
                    state = check(p.handle)
                except Exception as exc:
                    raise TransferFailedError(
                        f"NIXL check_xfer_state failed: {exc}", str(exc)
                    ) from exc
                if state == "ERR":
                    raise TransferFailedError(f"read from {p.peer} failed", "ERR")
                if state != "DONE":
                    still.append(p)
            pending = still
            if pending and clock() > deadline:
                raise TransferFailedError(
                    f"read from {[p.peer for p in pending]} not done by the deadline", "PROC"
                )

    def _release(self, posted: list[_Posted]) -> None:
        for p in posted:
            # An in-flight handle NIXL cannot cancel is freed with the agent.
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(p.handle)

    # -- notifications, teardown -------------------------------------------------------

    def progress(self) -> None:
        """Progress this agent once (a producer without a progress thread must be
        progressed for its peers' reads to complete); notifications are kept for
        :meth:`poll_notifs`."""
        for sender, messages in self._agent.get_new_notifs().items():
            key = sender.decode() if isinstance(sender, bytes) else str(sender)
            self._notifs.setdefault(key, []).extend(messages)

    def poll_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received so far, by sender, and forget them."""
        self.progress()
        out, self._notifs = self._notifs, {}
        return out

    def serve(
        self, until: Callable[[dict[str, list[bytes]]], bool], timeout: float
    ) -> dict[str, list[bytes]]:
        """Progress until ``until(notifications so far)`` is true; ``TimeoutError``
        after ``timeout`` seconds. What a producer process runs while peers read."""
        deadline = time.monotonic() + timeout
        seen: dict[str, list[bytes]] = {}
        while True:
            for sender, messages in self.poll_notifs().items():
                seen.setdefault(sender, []).extend(messages)
            if until(seen):
                return seen
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent {self.name}: not done after {timeout} s")
            time.sleep(0.0002)

    def send_notif(self, peer: str, message: bytes) -> None:
        self._agent.send_notif(peer, message)

    def close(self) -> None:
        """Release descriptor lists, forget peers and deregister memory."""
        for peer in self._peers.values():
            if peer.prepped is not None:
                self._agent.release_dlist_handle(peer.prepped)
            with contextlib.suppress(Exception):  # a peer that is already gone
                self._agent.remove_remote_agent(peer.name)
        self._peers.clear()
        if self._local_prepped is not None:
            self._agent.release_dlist_handle(self._local_prepped)
            self._local_prepped = None
        for descs in self._reg_descs:
            self._agent.deregister_memory(descs, backends=self._backends)
        self._reg_descs.clear()

    def __enter__(self) -> TraitsNixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
