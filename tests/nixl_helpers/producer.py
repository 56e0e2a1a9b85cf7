"""A producer rank in its own process: plan a family's KV cache, register it with NIXL,
send the handshake over a loopback socket, then serve reads.

    python producer.py PORT FAMILY NUM_BLOCKS SEED MODE [TP_SIZE TP_RANK]

MODE ``serve``: progress the agent until the consumer writes ``done`` (or closes the
socket). MODE ``stall``: never progress, so a consumer's read stays in flight until this
process is killed. Every wait is bounded (60 s) so an orphan cannot linger.

Framing on the socket: a 4-byte little-endian length, then the metadata bytes.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_LIMIT_S = 60.0


def main(argv: list[str]) -> int:
    port, family, num_blocks, seed, mode = (int(argv[0]), argv[1], int(argv[2]),
                                            int(argv[3]), argv[4])
    tp_size, tp_rank = (int(argv[5]), int(argv[6])) if len(argv) > 6 else (1, 0)
    from kvspec_traits.nixl import TraitsNixlAgent, plan_regions
    from nixl_helpers import layouts

    config, caches = layouts.build(family, num_blocks, tp=tp_size)
    layouts.fill_pattern(caches, seed + tp_rank)
    plan = plan_regions(caches, config, tp_size=tp_size, tp_rank=tp_rank)
    agent = TraitsNixlAgent()
    agent.register_plan(plan)
    metadata = agent.metadata()
    with socket.create_connection(("127.0.0.1", port), timeout=_LIMIT_S) as sock:
        sock.sendall(struct.pack("<I", len(metadata)) + metadata)
        deadline = time.monotonic() + _LIMIT_S
        while time.monotonic() < deadline:
            if mode == "serve":
                agent.progress()
            ready, _, _ = select.select([sock], [], [], 0.0005 if mode == "serve" else 0.5)
            if ready:
                data = sock.recv(16)
                if not data or data.startswith(b"done"):
                    break
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
