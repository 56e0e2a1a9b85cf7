"""A request's reads, posted: one NIXL READ per remote rank the connector planned a
read from, vLLM's notification on each and on every handshaken rank not read from (as
vLLM's read path notifies them: a producer rank frees a request's blocks once each
consumer rank it expects has notified it). Shared by the reads the connector plans
itself (:mod:`._ratio_peer`: another block size; :mod:`._tp_peer`: another TP size)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvspec_traits.vllm_connector._log import logger
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME

__all__ = ["post_reads", "row_reads"]

Rows = tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]
MakeRead = Callable[[int, str, bytes], int]
"""``make(remote rank, its agent name, notification)``: the rank's READ handle."""


def post_reads(worker: Any, req_id: str, meta: Any, ranks: Collection[int], make: MakeRead) -> None:
    """Post request ``req_id``'s reads from ``ranks`` of the peer named in ``meta``
    (vLLM's ``ReqMeta``), each made by ``make`` and tracked as vLLM tracks its reads. A
    read NIXL refuses fails the request through vLLM's failed-read path, before any
    further read is posted (the reads posted are already tracked)."""
    engine = meta.remote.engine_id
    consumers = worker.tp_mappings[engine].local_consumers
    notif = f"{meta.remote.request_id}:{consumers}".encode()
    agents = worker.remote_agents[engine]
    agent = worker.nixl_wrapper
    try:
        for rank in ranks:
            handle = make(rank, agents[(0, rank)], notif)
            agent.transfer(handle)
            worker.recving_transfers[req_id].append(handle)
        for (_, rank), name in agents.items():
            if rank not in ranks:
                agent.send_notif(name, notif_msg=notif)
    except Exception as err:  # NIXL's errors are untyped; vLLM's failed-read path follows
        logger.error("%s: read of request %s failed: %r", CONNECTOR_NAME, req_id, err)
        worker.fail_read(req_id)


def row_reads(worker: Any, rows: dict[int, Rows], remote_mem: str) -> MakeRead:
    """:data:`MakeRead` of per-request rows (``rows``: per remote rank, the local and
    remote ``(address, length, device)`` rows)."""
    agent = worker.nixl_wrapper

    def make(rank: int, name: str, notif: bytes) -> int:
        local, remote = rows[rank]
        handle: int = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, worker.nixl_memory_type),
            agent.get_xfer_descs(remote, remote_mem),
            name,
            notif,
        )
        return handle

    return make
