"""The seam to vLLM: every private name of vLLM's that the connector reads, writes,
overrides or calls is here and nowhere else under src/kvspec_traits, listed in
:data:`NAMES` (owner, kind, the series that have it, why no public way serves) and
checked against each vLLM series by tests/test_vllm_seam.py.

vLLM's NIXL connector has no public hook for what the connector replaces (the layout
decisions its worker takes from spec classes, the peer metadata its handshake decodes,
the pull worker's read path), so the connector subclasses vLLM's classes. Here:

- the seam classes override vLLM's private methods and forward to public-named methods
  the connector's classes override (:meth:`SeamWorker.apply_layout_decisions`, ...),
  and give the private attributes the connector reads or writes names of ours
  (:class:`_Alias`; the contract test checks vLLM's classes have no such name);
- what only some series keep is probed on the object (vLLM's tests build workers with
  ``object.__new__``: an attribute is there exactly when the code reading it can be);
- the group kind tags and the state split in vLLM's vocabulary;
- the one process-wide change to vLLM, :class:`QueueWaitSwitch`.

Cut for a public way: ``KVConnectorFactory._registry`` (``_gate.register_with_vllm``
registers through ``register_connector``, which refuses a registered name).
Imports vLLM's NIXL modules: import it only where vLLM is already needed.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import types
from collections.abc import Callable, Collection, Sequence
from typing import Any, Generic, Self, TypeVar, cast, overload

from vllm.distributed import utils as vllm_utils
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)
from vllm.v1.attention.backends import cpu_attn as vllm_cpu_attn

from kvspec_traits.transfer import BlockIdShapeError, RegionPlan
from kvspec_traits.vllm_connector._errors import UnsupportedVllmVersionError
from kvspec_traits.vllm_connector._facts import GroupKind, StateSplit
from kvspec_traits.vllm_connector._fields import replicated_state_region

__all__ = [
    "NAMES",
    "Kind",
    "QueueWaitSwitch",
    "SeamPullWorker",
    "SeamPushWorker",
    "SeamScheduler",
    "SeamWorker",
    "VllmName",
    "connector_metadata",
    "conv_split_info",
    "group_spec_types",
    "kind_tag",
    "queue_wait_switch",
    "worker_fields",
]

_T = TypeVar("_T")
_V = TypeVar("_V")


class Kind(enum.StrEnum):
    """What the connector does with a name (the contract test checks each kind its way)."""

    ATTRIBUTE = "attribute"  # set on instances by vLLM's code
    CLASS_ATTRIBUTE = "class attribute"
    OVERRIDDEN = "method overridden"
    CALLED = "method called"
    FUNCTION_GLOBAL = "function global"  # a module global a vLLM function reads
    MODULE_FLAG = "module flag"


@dataclasses.dataclass(frozen=True)
class VllmName:
    """One name of vLLM's the connector uses: ``owner`` (a class, module or function)
    holds ``name`` in the vLLM ``series`` listed, and ``why`` no public way serves."""

    owner: type | types.ModuleType | Callable[..., Any]
    name: str
    kind: Kind
    series: frozenset[str]
    why: str


_ALL = frozenset({"0.32", "0.33", "0.34"})
_TO_33 = frozenset({"0.32", "0.33"})
_FROM_33 = frozenset({"0.33", "0.34"})
_ONLY_34 = frozenset({"0.34"})
_W, _PW, _S = NixlBaseConnectorWorker, NixlPullConnectorWorker, NixlBaseConnectorScheduler
_PUW, _PUS = NixlPushConnectorWorker, NixlPushConnectorScheduler
_A, _CA, _O, _C = Kind.ATTRIBUTE, Kind.CLASS_ATTRIBUTE, Kind.OVERRIDDEN, Kind.CALLED
_CLASS_RULE = "vLLM's decision from spec classes; no hook replaces it"
_BOOK = "register_kv_caches' bookkeeping, set from our plan; no setter"

NAMES: tuple[VllmName, ...] = (
    # The worker's decisions from spec classes (its __init__), replaced from traits.
    VllmName(
        _W,
        "_sync_block_size_with_kernel",
        _O,
        _ALL,
        "runs between the constructor's class answers and their use",
    ),
    VllmName(_W, "_is_hma_required", _A, _ALL, _CLASS_RULE),
    VllmName(_W, "_has_mamba", _A, _ALL, _CLASS_RULE),
    VllmName(_W, "_is_csa_linear", _A, _ALL, _CLASS_RULE),
    VllmName(_W, "_ple_group_index", _A, _ALL, _CLASS_RULE),
    VllmName(_W, "_conv_decomp", _A, _ALL, _CLASS_RULE),
    VllmName(_W, "_mamba_ssm_size", _A, _ALL, _CLASS_RULE),
    VllmName(_W, "_group_spec_types", _A, _ALL, _CLASS_RULE),
    VllmName(_W, "_dcp_replicated_groups", _A, _ONLY_34, _CLASS_RULE),
    VllmName(
        _W,
        "_logical_to_kernel_block_ids",
        _O,
        _ALL,
        "expands by spec class; no hook for group kinds",
    ),
    VllmName(
        _W,
        "_compute_desc_ids",
        _O,
        _ALL,
        "0.32/0.33 read a group's blocks in every region with state; no hook for which",
    ),
    # What register_kv_caches keeps (the worker's is replaced, not extended).
    VllmName(_W, "_region_is_mla", _A, _ALL, _BOOK),
    VllmName(_W, "_ssm_region_indices", _A, _ALL, _BOOK),
    VllmName(_W, "_scratch_region_indices", _A, _TO_33, _BOOK),
    VllmName(_W, "_ple_region_index", _A, _ALL, _BOOK),
    VllmName(_W, "_ple_block_len", _A, _ALL, _BOOK),
    VllmName(_W, "_mixed_mem_types", _A, _ALL, _BOOK),
    VllmName(_W, "_uses_region_group_mapping", _A, _TO_33, _BOOK),
    VllmName(_W, "dst_uses_region_group_mapping", _A, _TO_33, f"public name, probed: {_BOOK}"),
    VllmName(_W, "_skip_dram_xfer", _A, _ALL, _BOOK),
    VllmName(_W, "_remote_region_offset", _A, _TO_33, _BOOK),
    VllmName(_W, "_group_region_indices", _A, _ONLY_34, _BOOK),
    VllmName(_W, "_head_sharded_draft_regions", _A, _FROM_33, _BOOK),
    VllmName(_W, "_packed_member_layouts", _A, _FROM_33, _BOOK),
    VllmName(_W, "_set_region_layers", _C, _ALL, "no public setter for the per-layer region maps"),
    VllmName(
        _W,
        "_leaves_dram_xfer_to_rank0",
        _C,
        _ALL,
        "vLLM's HiSparse rank-0 rule; private, not re-derived",
    ),
    VllmName(
        _W,
        "_get_head_sharded_draft_regions",
        _C,
        _FROM_33,
        "vLLM's draft-region rule; private, not re-derived",
    ),
    VllmName(
        _W, "_registered_descs", _A, _ALL, "vLLM deregisters them at shutdown; no register API"
    ),
    # What the worker reads of vLLM's state.
    VllmName(_W, "_TRANSFER_MODE", _CA, _ALL, "the worker's mode; no public attribute"),
    VllmName(_W, "_supports_pp_hma", _CA, _ALL, "push workers' flag (compat hash); no public one"),
    VllmName(
        _W,
        "_physical_blocks_per_logical_kv_block",
        _A,
        _ALL,
        "kernel blocks per block; no public one",
    ),
    VllmName(_W, "_has_packed_cache", _A, _ALL, "vLLM's block-outermost test; no public one"),
    VllmName(
        _W, "_transfer_layer_region_indices", _A, _TO_33, "the regions vLLM moves; no public list"
    ),
    VllmName(_W, "_tracks_region_layers", _C, _TO_33, "whether vLLM keeps region members; private"),
    VllmName(
        _W, "_requires_layer_name_routing", _C, _TO_33, "whether PP stages pair by name; private"
    ),
    # The handshake: the peer's metadata decoded into ours, checked after vLLM's checks.
    VllmName(_W, "_nixl_handshake", _O, _ALL, "the peer checks wrap it; no handshake hook"),
    VllmName(
        _W._nixl_handshake,
        "NixlAgentMetadata",
        Kind.FUNCTION_GLOBAL,
        _ALL,
        "the decode class; no parameter, so ours goes in a copy",
    ),
    VllmName(
        _W,
        "_validate_remote_parallel_config",
        _O,
        _ALL,
        "the one call given the decoded peer metadata",
    ),
    # The pull worker's read path (leases that fail closed).
    VllmName(_PW, "_send_heartbeats", _O, _ALL, "no hook around the heartbeats sent"),
    VllmName(_PW, "_read_blocks_for_req", _O, _ALL, "no hook before a read starts"),
    VllmName(_PW, "_pop_done_transfers", _O, _ALL, "no hook after a read completes"),
    VllmName(_PW, "_get_new_notifs", _O, _ALL, "no hook where a producer's notifications arrive"),
    VllmName(_PW, "_handle_failed_transfer", _C, _ALL, "vLLM's failed-read path; no public one"),
    VllmName(_W, "_invalid_remote_engines", _A, _ALL, "peers vLLM's reads decline; no getter"),
    VllmName(_W, "_bidirectional_kv_xfer_enabled", _A, _ALL, "whether reads may expire; no getter"),
    VllmName(_PW, "_is_turn2_read_expired", _C, _ALL, "vLLM's expiry of a readback; private"),
    VllmName(
        _W,
        "_apply_prefix_caching",
        _C,
        _ALL,
        "which of a request's blocks pair with the peer's (the scheduler's contract); private",
    ),
    VllmName(_PW, "_engine_clock_offset", _A, _ALL, "the handshake's clock offset; no getter"),
    VllmName(_PW, "_remote_agents", _A, _ALL, "which engines are handshaken; no getter"),
    VllmName(_PW, "_recving_transfers", _A, _ALL, "tells reads from writes; no getter"),
    VllmName(_PW, "_recving_metadata", _A, _ALL, "the request of a done read; no getter"),
    VllmName(_PW, "_recv_failures", _A, _ALL, "where vLLM collects failed reads; no API"),
    VllmName(
        _W, "_engine_last_active", _A, _ALL, "a read stamps its engine as vLLM's reads do; no API"
    ),
    # The push worker's write path (a consumer of another block size: our WRITEs).
    VllmName(_PUW, "_do_start_push_kv", _O, _ALL, "the one call given a consumer's registration"),
    VllmName(
        _W, "_add_notif_only_remote_agent", _O, _ALL, "a push consumer's peer; no hook around it"
    ),
    VllmName(_PUW, "_xfer_blocks_for_req", _O, _ALL, "no hook before a request's WRITEs"),
    VllmName(_PUW, "_sending_transfers", _A, _ALL, "where a request's WRITEs are counted; no API"),
    VllmName(_PUW, "_sending_transfers_lock", _A, _ALL, "guards them against the main thread"),
    VllmName(_PUW, "_send_failures", _A, _ALL, "where vLLM collects failed WRITEs; no API"),
    # The scheduler's decisions from spec classes, and the lease it keeps.
    VllmName(_S, "_is_hma_required", _A, _ALL, _CLASS_RULE),
    VllmName(_S, "_ssm_spec_blocks", _A, _ALL, _CLASS_RULE),
    VllmName(_S, "_has_mamba", _A, _ALL, _CLASS_RULE),
    VllmName(_S, "_reqs_need_send", _A, _ALL, "a finished prefill's lease deadline; no getter"),
    VllmName(_S, "_reqs_need_recv", _A, _ALL, "a received request's params; no getter"),
    VllmName(
        _S, "_kv_lease_duration", _A, _ALL, "the lease vLLM applies (its parse of the config)"
    ),
    VllmName(
        _PUS,
        "_push_pending_registrations",
        _A,
        _ALL,
        "a consumer's registration before it is sent; no hook to add to it",
    ),
    # The connector.
    VllmName(
        KVConnectorBase_V1,
        "_connector_metadata",
        _A,
        _ALL,
        "its getter is private too, and asserts",
    ),
    VllmName(
        vllm_cpu_attn,
        "_get_attn_isa",
        _C,
        _ALL,
        "how vLLM-CPU's attention kernel packs a block (reads between block sizes); private",
    ),
    VllmName(
        vllm_utils,
        "USE_SCHED_YIELD",
        Kind.MODULE_FLAG,
        _ALL,
        "vLLM's own switch; no per-queue or config option",
    ),
)


class _Alias(Generic[_V]):
    """A name of ours for one of vLLM's private attributes: reads and writes go to
    vLLM's; ``default`` answers where the object has none (a series without it, or a
    worker built with ``object.__new__``)."""

    def __init__(self, name: str, *default: _V) -> None:
        self.name = name
        self.default = default

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _V: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.default:
            return getattr(obj, self.name, self.default[0])
        return getattr(obj, self.name)

    def __set__(self, obj: object, value: _V) -> None:
        setattr(obj, self.name, value)


# Set on the running thread while vLLM's own peer checks run inside a push worker's.
_upstream_checks = threading.local()


class SeamWorker(NixlBaseConnectorWorker):
    """vLLM's NIXL worker (both modes): its private hooks forward to the public methods
    below, which do what vLLM does until the connector's worker overrides them."""

    peer_metadata_class: type[NixlAgentMetadata] = NixlAgentMetadata
    """The class vLLM's handshake decodes the peer's agent metadata into."""

    is_hma_required = _Alias[bool]("_is_hma_required")
    has_mamba = _Alias[bool]("_has_mamba")
    is_csa_linear = _Alias[bool]("_is_csa_linear")
    ple_group_index = _Alias["int | None"]("_ple_group_index")
    conv_decomp = _Alias[Any]("_conv_decomp")
    mamba_ssm_size = _Alias["tuple[int, int]"]("_mamba_ssm_size")
    group_spec_types = _Alias["tuple[type[Any], ...]"]("_group_spec_types")
    region_is_mla = _Alias["list[bool]"]("_region_is_mla")
    ple_region_index = _Alias["int | None"]("_ple_region_index")
    ple_block_len = _Alias["int | None"]("_ple_block_len")
    mixed_mem_types = _Alias[bool]("_mixed_mem_types")
    uses_region_group_mapping = _Alias[bool]("_uses_region_group_mapping")
    skip_dram_xfer = _Alias[bool]("_skip_dram_xfer")
    remote_region_offset = _Alias[int]("_remote_region_offset")
    registered_descs = _Alias["list[Any]"]("_registered_descs")
    transfer_mode = _Alias[str]("_TRANSFER_MODE")
    supports_pp_hma = _Alias[bool]("_supports_pp_hma")
    physical_blocks_per_logical_kv_block = _Alias[int]("_physical_blocks_per_logical_kv_block")
    has_packed_cache = _Alias[bool]("_has_packed_cache", False)

    # -- vLLM's private hooks, forwarded -------------------------------------------------

    def _sync_block_size_with_kernel(self) -> None:
        self.apply_layout_decisions()
        super()._sync_block_size_with_kernel()

    def apply_layout_decisions(self) -> None:
        """Called from vLLM's ``__init__`` once it has taken its class-based decisions,
        before its kernel block-size sync reads them."""

    def _logical_to_kernel_block_ids(self, block_ids: Any, ratio: int) -> Any:
        return self.logical_to_kernel_block_ids(block_ids, ratio)

    def logical_to_kernel_block_ids(self, block_ids: Any, ratio: int) -> Any:
        """Manager blocks to kernel blocks (``ratio`` per block), per transfer group."""
        return super()._logical_to_kernel_block_ids(block_ids, ratio)

    def _compute_desc_ids(self, block_ids: Any, *args: Any, **kwargs: Any) -> Any:
        upstream = super()._compute_desc_ids
        if hasattr(self, "_group_region_indices") or not issubclass(type(self), SeamWorker):
            # vLLM 0.34 reads each group in the regions kept per group from the plan
            # (keep_group_region_indices): nothing to narrow. Nor for a stand-in that
            # only claims the class (vLLM's tests call it on a MagicMock spec'd as it).
            return upstream(block_ids, *args, **kwargs)
        # vLLM passes every argument but block_ids by keyword (0.32, 0.33).
        keys = kwargs.get("region_group_ids", args[4] if len(args) > 4 else None)
        return self.compute_desc_ids(block_ids, lambda ids: upstream(ids, *args, **kwargs), keys)

    def compute_desc_ids(
        self, block_ids: Any, upstream: Callable[[Any], Any], region_keys: Any
    ) -> Any:
        """vLLM 0.32/0.33's descriptor ids of a request's ``block_ids`` (one list per
        key of ``region_keys``: the regions' group ids, or ``range(num_regions)`` where
        vLLM expanded the ids per region); ``upstream(ids)`` computes vLLM's for any
        ``ids``."""
        return upstream(block_ids)

    def _nixl_handshake(
        self, host: str, port: int, remote_tp_size: int, *args: Any, **kwargs: Any
    ) -> Any:
        remote_pp_size = int(kwargs.get("remote_pp_size", args[2] if len(args) > 2 else 1))
        upstream = super()._nixl_handshake

        def handshake() -> Any:
            decoding = _decoding_as(upstream, self.peer_metadata_class)
            return decoding(host, port, remote_tp_size, *args, **kwargs)

        return self.nixl_handshake(host, port, remote_tp_size, remote_pp_size, handshake)

    def nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        remote_pp_size: int,
        handshake: Callable[[], _T],
    ) -> _T:
        """vLLM's handshake with ``host:port``: ``handshake()`` runs it, decoding the
        peer's metadata into :attr:`peer_metadata_class`."""
        return handshake()

    def _validate_remote_parallel_config(self, agent_metadata: NixlAgentMetadata) -> None:
        super()._validate_remote_parallel_config(agent_metadata)
        if not getattr(_upstream_checks, "running", False):
            self.check_remote_fingerprint(agent_metadata)

    def check_remote_fingerprint(self, agent_metadata: NixlAgentMetadata) -> None:
        """Called with the peer's decoded metadata after vLLM's checks of it."""

    def pair_uncomputed(
        self, decode: Any, prefill: Any, decode_per_logical: int, prefill_per_logical: int
    ) -> tuple[Any, Any]:
        """vLLM's pairing of a request's decode kernel blocks (the suffix a prefix-cache
        hit leaves; a state group's slots) with the prefill side's, each side of its
        own kernel blocks a block: ``_apply_prefix_caching`` (both modes call it; pull
        with our blocks as ``decode``, push with the consumer's). Lists it cannot pair
        raise :class:`~kvspec_traits.transfer.BlockIdShapeError`."""
        try:
            paired: tuple[Any, Any] = self._apply_prefix_caching(
                decode_block_ids=decode,
                prefill_block_ids=prefill,
                decode_physical_per_logical=decode_per_logical,
                prefill_physical_per_logical=prefill_per_logical,
            )
        except AssertionError as err:  # vLLM's check of the lists, as a named error
            raise BlockIdShapeError(
                "both",
                sum(len(g) for g in decode),
                sum(len(g) for g in prefill),
                f"vLLM pairs no uncomputed blocks of these lists per group "
                f"({[len(g) for g in decode]} decode, {[len(g) for g in prefill]} "
                f"prefill): {err}",
            ) from err
        return paired

    # -- vLLM's private methods and what each series keeps -------------------------------

    def set_region_layers(self, region_layers: list[list[str]]) -> None:
        self._set_region_layers(region_layers)

    def leaves_dram_xfer_to_rank0(self) -> bool:
        return self._leaves_dram_xfer_to_rank0()

    def keep_plan_fields(self, plan: RegionPlan) -> None:
        """Set :func:`worker_fields` of ``plan`` but the members and descriptor count
        (which each series keeps its own way); a PLE region only in a ring-buffer
        (CSA-linear) model (a replicated state elsewhere moves in REPLICATE regions of
        its own)."""
        fields = worker_fields(plan, ple=bool(self.is_csa_linear))
        self.kv_caches_base_addr[self.engine_id][self.tp_rank] = fields.pop("kv_caches_base_addr")
        del fields["region_members"], fields["num_descs"]
        for name, value in fields.items():
            setattr(self, name, value)

    def transfer_layer_region_indices(self) -> list[int]:
        """vLLM 0.32/0.33: the regions of the transfer layers (0.34 keeps no such list)."""
        return list(getattr(self, "_transfer_layer_region_indices", []))

    def tracks_region_layers(self) -> bool:
        """Whether the worker keeps each region's member layers: vLLM 0.32/0.33 where it
        routes by layer name (``_tracks_region_layers()``); 0.34 always."""
        tracks = getattr(self, "_tracks_region_layers", None)
        return tracks is None or bool(tracks())

    def stage_regions_by_position(self) -> bool:
        """Whether a pipeline-parallel stage pairs its regions with its PP 1 peer's by
        position: vLLM 0.32/0.33 slice the peer's regions from the stage's first layer on
        (:attr:`remote_region_offset`), unless the worker routes by layer name
        (``_requires_layer_name_routing()``: push with HMA or packed rows). vLLM 0.34 has
        neither: ``add_remote_agent`` pairs every region by the layers both sides hold."""
        routes_by_name = getattr(self, "_requires_layer_name_routing", None)
        return routes_by_name is not None and not routes_by_name()

    def keep_dst_region_group_mapping(self, engine_id: str, uses_mapping: bool) -> None:
        """vLLM 0.32/0.33 keep, per engine, whether region group ids route transfers."""
        if hasattr(self, "dst_uses_region_group_mapping"):
            self.dst_uses_region_group_mapping[engine_id] = uses_mapping

    def keep_group_region_indices(
        self, regions: Sequence[tuple[int, Collection[int]]], groups: int
    ) -> None:
        """vLLM 0.34: per transfer group (``groups`` of them), its regions in region
        order (``None`` for a group without one); ``regions``: each (index, group ids)."""
        if hasattr(self, "_group_region_indices"):
            self._group_region_indices = [
                [index for index, ids in regions if group in ids] or None for group in range(groups)
            ]

    def derive_region_sets(self, packed_layouts: dict[str, tuple[int, int]]) -> None:
        """What vLLM 0.33+ derives from the regions once they are set: the head-sharded
        draft regions, and each layer's place in a packed row (``packed_layouts``: layer
        -> (offset, length), ``_fields.packed_layouts``)."""
        if hasattr(self, "_get_head_sharded_draft_regions"):
            self._head_sharded_draft_regions = self._get_head_sharded_draft_regions()
        if hasattr(self, "_packed_member_layouts"):
            self._packed_member_layouts = dict(packed_layouts)

    def keep_dcp_replicated_groups(
        self, replicated: Collection[int], groups: Sequence[Any]
    ) -> None:
        """vLLM 0.34: the transfer groups a DCP peer holds whole on every rank (which
        vLLM derives from MLA classes): the groups whose layers are all TP-replicated
        (``replicated``), less those the spec marks as split over DCP ranks
        (``dcp_sharded``, a field of every vLLM spec)."""
        if hasattr(self, "_dcp_replicated_groups"):
            self._dcp_replicated_groups = {
                i for i in replicated if not getattr(groups[i].spec, "dcp_sharded", False)
            }


class SeamPushWorker(NixlPushConnectorWorker, SeamWorker):
    """vLLM's push worker: vLLM's peer checks (0.34's own, after its ``super()`` call)
    all run before :meth:`check_remote_fingerprint`, as in the pull worker, so a pair
    vLLM refuses is refused with vLLM's error; a peer of another block size the plan
    serves (:meth:`ratio_view`) is checked first, and vLLM's checks see it at our block
    size. Its write path's private steps forward to public methods, each given vLLM's
    step (``upstream``) to run."""

    remote_agents = _Alias["dict[str, Any]"]("_remote_agents")
    sending_transfers = _Alias["dict[str, list[int]]"]("_sending_transfers")
    sending_transfers_lock = _Alias["threading.Lock"]("_sending_transfers_lock")
    send_failures = _Alias["set[str]"]("_send_failures")

    def _validate_remote_parallel_config(self, agent_metadata: NixlAgentMetadata) -> None:
        view = self.ratio_view(agent_metadata)
        _upstream_checks.running = True
        try:
            super()._validate_remote_parallel_config(agent_metadata if view is None else view)
        finally:
            _upstream_checks.running = False
        if view is None:
            self.check_remote_fingerprint(agent_metadata)

    def ratio_view(self, agent_metadata: NixlAgentMetadata) -> NixlAgentMetadata | None:
        """The peer's metadata at our block size where its blocks hold other token
        counts and :meth:`check_remote_fingerprint` accepted it (already run), else
        ``None`` (vLLM's checks, then the fingerprint's, as for any peer)."""
        return None

    def at_our_block_size(self, agent_metadata: NixlAgentMetadata) -> NixlAgentMetadata | None:
        """A peer of another block size, accepted in its handshake, at our block size
        (``None``: any other peer), as vLLM's bookkeeping of it is to see it."""
        return None

    def _add_notif_only_remote_agent(
        self, metadata: NixlAgentMetadata, remote_tp_size: int, remote_dcp_size: int = 1
    ) -> str:
        name: str = super()._add_notif_only_remote_agent(
            self.at_our_block_size(metadata) or metadata, remote_tp_size, remote_dcp_size
        )
        return name

    def _do_start_push_kv(self, request_id: str, local_block_ids: Any, registration: Any) -> None:
        self.start_push(request_id, local_block_ids, registration, super()._do_start_push_kv)

    def start_push(
        self,
        request_id: str,
        local_block_ids: Any,
        registration: dict[str, Any],
        upstream: Callable[[str, Any, dict[str, Any]], None],
    ) -> None:
        """A consumer's registration matched with our finished blocks (writer thread)."""
        upstream(request_id, local_block_ids, registration)

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> None:
        self.write_blocks_for_req(req_id, meta, super()._xfer_blocks_for_req)

    def write_blocks_for_req(
        self, req_id: str, meta: Any, upstream: Callable[[str, Any], None]
    ) -> None:
        """Write request ``req_id`` (vLLM's push ``ReqMeta``) once handshaken."""
        upstream(req_id, meta)


class SeamPullWorker(NixlPullConnectorWorker):
    """vLLM's pull worker: its read path's private steps forward to public methods,
    each given vLLM's step (``upstream``) to run."""

    engine_clock_offset = _Alias["dict[str, float]"]("_engine_clock_offset")
    remote_agents = _Alias["dict[str, Any]"]("_remote_agents")
    recving_transfers = _Alias["dict[str, Any]"]("_recving_transfers")
    recving_metadata = _Alias["dict[str, Any]"]("_recving_metadata")
    engine_last_active = _Alias["dict[str, float]"]("_engine_last_active")

    def _send_heartbeats(self, metadata: NixlConnectorMetadata) -> None:
        self.send_heartbeats(metadata, super()._send_heartbeats)

    def send_heartbeats(
        self, metadata: NixlConnectorMetadata, upstream: Callable[[NixlConnectorMetadata], None]
    ) -> None:
        upstream(metadata)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        self.read_blocks_for_req(req_id, meta, super()._read_blocks_for_req)

    def read_blocks_for_req(
        self, req_id: str, meta: Any, upstream: Callable[[str, Any], None]
    ) -> None:
        upstream(req_id, meta)

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        return self.pop_done_transfers(transfers, super()._pop_done_transfers)

    def pop_done_transfers(
        self,
        transfers: dict[str, list[int]],
        upstream: Callable[[dict[str, list[int]]], tuple[set[str], set[str]]],
    ) -> tuple[set[str], set[str]]:
        return upstream(transfers)

    def _get_new_notifs(self) -> set[str]:
        return self.get_new_notifs(super()._get_new_notifs)

    def get_new_notifs(self, upstream: Callable[[], set[str]]) -> set[str]:
        """vLLM's handling of the NIXL notifications that arrived (``upstream``): the
        requests whose every reader is done."""
        return upstream()

    def upstream_declines(self, meta: Any) -> bool:
        """Whether vLLM's read path declines request ``meta`` before reading (its peer
        invalidated, or a readback whose blocks expire): the connector's own reads of
        it leave it to vLLM, which fails it as it fails its own."""
        if meta.remote.engine_id in self._invalid_remote_engines:
            return True
        return bool(self._bidirectional_kv_xfer_enabled) and bool(self._is_turn2_read_expired(meta))

    def fail_read(self, req_id: str) -> None:
        """vLLM's failed read without a transport failure (as its expired readback)."""
        self._handle_failed_transfer(
            req_id, None, self._recv_failures, record_failed_transfer=False
        )


class SeamScheduler(NixlBaseConnectorScheduler):
    """vLLM's NIXL scheduler (both modes), its private decisions and lease state under
    names of ours."""

    is_hma_required = _Alias[bool]("_is_hma_required")
    ssm_spec_blocks = _Alias["list[int | None]"]("_ssm_spec_blocks")
    has_mamba = _Alias[bool]("_has_mamba")
    reqs_need_send = _Alias["dict[str, float]"]("_reqs_need_send")
    reqs_need_recv = _Alias["dict[str, Any]"]("_reqs_need_recv")
    kv_lease_duration = _Alias[float]("_kv_lease_duration")
    push_pending_registrations = _Alias["dict[str, dict[str, Any]]"](
        "_push_pending_registrations", {}
    )


def connector_metadata(connector: KVConnectorBase_V1) -> object:
    """The metadata bound to ``connector`` for this step (``None`` if none is)."""
    return connector._connector_metadata


def _decoding_as(handshake: Callable[..., _T], metadata_class: type) -> Callable[..., _T]:
    """vLLM's bound ``_nixl_handshake``, run so that the agent metadata it decodes is a
    ``metadata_class``: the function with a copy of its module's globals, taken at each
    call, in which ``NixlAgentMetadata`` is that class (vLLM's module, and any other
    reader in the process, keeps its own). Raises :class:`UnsupportedVllmVersionError`
    when the installed vLLM's handshake no longer decodes by that name (a series whose
    handshake the seam does not know: the metadata class would be dropped, and with it
    the peer's traits fingerprint)."""
    if metadata_class is NixlAgentMetadata:
        return handshake
    func = getattr(handshake, "__func__", None)
    owner = getattr(handshake, "__self__", None)
    if not isinstance(func, types.FunctionType) or "NixlAgentMetadata" not in (
        func.__code__.co_names
    ):
        import vllm

        raise UnsupportedVllmVersionError(
            str(getattr(vllm, "__version__", "unknown")),
            detail=f"its NIXL handshake {getattr(handshake, '__qualname__', handshake)!r} "
            "does not decode the peer's agent metadata with its module's NixlAgentMetadata, "
            "which the connector binds to read the peer's traits fingerprint",
        )
    scope = dict(func.__globals__)
    scope["NixlAgentMetadata"] = metadata_class
    clone = types.FunctionType(
        func.__code__, scope, func.__name__, func.__defaults__, func.__closure__
    )
    clone.__kwdefaults__ = func.__kwdefaults__
    return cast("Callable[..., _T]", types.MethodType(clone, owner))


def worker_fields(plan: RegionPlan, *, ple: bool = True) -> dict[str, Any]:
    """``plan`` under the attribute names of vLLM's NIXL worker (0.32-0.34), as
    ``register_kv_caches`` keeps them: what the connector's worker sets, and what a
    test compares field by field with upstream's bookkeeping. ``ple``: whether a
    replicated-state region is vLLM's PLE region (a ring model's), else none is.

    Raises ``ValueError`` as :func:`~._fields.replicated_state_region` does.
    """
    regions = plan.regions
    return {
        "kv_caches_base_addr": [r.base_addr for r in regions],
        "block_len_per_layer": [r.block_len for r in regions],
        "block_stride_per_layer": [r.block_stride for r in regions],
        "region_num_blocks": [r.num_blocks for r in regions],
        "region_group_ids": plan.region_group_ids,
        "region_names": plan.region_names,
        "region_members": [list(r.layers) for r in regions],
        "region_mem_types": [r.mem_type for r in regions],
        # REPLICATE (True) or SPLIT (False) per region.
        "_region_is_mla": [r.replicated for r in regions],
        "_ssm_region_indices": [r.index for r in regions if r.sharded_state],
        "_scratch_region_indices": [r.index for r in regions if r.scratch],
        "_ple_region_index": replicated_state_region(plan) if ple else None,
        "num_regions": len(regions),
        # The descriptors of the plan's strided list, expanded.
        "num_descs": sum(r.num_blocks for r in regions),
    }


# -- group kinds and the state split, in vLLM's vocabulary ------------------------------
# vLLM's descriptor code (descriptor ids, remote build, TP mapping, read planning)
# classifies each transfer group by its ``_group_spec_types`` entry (through
# ``tp_mapping``'s ``_is_attention_spec`` / ``_is_ssm_spec`` and, in 0.32/0.33,
# ``is CircularBufferSpec``). The connector decides each group's kind from traits and
# gives vLLM the one vLLM class that stands for that kind: a group of a spec class vLLM
# has never seen is addressed as its traits say, not refused as "Unknown spec type".


def kind_tag(kind: GroupKind) -> type[Any]:
    """The vLLM class that vLLM's NIXL worker reads as ``kind``: ``AttentionSpec`` for
    paged groups, ``CircularBufferSpec`` for rings (an ``AttentionSpec`` too, picked out
    by identity for its scratch regions), ``MambaSpec`` for states moved by vLLM's
    state descriptors, ``AttentionSpec`` for replicated states outside a ring model
    (their REPLICATE regions read whole, as an MLA page group's). A tag only: never
    instantiated."""
    from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec, MambaSpec

    tags: dict[GroupKind, type[Any]] = {
        GroupKind.PAGED: AttentionSpec,
        GroupKind.RING: CircularBufferSpec,
        GroupKind.STATE: MambaSpec,
        # Addressed as a replicated page group: whole blocks of its own regions.
        GroupKind.REPLICATED_STATE: AttentionSpec,
    }
    return tags[kind]


def group_spec_types(kinds: Sequence[GroupKind]) -> tuple[type[Any], ...]:
    """vLLM's per-group types for transfer groups of these kinds.

    vLLM's descriptor code builds attention descriptors for every region and takes their
    TP split from the first attention-typed group (``_build_fa_remote``,
    ``_build_local_splits_from_plan``: ``next(...)``). A model whose only caches are
    states has none, and vLLM's handshake stopped there on a bare ``StopIteration``
    (issue 47); a trailing attention tag that no transfer group owns stands in (every
    use of the list past that lookup is by a group's index, so no group reads it)."""
    tags = tuple(kind_tag(kind) for kind in kinds)
    if kinds and all(kind is GroupKind.STATE for kind in kinds):
        tags += (kind_tag(GroupKind.PAGED),)
    return tags


def conv_split_info(split: StateSplit) -> Any:
    """vLLM's ``MambaConvSplitInfo`` (its descriptor code's state split) of ``split``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        MambaConvSplitInfo,
    )

    return MambaConvSplitInfo(
        conv_rows=split.conv_rows,
        local_proj_dims=split.local_proj_dims,
        conv_dtype_size=split.conv_dtype_size,
        ssm_sizes=split.sizes,
    )


# -- the topology the worker reads ---------------------------------------------------------

_TOPOLOGIES: dict[type, type] = {}


def gathering_topology(topology: Any) -> Any:
    """vLLM's ``TransferTopology`` class (``topology``, looked up where vLLM's tests patch
    it) with one answer of its own: a producer of more ranks than ours, whose ranks hold
    replicas of the model's KV heads, is not "replicated" to this consumer, which gathers
    its heads from them. vLLM's read path already reads one rank per distinct head there
    (``compute_tp_mapping``: the first rank of each head); its handshake validation alone
    asks ``is_kv_replicated`` and asserts the pair away (issue 47). Every other answer is
    vLLM's. The plan decides the pair first (``check_tp_pair``), and the connector's
    tests compare every decode byte (``tests/test_connector_replica_tp.py``)."""
    if not isinstance(topology, type):
        return topology  # a stand-in (vLLM's tests patch the name with a Mock): as given
    found = _TOPOLOGIES.get(topology)
    base: Any = topology
    if found is None:

        def is_kv_replicated(self: Any, remote_engine_id: Any, remote_pp_rank: int = 0) -> bool:
            info = self.get_engine_info(remote_engine_id, remote_pp_rank)
            if info.remote_tp_size > self.tp_size and not self.is_mla:
                return False
            return bool(base.is_kv_replicated(self, remote_engine_id, remote_pp_rank))

        found = _TOPOLOGIES[topology] = type(
            "GatheringTransferTopology", (topology,), {"is_kv_replicated": is_kv_replicated}
        )
    return found


# -- the one process-wide change --------------------------------------------------------


class QueueWaitSwitch:
    """vLLM's shared-memory queue readers wait between checks with ``sched_yield()``,
    which is ``os.sched_yield()`` while the module flag ``vllm.distributed.utils.
    USE_SCHED_YIELD`` is true and ``time.sleep(0)`` while it is false (vLLM's own choice
    on Python < 3.11.1). A connector built with ``kvspec_shm_wait: "sleep"`` holds the
    flag false (:meth:`hold_sleep`); the first holder records the value it found, and
    the last one to let go (:meth:`release`, from the connector's ``shutdown``) puts that
    value back. A connector never shut down holds it until the process ends (vLLM keeps
    its connectors until then)."""

    FLAG = "USE_SCHED_YIELD"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, object] = {}  # by identity, kept alive until released
        self.previous: bool | None = None
        """The flag's value before the first holder set it (``None``: not held)."""

    def available(self) -> bool:
        """Whether this vLLM has the flag (a boolean ``USE_SCHED_YIELD``)."""
        return isinstance(getattr(vllm_utils, self.FLAG, None), bool)

    def hold_sleep(self, holder: object) -> bool:
        """Make the queue readers of this process sleep until ``holder`` (and every
        other holder) lets go; the value the flag had (True: they yielded)."""
        with self._lock:
            was = bool(getattr(vllm_utils, self.FLAG))
            if not self._holders:
                self.previous = was
            self._holders[id(holder)] = holder
            setattr(vllm_utils, self.FLAG, False)
            return was

    def release(self, holder: object) -> None:
        """``holder`` lets go; the last holder puts back the value recorded."""
        with self._lock:
            if self._holders.pop(id(holder), None) is None:
                return
            if not self._holders and self.previous is not None:
                setattr(vllm_utils, self.FLAG, self.previous)
                self.previous = None


_QUEUE_WAIT = QueueWaitSwitch()


def queue_wait_switch() -> QueueWaitSwitch:
    """The switch of this process (one: the flag is process-wide)."""
    return _QUEUE_WAIT


def cpu_attention_isa(dtype: Any, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """The instruction set vLLM-CPU's attention kernel packs a block for (``"vec"``,
    ``"vec16"``, ``"amx"``, ...): vLLM's own choice, for these settings."""
    isa: str = vllm_cpu_attn._get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    return isa
