"""The value types of a plan: regions, what to register, and a rank's region plan.

Pure: imports neither NIXL, numpy nor vLLM. A region holds every fact vLLM's NIXL worker
keeps per region (``vllm_connector._fields.worker_fields`` names them as the worker does),
so a connector can compare them field by field. :class:`PlanLayout` holds the choices two
valid plans of the same bytes differ in.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from types import MappingProxyType
from typing import Any, Final, Literal, TypeVar, cast

from kvspec_traits._traits import KVLayoutTraits, TokenScope, TPLayout
from kvspec_traits.transfer._fingerprint import PlanFingerprint, fingerprint_of, traits_record

__all__ = [
    "SHARED_REGION_GROUP_ID",
    "MemoryRange",
    "PlanLayout",
    "Region",
    "RegionPlan",
    "StateComponent",
    "Rows",
    "desc_offsets",
    "has_ring",
    "is_state",
    "region_sort_key",
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


class Rows(enum.Flag):
    """Which pages of a block-major storage (``num_blocks`` rows of one block stride,
    plus less than a row) are registered as the whole row they lie in: base = the
    storage's, block length = stride, never split by heads. One descriptor per block
    moves every page of the row."""

    NONE = 0
    SCATTERED = enum.auto()
    """A page that is not one dense run of its spec's page size (layers interleaved
    inside a block, as BHLNC puts them; a page padded past its content): the row is its
    one contiguous description, shared by every such layer of the storage."""
    LATENT = enum.auto()
    """Replicated latent (MLA) token pages, when every view shares one storage and one
    block stride; :attr:`Region.packed_members` says where each page sits in the row."""
    ALL = enum.auto()
    """Every page of a block-outermost storage without a recurrent state (every view
    at one block stride and count, each page inside the row, the row wider than each)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanLayout:
    """How :func:`~kvspec_traits.transfer.plan_regions` lays regions over the same
    bytes: the choices two valid plans of one KV cache differ in (both peers of a
    transfer must plan with equal layouts; the fingerprint shows where they differ)."""

    sub_blocks: int | None = None
    """Plan each block as this many equal sub-blocks: ``block_len / n`` bytes,
    ``num_blocks * n`` of them. A paged view's rows must be its blocks split ``n`` ways
    (kernel blocks; :class:`UnsupportedLayoutError` otherwise); a recurrent-state page,
    which no view splits, becomes ``n`` sub-blocks read back whole ``n`` sub-blocks
    apart (so it can share a region with split pages). ``None``: whole blocks, also
    for views whose rows are sub-blocks (those rows are merged back)."""
    order: Literal["model", "given"] = "model"
    """Region order: model-layer order (:func:`region_sort_key`), or the order of the
    ``kv_caches`` mapping."""
    rows: Rows | None = None
    """Which pages are registered as whole rows. ``None``: :attr:`Rows.SCATTERED`,
    unless a layer is a ring buffer (:func:`has_ring`): each owner then registers its
    own page of a shared row, so a ring's page keeps a region of its own."""
    separate_page_sizes: bool = False
    """Pages of other sizes at one base (overlaid groups: a compressor ring over an MLA
    page) are separate regions, each moving its own page; by default they share one
    region that moves the longest page."""
    replicated_states_apart: frozenset[str] = frozenset()
    """Layers of TP-replicated recurrent states each planned as a region of its own,
    also where its pages overlay another layer's (a hybrid allocator's shared
    tensors), moving the state's content (``unpadded_page_size_bytes``: the same on
    every rank, the padding to the unified page left out). Their region is REPLICATE
    whatever the layers it overlays."""

    def __post_init__(self) -> None:
        if self.sub_blocks is not None and self.sub_blocks < 1:
            raise ValueError(f"sub_blocks {self.sub_blocks} must be >= 1 (or None)")
        if self.order not in ("model", "given"):
            raise ValueError(f"order {self.order!r} is not 'model' or 'given'")


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
    layers: tuple[tuple[str, int, int], ...] = ()
    """``(layer, first byte, bytes spanned)`` of each layer's cache view in this
    allocation, read from the tensors (not from region bases): what binds each region's
    base to its own layers' memory (:func:`~kvspec_traits.transfer.check_peer`)."""


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
    block row by :attr:`Rows.LATENT`: where its page sits in the row (vLLM's
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
        """The canonical, TP-independent facts of this region (for the fingerprint):
        :func:`~kvspec_traits.transfer.traits_record`."""
        return traits_record(self, tp_size)


def desc_offsets(region_num_blocks: Sequence[int]) -> tuple[int, ...]:
    """Flat descriptor id of block 0 of each region in a strided list whose regions
    hold ``region_num_blocks`` blocks."""
    return (0, *accumulate(region_num_blocks[:-1])) if region_num_blocks else ()


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
    _memo: dict[tuple[object, ...], Any] = field(init=False, repr=False, compare=False)

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
        object.__setattr__(self, "_memo", {})

    def memo(self, key: tuple[object, ...], build: Callable[[], _T]) -> _T:
        """``build()``, computed once per ``key`` for this plan and kept with it (what a
        transfer backend derives from the plan once, not once per request: descriptor
        indices, the regions that overlap)."""
        if key not in self._memo:
            self._memo[key] = build()
        return cast("_T", self._memo[key])

    @property
    def desc_offsets(self) -> tuple[int, ...]:
        """Flat descriptor id of block 0 of each region in the plan's strided list."""
        return self._desc_offsets

    @property
    def region_group_ids(self) -> list[int]:
        """Each region's group id (:data:`SHARED_REGION_GROUP_ID` for a shared one)."""
        return list(self._group_ids)

    @property
    def region_names(self) -> list[str]:
        """Each region's name (its first member layer)."""
        return [r.name for r in self.regions]

    def region_of(self, layer: str) -> Region:
        """The (first) region holding ``layer``; ``KeyError`` if it has none."""
        for region in self.regions:
            if layer in region.layers:
                return region
        raise KeyError(
            f"layer {layer!r} has no region (skipped: "
            f"{self.skipped_layers.get(layer, 'unknown layer')})"
        )

    def fingerprint(self, *, pp: tuple[int, int] = (0, 1)) -> PlanFingerprint:
        """The canonical, versioned per-region traits fingerprint for the handshake, of
        pipeline stage ``pp`` (``(pp_rank, pp_size)``; ``(0, 1)``: every layer)."""
        return fingerprint_of(self, pp=pp)

    def subset(self, indices: Sequence[int]) -> RegionPlan:
        """The plan of the regions at ``indices`` (in that order) over the same
        registrations: what a pipeline stage's peer moves of this plan."""
        return RegionPlan(
            regions=tuple(self.regions[i] for i in indices),
            registrations=self.registrations,
            num_blocks=self.num_blocks,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            skipped_layers=self.skipped_layers,
            num_groups=self.num_groups,
        )


def is_state(traits: KVLayoutTraits) -> bool:
    """Whether a layer's cache is a recurrent state (one indivisible page per block,
    never split into kernel blocks nor by heads), not token-addressed pages."""
    return traits.token_scope is TokenScope.RECURRENT_STATE


def has_ring(traits: Iterable[KVLayoutTraits]) -> bool:
    """Whether any of these layers' caches is a ring buffer (one page rewritten in
    place, :attr:`TokenScope.RING`): a region's :attr:`Region.scratch`, a plan's
    default :attr:`PlanLayout.rows`, the connector's CSA-linear models."""
    return any(t.token_scope is TokenScope.RING for t in traits)
