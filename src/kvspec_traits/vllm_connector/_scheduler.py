"""The scheduler side of both NIXL connectors (pull and push), its layout decisions
taken from traits.

vLLM's NIXL scheduler (``base_scheduler.py``) decides from spec classes which groups'
blocks a request sends: ``isinstance(spec, FullAttentionSpec)`` (is the hybrid
allocator's per-group clipping needed), ``SlidingWindowSpec`` (send only the window's
blocks), ``MambaSpec`` (keep only the state slot, and leave the last prompt token to
the decoder). Here each is answered by :func:`~kvspec_traits.vllm_connector._facts.
scheduler_facts` from ``token_scope`` and ``is_state``, replacing upstream's answers
as soon as its constructor has run (nothing reads them in between). Everything else
(the handshake listener, leases, heartbeats, the clipping code that reads these
answers) is upstream's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)

from kvspec_traits._registry import Registry, default_registry
from kvspec_traits.vllm_connector._facts import SchedulerFacts, scheduler_facts

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "TraitsNixlConnectorScheduler",
    "TraitsNixlPushConnectorScheduler",
    "TraitsSchedulerBase",
]


class TraitsSchedulerBase(NixlBaseConnectorScheduler):
    """The traits half of both NIXL schedulers: upstream's per-group decisions
    (``_is_hma_required``, ``blocks_per_sw``, ``_ssm_spec_blocks``, ``_has_mamba``)
    from :class:`SchedulerFacts`."""

    _traits_registry: Registry = default_registry

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        *,
        registry: Registry | None = None,
    ) -> None:
        if registry is not None:
            self._traits_registry = registry
        # First: a spec the traits refuse is refused before upstream starts anything.
        facts = scheduler_facts(kv_cache_config, self._traits_registry)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.scheduler_facts: SchedulerFacts = facts
        self._is_hma_required = (
            not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and facts.hybrid
        )
        self.blocks_per_sw = list(facts.window_blocks)
        self._ssm_spec_blocks = list(facts.state_scratch_blocks)
        self._has_mamba = facts.has_state


class TraitsNixlConnectorScheduler(TraitsSchedulerBase, NixlPullConnectorScheduler):
    """vLLM's pull-mode NIXL scheduler with its per-group decisions taken from traits."""


class TraitsNixlPushConnectorScheduler(TraitsSchedulerBase, NixlPushConnectorScheduler):
    """vLLM's push-mode NIXL scheduler with its per-group decisions taken from traits."""
