"""The value types of a plan: regions and what to register (a rank's plan of them is
``_region_plan.RegionPlan``).

Pure: imports neither NIXL, numpy nor vLLM. A region holds every fact vLLM's NIXL worker
keeps per region (``vllm_connector._fields.worker_fields`` names them as the worker does),
so a connector can compare them field by field. :class:`PlanLayout` holds the choices two
valid plans of the same bytes differ in.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Final, Literal, TypeVar

from kvspec_traits._traits import TokenScope, TPLayout

__all__ = [
    "SHARED_REGION_GROUP_ID",
    "MemoryRange",
    "PlanLayout",
    "Region",
    "Rows",
    "StateComponent",
    "desc_offsets",
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
    runs: tuple[int, ...] | None = None
    """Bytes of each run this rank holds one contiguous slice of (the component's
    :attr:`~kvspec_traits.PageComponent.tp_split` times its row bytes; they add up to
    ``nbytes``): every rank of a TP group holds ``1 / tp`` of each run, in rank order,
    which is what a rank of another TP size reads its share from. ``None``: the traits
    do not say how the component splits."""


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
    block_sizes: tuple[int, ...] = ()
    """Tokens per block of the paged members (their traits' ``block_size``; several where
    members differ, none for a state-only region): two peers whose blocks hold other
    token counts cannot pair block ids one to one."""
    page_head_slots: tuple[int, ...] = ()
    """Head slots of a paged member's page on this rank (their traits'
    ``num_head_slots``; several where members differ), replicated or not: how many
    token runs a heads-outermost page holds, which a block-size ratio reads one by one."""
    state_group_ids: tuple[int, ...] = ()
    """The cache groups whose blocks in this region hold a recurrent state (the rest of
    :attr:`group_ids` hold token pages): a block of a region shared by an attention
    group and a state group is read as what its group keeps there."""

    @property
    def sharded_state(self) -> bool:
        """Holds a recurrent state split across TP ranks: each rank's blocks hold its
        own shard, whatever the paged members' replication."""
        return self.state and self.state_tp_layout is not TPLayout.REPLICATED


def desc_offsets(region_num_blocks: Sequence[int]) -> tuple[int, ...]:
    """Flat descriptor id of block 0 of each region in a strided list whose regions
    hold ``region_num_blocks`` blocks."""
    return (0, *accumulate(region_num_blocks[:-1])) if region_num_blocks else ()
