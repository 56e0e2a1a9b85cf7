"""The connector and its worker, on vLLM's pull-mode NIXL connector (push: ``_push``, same
:class:`TraitsWorkerBase`). From traits and the region planner only (no spec class named):
the worker's layout facts (transfer ``block_size``, hybrid, state descriptors, ring,
replicated-state group, group kinds, ``use_mla``, the state split), set before vLLM's
kernel block-size sync; kernel block ids; ``register_kv_caches``' regions (base,
block length, stride, count, group, name, REPLICATE/SPLIT, state and scratch indices, the
memory registered) from :func:`kvspec_traits.transfer.plan_regions`; the per-region traits
fingerprint in the agent metadata, checked against the peer's in vLLM's handshake
(:mod:`~kvspec_traits.vllm_connector._handshake`). Scheduler: ``_scheduler``; host staging:
``_staging``; leases: ``_lease_worker``; queue waits: ``_shm_wait``. The rest (transfers,
heartbeats, host copies, and the descriptor arithmetic over the decisions above) is
upstream's: docs/vllm.md lists it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlConnectorMetadata,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from kvspec_traits import __version__
from kvspec_traits._registry import Registry, default_registry
from kvspec_traits._traits import is_state
from kvspec_traits.nixl._progress import progress_delay
from kvspec_traits.nixl._ratio_descs import ratio_lanes
from kvspec_traits.nixl._register import register_ranges
from kvspec_traits.transfer import (
    SHARED_REGION_GROUP_ID,
    PlanFingerprint,
    RegionPlan,
    plan_regions,
)
from kvspec_traits.vllm_connector import _quirks as quirks
from kvspec_traits.vllm_connector import _seam as seam
from kvspec_traits.vllm_connector._consumers import HELLO, ConsumerCensus, ReplayedNotifs
from kvspec_traits.vllm_connector._errors import (
    UnsupportedStateLayoutError,
    VllmHandshakeRefusalError,
)
from kvspec_traits.vllm_connector._facts import GroupKind, LayoutFacts, layout_facts
from kvspec_traits.vllm_connector._fields import packed_layouts
from kvspec_traits.vllm_connector._gate import installed_vllm
from kvspec_traits.vllm_connector._handshake import (
    TraitsNixlAgentMetadata,
    check_decode_stage,
    check_parallel_pair,
    check_remote_fingerprint,
    handshake_with,
    logger,
    pipeline_stage,
    stage_view,
)
from kvspec_traits.vllm_connector._lease_worker import LeasedPullWorker
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME, PUSH_IMPL_MODULE
from kvspec_traits.vllm_connector._observe import planned_bytes, refusal_reason, startup_lines
from kvspec_traits.vllm_connector._options import ConnectorOptions, connector_options
from kvspec_traits.vllm_connector._policy import VllmLayoutPolicy, layout_policy
from kvspec_traits.vllm_connector._ratio_peer import (
    RatioPeer,
    at_our_block_size,
    read_request,
    slot_parts,
)
from kvspec_traits.vllm_connector._scheduler import TraitsNixlConnectorScheduler
from kvspec_traits.vllm_connector._shm_wait import holding_shm_wait, release_shm_wait
from kvspec_traits.vllm_connector._staging import transfer_caches
from kvspec_traits.vllm_connector._stats import (
    TraitsNixlKVConnectorStats,
    TraitsStatsConnector,
    traits_stats,
)
from kvspec_traits.vllm_connector._tp_peer import (
    TPConsumer,
    TPPeer,
    read_tp_request,
    reads_tp_peer,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["TraitsNixlAgentMetadata", "TraitsNixlConnector", "TraitsNixlConnectorWorker"]

_T = TypeVar("_T")


class TraitsWorkerBase(seam.SeamWorker):
    """The traits half of both NIXL workers (pull: below; push: ``_push``): every layout
    decision vLLM's base worker takes, from traits and the region plan (vLLM's private
    names through :mod:`._seam`)."""

    # Class defaults: vLLM's tests build workers with object.__new__ (upstream's fields only).
    region_plan: RegionPlan | None = None
    stage_view: RegionPlan | None = None  # whole rows as a PP stage pairs with them
    traits_fingerprint: PlanFingerprint | None = None
    _traits_registry: Registry = default_registry
    _policy: VllmLayoutPolicy = layout_policy()
    options: ConnectorOptions = ConnectorOptions()
    peer_metadata_class = TraitsNixlAgentMetadata

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        *,
        registry: Registry | None = None,
        options: ConnectorOptions | None = None,
    ) -> None:
        if registry is not None:  # else the class default (or what a subclass set)
            self._traits_registry = registry
        self.options = options or vars(self).get("options") or connector_options(vllm_config)
        check_decode_stage(vllm_config, self._policy.quirks.series)  # before an agent exists
        # Before super().__init__: its block-size sync hook (below) needs them.
        self.layout_facts = layout_facts(kv_cache_config, self._traits_registry)
        with progress_delay(self.options.nixl_progress_delay_us):  # the agent is built here
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self.xfer_stats = TraitsNixlKVConnectorStats()  # upstream's counters and ours
        self._own_group_kinds()

    def _layout_facts(self) -> LayoutFacts:
        """The layout facts (computed here for a worker built without __init__)."""
        facts: LayoutFacts | None = self.__dict__.get("layout_facts")
        if facts is None:
            facts = layout_facts(self.kv_cache_config, self._traits_registry)
            self.layout_facts = facts
        return facts

    # -- decisions vLLM takes in __init__ ---------------------------------------------

    def apply_layout_decisions(self) -> None:
        # vLLM's __init__ calls this after its class-based answers: replace them.
        facts = self.layout_facts
        if facts.transfer_block_size is not None:
            self.block_size = facts.transfer_block_size
        else:
            self.block_size = int(self.vllm_config.cache_config.block_size)
        self.is_hma_required = (
            not self.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and facts.hybrid
        )
        # vLLM's state descriptors: TP-sharded states (and a ring model's PLE cache);
        # a replicated state elsewhere moves as replicated pages (GroupKind).
        self.has_mamba = facts.state_descriptors
        # use_mla from the caches, not the model config (else MLA might transfer per head).
        if self.use_mla != facts.mla:
            logger.info(
                "%s: use_mla %s from the KV cache layers (the model config says %s)",
                CONNECTOR_NAME,
                facts.mla,
                self.use_mla,
            )
        self.use_mla = facts.mla
        self.is_csa_linear = facts.has_ring
        self.ple_group_index = facts.replicated_state_kv_cache_group
        # The state split from traits, replacing vLLM's derive_mamba_conv_split (equal
        # for vLLM's Mamba kinds; the only one for a state class vLLM does not know).
        if facts.state_split is not None:
            self.conv_decomp = seam.conv_split_info(facts.state_split)
            self.mamba_ssm_size = facts.state_split.sizes

    def _own_group_kinds(self) -> None:
        """Replace vLLM's class-based group kinds (set in its ``__init__`` from
        ``type(spec)``) with the traits' (:func:`._seam.group_spec_types`), and 0.34's
        DCP-replicated groups (MLA classes) with the groups whose every layer is
        TP-replicated."""
        facts = self.layout_facts
        planned = tuple(g.kv_cache_group for g in facts.transfer_groups)
        if tuple(self.kv_cache_config.transfer_group_ids) != planned:
            raise ValueError(
                f"{CONNECTOR_NAME}: vLLM transfers cache groups "
                f"{self.kv_cache_config.transfer_group_ids}, the region planner {planned}"
            )
        self.group_spec_types = seam.group_spec_types(facts.group_kinds)
        self.keep_dcp_replicated_groups(facts.replicated_groups(), facts.transfer_groups)

    def logical_to_kernel_block_ids(self, block_ids: Any, ratio: int) -> Any:
        """Manager blocks to kernel blocks, per transfer group: a state group's blocks
        are indivisible (kept as they are), every other group's block ``b`` is kernel
        blocks ``b * ratio`` to ``b * ratio + ratio - 1`` (vLLM's rule, its group kinds
        from traits)."""
        if ratio == 1:
            return block_ids
        kinds = self._layout_facts().group_kinds
        return [
            list(group)
            if kinds[i] in (GroupKind.STATE, GroupKind.REPLICATED_STATE)
            else [b * ratio + k for b in group for k in range(ratio)]
            for i, group in enumerate(block_ids)
        ]

    def compute_desc_ids(
        self, block_ids: Any, upstream: Callable[[Any], Any], region_keys: Any
    ) -> Any:
        """vLLM 0.32/0.33's descriptor ids, each group's blocks in the regions of its own
        layers only (:attr:`RegionPlan.group_regions`: the planner's answer). vLLM reads
        a group's blocks in regions none of its layers uses: with state descriptors, an
        attention-typed group's in every region (three GDN layers beside one attention
        layer: the attention blocks in all three tensors); without, every group's in
        each region shared by several groups (gpt-oss with five layers: a group of one
        layer in a tensor shared by two others). Upstream lists a group's ids region by
        region, so its rows are narrowed to the group's regions; the rest is vLLM's.
        Both sides of a read narrow alike (their region lists are equal); ids vLLM
        expanded per region (``region_keys`` not the plan's group ids) are vLLM's."""
        plan = self.region_plan
        if (
            plan is None
            or self.pp_size > 1  # stages route by layer name or region offset: vLLM's
            or self.num_regions != len(plan.regions)
            or self.transfer_layer_region_indices()
            or len(block_ids) != plan.num_groups
            or (region_keys is not None and list(region_keys) != plan.region_group_ids)
        ):
            return upstream(block_ids)
        rows = self._upstream_regions(plan)
        narrowed = {
            g: [k for k, region in enumerate(read) if region in plan.group_regions[g]]
            for g, read in enumerate(rows)
            if read is not None and len(read) > len(plan.group_regions[g])
        }
        if not narrowed:
            return upstream(block_ids)
        empty: list[list[int]] = [[] for _ in block_ids]
        parts = []
        for g, ids in enumerate(block_ids):
            if not len(ids):
                continue
            alone = list(empty)
            alone[g] = ids
            got = np.asarray(upstream(alone))
            read = rows[g]
            if g in narrowed and read is not None:
                got = got.reshape(len(read), len(ids))[narrowed[g]].ravel()
            parts.append(got)
        return np.concatenate(parts) if parts else upstream(block_ids)

    def _upstream_regions(self, plan: RegionPlan) -> list[list[int] | None]:
        """Per transfer group, the regions vLLM 0.32/0.33's ``_compute_desc_ids`` reads
        its blocks in, one row of ids each (``None``: not a row per region, or not
        narrowed: state descriptors, a ring's scratch regions)."""
        every = list(range(len(plan.regions)))
        kinds = self._layout_facts().group_kinds
        if self.has_mamba:
            paged = (GroupKind.PAGED, GroupKind.REPLICATED_STATE)
            return [every if kind in paged else None for kind in kinds]
        gids = plan.region_group_ids
        if len(set(gids)) == 1:  # one group, or every region shared: all regions
            return [every for _ in kinds]
        return [
            [i for i, x in enumerate(gids) if x in (g, SHARED_REGION_GROUP_ID)]
            for g in range(len(kinds))
        ]

    # -- register_kv_caches -------------------------------------------------------------

    def plan(
        self, kv_caches: Mapping[str, torch.Tensor], *, pp_size: int | None = None
    ) -> RegionPlan:
        """The region plan of ``kv_caches`` for this rank (no NIXL calls), laid out as
        this vLLM series registers it (:class:`VllmLayoutPolicy`; with ``pp_size``, as
        a pipeline stage of that size would)."""
        facts = self._layout_facts()
        ratio = self.physical_blocks_per_logical_kv_block
        if facts.replicated_state_layers and ratio != 1:
            layer = min(facts.replicated_state_layers)
            raise UnsupportedStateLayoutError(
                facts.layer_traits[layer].spec_name,
                layer,
                "tp_layout",
                f"a TP-replicated state moves as whole pages of its own regions, and "
                f"vLLM's worker would address them as {ratio} kernel blocks per block",
            )
        # HiSparse groups: over the host pool's blocks (hisparse_host_num_blocks), as vLLM.
        return plan_regions(
            kv_caches,
            self.kv_cache_config,
            tp_size=self.transfer_tp_size,
            tp_rank=self.transfer_tp_rank,
            registry=self._traits_registry,
            layout=self._policy.worker_layout(self, facts, pp_size=pp_size),
            # What vLLM's own TransferTopology reads: a spec cannot tell one KV head of
            # one at TP 2 from one head of two (issue 47).
            total_kv_heads=None if self.use_mla else self.model_config.get_total_num_kv_heads(),
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV caches with NIXL, regions planned from traits."""
        self._set_topology_and_hash(kv_caches)

        # The caches, or (kv_buffer_device "cpu" on an accelerator) the host buffer upstream's
        # copies fill before a send and after a receive: regions and fingerprint of what NIXL moves.
        plan = self.plan(transfer_caches(self, kv_caches))
        self.region_plan = plan
        self._apply_plan(plan)

        register_ranges(
            self.nixl_wrapper,
            plan.registrations,
            self.nixl_backends,
            self.registered_descs,
            skip={"DRAM"} if self.skip_dram_xfer else (),
        )

        self.device_kv_caches = kv_caches
        self.dst_num_blocks[self.engine_id] = self.num_blocks
        self.dst_region_num_blocks[self.engine_id] = self._xfer_region_num_blocks()
        self.dst_region_group_ids[self.engine_id] = self.region_group_ids
        self.keep_dst_region_group_mapping(self.engine_id, self.uses_region_group_mapping)
        self.dst_region_mem_types[self.engine_id] = self.region_mem_types

        self.src_xfer_handles_by_block_size[self.block_size], self.src_blocks_data = (
            self.register_local_xfer_handler(self.block_size)
        )

        stage = pipeline_stage(self)
        self.traits_fingerprint = plan.fingerprint(pp=(stage.rank, stage.size))
        self.stage_view = stage_view(self, kv_caches, plan)
        logger.info(
            "%s: registered %d NIXL regions planned from layout traits "
            "(fingerprint %s, replicated %s)",
            CONNECTOR_NAME,
            len(plan.regions),
            self.traits_fingerprint.digest[:16],
            self.region_is_mla,
        )
        self._log_startup(plan)
        if self.compat_hash is None:
            raise RuntimeError("compatibility hash was not computed")
        self.xfer_handshake_metadata = NixlHandshakePayload(
            compatibility_hash=self.compat_hash,
            agent_metadata_bytes=msgspec.msgpack.Encoder().encode(self._agent_metadata(plan)),
        )

    def _set_topology_and_hash(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """vLLM's transfer topology (gathering replicas: issue 47) and compatibility
        hash, as its ``register_kv_caches`` sets them."""
        # Through base_worker's names: vLLM's tests (and users' hooks) patch them there.
        topology = seam.gathering_topology(_bw.TransferTopology)  # type: ignore[attr-defined]
        self.transfer_topo = topology(
            tp_rank=self.transfer_tp_rank,
            tp_size=self.transfer_tp_size,
            block_size=self.block_size,
            engine_id=self.engine_id,
            is_mla=self.use_mla,
            total_num_kv_heads=1 if self.use_mla else self.model_config.get_total_num_kv_heads(),
            attn_backends=self.attn_backends,
            dcp_size=self.dcp_size,
            tensor_shape=None if self.has_mamba else next(iter(kv_caches.values())).shape,
            is_mamba=self.has_mamba,
        )
        # As upstream: a push worker hashes every backend of a packed cache (PP reorders them).
        names = {self.backend_name}
        if self.supports_pp_hma and self.has_packed_cache:
            names = {b.get_name() for b in self.attn_backends}
        self.compat_hash = _bw.compute_nixl_compatibility_hash(  # type: ignore[attr-defined]
            self.vllm_config, ",".join(sorted(names)), transfer_mode=self.transfer_mode
        )

    def _agent_metadata(self, plan: RegionPlan) -> TraitsNixlAgentMetadata:
        """What a peer's handshake receives: vLLM's agent metadata of the planned
        regions, with the traits fingerprint (and a PP 1 push worker's stage view)."""
        if self.traits_fingerprint is None:
            raise RuntimeError("the traits fingerprint was not computed")
        return TraitsNixlAgentMetadata(
            engine_id=self.engine_id,
            agent_metadata=self.nixl_wrapper.get_agent_metadata(),
            device_id=self.device_id,
            kv_caches_base_addr=self.kv_caches_base_addr[self.engine_id][self.tp_rank],
            num_blocks=self.num_blocks,
            block_lens=self.block_len_per_layer,
            block_strides=self.block_stride_per_layer,
            kv_cache_layout=self.host_buffer_kv_cache_layout
            if self.use_host_buffer
            else self.kv_cache_layout,
            block_size=self.block_size,
            ssm_sizes=self.mamba_ssm_size,
            ple_block_len=self.ple_block_len,
            attn_backend_name=self.backend_name,
            physical_blocks_per_logical_kv_block=self.physical_blocks_per_logical_kv_block,
            region_num_blocks=self.region_num_blocks,
            region_group_ids=self.region_group_ids,
            region_names=self.region_names,
            region_mem_types=self.region_mem_types,
            dcp_size=self.dcp_size,
            pcp_size=self.pcp_size,
            region_members=self.region_members,
            packed_member_layouts=packed_layouts(plan),
            kvspec_traits_fingerprint=self.traits_fingerprint.canonical(),
            kvspec_traits_stage_view=self.stage_view.fingerprint().canonical()
            if self.stage_view is not None
            else None,
            **self._layer_group_ids(),
        )

    def _log_startup(self, plan: RegionPlan) -> None:
        """Once per worker: versions, options in effect, one line per region."""
        for line in startup_lines(
            version=__version__,
            vllm_version=installed_vllm(),
            engine_id=self.engine_id,
            tp_rank=self.transfer_tp_rank,
            tp_size=self.transfer_tp_size,
            options=self.options,
            plan=plan,
        ):
            logger.info("%s", line)

    def _layer_group_ids(self) -> dict[str, dict[str, int]]:
        """vLLM 0.34's metadata names each region member's transfer group."""
        if not quirks.metadata_has_layer_group_ids(NixlAgentMetadata):
            return {}
        by_layer = {
            layer: g.index for g in self._layout_facts().transfer_groups for layer in g.layer_names
        }
        return {
            "layer_group_ids": {
                name: by_layer[name] for names in self.region_members for name in names
            }
        }

    def _xfer_region_num_blocks(self) -> list[int]:  # 0.32/0.33: the transfer layers' regions
        indices = self.transfer_layer_region_indices()
        if indices:
            return [self.region_num_blocks[i] for i in indices]
        return list(self.region_num_blocks)

    def _apply_plan(self, plan: RegionPlan) -> None:
        """Fill vLLM's per-region bookkeeping from the plan (the fields of
        :func:`._seam.worker_fields`, then what each vLLM series keeps its own way)."""
        regions = plan.regions
        self.keep_plan_fields(plan)
        self.ple_block_len = None
        if self.ple_region_index is not None:
            region = regions[self.ple_region_index]
            layer_traits = self._layout_facts().layer_traits
            state_pages = [
                layer_traits[layer].page_size_bytes
                for layer in region.layers
                if is_state(layer_traits[layer])
            ]
            # Per kernel block, as vLLM keeps it (it reads ratio of them per page).
            self.ple_block_len = max(state_pages) // self.physical_blocks_per_logical_kv_block
        devices = {r.device_id for r in regions if r.mem_type != "DRAM"}
        if devices:
            self.device_id = max(devices)
        self.uses_region_group_mapping = len(set(self.region_group_ids)) > 1
        self.mixed_mem_types = len(set(self.region_mem_types)) > 1
        if self.has_mamba:
            # vLLM counts state descriptors per logical block in every region.
            self.region_num_blocks = [self.num_blocks] * self.num_regions
        self.set_region_layers(
            [list(r.layers) for r in regions] if self.tracks_region_layers() else []
        )
        self.keep_group_region_indices(
            [(r.index, r.group_ids) for r in regions],
            len(self._layout_facts().transfer_groups),
        )
        if self.pp_size > 1 and self.stage_regions_by_position():
            start, end = self.model_config.get_layers_start_end_indices(
                self.vllm_config.parallel_config
            )
            if end <= start or self.num_regions % (end - start):
                raise ValueError(
                    f"{CONNECTOR_NAME}: {self.num_regions} regions do not "
                    f"split over {end - start} local layers"
                )
            self.remote_region_offset = self.num_regions // (end - start) * start
        self.num_descs = sum(self._xfer_region_num_blocks())
        self.skip_dram_xfer = self.leaves_dram_xfer_to_rank0()
        if self.mixed_mem_types and (not self.use_mla or self.has_mamba):
            raise ValueError(
                f"{CONNECTOR_NAME}: mixed-device KV registration is only "
                f"supported for MLA models without recurrent state"
            )
        # vLLM 0.33+ derives these from the regions at the same point.
        self.derive_region_sets(packed_layouts(plan))

    # -- handshake (the checks are vllm_connector._handshake's) --------------------------

    def nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        remote_pp_size: int,
        handshake: Callable[[], _T],
    ) -> _T:
        try:
            check_parallel_pair(self, remote_tp_size, remote_pp_size)
            # vLLM's handshake (its socket, its order: the compatibility hash, then the
            # metadata decode, into TraitsNixlAgentMetadata) checks the decoded metadata,
            # then calls check_remote_fingerprint with it (the peer's address kept here).
            with handshake_with(host, port):
                return handshake()
        except Exception as err:  # counted by reason, then vLLM's failure path as before
            reason = refusal_reason(err)
            if reason is not None:
                traits_stats(self).record_refused_peer(reason)
            raise

    def check_remote_fingerprint(self, agent_metadata: NixlAgentMetadata) -> None:
        """Compare the peer's per-region traits fingerprint with ours (see
        :func:`~kvspec_traits.vllm_connector._handshake.check_remote_fingerprint`)."""
        check_remote_fingerprint(
            self.region_plan,
            agent_metadata,
            require_traits_peer=self.options.require_traits_peer,
            stage_of=lambda: pipeline_stage(self),
            stage_view=self.stage_view,
            keep_region_offset=self._keep_region_offset,
            read_ratio=self.ratio_reader(agent_metadata.engine_id),
        )
        if getattr(agent_metadata, "kvspec_traits_fingerprint", None) is None:
            traits_stats(self).record_upstream_peer()  # accepted (and warned about)

    # -- peers of another block size (._ratio_peer) ---------------------------------------

    def _ratio_peers(self) -> dict[str, RatioPeer]:
        # Lazily: vLLM's tests build workers with object.__new__.
        peers: dict[str, RatioPeer] = self.__dict__.setdefault("_kvspec_ratio_peers", {})
        return peers

    def ratio_reader(self, engine_id: str) -> Callable[[int, tuple[int, ...] | None], None]:
        """What keeps peer ``engine_id`` whose blocks hold other token counts than ours
        (given its TP size and tokens per block of each region): the lanes our blocks
        read (pull), which plan every region or raise the planner's refusal by name, so
        a push worker refuses what its consumer could not read either."""
        peers = self._ratio_peers()

        def keep(remote_tp: int, tokens: tuple[int, ...] | None) -> None:
            # Called once per remote rank's handshake: the ranks kept so far stay while
            # the peer's layout stays; a peer handshaken again at our size is forgotten.
            plan = self.region_plan
            if tokens is None or plan is None:
                peers.pop(engine_id, None)
                return
            parts = tuple(slot_parts(self, plan))
            lanes = ratio_lanes(plan, remote_tp, tokens, parts)
            kept = peers.get(engine_id)
            if kept is None or (kept.lanes, kept.remote_tp) != (lanes, remote_tp):
                peers[engine_id] = RatioPeer(lanes, remote_tp, tokens, parts)

        return keep

    def add_remote_agent(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
        remote_dcp_size: int = 1,
    ) -> str:
        """vLLM's registration of a peer rank; a peer of another block size is kept for
        the connector's reads (and a push producer's writes, planned here) and handed
        to vLLM at this worker's block size (:func:`._ratio_peer.at_our_block_size`)."""
        engine = nixl_agent_meta.engine_id
        peer = self._ratio_peers().get(engine)
        if peer is not None:
            writes = self.region_plan if self.transfer_mode == "push" else None
            peer.keep_rank(remote_tp_rank, nixl_agent_meta, writes)
            nixl_agent_meta = at_our_block_size(
                nixl_agent_meta,
                peer,
                self.block_size,
                self.physical_blocks_per_logical_kv_block,
            )
        try:
            name: str = super().add_remote_agent(
                nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size
            )
        except (AssertionError, StopIteration) as err:
            if self.region_plan is None:  # not registered by us (vLLM's tests): vLLM's
                raise
            detail = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            raise VllmHandshakeRefusalError(engine, remote_tp_rank, detail) from err
        if peer is None and reads_tp_peer(
            self, nixl_agent_meta, remote_tp_size, remote_dcp_size, self.region_plan
        ):
            self._keep_tp_peer(nixl_agent_meta, remote_tp_rank, remote_tp_size, name)
        else:
            self._forget_tp_peer(engine)
        return name

    def _tp_peers(self) -> dict[str, TPPeer]:
        # Lazily: vLLM's tests build workers with object.__new__.
        peers: dict[str, TPPeer] = self.__dict__.setdefault("_kvspec_tp_peers", {})
        return peers

    def _tp_consumers(self) -> dict[str, TPConsumer]:
        consumers: dict[str, TPConsumer] = self.__dict__.setdefault("_kvspec_tp_consumers", {})
        return consumers

    def _keep_tp_peer(
        self, metadata: NixlAgentMetadata, rank: int, remote_tp: int, agent_name: str
    ) -> None:
        """Keep remote rank ``rank`` (NIXL agent ``agent_name``) of a peer of
        ``remote_tp`` ranks, which the connector reads (pull) or writes (push) itself
        (:mod:`._tp_peer`); a peer seen before at another TP size or geometry is
        planned anew."""
        plan = self.region_plan
        if plan is None:
            return
        engine = metadata.engine_id
        kept: TPPeer | TPConsumer | None
        if self.transfer_mode == "push":
            kept = self._tp_consumers().get(engine)
            if kept is None or kept.remote_tp != remote_tp or kept.plan is not plan:
                self._forget_tp_peer(engine)
                kept = self._tp_consumers()[engine] = TPConsumer(plan, remote_tp)
        else:
            kept = self._tp_peers().get(engine)
            if kept is None or kept.remote_tp != remote_tp or kept.plan is not plan:
                self._forget_tp_peer(engine)
                kept = self._tp_peers()[engine] = TPPeer.of(plan, remote_tp, metadata)
        kept.keep_rank(self, rank, metadata, agent_name)
        logger.info(
            "%s: peer engine %s rank %d of TP %d (ours: TP %d): its %s planned from layout "
            "traits (transfer.tp_reads), not vLLM's split descriptors",
            CONNECTOR_NAME,
            engine,
            rank,
            remote_tp,
            plan.tp_size,
            "writes" if self.transfer_mode == "push" else "reads",
        )

    def _forget_tp_peer(self, engine_id: str) -> None:
        for peers in (self._tp_peers(), self._tp_consumers()):
            peer = peers.pop(engine_id, None)
            if peer is not None:
                peer.release(self)

    def release_tp_peers(self) -> None:
        """Release the lists prepared for peers of another TP size (:mod:`._tp_peer`)."""
        for engine_id in {*self._tp_peers(), *self._tp_consumers()}:
            self._forget_tp_peer(engine_id)

    def shutdown(self) -> None:
        """vLLM's shutdown, after :meth:`release_tp_peers`."""
        self.release_tp_peers()
        super().shutdown()

    def _keep_region_offset(self, offset: int) -> None:
        """vLLM 0.32/0.33 slice a PP 1 peer's regions from this offset for a stage:
        the one the stage's layers pair with (``check_remote_fingerprint``)."""
        self.remote_region_offset = offset


class TraitsNixlConnectorWorker(TraitsWorkerBase, LeasedPullWorker):
    """vLLM's pull-mode NIXL worker: layout from traits, leases that fail closed."""

    def read_blocks_for_req(
        self, req_id: str, meta: Any, upstream: Callable[[str, Any], None]
    ) -> None:
        def read(req: str, request: Any) -> None:
            # Past the handshake vLLM reads now (before it, it starts the handshake and
            # comes back): the bytes this rank's plan moves for the request.
            plan = self.region_plan
            engine = request.remote.engine_id
            if (
                plan is not None
                and engine in self.remote_agents
                and not self.upstream_declines(request)  # vLLM fails it, as its own
            ):
                nbytes = planned_bytes(plan, request.local_physical_block_ids)
                if nbytes:
                    traits_stats(self).record_planned_bytes(nbytes)
                peer = self._ratio_peers().get(engine)
                if peer is not None and any(request.local_physical_block_ids):
                    read_request(self, peer, req, request)  # another block size: ours
                    return
                tp_peer = self._tp_peers().get(engine)
                if tp_peer is not None and any(request.local_physical_block_ids):
                    read_tp_request(self, tp_peer, req, request)  # another TP size: ours
                    return
            upstream(req, request)

        super().read_blocks_for_req(req_id, meta, read)

    # -- who reads from this producer (._consumers) ---------------------------------------

    def nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        remote_pp_size: int,
        handshake: Callable[[], _T],
    ) -> _T:
        done = super().nixl_handshake(host, port, remote_tp_size, remote_pp_size, handshake)
        # vLLM's pull handshake gives (remote ranks -> agent names, clock offset).
        agents = done[0] if isinstance(done, tuple) and done and isinstance(done[0], dict) else {}
        for agent in agents.values():
            try:  # before any read or heartbeat goes there; never fails the handshake
                self.nixl_wrapper.send_notif(agent, notif_msg=HELLO)
            except Exception as err:  # an announcement only; reads follow
                logger.debug("%s: no announcement to %s: %r", CONNECTOR_NAME, agent, err)
        return done

    def get_new_notifs(self, upstream: Callable[[], set[str]]) -> set[str]:
        agent = self.nixl_wrapper
        notifs = agent.get_new_notifs()
        if notifs:
            census: ConsumerCensus | None = self.__dict__.get("_consumer_census")
            if census is None:  # lazily: vLLM's tests build workers with object.__new__
                census = self.__dict__["_consumer_census"] = ConsumerCensus(self._upstream_reader)
            census.saw(notifs)
        self.nixl_wrapper = ReplayedNotifs(agent, notifs)  # vLLM handles what we saw
        try:
            return upstream()
        finally:
            self.nixl_wrapper = agent

    def _upstream_reader(self, agent: str) -> None:
        logger.warning(
            "%s: NIXL consumer agent %s reads from this producer without announcing "
            "kvspec-traits: it runs upstream's NixlConnector (or a kvspec-traits without "
            "the announcement); the pair's layout is checked by vLLM's compatibility hash "
            "only, not by the traits fingerprint",
            CONNECTOR_NAME,
            agent,
        )
        traits_stats(self).record_upstream_peer()


class TraitsNixlConnector(TraitsStatsConnector, NixlPullConnector):
    """vLLM's ``NixlConnector`` whose worker plans regions from traits: a subclass of its
    pull connector (every method a series adds, e.g. 0.33's sleep mode, is ours too), or a
    ``TraitsNixlPushConnector`` where ``options.transfer_mode`` is ``"push"`` (0.34).
    Its stats and metrics are upstream's plus the connector's (:mod:`._stats`)."""

    options: ConnectorOptions  # by __new__: the vLLM version checked, then every key read

    def __new__(cls, vllm_config: VllmConfig, role: Any, kv_cache_config: Any) -> Any:
        connector = super().__new__(cls)
        options = connector.options = connector_options(vllm_config)
        if cls is TraitsNixlConnector and options.transfer_mode == "push":
            push = import_module(PUSH_IMPL_MODULE)  # by name: _push imports this module
            return push.TraitsNixlPushConnector(vllm_config, role, kv_cache_config, options=options)
        return connector

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        # Before this process waits on a queue; let go in shutdown (below).
        with holding_shm_wait(self.options.shm_wait, self):
            # Not NixlPullConnector.__init__: it would build upstream's worker (an agent).
            NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
            if role == KVConnectorRole.SCHEDULER:
                self.connector_scheduler = TraitsNixlConnectorScheduler(
                    vllm_config, self.engine_id, kv_cache_config
                )
            elif role == KVConnectorRole.WORKER:
                self.connector_worker = TraitsNixlConnectorWorker(
                    vllm_config, self.engine_id, kv_cache_config, options=self.options
                )
            else:
                raise ValueError(f"{CONNECTOR_NAME}: unknown connector role {role!r}")

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[no-untyped-call]  # vLLM's is untyped
        finally:
            release_shm_wait(self)  # kvspec_shm_wait: the last connector puts vLLM's back

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self.connector_worker
        if not isinstance(worker, NixlPullConnectorWorker):
            raise RuntimeError(f"{CONNECTOR_NAME}.start_load_kv called without a worker")
        metadata = seam.connector_metadata(self)
        if not isinstance(metadata, NixlConnectorMetadata):
            raise RuntimeError(
                f"{CONNECTOR_NAME}: expected NIXL connector metadata, got "
                f"{type(metadata).__qualname__}"
            )
        worker.start_load_kv(metadata)
