"""Diagnosis only: record every vLLM ``MessageQueue`` enqueue and dequeue of a process.

Put this folder first on a vLLM server's ``PYTHONPATH`` and set ``MQTRACE_DIR``: each
Python process that imports vLLM's ``shm_broadcast`` then appends to
``$MQTRACE_DIR/mq-<pid>.log`` one line per queue operation: monotonic time, thread,
``E0`` (enqueue starts) / ``E1`` (enqueue done) / ``D`` (dequeue done) / ``DX`` (dequeue
raised), the ring's shared-memory segment, the ring index before and after, and what moved
(``RPC <method>`` from the engine core, ``RESP <status> <type>`` from a worker). An engine
core's ``E1`` of an RPC followed much later by its ``D`` of the answer is a step its
worker answered late; the worker's own log says when it read the step. docs/vllm.md
("Push end to end") reads such traces. With ``MQTRACE_SLEEP0=1`` it also sets
``vllm.distributed.utils.USE_SCHED_YIELD`` false (what ``kvspec_shm_wait: "sleep"`` does).
Without ``MQTRACE_DIR`` it does nothing. Never used by the library or its tests.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_DIR = os.environ.get("MQTRACE_DIR")
_QUEUES = "vllm.distributed.device_communicators.shm_broadcast"
_UTILS = "vllm.distributed.utils"


def _summary(obj: Any) -> str:
    if isinstance(obj, tuple) and len(obj) == 4 and isinstance(obj[0], str | bytes):
        method = obj[0] if isinstance(obj[0], str) else "<pickled>"
        return f"RPC {method} rank={obj[3]}"
    if isinstance(obj, tuple) and len(obj) == 2 and hasattr(obj[0], "name"):
        return f"RESP {obj[0].name} {type(obj[1]).__name__}"
    return type(obj).__name__


def _trace_queues(module: ModuleType) -> None:
    queue_class: Any = module.MessageQueue
    out = open(os.path.join(str(_DIR), f"mq-{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115
    lock = threading.Lock()

    def log(kind: str, queue: Any, before: int, what: str) -> None:
        segment = getattr(
            getattr(getattr(queue, "buffer", None), "shared_memory", None), "name", "-"
        )
        with lock:
            out.write(
                f"{time.monotonic():.6f} {threading.current_thread().name} {kind} "
                f"{segment} {before}->{queue.current_idx} {what}\n"
            )

    enqueue, dequeue = queue_class.enqueue, queue_class.dequeue

    def traced_enqueue(self: Any, obj: Any, timeout: float | None = None) -> Any:
        before = self.current_idx
        log("E0", self, before, _summary(obj))
        result = enqueue(self, obj, timeout)
        log("E1", self, before, "")
        return result

    def traced_dequeue(self: Any, timeout: float | None = None, indefinite: bool = False) -> Any:
        before = self.current_idx
        try:
            obj = dequeue(self, timeout, indefinite)
        except BaseException as exc:
            log("DX", self, before, repr(exc))
            raise
        log("D", self, before, _summary(obj))
        return obj

    queue_class.enqueue, queue_class.dequeue = traced_enqueue, traced_dequeue
    out.write(f"{time.monotonic():.6f} patched pid {os.getpid()} {sys.argv[:3]}\n")


def _sleep_instead_of_yield(module: ModuleType) -> None:
    if os.environ.get("MQTRACE_SLEEP0") == "1":
        module.USE_SCHED_YIELD = False


_AFTER_IMPORT: dict[str, Callable[[ModuleType], None]] = {
    _QUEUES: _trace_queues,
    _UTILS: _sleep_instead_of_yield,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :data:`_AFTER_IMPORT`'s function on a module once it is executed."""

    busy = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _AFTER_IMPORT or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        execute, after = loader.exec_module, _AFTER_IMPORT[fullname]

        def exec_module(module: ModuleType) -> None:
            execute(module)
            after(module)

        loader.exec_module = exec_module
        return spec


if _DIR:
    sys.meta_path.insert(0, _AfterImport())
