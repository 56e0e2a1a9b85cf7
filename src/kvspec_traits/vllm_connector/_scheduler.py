"""The scheduler side of both NIXL connectors (pull and push), its layout decisions
taken from traits.

vLLM's NIXL scheduler (``base_scheduler.py``) decides from spec classes which groups'
blocks a request sends: ``isinstance(spec, FullAttentionSpec)`` (is the hybrid
allocator's per-group clipping needed), ``SlidingWindowSpec`` (send only the window's
blocks), ``MambaSpec`` (keep only the state slot, and leave the last prompt token to
the decoder). Here each is answered by :func:`~kvspec_traits.vllm_connector._facts.
scheduler_facts` from ``token_scope`` and ``is_state``, replacing upstream's answers
as soon as its constructor has run (nothing reads them in between). The pull
scheduler also exports its lease deadline with each finished prefill and hands the
consumer's workers the deadlines it received (:mod:`._lease`). Everything else (the
handshake listener, leases, heartbeats, the clipping code that reads these answers) is
upstream's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)

from kvspec_traits._registry import Registry, default_registry
from kvspec_traits.vllm_connector._facts import SchedulerFacts, scheduler_facts
from kvspec_traits.vllm_connector._lease import LEASE_KEY, LEASES_ATTR, lease_offer
from kvspec_traits.vllm_connector._ratio_peer import RATIO_REGISTRATION_KEY
from kvspec_traits.vllm_connector._seam import SeamScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "TraitsNixlConnectorScheduler",
    "TraitsNixlPushConnectorScheduler",
    "TraitsSchedulerBase",
]


class TraitsSchedulerBase(SeamScheduler):
    """The traits half of both NIXL schedulers: upstream's per-group decisions (is the
    hybrid allocator needed, ``blocks_per_sw``, the state groups' blocks, is there a
    state) from :class:`SchedulerFacts`."""

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
        self.is_hma_required = (
            not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and facts.hybrid
        )
        self.blocks_per_sw = list(facts.window_blocks)
        self.ssm_spec_blocks = list(facts.state_scratch_blocks)
        self.has_mamba = facts.has_state


class TraitsNixlConnectorScheduler(TraitsSchedulerBase, NixlPullConnectorScheduler):
    """vLLM's pull-mode NIXL scheduler with its per-group decisions taken from traits,
    and leases that fail closed (:mod:`._lease`)."""

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        expiry = self.reqs_need_send.get(request.request_id)
        if delay and params is not None and params.get("do_remote_prefill") and expiry:
            # The producer's deadline, in this process's perf_counter (the clock the
            # consumer's handshake measured): the consumer reads only before it.
            params[LEASE_KEY] = lease_offer(expiry, self.kv_lease_duration)
        return delay, params

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        # Upstream's metadata keeps only the fields it knows; the lease rides beside it.
        offered = {
            req_id: (entry[0].kv_transfer_params or {}).get(LEASE_KEY)
            for req_id, entry in self.reqs_need_recv.items()
        }
        meta = super().build_connector_meta(scheduler_output)
        if not isinstance(meta, NixlConnectorMetadata):
            raise TypeError(f"vLLM's NIXL scheduler built {type(meta).__qualname__}")
        setattr(meta, LEASES_ATTR, {r: offered.get(r) for r in meta.reqs_to_recv})
        return meta


class TraitsNixlPushConnectorScheduler(TraitsSchedulerBase, NixlPushConnectorScheduler):
    """vLLM's push-mode NIXL scheduler with its per-group decisions taken from traits;
    a consumer's block registration also says where its lists start
    (:data:`~._ratio_peer.RATIO_REGISTRATION_KEY`)."""

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        registration = self.push_pending_registrations.get(request.request_id)
        if registration is None:
            return
        # Where the registered lists start (the blocks this side's prefix cache held,
        # per group, counted as the pull scheduler counts them) and the request's
        # tokens: a producer of another block size places a suffix of blocks by them.
        # Blocks that do not list their KVCacheBlock objects (vLLM's own push tests
        # stage a registration from ids alone) say nothing: the producer then places
        # the lists from the request's first block, and refuses them if they are fewer.
        params = request.kv_transfer_params or {}
        groups = getattr(blocks, "blocks", None)
        registration[RATIO_REGISTRATION_KEY] = {
            "computed": None
            if groups is None
            else [sum(b.block_hash is not None and not b.is_null for b in g) for g in groups],
            "tokens": int(params.get("remote_num_tokens") or 0) or None,
        }
