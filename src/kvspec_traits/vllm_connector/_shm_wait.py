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
from typing import TYPE_CHECKING

from kvspec_traits._errors import KVSpecTraitsError
from kvspec_traits.vllm_connector._names import SHM_WAIT, SHM_WAITS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ShmWaitError", "apply_from_config", "apply_shm_wait", "shm_wait"]

# Under "vllm.", so vLLM's own log configuration prints it beside vLLM's lines.
_LOG = logging.getLogger("vllm.kvspec_traits.connector")
FLAG = "USE_SCHED_YIELD"


class ShmWaitError(KVSpecTraitsError, ValueError):
    """A ``kvspec_shm_wait`` that is not ``"yield"`` or ``"sleep"``, or ``"sleep"`` on a
    vLLM whose queues have no such switch."""


def apply_shm_wait(mode: str) -> bool:
    """Apply ``mode`` in this process; True if vLLM's wait was changed. ``"yield"``
    changes nothing. ``"sleep"`` refuses, naming the module, a vLLM without the flag
    (its queues would keep yielding while the operator believes otherwise)."""
    if mode == "yield":
        return False
    if mode != "sleep":
        raise ShmWaitError(f"kvspec_shm_wait is {mode!r}; give 'yield' or 'sleep'")
    from vllm.distributed import utils

    if not isinstance(getattr(utils, FLAG, None), bool):
        raise ShmWaitError(
            f"kvspec_shm_wait 'sleep': this vLLM's vllm.distributed.utils has no boolean "
            f"{FLAG}, so its shared-memory queues cannot be told to sleep; remove the key"
        )
    was = getattr(utils, FLAG)
    setattr(utils, FLAG, False)
    _LOG.info(
        "kvspec_shm_wait 'sleep': vLLM's shared-memory queue readers wait with "
        "time.sleep(0)%s in this process",
        " instead of os.sched_yield()" if was else " (already)",
    )
    return True


def shm_wait(vllm_config: VllmConfig) -> str:
    """The :data:`~._names.SHM_WAIT` of a config, checked (:class:`ShmWaitError`)."""
    config = vllm_config.kv_transfer_config
    raw = "yield" if config is None else config.get_from_extra_config(SHM_WAIT, "yield")
    if raw not in SHM_WAITS:
        raise ShmWaitError(
            f"kv_connector_extra_config {SHM_WAIT} is {raw!r}; give one of {list(SHM_WAITS)} "
            '("yield": vLLM\'s default, "sleep": time.sleep(0) between checks)'
        )
    return str(raw)


def apply_from_config(vllm_config: VllmConfig) -> bool:
    """:func:`apply_shm_wait` of the config's ``kvspec_shm_wait`` (checked)."""
    return apply_shm_wait(shm_wait(vllm_config))
