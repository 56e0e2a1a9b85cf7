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
scheduler, each worker process for the worker), before anything waits on a queue.
"""

from __future__ import annotations

import logging
from typing import Literal

from kvspec_traits.vllm_connector._errors import ConnectorOptionError
from kvspec_traits.vllm_connector._names import SHM_WAIT

__all__ = ["ShmWait", "ShmWaitError", "apply_shm_wait"]

# Under "vllm.", so vLLM's own log configuration prints it beside vLLM's lines.
_LOG = logging.getLogger("vllm.kvspec_traits.connector")
FLAG = "USE_SCHED_YIELD"

ShmWait = Literal["yield", "sleep"]
"""The values of :data:`~._names.SHM_WAIT` (checked by :class:`~._options.ConnectorOptions`)."""


class ShmWaitError(ConnectorOptionError):
    """A ``kvspec_shm_wait`` that is not ``"yield"`` or ``"sleep"``, or ``"sleep"`` on a
    vLLM whose queues have no such switch."""


def apply_shm_wait(mode: ShmWait) -> bool:
    """Apply ``mode`` (a checked option) in this process; True if vLLM's wait was
    changed. ``"yield"`` changes nothing. ``"sleep"`` refuses, naming the module, a vLLM
    without the flag (its queues would keep yielding while the operator believes
    otherwise)."""
    if mode == "yield":
        return False
    from vllm.distributed import utils

    if not isinstance(getattr(utils, FLAG, None), bool):
        raise ShmWaitError(
            SHM_WAIT,
            mode,
            f"this vLLM's vllm.distributed.utils has no boolean {FLAG}, so its "
            f"shared-memory queues cannot be told to sleep; remove the key",
        )
    was = getattr(utils, FLAG)
    setattr(utils, FLAG, False)
    _LOG.info(
        "kvspec_shm_wait 'sleep': vLLM's shared-memory queue readers wait with "
        "time.sleep(0)%s in this process",
        " instead of os.sched_yield()" if was else " (already)",
    )
    return True
