"""The connector's names: what vLLM's config refers to it by (pure, no vLLM)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "CONNECTOR_NAME",
    "IMPL_MODULE",
    "MODULE_PATH",
    "PUSH_CONNECTOR_NAME",
    "PUSH_IMPL_MODULE",
    "NIXL_PROGRESS_DELAY",
    "REQUIRE_TRAITS_PEER",
    "SHM_WAIT",
    "SHM_WAITS",
    "TRANSFER_MODE",
]

CONNECTOR_NAME: Final = "TraitsNixlConnector"
MODULE_PATH: Final = "kvspec_traits.vllm_connector"
IMPL_MODULE: Final = "kvspec_traits.vllm_connector._connector"
"""The module of the classes that need vLLM (loaded when a connector is built)."""
PUSH_CONNECTOR_NAME: Final = "TraitsNixlPushConnector"
"""Push mode (WRITE from prefill to decode): upstream's ``NixlPushConnector``, with traits."""
PUSH_IMPL_MODULE: Final = "kvspec_traits.vllm_connector._push"
REQUIRE_TRAITS_PEER: Final = "kvspec_require_traits_peer"
"""``kv_connector_extra_config`` key: true refuses NIXL peers that send no kvspec-traits
fingerprint (upstream's ``NixlConnector``) with :class:`PeerWithoutTraitsError`."""
NIXL_PROGRESS_DELAY: Final = "kvspec_nixl_progress_delay_us"
"""``kv_connector_extra_config`` key: microseconds NIXL's progress thread sleeps between
polls in this connector's agents (default 0, NIXL's busy polling; see
:mod:`kvspec_traits.nixl._progress`)."""
SHM_WAIT: Final = "kvspec_shm_wait"
"""``kv_connector_extra_config`` key: how vLLM's shared-memory queues (engine core <->
worker) wait for the next message in the processes that build this connector.
``"yield"`` (the default) leaves vLLM as it is: ``os.sched_yield()`` between checks for
a second after each message. ``"sleep"`` takes vLLM's own other path,
``time.sleep(0)`` (``vllm.distributed.utils.USE_SCHED_YIELD`` false, which vLLM uses on
Python < 3.11.1). On a loaded machine whose kernel schedules with EEVDF, a worker that
spins on ``sched_yield`` was seen runnable and not run for 20-120 s (docs/vllm.md, "Push
end to end"); push mode spins without pause while the producer holds blocks."""
SHM_WAITS: Final = ("yield", "sleep")
"""Its values (``_shm_wait.ShmWait``, the type ``ConnectorOptions.shm_wait`` holds)."""
TRANSFER_MODE: Final = "transfer_mode"
"""``kv_connector_extra_config`` key of vLLM's: ``"pull"`` or ``"push"``, read by vLLM
0.34's factory for ``"NixlConnector"`` (and by this connector as it does)."""
