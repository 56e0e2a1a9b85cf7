"""The pull worker's half of :mod:`._lease`: vLLM's receive path, with reads that the
producer's lease may no longer cover turned into vLLM's failed reads.

Three points of upstream's ``NixlPullConnectorWorker`` (the same in 0.32, 0.33 and 0.34;
the private ones forwarded by :class:`~._seam.SeamPullWorker`):

- ``start_load_kv``: each received request's lease starts being tracked;
- ``read_blocks_for_req``: a read that would start too late is declined, the way
  upstream declines an expired turn-2 readback (its failed-read path without a
  transport failure, ``record_kv_expired_req``);
- ``pop_done_transfers``: a read seen complete too late joins the failed ones, so
  ``get_transfer_results`` reports it in ``failed_recving`` and (without the hybrid
  allocator) its blocks as load errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

from kvspec_traits.vllm_connector._lease import LEASES_ATTR, LeaseBook
from kvspec_traits.vllm_connector._log import logger
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME
from kvspec_traits.vllm_connector._options import ConnectorOptions
from kvspec_traits.vllm_connector._seam import SeamPullWorker
from kvspec_traits.vllm_connector._stats import traits_stats

__all__ = ["LeasedPullWorker"]


class LeasedPullWorker(SeamPullWorker):
    """vLLM's pull worker whose reads fail closed on expired leases."""

    # The connector's options (its lease margin), set by the worker's __init__; the
    # defaults for workers vLLM's tests build with object.__new__.
    options: ConnectorOptions = ConnectorOptions()

    def _leases(self) -> LeaseBook:
        book: LeaseBook | None = self.__dict__.get("_lease_book")
        if book is None:  # built lazily: vLLM's tests build workers with object.__new__
            book = self.__dict__["_lease_book"] = LeaseBook(self.options.lease_margin)
        return book

    def _lease_expired(self, req_id: str, engine_id: str) -> bool:
        book = self._leases()
        if req_id not in book:
            return False
        offset = self.engine_clock_offset.get(engine_id)
        return book.expired(req_id, offset, time.perf_counter())

    def _decline_expired(self, req_id: str, engine_id: str, when: str) -> None:
        logger.warning(
            "%s: request %s: the lease of engine %s on its blocks may have expired %s; "
            "the read counts as failed (kv_load_failure_policy applies)",
            CONNECTOR_NAME,
            req_id,
            engine_id,
            when,
        )
        self.xfer_stats.record_kv_expired_req()  # type: ignore[no-untyped-call]  # vLLM
        traits_stats(self).record_lease_declined()

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        offered: Mapping[str, object] = getattr(metadata, LEASES_ATTR, None) or {}
        if offered:
            book = self._leases()
            for req_id, meta in metadata.reqs_to_recv.items():
                # Only reads that bring blocks: a full local prefix hit (or an aborted
                # request's cleanup) only notifies the producer, and nothing is read.
                reads = getattr(meta, "awaiting_kvs", False) or any(meta.local_block_ids)
                if reads and req_id in offered and meta.remote is not None:
                    remote = meta.remote
                    book.track(req_id, remote.engine_id, remote.request_id, offered[req_id])
        super().start_load_kv(metadata)

    def read_blocks_for_req(
        self, req_id: str, meta: Any, upstream: Callable[[str, Any], None]
    ) -> None:
        engine_id = meta.remote.engine_id
        # Checked once the handshake is done (its clock offset places the deadline);
        # before that upstream starts the handshake and calls this again.
        if engine_id in self.remote_agents and self._lease_expired(req_id, engine_id):
            self._decline_expired(req_id, engine_id, "before the read")
            self.fail_read(req_id)
            return
        upstream(req_id, meta)

    def pop_done_transfers(
        self,
        transfers: dict[str, list[int]],
        upstream: Callable[[dict[str, list[int]]], tuple[set[str], set[str]]],
    ) -> tuple[set[str], set[str]]:
        done, failed = upstream(transfers)
        if transfers is self.recving_transfers and len(self._leases()):
            for req_id in done - failed:
                meta = self.recving_metadata.get(req_id)
                if meta is None or meta.remote is None:
                    continue
                if self._lease_expired(req_id, meta.remote.engine_id):
                    self._decline_expired(req_id, meta.remote.engine_id, "before it completed")
                    failed.add(req_id)
        return done, failed

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        book = self._leases()
        if len(book):
            # Done (or failed) reads left vLLM's receive bookkeeping above; so did any
            # request it dropped otherwise. Their leases are of no further use.
            for req_id in book.tracked() - self.recving_metadata.keys():
                book.forget(req_id)
        return results
