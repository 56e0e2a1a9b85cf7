"""Producer and consumer in two processes, agent metadata over a loopback socket.

The producer (nixl_helpers/producer.py) plans, registers and fills its own KV cache from
a seed; the consumer rebuilds the same bytes from the seed to compare every byte. Then
the consumer starts a read from the producer's second agent, which is never progressed,
and the producer is killed mid-transfer: the consumer must fail within a bounded time
and not mark the blocks received. The child is killed on every exit path.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import pathlib  # NIXL reads its log level at import
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvspec_traits.nixl import RemotePeer, TraitsNixlAgent, TransferFailedError
from kvspec_traits.transfer import plan_regions
from tests.nixl_helpers import checks, layouts

FAMILY, NB, SEED = "deepseek_v4", 32, 21
PRODUCER = pathlib.Path(__file__).parent / "nixl_helpers" / "producer.py"
# The child imports torch and vLLM's spec module (~5-30 s on a shared 2-core machine).
HANDSHAKE_TIMEOUT_S = 120.0
FAILURE_BOUND_S = 10.0


@dataclass
class Session:
    agent: TraitsNixlAgent
    caches: dict[str, torch.Tensor]
    config: KVCacheConfig
    child: subprocess.Popen[bytes]
    serving: RemotePeer
    stalled: RemotePeer


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError(f"producer closed the socket after {len(data)} of {n} bytes")
        data += chunk
    return data


def _recv_frame(conn: socket.socket) -> bytes:
    (length,) = struct.unpack("<I", _recv_exact(conn, 4))
    return _recv_exact(conn, length)


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(HANDSHAKE_TIMEOUT_S)
    child = subprocess.Popen(
        [sys.executable, str(PRODUCER), str(server.getsockname()[1]), FAMILY, str(NB), str(SEED)]
    )
    agent = None
    conn = None
    try:
        config, caches = layouts.build(FAMILY, NB)
        agent = TraitsNixlAgent()
        agent.register_plan(plan_regions(caches, config))
        conn, _ = server.accept()
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        serving = agent.connect(_recv_frame(conn))
        stalled = agent.connect(_recv_frame(conn))
        yield Session(agent, caches, config, child, serving, stalled)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        if conn is not None:
            conn.close()
        server.close()
        if agent is not None:
            agent.close()


def test_two_processes_transfer_byte_exact(session: Session) -> None:
    block_ids = checks.request_blocks(session.config, per_group=4)
    result = session.agent.read_blocks(session.serving, block_ids, timeout=30)
    assert result.nbytes > 0
    expected_config, expected = layouts.build(FAMILY, NB)
    layouts.fill_pattern(expected, SEED)  # the producer's bytes (tp_rank 0)
    compared = checks.assert_transferred(expected, session.caches, expected_config, block_ids)
    assert compared > 0


def test_killed_producer_fails_the_read_in_bounded_time(session: Session) -> None:
    """The producer's second agent is never progressed, so a read from it (the first,
    which must also wire up the connection) cannot finish before the kill: it is in
    flight when the producer dies."""
    received: set[int] = set()
    kill_delay = 0.5
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(kill_delay)
        session.child.send_signal(signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill)
    started = time.monotonic()
    killer.start()
    try:
        with pytest.raises(TransferFailedError) as info:  # noqa: PT012  # the ledger line is the point
            session.agent.read_blocks(  # every block, split over the 4 groups
                session.stalled, [list(range(g, NB, 4)) for g in range(4)], timeout=60
            )
            received.update(range(NB))  # only reached if the read completed
    finally:
        killer.join()
    failed_at = time.monotonic()
    # The read was in flight when the producer died (it could not finish without it) ...
    assert killed_at and failed_at >= killed_at[0] > started
    # ... and the consumer noticed within the bound, far before its own 60 s timeout.
    assert failed_at - killed_at[0] < FAILURE_BOUND_S
    assert info.value.state != "PROC", "reported as a timeout, not as the peer failure"
    assert received == set()
    # Some bytes may have landed before the failure; that is why nothing is marked.
    session.child.wait(timeout=10)
