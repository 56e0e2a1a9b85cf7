"""Push mode (WRITE from prefill to decode): vLLM's ``NixlPushConnector`` and its worker
with the layout decisions of the pull connector's.

The worker is vLLM's push worker over :class:`TraitsWorkerBase`, the class the pull
worker is built on: regions planned, registered and fingerprinted from the same
:class:`~kvspec_traits.transfer.RegionPlan`, the peer's fingerprint and region geometry
checked inside vLLM's handshake. Push handshakes both ways before a byte moves: the
decode side with the prefill side before it sends its block registration (``PUSH_REG``),
the prefill side with the decode side before its first WRITE. Either side refuses a peer
whose layout differs, so a refused pair writes nothing. The writer thread, the
registration matching, the WRITE descriptors (ids from the planned regions by vLLM's
unchanged descriptor-id code) and the notifications are upstream's.

A consumer whose blocks hold other token counts (issue 48) is written by the
connector: each consumer rank gets what it would read from this rank between the two
block sizes (:func:`~._ratio_peer.write_request`, planned by
:func:`~kvspec_traits.transfer.block_reads` from the consumer's side), where its
scheduler's registration says its lists start
(:data:`~._ratio_peer.RATIO_REGISTRATION_KEY`); vLLM's bookkeeping of the peer sees it
at our block size, as in pull mode. A consumer of another TP size at our block size is
written by the connector too: each consumer rank gets its reads of this rank, planned
from its side (:func:`~._tp_peer.write_tp_request`, the planner's ``tp_reads``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPushConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)

from kvspec_traits._registry import Registry
from kvspec_traits.vllm_connector._connector import TraitsWorkerBase
from kvspec_traits.vllm_connector._gate import check_vllm_version
from kvspec_traits.vllm_connector._handshake import other_block_sizes
from kvspec_traits.vllm_connector._log import logger
from kvspec_traits.vllm_connector._names import PUSH_CONNECTOR_NAME
from kvspec_traits.vllm_connector._options import ConnectorOptions, connector_options
from kvspec_traits.vllm_connector._ratio_peer import (
    RATIO_REGISTRATION_KEY,
    at_our_block_size,
    write_request,
)
from kvspec_traits.vllm_connector._scheduler import TraitsNixlPushConnectorScheduler
from kvspec_traits.vllm_connector._seam import SeamPushWorker
from kvspec_traits.vllm_connector._shm_wait import holding_shm_wait, release_shm_wait
from kvspec_traits.vllm_connector._stats import TraitsStatsConnector
from kvspec_traits.vllm_connector._tp_peer import write_tp_request

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["TraitsNixlPushConnector", "TraitsNixlPushConnectorWorker"]


class TraitsNixlPushConnectorWorker(SeamPushWorker, TraitsWorkerBase):
    """vLLM's push-mode NIXL worker with its layout decisions taken from traits.

    Upstream's push worker comes first in the MRO, so its ``register_kv_caches`` (the
    writer thread, its mixed-memory refusal) wraps the traits registration, and its
    ``__init__`` runs the traits worker's (layout facts before vLLM's block-size sync).
    Upstream's peer checks (0.34: identical block sizes, after its ``super()`` call) run
    before the fingerprint check, as in the pull worker (:class:`~._seam.SeamPushWorker`):
    a pair upstream refuses is refused with upstream's error.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        *,
        registry: Registry | None = None,
        options: ConnectorOptions | None = None,
    ) -> None:
        # Read by TraitsWorkerBase.__init__, which upstream's calls without them.
        if registry is not None:
            self._traits_registry = registry
        self.options = options or connector_options(vllm_config, mode="push")
        super().__init__(vllm_config, engine_id, kv_cache_config)

    # -- consumers of another block size (._ratio_peer) -----------------------------------

    def ratio_view(self, agent_metadata: NixlAgentMetadata) -> NixlAgentMetadata | None:
        # vLLM 0.34 refuses any peer of another block size (its push worker's check):
        # one the plan serves is checked by the fingerprint first, then by vLLM at ours.
        if not other_block_sizes(self.region_plan, agent_metadata):
            return None
        self.check_remote_fingerprint(agent_metadata)
        return self.at_our_block_size(agent_metadata)

    def at_our_block_size(self, agent_metadata: NixlAgentMetadata) -> NixlAgentMetadata | None:
        peer = self._ratio_peers().get(agent_metadata.engine_id)
        if peer is None:
            return None
        view: NixlAgentMetadata = at_our_block_size(
            agent_metadata, peer, self.block_size, self.physical_blocks_per_logical_kv_block
        )
        return view

    def shutdown(self) -> None:
        """vLLM's push worker's shutdown, after releasing the lists prepared for
        consumers of another TP size."""
        self.release_tp_peers()
        super().shutdown()

    def start_push(
        self,
        request_id: str,
        local_block_ids: Any,
        registration: dict[str, Any],
        upstream: Callable[[str, Any, dict[str, Any]], None],
    ) -> None:
        # Kept for the WRITE that follows (here, or once the handshake is done).
        ratio = registration.get(RATIO_REGISTRATION_KEY)
        self.__dict__.setdefault("_kvspec_ratio_registrations", {})[request_id] = ratio
        upstream(request_id, local_block_ids, registration)

    def write_blocks_for_req(
        self, req_id: str, meta: Any, upstream: Callable[[str, Any], None]
    ) -> None:
        peer = self._ratio_peers().get(meta.remote.engine_id)
        placement = self.__dict__.get("_kvspec_ratio_registrations", {}).pop(req_id, None)
        consumer = self._tp_consumers().get(meta.remote.engine_id)
        if peer is None and consumer is None:
            upstream(req_id, meta)
            return
        handles: list[int] = []
        try:
            if peer is not None:
                write_request(self, peer, meta, placement, handles)
            elif consumer is not None:  # another TP size: its ranks' reads of us
                write_tp_request(self, consumer, meta, handles)
        except Exception as err:  # ids that do not pair, or NIXL's untyped errors
            # vLLM's failed-WRITE bookkeeping: never reported sent; the lease frees it.
            logger.error("%s: request %s not written: %r", PUSH_CONNECTOR_NAME, req_id, err)
            with self.sending_transfers_lock:
                self.send_failures.add(req_id)
        # All of the request's WRITEs at once, as vLLM publishes them (none: the
        # request is done at the next poll, its notifications sent).
        with self.sending_transfers_lock:
            self.sending_transfers.setdefault(req_id, []).extend(handles)


class TraitsNixlPushConnector(TraitsStatsConnector, NixlPushConnector):
    """vLLM's ``NixlPushConnector`` whose worker plans regions from traits.

    Turned on as upstream's is, by the connector name: ``"kv_connector":
    "TraitsNixlPushConnector"`` where upstream reads ``"NixlPushConnector"``, every other
    key unchanged. Refuses on a vLLM outside the supported series. ``options`` are the
    ``kv_connector_extra_config`` keys read (``TraitsNixlConnector`` gives them when
    ``transfer_mode`` makes it build this one); without them, read here, push by name
    (the key ``transfer_mode`` unread, as by upstream's ``NixlPushConnector``).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        *,
        options: ConnectorOptions | None = None,
    ) -> None:
        check_vllm_version()
        # Every key read and checked at once, before an agent exists.
        self.options = options or connector_options(vllm_config, mode="push")
        # Before this process waits on a queue; let go in shutdown (below).
        with holding_shm_wait(self.options.shm_wait, self):
            # NixlPushConnector.__init__ would build upstream's worker (a NIXL agent)
            # first: its base's constructor and its one push check, then ours.
            NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
            if vllm_config.parallel_config.decode_context_parallel_size > 1:
                raise ValueError(
                    f"{PUSH_CONNECTOR_NAME} (as NixlPushConnector) does not support "
                    f"decode_context_parallel_size > 1; run the pull connector for DCP"
                )
            self.connector_scheduler: NixlPushConnectorScheduler | None = None
            self.connector_worker: NixlPushConnectorWorker | None = None
            if role == KVConnectorRole.SCHEDULER:
                self.connector_scheduler = TraitsNixlPushConnectorScheduler(
                    vllm_config, self.engine_id, kv_cache_config
                )
            elif role == KVConnectorRole.WORKER:
                self.connector_worker = TraitsNixlPushConnectorWorker(
                    vllm_config, self.engine_id, kv_cache_config, options=self.options
                )
            else:
                raise ValueError(f"{PUSH_CONNECTOR_NAME}: unknown connector role {role!r}")

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[no-untyped-call]  # vLLM's is untyped
        finally:
            release_shm_wait(self)  # kvspec_shm_wait: the last connector puts vLLM's back
