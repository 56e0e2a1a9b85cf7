"""A producer rank in its own process: plan a family's KV cache, register it with NIXL,
send the handshake over a loopback socket, then serve reads.

    python producer.py PORT FAMILY NUM_BLOCKS SEED [TP_SIZE TP_RANK]

Two agents register the same plan: the first is progressed until the consumer writes
``done`` or closes the socket; the second is never progressed, so a consumer's first
read from it (which must also wire up the connection) stays in flight until this
process is killed. Every wait is bounded (60 s) so an orphan cannot linger.

Framing on the socket: for each agent, a 4-byte little-endian length, then its
metadata.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
# The repository root, so `tests.nixl_helpers` imports as it does under pytest.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_LIMIT_S = 60.0


def main(argv: list[str]) -> int:
    port, family, num_blocks, seed = int(argv[0]), argv[1], int(argv[2]), int(argv[3])
    tp_size, tp_rank = (int(argv[4]), int(argv[5])) if len(argv) > 5 else (1, 0)
    from kvspec_traits.nixl import TraitsNixlAgent
    from kvspec_traits.transfer import plan_regions
    from tests.nixl_helpers import layouts

    config, caches = layouts.build(family, num_blocks, tp=tp_size)
    layouts.fill_pattern(caches, seed + tp_rank)
    plan = plan_regions(caches, config, tp_size=tp_size, tp_rank=tp_rank)
    serving, stalled = TraitsNixlAgent(), TraitsNixlAgent()
    for agent in (serving, stalled):
        agent.register_plan(plan)
    with socket.create_connection(("127.0.0.1", port), timeout=_LIMIT_S) as sock:
        for agent in (serving, stalled):
            metadata = agent.metadata()
            sock.sendall(struct.pack("<I", len(metadata)) + metadata)
        deadline = time.monotonic() + _LIMIT_S
        while time.monotonic() < deadline:
            serving.progress()
            ready, _, _ = select.select([sock], [], [], 0.0005)
            if ready:
                data = sock.recv(16)
                if not data or data.startswith(b"done"):
                    break
    for agent in (serving, stalled):
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
