"""vLLM's request path between NIXL worker ranks, for the connector tests: the prefill
ranks' handshake payloads served on vLLM's own side-channel listener, and one request
received through vLLM's receive path (handshake, ``start_load_kv``, ``get_finished``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

__all__ = ["receive", "serving"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(producers: Sequence[Any]) -> Iterator[int]:
    """vLLM's side-channel listener serving each prefill TP rank's handshake payload
    (keyed by (PP rank 0, TP rank), as a prefill engine's scheduler serves them)."""
    port = _free_port()
    encoded = {
        (0, rank): msgspec.msgpack.Encoder().encode(worker.xfer_handshake_metadata)
        for rank, worker in enumerate(producers)
    }
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=(encoded, ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    thread.start()
    ready.wait(10)
    try:
        yield port
    finally:
        stop.set()


def receive(
    consumer: Any,
    *,
    port: int,
    local: Sequence[Sequence[int]],
    remote: Sequence[Sequence[int]],
    remote_engine: str = "prefill",
    remote_tp: int = 1,
    timeout: float = 120,
    params: Mapping[str, Any] | None = None,
    planned: bool = False,
) -> None:
    """One request (``"req"``) through vLLM's receive path: the prefill engine's blocks
    ``remote`` (per group) into ``local``; fails unless it finishes within ``timeout``
    seconds with no block in error. ``params``: more of the producer's
    ``kv_transfer_params`` (``remote_num_tokens``, ...). ``planned``: the bytes must
    be read by the connector's planned reads, never by vLLM's descriptor path
    (``_read_blocks``, which then fails the read)."""
    if planned:

        def upstream_read(**kwargs: Any) -> bool:
            raise AssertionError("vLLM's _read_blocks read a peer the connector plans")

        consumer._read_blocks = upstream_read
    metadata = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
    metadata.add_new_req_to_recv(
        request_id="req",
        local_block_ids=tuple(list(b) for b in local),
        kv_transfer_params={
            "remote_block_ids": [list(b) for b in remote],
            "remote_engine_id": remote_engine,
            "remote_request_id": "prefill-req",
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": remote_tp,
            **(params or {}),
        },
    )
    consumer.start_load_kv(metadata)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # An empty step picks up requests whose handshake finished.
        consumer.start_load_kv(NixlConnectorMetadata())  # type: ignore[no-untyped-call]
        _, done = consumer.get_finished()
        if "req" in done:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the read did not finish in {timeout:.0f} s")
    assert consumer.get_block_ids_with_load_errors() == set()


def push_request(
    producers: list[Any],
    consumers: list[Any],
    ports: tuple[int, int],
    p_ids: list[list[int]],
    d_ids: list[list[int]],
    extra: Mapping[str, Any] | None = None,
    timeout: float = 60,
) -> None:
    """One request (``"req"``) as vLLM's push schedulers stage it: each prefill rank gets
    its finished blocks ``p_ids``, each decode rank the request to receive into ``d_ids``
    and the registration (upstream's fields, and ``extra``'s); fails unless every rank
    reports it done within ``timeout`` seconds."""
    (p_port, d_port), req = ports, "req"
    for producer in producers:
        meta = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
        meta.reqs_in_batch.add(req)
        meta.reqs_to_send[req] = time.perf_counter() + 600
        meta.push_finished_blocks[req] = tuple(list(b) for b in p_ids)
        producer.start_load_kv(meta)
    peer = {"host": "127.0.0.1", "p_port": p_port, "p_tp": len(producers)}
    registration = {
        "request_id": req,
        "decode_engine_id": "decode",
        "decode_host": peer["host"],
        "decode_port": d_port,
        "decode_tp_size": len(consumers),
        "local_block_ids": tuple(list(b) for b in d_ids),
        "remote_engine_id": "prefill",
        "remote_host": peer["host"],
        "remote_port": p_port,
        "remote_tp_size": len(producers),
        "remote_pp_size": 1,
        **(extra or {}),
    }
    for consumer in consumers:
        meta = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
        meta.add_new_req_to_recv(
            request_id=req,
            local_block_ids=tuple(list(b) for b in d_ids),
            kv_transfer_params={
                "remote_block_ids": (),  # push: the decode side does not know them
                "remote_engine_id": "prefill",
                "remote_request_id": req,
                "remote_host": "127.0.0.1",
                "remote_port": p_port,
                "tp_size": len(producers),
                "pp_size": 1,
            },
        )
        meta.push_registrations[req] = dict(registration)
        consumer.start_load_kv(meta)
    sent: list[set[str]] = [set() for _ in producers]
    got: list[set[str]] = [set() for _ in consumers]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for done, worker in zip(sent, producers, strict=True):
            done |= worker.get_finished()[0]
        for done, worker in zip(got, consumers, strict=True):
            done |= worker.get_finished()[1]
        if all(req in d for d in sent + got):
            break
        time.sleep(0.02)
    assert all(req in d for d in got), f"not received in {timeout:.0f} s: {got}"
    assert all(req in d for d in sent), f"not sent in {timeout:.0f} s: {sent}"
    for consumer in consumers:
        assert consumer.get_block_ids_with_load_errors() == set()
