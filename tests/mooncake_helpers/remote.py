"""The test side of ``peer.py``: start it, send commands, read the bytes of its ranks.
One process serves a whole test module (its start imports torch and vLLM's specs)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from kvspec_traits.mooncake import MooncakePeer, TraitsMooncakeEngine, fetch_record
from tests.nixl_helpers import layouts

__all__ = ["Remote"]

PEER = Path(__file__).with_name("peer.py")
START_TIMEOUT_S = 180.0  # torch and vLLM's spec module, on a shared 2-core machine
COMMAND_TIMEOUT_S = 120.0


class Remote:
    """A running ``peer.py``; ``close`` ends it (quit, then kill)."""

    def __init__(self, tmp: Path) -> None:
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        self._tmp = tmp
        self._proc = subprocess.Popen(
            [sys.executable, str(PEER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._count = 0
        self._reply(START_TIMEOUT_S)

    def _reply(self, timeout: float) -> dict[str, Any]:
        stdout = self._proc.stdout
        if stdout is None:  # pragma: no cover - Popen made the pipe
            raise RuntimeError("no pipe to the peer process")
        ready, _, _ = select.select([stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the peer process did not answer in {timeout:.0f} s")
        line = stdout.readline()
        if not line:
            raise EOFError(f"the peer process exited ({self._proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("ok") is False:
            raise RuntimeError(f"the peer process failed: {reply['error']}")
        return reply

    def command(self, op: str, **fields: Any) -> dict[str, Any]:
        stdin = self._proc.stdin
        if stdin is None:  # pragma: no cover
            raise RuntimeError("no pipe to the peer process")
        stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        stdin.flush()
        return self._reply(COMMAND_TIMEOUT_S)

    def build(
        self,
        family: str,
        num_blocks: int,
        tp: int,
        rank: int,
        seed: int | None,
        *,
        whole: bool = False,
    ) -> tuple[str, int]:
        """A rank in the peer process (``mooncake_helpers.ranks.rank_caches``); its key
        and its side channel's port."""
        self._count += 1
        key = f"r{self._count}"
        port = self.command(
            "build",
            key=key,
            family=family,
            nb=num_blocks,
            tp=tp,
            rank=rank,
            seed=seed,
            whole=whole,
        )["port"]
        return key, int(port)

    def connect(
        self,
        engine: TraitsMooncakeEngine,
        family: str,
        num_blocks: int,
        tp: int,
        rank: int,
        seed: int | None,
    ) -> tuple[str, MooncakePeer]:
        """Build a rank there, fetch its record on the side channel, connect ``engine``."""
        key, port = self.build(family, num_blocks, tp, rank, seed)
        return key, engine.connect(fetch_record("127.0.0.1", port), "127.0.0.1")

    def caches(self, key: str, family: str, num_blocks: int, tp: int) -> dict[str, torch.Tensor]:
        """A copy of rank ``key``'s caches, as vLLM's views of its bytes."""
        path = self._tmp / f"{key}.bin"
        self.command("dump", key=key, path=str(path))
        _, caches = layouts.build(family, num_blocks, tp=tp)
        raw = layouts.backing(caches)
        raw.copy_(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))
        path.unlink()
        return caches

    def close(self) -> None:
        try:
            if self._proc.poll() is None:
                self.command("quit")
        except (OSError, TimeoutError, EOFError, RuntimeError):
            pass
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=30)
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
