"""How vLLM's shared-memory message queues wait: :data:`~._names.SHM_WAIT`.

vLLM's engine core and its workers talk through ``MessageQueue`` rings in shared memory
(``vllm/distributed/device_communicators/shm_broadcast.py``). A reader checks its next
block's flags and, for a second after each message, calls
``vllm.distributed.utils.sched_yield()`` between checks, which is ``os.sched_yield()``
on Python >= 3.11.1 and ``time.sleep(0)`` before (the module flag ``USE_SCHED_YIELD``).

``"sleep"`` sets that flag false in this process, so the same loop sleeps for zero
seconds instead of yielding. Nothing else changes: the flags, the rings, the one-second
spin and the idle poll are vLLM's. The switch is process-wide and takes effect on the
next wait; the connector applies it where it is built (the engine core for the
scheduler, each worker process for the worker), before anything waits on a queue, and
lets go of it in its ``shutdown``: the last connector of the process to let go puts
back the value it found (:class:`~._seam.QueueWaitSwitch`, the one place the flag is
changed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from kvspec_traits.vllm_connector._errors import ConnectorOptionError
from kvspec_traits.vllm_connector._log import logger
from kvspec_traits.vllm_connector._names import SHM_WAIT

__all__ = ["ShmWait", "ShmWaitError", "apply_shm_wait", "holding_shm_wait", "release_shm_wait"]

ShmWait = Literal["yield", "sleep"]
"""The values of :data:`~._names.SHM_WAIT` (checked by :class:`~._options.ConnectorOptions`)."""


class ShmWaitError(ConnectorOptionError):
    """A ``kvspec_shm_wait`` that is not ``"yield"`` or ``"sleep"``, or ``"sleep"`` on a
    vLLM whose queues have no such switch."""


def apply_shm_wait(mode: ShmWait, holder: object) -> bool:
    """Apply ``mode`` (a checked option) in this process for ``holder`` (a connector,
    which lets go with :func:`release_shm_wait`); True if vLLM's wait was changed.
    ``"yield"`` changes nothing. ``"sleep"`` refuses, naming the module, a vLLM without
    the flag (its queues would keep yielding while the operator believes otherwise)."""
    if mode == "yield":
        return False
    from kvspec_traits.vllm_connector._seam import queue_wait_switch

    switch = queue_wait_switch()
    if not switch.available():
        raise ShmWaitError(
            SHM_WAIT,
            mode,
            f"this vLLM's vllm.distributed.utils has no boolean {switch.FLAG}, so its "
            f"shared-memory queues cannot be told to sleep; remove the key",
        )
    was = switch.hold_sleep(holder)
    logger.info(
        "kvspec_shm_wait 'sleep': vLLM's shared-memory queue readers wait with "
        "time.sleep(0)%s in this process",
        " instead of os.sched_yield()" if was else " (already)",
    )
    return True


def release_shm_wait(holder: object) -> None:
    """``holder`` (a connector shutting down) lets go of the wait it applied; the last
    holder of the process puts back vLLM's value. Nothing for a holder that applied none."""
    from kvspec_traits.vllm_connector._seam import queue_wait_switch

    queue_wait_switch().release(holder)


@contextlib.contextmanager
def holding_shm_wait(mode: ShmWait, holder: object) -> Iterator[None]:
    """:func:`apply_shm_wait` for the construction of ``holder`` that the block runs
    (before it waits on a queue); let go again if the construction fails (no
    ``shutdown`` follows)."""
    apply_shm_wait(mode, holder)
    try:
        yield
    except BaseException:
        release_shm_wait(holder)
        raise
