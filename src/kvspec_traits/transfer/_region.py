"""The value types of a plan: regions, what to register, and a rank's region plan.

Pure: imports neither NIXL, numpy nor vLLM. The records mirror vLLM's NIXL worker
bookkeeping (``kv_caches_base_addr``, ``block_len_per_layer``, ``block_stride_per_layer``,
``region_num_blocks``, ``region_group_ids``, ``region_names``, ``_region_is_mla``,
``_ssm_region_indices``, ``_scratch_region_indices``) so a connector can compare them
field by field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from types import MappingProxyType
from typing import Any, Final, TypeVar, cast

from kvspec_traits._traits import KVLayoutTraits, TokenScope, TPLayout
from kvspec_traits.transfer._fingerprint import PlanFingerprint, fingerprint_of, traits_record

__all__ = [
    "SHARED_REGION_GROUP_ID",
    "MemoryRange",
    "Region",
    "RegionPlan",
    "StateComponent",
    "desc_offsets",
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
        return fingerprint_of(self)


def is_state(traits: KVLayoutTraits) -> bool:
    """Whether a layer's cache is a recurrent state (one indivisible page per block,
    never split into kernel blocks nor by heads), not token-addressed pages."""
    return traits.token_scope is TokenScope.RECURRENT_STATE
