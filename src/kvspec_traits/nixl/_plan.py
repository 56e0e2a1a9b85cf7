"""Region planning: per-layer KV cache tensors -> NIXL regions, decided from traits alone.

Pure: imports neither NIXL nor vLLM nor torch at import time. A tensor is read only for
its address, shape, strides, element size and storage; a spec only through
``Registry.traits_of`` (one call per layer, or one per group spec), so no decision here
names a spec class.

The records mirror vLLM's NIXL worker bookkeeping (``kv_caches_base_addr``,
``block_len_per_layer``, ``block_stride_per_layer``, ``region_num_blocks``,
``region_group_ids``, ``region_names``, ``_region_is_mla``, ``_ssm_region_indices``,
``_scratch_region_indices``) so a connector can compare them field by field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from math import gcd, prod
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypeVar

from kvspec_traits._group import traits_for_layer
from kvspec_traits._registry import Registry, default_registry
from kvspec_traits._traits import KVLayoutTraits, TokenScope, TPLayout
from kvspec_traits.nixl._errors import (
    MissingLayerError,
    RegionConflictError,
    UnsupportedLayoutError,
)

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from kvspec_traits.nixl._handshake import PlanFingerprint

__all__ = [
    "SHARED_REGION_GROUP_ID",
    "MemoryRange",
    "Region",
    "RegionPlan",
    "StateComponent",
    "plan_regions",
    "region_sort_key",
    "shard_count",
]

_T = TypeVar("_T")

SHARED_REGION_GROUP_ID: Final = -1
"""Group id of a region whose layers belong to several cache groups (vLLM's
``_SHARED_REGION_GROUP_ID``)."""


def region_sort_key(layer_name: str) -> tuple[tuple[int, int | str], ...]:
    """Model-layer order (``layers.2`` before ``layers.10``), then cache name; the
    same key as vLLM's ``_region_sort_key`` so region order matches upstream."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", layer_name)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StateComponent:
    """One tensor of a recurrent-state page (a Mamba conv or SSM state): a NIXL
    sub-region at ``offset`` bytes into each block, ``nbytes`` long."""

    name: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryRange:
    """One range to register with NIXL (a whole storage allocation)."""

    base: int
    length: int
    device_id: int
    mem_type: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """One NIXL region: ``num_blocks`` blocks of ``block_len`` bytes, ``block_stride``
    apart from ``base_addr``, shared by ``layers``.

    Every trait below is decided from all member layers: members that disagree on a
    fact the transfer needs raise :class:`RegionConflictError` at planning time.
    """

    index: int
    name: str
    """The first member layer in model order (vLLM's ``region_names``)."""
    layers: tuple[str, ...]
    base_addr: int
    block_len: int
    """Bytes moved per block: the largest member page (a ring overlaying an MLA page
    moves whichever is longer, never the first-registered one)."""
    block_stride: int
    num_blocks: int
    mem_type: str
    device_id: int
    group_id: int
    """The cache group of every member, or :data:`SHARED_REGION_GROUP_ID`."""
    group_ids: tuple[int, ...]
    tp_layout: TPLayout
    """Of the paged members if any, else of the state members."""
    tp_shards: int | None
    replicated: bool
    """Same bytes on every TP rank (vLLM's REPLICATE / ``_region_is_mla``)."""
    paged: bool
    """Has a paged (token-addressed) member."""
    state: bool
    """Has a recurrent-state member (its blocks hold :attr:`state_components`)."""
    state_tp_layout: TPLayout | None
    state_components: tuple[StateComponent, ...]
    scratch: bool
    """Has a ring-buffer member (vLLM's ``_scratch_region_indices``)."""
    token_scopes: tuple[TokenScope, ...]
    dtypes: tuple[str, ...]
    kv_quant_modes: tuple[str, ...]
    num_head_slots: int | None
    """Head slots of a head-sharded region on this rank (``None`` if replicated). Members
    with other head counts, all heads-outermost: the gcd of theirs (the byte slices of a
    block that hold whole heads of every member)."""
    head_major: bool
    """A head slice of one block is one contiguous byte run (heads outermost in the
    page), which is what splitting a block by heads across TP ranks needs."""
    head_segment: tuple[int, int] | None = None
    """``(head, heads)`` when the layout puts heads outside blocks and this region is
    one head's segment of a layer."""
    replicated_state: bool = False
    """Has a TP-replicated recurrent-state member (vLLM's PLE state of CSA-linear
    models), next to or instead of a TP-sharded one."""
    packed_members: tuple[tuple[str, int, int], ...] = ()
    """``(layer, offset, page bytes)`` of each member registered as part of a whole
    block row (``packed_member_rows``): where its page sits in the row (vLLM's
    ``packed_member_layouts``)."""
    kv_head_contiguous: bool = True
    """Every paged member keeps each KV head's slots together
    (:attr:`~kvspec_traits.KVLayoutTraits.kv_head_contiguous`): the order of the head
    slots inside a page, which equal page sizes do not show."""

    @property
    def sharded_state(self) -> bool:
        """Holds a recurrent state split across TP ranks: each rank's blocks hold its
        own shard, whatever the paged members' replication."""
        return self.state and self.state_tp_layout is not TPLayout.REPLICATED

    def traits_record(self, tp_size: int) -> dict[str, Any]:
        """The canonical, TP-independent facts of this region (for the fingerprint).

        Sizes of a split region are scaled to the whole TP group, so producer and
        consumer with different TP sizes compare equal when their layouts agree.
        """
        shards = _shard_count(self.tp_layout, self.tp_shards, tp_size)
        state_shards = (
            _shard_count(self.state_tp_layout, None, tp_size)
            if self.state_tp_layout is not None
            else 1
        )
        scale = 1 if self.replicated or not self.paged else shards
        return {
            "name": self.name,
            "layers": list(self.layers),
            "block_len": self.block_len * (scale if self.paged else state_shards),
            "replicated": self.replicated,
            "tp_layout": self.tp_layout.value,
            "tp_shards": self.tp_shards,
            "paged": self.paged,
            "state": self.state,
            "state_tp_layout": None if self.state_tp_layout is None else self.state_tp_layout.value,
            "state_components": [[c.name, c.nbytes * state_shards] for c in self.state_components],
            "scratch": self.scratch,
            "scope": [s.value for s in self.token_scopes],
            "dtype": list(self.dtypes),
            "kv_quant_mode": list(self.kv_quant_modes),
            "num_head_slots": None if self.num_head_slots is None else self.num_head_slots * scale,
            "head_segment": None if self.head_segment is None else list(self.head_segment),
            # The order of data inside a page: equal sizes in another order (LBHNC
            # against LBNHC) would move every byte to the wrong place.
            "head_major": self.head_major,
            # The order of head slots inside a page (vLLM 0.34's kv_head_major_slots):
            # same size, other order, and a peer would read every head's V as K.
            "kv_head_contiguous": self.kv_head_contiguous,
            "group_id": self.group_id,
            "replicated_state": self.replicated_state,
        }


def desc_offsets(region_num_blocks: Sequence[int]) -> tuple[int, ...]:
    """Flat descriptor id of block 0 of each region in a strided list whose regions
    hold ``region_num_blocks`` blocks."""
    return (0, *accumulate(region_num_blocks[:-1])) if region_num_blocks else ()


def _shard_count(layout: TPLayout, tp_shards: int | None, tp_size: int) -> int:
    """Distinct shards of a cache across ``tp_size`` ranks."""
    if layout is TPLayout.REPLICATED:
        return 1
    if tp_shards is None:
        return tp_size
    return min(tp_shards, tp_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionPlan:
    """The regions of one rank's KV cache, in transfer order, and what to register."""

    regions: tuple[Region, ...]
    registrations: tuple[MemoryRange, ...]
    num_blocks: int
    tp_size: int = 1
    tp_rank: int = 0
    skipped_layers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Layers with no region, and why (not transferable, no spec), read-only. Layers
    that are not transferable (by their traits or their group's
    ``enable_kv_transfer``) get no region, so region indices match vLLM's, which never
    registers them."""
    num_groups: int = 0
    """Transfer (KV cache) groups a request names: one block-id list each. ``0`` (the
    default) derives it from the regions' group ids."""

    # Asked for every region of every request: answered once, when the plan is built.
    _group_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _desc_offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _desc_index: dict[tuple[object, ...], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A copy behind a read-only view: the plan is frozen, so is what it says.
        object.__setattr__(self, "skipped_layers", MappingProxyType(dict(self.skipped_layers)))
        object.__setattr__(self, "_group_ids", tuple(r.group_id for r in self.regions))
        object.__setattr__(
            self, "_desc_offsets", desc_offsets([r.num_blocks for r in self.regions])
        )
        if self.num_groups < 1:
            derived = max((g for r in self.regions for g in r.group_ids if g >= 0), default=0) + 1
            object.__setattr__(self, "num_groups", derived)
        # Per-request index arrays of descriptor ids, built once per offsets list.
        object.__setattr__(self, "_desc_index", {})

    # -- upstream-shaped views (vLLM NixlConnectorWorker field names) ---------------
    @property
    def base_addresses(self) -> list[int]:
        return [r.base_addr for r in self.regions]

    @property
    def block_lens(self) -> list[int]:
        return [r.block_len for r in self.regions]

    @property
    def block_strides(self) -> list[int]:
        return [r.block_stride for r in self.regions]

    @property
    def region_num_blocks(self) -> list[int]:
        return [r.num_blocks for r in self.regions]

    @property
    def region_group_ids(self) -> list[int]:
        return list(self._group_ids)

    @property
    def region_names(self) -> list[str]:
        return [r.name for r in self.regions]

    @property
    def region_members(self) -> list[list[str]]:
        """Member layers of each region (vLLM's ``region_members``)."""
        return [list(r.layers) for r in self.regions]

    @property
    def num_descs(self) -> int:
        """Descriptors of :func:`build_block_descs` expanded (vLLM's ``num_descs``)."""
        return sum(r.num_blocks for r in self.regions)

    @property
    def region_replicated(self) -> list[bool]:
        """vLLM's ``_region_is_mla``: REPLICATE (True) or SPLIT (False) per region."""
        return [r.replicated for r in self.regions]

    @property
    def state_region_indices(self) -> list[int]:
        """Regions holding a TP-sharded recurrent state (vLLM's ``_ssm_region_indices``)."""
        return [r.index for r in self.regions if r.sharded_state]

    @property
    def replicated_state_region_indices(self) -> list[int]:
        """Regions holding a replicated recurrent state (vLLM's ``_ple_region_index``)."""
        return [r.index for r in self.regions if r.replicated_state]

    @property
    def scratch_region_indices(self) -> list[int]:
        return [r.index for r in self.regions if r.scratch]

    def as_vllm_fields(self) -> dict[str, object]:
        """This plan under the attribute names of vLLM's NIXL worker (0.32/0.33), for a
        field-by-field comparison with ``register_kv_caches``' bookkeeping."""
        ple = self.replicated_state_region_indices
        return {
            "kv_caches_base_addr": self.base_addresses,
            "block_len_per_layer": self.block_lens,
            "block_stride_per_layer": self.block_strides,
            "region_num_blocks": self.region_num_blocks,
            "region_group_ids": self.region_group_ids,
            "region_names": self.region_names,
            "region_members": self.region_members,
            "region_mem_types": [r.mem_type for r in self.regions],
            "_region_is_mla": self.region_replicated,
            "_ssm_region_indices": self.state_region_indices,
            "_scratch_region_indices": self.scratch_region_indices,
            "_ple_region_index": ple[0] if ple else None,
            "num_regions": len(self.regions),
            "num_descs": self.num_descs,
        }

    def region_of(self, layer: str) -> Region:
        """The (first) region holding ``layer``; ``KeyError`` if it has none."""
        for region in self.regions:
            if layer in region.layers:
                return region
        raise KeyError(
            f"layer {layer!r} has no region (skipped: "
            f"{self.skipped_layers.get(layer, 'unknown layer')})"
        )

    def fingerprint(self) -> PlanFingerprint:
        """The canonical, versioned per-region traits fingerprint for the handshake."""
        from kvspec_traits.nixl._handshake import fingerprint_of

        return fingerprint_of(self)


# ---------------------------------------------------------------------------------------
# Planning


@dataclass(slots=True)
class _Piece:
    """One region candidate from one layer."""

    layer: str
    traits: KVLayoutTraits
    group_id: int
    base: int
    block_len: int
    block_stride: int
    num_blocks: int
    mem_type: str
    device_id: int
    head_major: bool
    head_segment: tuple[int, int] | None
    row_member: tuple[int, int] | None = None
    """``(offset, page bytes)`` of the layer's page in a whole-row piece."""


def plan_regions(
    kv_caches: Mapping[str, torch.Tensor],
    kv_cache_config: KVCacheConfig | None = None,
    *,
    specs: Mapping[str, KVCacheSpec] | None = None,
    group_ids: Mapping[str, int] | None = None,
    num_blocks: int | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    registry: Registry | None = None,
    packed_rows: bool = False,
    kernel_blocks: bool = False,
    kernel_ratio: int | None = None,
    model_order: bool = True,
    whole_rows: bool | None = None,
    split_by_block_len: bool = False,
    packed_member_rows: bool = False,
) -> RegionPlan:
    """Plan the NIXL regions of one rank's KV cache.

    Pass either ``kv_cache_config`` (group ids, per-layer specs and ``num_blocks`` are
    read from it; only ``enable_kv_transfer`` groups take part, numbered as vLLM's
    ``transfer_groups``) or ``specs`` with ``num_blocks`` (and optionally
    ``group_ids``; default 0). ``kv_caches`` maps layer names to the tensors vLLM
    allocated (``[B, H, N, C]`` views, or flat byte views).

    ``packed_rows=True`` makes each block-outermost storage (every view advancing by
    one row of several pages, the storage exactly ``num_blocks`` rows) one region whose
    block is the whole row, as vLLM 0.32 registers padded DeepSeek-V4 rows: one
    descriptor per block instead of one per page, at the cost of moving every page of
    the row. Storages with a recurrent-state member keep one region per page. A row
    region is never split by heads (:attr:`Region.head_major` is False).

    ``packed_member_rows=True`` registers whole block rows for the pages that are the
    same on every TP rank, as vLLM 0.33+ does for block-outermost MLA caches: when every
    view shares one storage and one block stride, each replicated, token-paged,
    latent (MLA) view of a block-major storage becomes a region of whole rows at the
    storage's base (block length = stride), and :attr:`Region.packed_members` says
    where its page sits in the row. Other views keep their own pages.

    Views whose rows are kernel blocks (vLLM's kernel block splitting: ``num_blocks *
    ratio`` rows) are planned in manager blocks, the ids requests carry.
    ``kernel_blocks=True`` keeps vLLM's worker granularity instead (``block_len /
    ratio``, ``num_blocks * ratio``), for code that feeds the plan to vLLM's own
    descriptor machinery. ``kernel_ratio`` (the worker's
    ``_physical_blocks_per_logical_kv_block``; default: the paged views' common ratio)
    then also sets recurrent-state members in vLLM's worker form: ``ratio`` blocks of
    ``page / ratio`` bytes per state page, which vLLM's ``_build_mamba_local`` reads back
    as whole pages ``ratio`` kernel blocks apart (so a state can share a region with
    split attention pages). A paged view that is not split by that ratio raises
    :class:`UnsupportedLayoutError` (its kernel descriptors would address other blocks).

    A paged view whose block is not one dense page of its spec's size (layers
    interleaved inside a block, as BHLNC puts them; a page padded past its content) in
    a block-major storage (``num_blocks`` rows of the view's block stride, plus less
    than a row) is planned as the whole storage row, as vLLM registers it: one region
    per storage whose block is the row, shared by every such layer, never split by
    heads. vLLM does not do this for CSA-linear models (a ring-buffer layer present),
    whose shared rows it registers per owner: the default (``whole_rows=None``) follows
    that from the traits; ``True``/``False`` force it.

    Regions follow model-layer order (:func:`region_sort_key`); ``model_order=False``
    keeps the order of ``kv_caches`` instead, as vLLM's worker does for CSA-linear
    (ring-buffer) models, whose region indices its descriptor code relies on.

    Views at one base address share a region; ``split_by_block_len=True`` keys regions by
    base address and block length instead, as vLLM 0.34 does: overlaid groups paging the
    same bytes with different page sizes (a compressor ring over an MLA page) are then
    separate regions, each moving its own page, where by default they share one region
    that moves the longest page.

    Raises :class:`RegionConflictError` when layers sharing a region disagree on a
    fact the transfer needs, :class:`UnsupportedLayoutError` for a tensor that is not
    a whole number of strided blocks, :class:`MissingLayerError` for a transferable
    layer with no tensor in ``kv_caches`` (a tensor with no spec is skipped, as vLLM's
    worker skips it), ``ValueError`` for inconsistent arguments.
    """
    reg = registry if registry is not None else default_registry
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of tp_size {tp_size}")
    layer_traits, layer_groups, layer_blocks, n_blocks, skipped = _layer_facts(
        kv_caches, kv_cache_config, specs, group_ids, num_blocks, reg
    )
    # vLLM allocates a tensor for every layer of a transfer group (layers that share
    # another layer's cache get that tensor too), so a transferable spec without one
    # is a caller error; planning on would silently leave the layer's blocks behind.
    without_tensor = layer_traits.keys() - kv_caches.keys()
    if without_tensor:
        raise MissingLayerError(
            sorted(without_tensor, key=region_sort_key),
            "kv_caches",
            "pass every layer's KV cache tensor (the kv_caches vLLM gives "
            "register_kv_caches), or a config/specs without those layers",
        )

    if kernel_ratio is None and kernel_blocks:
        kernel_ratio = _paged_ratio(kv_caches, layer_traits, layer_blocks, n_blocks)
    if kernel_ratio is not None and (kernel_ratio < 1 or not kernel_blocks):
        raise ValueError(f"kernel_ratio {kernel_ratio} needs kernel_blocks=True and >= 1")
    if whole_rows is None:
        whole_rows = not any(t.token_scope is TokenScope.RING for t in layer_traits.values())
    by_storage: dict[tuple[int, str], list[_Piece]] = {}
    registrations: dict[tuple[int, str], MemoryRange] = {}
    for layer in sorted(kv_caches, key=region_sort_key) if model_order else kv_caches:
        traits = layer_traits.get(layer)
        if traits is None:
            skipped.setdefault(layer, "no KV cache spec for this layer")
            continue
        cache = kv_caches[layer]
        storage = cache.untyped_storage()
        key = (storage.data_ptr(), _mem_type(cache))
        if key not in registrations:
            registrations[key] = MemoryRange(
                base=key[0], length=storage.nbytes(), device_id=_device_id(cache), mem_type=key[1]
            )
        by_storage.setdefault(key, []).extend(
            _layer_pieces(
                layer,
                cache,
                traits,
                layer_groups[layer],
                layer_blocks.get(layer, n_blocks),
                kernel_blocks,
                kernel_ratio,
                registrations[key] if whole_rows else None,
            )
        )

    shared_rows = (
        packed_member_rows
        and len(registrations) == 1
        and len(
            {
                kv_caches[layer].stride(0) * kv_caches[layer].element_size()
                for layer in kv_caches
                if layer in layer_traits
            }
        )
        == 1
    )
    pieces: dict[tuple[int, str, int], list[_Piece]] = {}
    for key, storage_pieces in by_storage.items():
        if packed_rows:
            storage_pieces = _as_rows(storage_pieces, registrations[key])
        if shared_rows:
            storage_pieces = [_as_member_row(p, registrations[key]) for p in storage_pieces]
        for piece in storage_pieces:
            region_key = (piece.base, piece.mem_type, piece.block_len if split_by_block_len else 0)
            pieces.setdefault(region_key, []).append(piece)

    regions = tuple(_region(index, members) for index, members in enumerate(pieces.values()))
    for region in regions:
        _shard_count_checked(region, tp_size)
    if kv_cache_config is not None:
        num_groups = sum(1 for g in kv_cache_config.kv_cache_groups if g.enable_kv_transfer)
    else:
        num_groups = max(group_ids.values(), default=0) + 1 if group_ids else 1
    return RegionPlan(
        regions=regions,
        registrations=tuple(registrations.values()),
        num_blocks=n_blocks,
        tp_size=tp_size,
        tp_rank=tp_rank,
        skipped_layers=skipped,
        num_groups=max(num_groups, 1),
    )


def _is_state(traits: KVLayoutTraits) -> bool:
    """Whether a layer's cache is a recurrent state (one indivisible page per block,
    never split into kernel blocks nor by heads), not token-addressed pages."""
    return traits.token_scope is TokenScope.RECURRENT_STATE


def _not_transferable(traits: KVLayoutTraits) -> str:
    """The :attr:`RegionPlan.skipped_layers` reason of a layer whose traits say it is
    not transferable."""
    return f"{traits.spec_name} is not transferable (scope {traits.token_scope.value})"


def _layer_facts(
    kv_caches: Mapping[str, Any],
    config: KVCacheConfig | None,
    specs: Mapping[str, KVCacheSpec] | None,
    group_ids: Mapping[str, int] | None,
    num_blocks: int | None,
    reg: Registry,
) -> tuple[dict[str, KVLayoutTraits], dict[str, int], dict[str, int], int, dict[str, str]]:
    """Traits, transfer group and (where it differs from the pool's) block count of
    every layer: one traits lookup per layer (or per group spec), never per request."""
    traits: dict[str, KVLayoutTraits] = {}
    groups: dict[str, int] = {}
    blocks: dict[str, int] = {}
    skipped: dict[str, str] = {}
    if config is not None:
        if specs is not None:
            raise ValueError("pass kv_cache_config or specs, not both")
        n_blocks = config.num_blocks if num_blocks is None else num_blocks
        transfer_index = 0
        for group in config.kv_cache_groups:
            if not group.enable_kv_transfer:
                for layer in group.layer_names:
                    skipped[layer] = "its cache group has enable_kv_transfer=False"
                continue
            group_traits = reg.traits_of(group.kv_cache_spec)
            host_blocks = getattr(config, "hisparse_host_num_blocks", None)
            for layer in group.layer_names:
                if getattr(group, "host_resident", False) and host_blocks is not None:
                    # A host-resident group lives in the HiSparse host pool, which has
                    # its own block count (vLLM's KVCacheConfig.num_blocks_of).
                    blocks[layer] = host_blocks
                layer_traits = traits_for_layer(group_traits, layer)
                if not layer_traits.transferable:
                    skipped[layer] = _not_transferable(layer_traits)
                    continue
                traits[layer] = layer_traits
                groups[layer] = transfer_index
            transfer_index += 1
        return traits, groups, blocks, n_blocks, skipped
    if specs is None or num_blocks is None:
        raise ValueError("plan_regions needs kv_cache_config, or specs and num_blocks")
    without_group = []
    for layer, spec in specs.items():
        layer_traits = reg.traits_of(spec)
        if not layer_traits.transferable:
            skipped[layer] = _not_transferable(layer_traits)
            continue
        traits[layer] = layer_traits
        if group_ids is None:
            groups[layer] = 0
        elif layer in group_ids:
            groups[layer] = group_ids[layer]
        else:
            without_group.append(layer)
    if without_group:
        raise MissingLayerError(
            sorted(without_group, key=region_sort_key),
            "group_ids",
            "give every transferable layer of specs its transfer group id (0, 1, ...), "
            "or omit group_ids to put every layer in group 0",
        )
    del kv_caches
    return traits, groups, blocks, num_blocks, skipped


def _mem_type(cache: torch.Tensor) -> str:
    return "DRAM" if cache.device.type == "cpu" else "VRAM"


def _device_id(cache: torch.Tensor) -> int:
    return 0 if cache.device.type == "cpu" else max(cache.get_device(), 0)


def _dense(sizes: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether elements of these sizes/byte strides fill one gap-free byte run."""
    dims = sorted(
        ((st, sz) for sz, st in zip(sizes, strides, strict=True) if sz != 1), reverse=True
    )
    expected = itemsize
    for stride, size in reversed(dims):
        if stride != expected:
            return False
        expected = stride * size
    return True


def _paged_ratio(
    kv_caches: Mapping[str, torch.Tensor],
    layer_traits: Mapping[str, KVLayoutTraits],
    layer_blocks: Mapping[str, int],
    num_blocks: int,
) -> int:
    """The kernel blocks per manager block of the paged views (1 if none is split)."""
    ratios = {
        layer: kv_caches[layer].shape[0] // layer_blocks.get(layer, num_blocks)
        for layer, traits in layer_traits.items()
        if not _is_state(traits)
        and kv_caches[layer].ndim > 1
        and layer_blocks.get(layer, num_blocks) > 0
    }
    distinct = set(ratios.values())
    if len(distinct) > 1:
        raise ValueError(
            f"paged views split manager blocks into different numbers of "
            f"kernel blocks {ratios}; pass kernel_ratio"
        )
    return distinct.pop() if distinct else 1


def _layer_pieces(
    layer: str,
    cache: torch.Tensor,
    traits: KVLayoutTraits,
    group_id: int,
    num_blocks: int,
    kernel_blocks: bool = False,
    kernel_ratio: int | None = None,
    storage: MemoryRange | None = None,
) -> Iterable[_Piece]:
    """The region(s) of one layer's cache view. With ``storage`` (the allocation the
    view lies in), a paged view whose block is not one dense page, in a block-major
    storage, is the whole storage row (vLLM's rule)."""
    mem_type, device_id = _mem_type(cache), _device_id(cache)
    page = traits.page_size_bytes
    is_state = _is_state(traits)

    def piece(
        base: int,
        block_len: int,
        stride: int,
        blocks: int,
        head_major: bool,
        segment: tuple[int, int] | None = None,
    ) -> _Piece:
        return _Piece(
            layer=layer,
            traits=traits,
            group_id=group_id,
            base=base,
            block_len=block_len,
            block_stride=stride,
            num_blocks=blocks,
            mem_type=mem_type,
            device_id=device_id,
            head_major=head_major,
            head_segment=segment,
        )

    if is_state and kernel_blocks and kernel_ratio is not None and kernel_ratio > 1:
        # vLLM's worker registers a state page as `ratio` kernel-sized blocks (a region
        # it can share with split attention pages) and reads it back whole, `ratio`
        # kernel blocks apart: valid only when the state pages abut.
        rows = cache.shape[0] if cache.ndim > 1 else num_blocks
        logical_stride = (
            cache.stride(0) * cache.element_size() * (rows // num_blocks)
            if cache.ndim > 1 and num_blocks
            else page
        )
        if page % kernel_ratio or rows % max(num_blocks, 1) or logical_stride != page:
            raise UnsupportedLayoutError(
                layer,
                f"state pages of {page} bytes at stride {logical_stride} cannot "
                f"be registered as {kernel_ratio} kernel blocks each",
            )
        kernel_page = page // kernel_ratio
        return [piece(cache.data_ptr(), kernel_page, kernel_page, num_blocks * kernel_ratio, True)]
    if cache.ndim <= 1:
        # A flat byte view (a raw buffer shared between layer types) has no block
        # dimension: blocks abut, one page apart.
        if kernel_blocks and kernel_ratio is not None and kernel_ratio > 1 and not is_state:
            if page % kernel_ratio:
                raise UnsupportedLayoutError(
                    layer, f"page of {page} bytes does not split into {kernel_ratio} kernel blocks"
                )
            kernel_page = page // kernel_ratio
            return [
                piece(cache.data_ptr(), kernel_page, kernel_page, num_blocks * kernel_ratio, True)
            ]
        return [piece(cache.data_ptr(), page, page, num_blocks, True)]
    itemsize = cache.element_size()
    rows = cache.shape[0]
    stride0 = cache.stride(0) * itemsize
    # Kernel block splitting views a manager block as `ratio` kernel blocks; a
    # recurrent state is indivisible and never split.
    ratio = 1 if is_state else rows // num_blocks
    if kernel_blocks and kernel_ratio is not None and not is_state and ratio != kernel_ratio:
        raise UnsupportedLayoutError(
            layer,
            f"{rows} rows for {num_blocks} blocks are not split into the worker's "
            f"{kernel_ratio} kernel blocks per block (shape {tuple(cache.shape)})",
        )
    if ratio < 1 or (not is_state and rows != ratio * num_blocks) or rows < num_blocks:
        raise UnsupportedLayoutError(
            layer,
            f"{rows} rows cannot hold {num_blocks} blocks "
            f"(shape {tuple(cache.shape)}, {traits.spec_name})",
        )
    sizes = tuple(cache.shape[1:])
    strides = tuple(s * itemsize for s in cache.stride()[1:])
    if ratio > 1 and not kernel_blocks:
        # vLLM splits a manager block into kernel blocks only when the block is one
        # dense page (create_kv_cache_views), so `ratio` abutting kernel pages are the
        # manager page: plan in manager blocks, the ids requests use (vLLM's worker
        # registers kernel blocks: block_len / ratio, num_blocks x ratio).
        kernel_page = prod(sizes) * itemsize
        if not (
            _dense(sizes, strides, itemsize)
            and kernel_page == stride0
            and kernel_page * ratio == page
        ):
            raise UnsupportedLayoutError(
                layer,
                f"{ratio} kernel blocks of {kernel_page} bytes at stride {stride0} "
                f"do not tile its {page}-byte page",
            )
        return [piece(cache.data_ptr(), page, page, num_blocks, sizes[0] == 1)]
    if page % ratio:
        raise UnsupportedLayoutError(
            layer, f"page of {page} bytes does not split into {ratio} kernel blocks"
        )
    block_len, blocks = page // ratio, num_blocks * ratio
    page_dense = _dense(sizes, strides, itemsize)
    if (
        storage is not None
        and not (page_dense and prod(sizes) * itemsize == block_len)
        and 0 <= storage.length - blocks * stride0 < stride0
        and storage.base <= cache.data_ptr() < storage.base + stride0
    ):
        # The view's block is not one dense page (layers interleaved inside a block,
        # BHLNC; or a page padded past its content, DeepSeek-V4 rows) in a storage of
        # `blocks` rows: the region is the whole row, shared by every layer of the
        # storage, as vLLM registers it. Moving the row moves each member's block.
        return [piece(storage.base, stride0, stride0, blocks, False)]
    if page_dense:
        if blocks > 1 and block_len > stride0:
            raise UnsupportedLayoutError(
                layer, f"pages of {block_len} bytes overlap at block stride {stride0}"
            )
        head_major = sizes[0] == 1 or (
            _dense(sizes[1:], strides[1:], itemsize) and strides[0] == prod(sizes[1:]) * itemsize
        )
        return [piece(cache.data_ptr(), block_len, stride0, blocks, head_major)]
    heads = sizes[0]
    if (
        heads > 1
        and strides[0] >= blocks * stride0
        and _dense(sizes[1:], strides[1:], itemsize)
        and block_len % heads == 0
    ):
        # Heads outside blocks (an H-before-B layout): each head is its own segment
        # of `blocks` strided sub-pages.
        return [
            piece(
                cache.data_ptr() + h * strides[0],
                block_len // heads,
                stride0,
                blocks,
                True,
                (h, heads),
            )
            for h in range(heads)
        ]
    raise UnsupportedLayoutError(
        layer,
        f"shape {tuple(cache.shape)} with strides {tuple(cache.stride())} is neither "
        f"a dense page per block nor one segment per head",
    )


def _as_rows(pieces: list[_Piece], storage: MemoryRange) -> list[_Piece]:
    """The pieces of one storage as whole-row pieces, if it is block-outermost."""
    strides = {p.block_stride for p in pieces}
    counts = {p.num_blocks for p in pieces}
    if len(strides) != 1 or len(counts) != 1:
        return pieces
    stride, count = strides.pop(), counts.pop()
    block_major = 0 <= storage.length - count * stride < stride
    inside = all(
        storage.base <= p.base and p.base - storage.base + p.block_len <= stride for p in pieces
    )
    has_state = any(_is_state(p.traits) for p in pieces)
    if not block_major or not inside or has_state or stride <= max(p.block_len for p in pieces):
        return pieces
    return [
        _Piece(
            layer=p.layer,
            traits=p.traits,
            group_id=p.group_id,
            base=storage.base,
            block_len=stride,
            block_stride=stride,
            num_blocks=count,
            mem_type=p.mem_type,
            device_id=p.device_id,
            head_major=False,
            head_segment=None,
        )
        for p in pieces
    ]


def _as_member_row(piece: _Piece, storage: MemoryRange) -> _Piece:
    """``piece`` as a whole-row piece remembering where its page sits, if it is a
    replicated latent token page of a block-major storage; else ``piece``."""
    traits = piece.traits
    stride = piece.block_stride
    offset = piece.base - storage.base
    if not (
        traits.is_mla
        and traits.tp_layout is TPLayout.REPLICATED
        and traits.token_scope not in (TokenScope.RING, TokenScope.RECURRENT_STATE)
        and piece.head_segment is None
        and 0 <= storage.length - piece.num_blocks * stride < stride
        and offset >= 0
        and offset + piece.block_len <= stride
    ):
        return piece
    return _Piece(
        layer=piece.layer,
        traits=traits,
        group_id=piece.group_id,
        base=storage.base,
        block_len=stride,
        block_stride=stride,
        num_blocks=piece.num_blocks,
        mem_type=piece.mem_type,
        device_id=piece.device_id,
        head_major=False,
        head_segment=None,
        row_member=(offset, piece.block_len),
    )


def _agree(region: str, layers: Sequence[str], trait: str, values: Mapping[str, _T]) -> _T:
    """The members' common value of ``trait``; RegionConflictError if they differ."""
    distinct = set(values.values())
    if len(distinct) > 1:
        raise RegionConflictError(region, layers, trait, values)
    return next(iter(distinct))


def _region(index: int, members: list[_Piece]) -> Region:
    first = members[0]
    name = first.layer
    layers = tuple(dict.fromkeys(m.layer for m in members))
    _agree(name, layers, "block_stride", {m.layer: m.block_stride for m in members})
    _agree(name, layers, "num_blocks", {m.layer: m.num_blocks for m in members})
    _agree(name, layers, "head_segment", {m.layer: m.head_segment for m in members})
    paged = [m for m in members if not _is_state(m.traits)]
    states = [m for m in members if _is_state(m.traits)]

    state_layout: TPLayout | None = None
    components: tuple[StateComponent, ...] = ()
    # A replicated state (the PLE state of CSA-linear models) may share a region with a
    # TP-sharded one (vLLM registers both there): the sharded states' layout and
    # components describe the region's state; the replicated one is flagged.
    sharded_states = [m for m in states if m.traits.tp_layout is not TPLayout.REPLICATED]
    replicated_state = len(sharded_states) < len(states)
    if states:
        described = sharded_states or states
        state_layout = _agree(
            name,
            layers,
            "tp_layout of the state layers",
            {m.layer: m.traits.tp_layout for m in described},
        )
        shapes = _agree(
            name,
            layers,
            "state components",
            {m.layer: tuple((c.name, c.nbytes) for c in m.traits.components) for m in described},
        )
        offset, parts = 0, []
        for comp_name, nbytes in shapes:
            parts.append(StateComponent(name=comp_name, offset=offset, nbytes=nbytes))
            offset += nbytes
        components = tuple(parts)

    # Members that disagree on replication: a head-sharded member with one head slot
    # holds the same bytes on every rank (vLLM replicates a single KV head), so a
    # replicated member decides; otherwise the split members decide, and a replicated
    # member of a split region is read in slices from ranks that all hold its bytes,
    # which is right (REPLICATE over heads would not be). vLLM's class list gives the
    # same answers for the layouts it registers (MLA with a ring; main KV with states).
    deciding = paged or sharded_states or states
    split = [m for m in deciding if m.traits.tp_layout is not TPLayout.REPLICATED]
    if len(split) < len(deciding) and any(m.traits.num_head_slots != 1 for m in split):
        deciding = split
    elif len(split) < len(deciding):
        deciding = [m for m in deciding if m.traits.tp_layout is TPLayout.REPLICATED]
    layout = _agree(name, layers, "tp_layout", {m.layer: m.traits.tp_layout for m in deciding})
    shards = _agree(name, layers, "tp_shards", {m.layer: m.traits.tp_shards for m in deciding})
    replicated = layout is TPLayout.REPLICATED
    heads: int | None = None
    if paged and not replicated:
        slots = {
            m.layer: m.traits.num_head_slots
            for m in paged
            if m.traits.tp_layout is not TPLayout.REPLICATED
        }
        if len(set(slots.values())) > 1 and all(
            m.head_major and m.traits.kv_head_contiguous for m in paged
        ):
            # Pages of other head counts at one base (MiMo-V2: full layers of 4 KV heads
            # and window layers of 8, paged to equal bytes), each heads-outermost: a
            # block splits into gcd(slots) byte slices that each hold whole heads of
            # every member, which is what a TP split reads.
            heads = gcd(*slots.values())
        else:
            heads = _agree(name, layers, "num_head_slots", slots)
    group_ids = tuple(sorted({m.group_id for m in members}))
    return Region(
        index=index,
        name=name,
        layers=layers,
        base_addr=first.base,
        # Paged blocks move block_len bytes; a state's pages are addressed by their
        # components (and vLLM's PLE length), so a wider state page does not widen it.
        block_len=max(m.block_len for m in (paged or members)),
        block_stride=first.block_stride,
        num_blocks=first.num_blocks,
        mem_type=first.mem_type,
        device_id=first.device_id,
        group_id=group_ids[0] if len(group_ids) == 1 else SHARED_REGION_GROUP_ID,
        group_ids=group_ids,
        tp_layout=layout,
        tp_shards=shards,
        replicated=replicated,
        paged=bool(paged),
        state=bool(states),
        state_tp_layout=state_layout,
        state_components=components,
        scratch=any(m.traits.token_scope is TokenScope.RING for m in members),
        token_scopes=tuple(sorted({m.traits.token_scope for m in members}, key=lambda s: s.value)),
        dtypes=tuple(sorted({m.traits.dtype or "mixed" for m in members})),
        kv_quant_modes=tuple(sorted({m.traits.kv_quant_mode for m in members})),
        num_head_slots=heads,
        # A head's slice of a block is contiguous only if the page also keeps each KV
        # head's slots together.
        head_major=all(m.head_major and m.traits.kv_head_contiguous for m in paged),
        head_segment=first.head_segment,
        replicated_state=replicated_state,
        packed_members=tuple((m.layer, *m.row_member) for m in members if m.row_member is not None),
        kv_head_contiguous=all(m.traits.kv_head_contiguous for m in paged),
    )


def _shard_count_checked(region: Region, tp_size: int) -> int:
    shards = _shard_count(region.tp_layout, region.tp_shards, tp_size)
    if tp_size % shards:
        raise ValueError(f"region {region.name!r}: {shards} shards do not divide TP size {tp_size}")
    return shards


def shard_count(region: Region, tp_size: int) -> int:
    """Distinct shards of ``region`` across ``tp_size`` ranks (1 if replicated)."""
    return _shard_count_checked(region, tp_size)
