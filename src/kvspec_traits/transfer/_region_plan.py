"""A rank's region plan: its regions in transfer order, what to register, and the
layout fingerprint its peer compares.

Pure: imports neither NIXL, numpy nor vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar, cast

from kvspec_traits.transfer._fingerprint import PlanFingerprint, fingerprint_of
from kvspec_traits.transfer._region import MemoryRange, Region, desc_offsets

__all__ = ["RegionPlan"]

_T = TypeVar("_T")


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
    _group_regions: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
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
        object.__setattr__(
            self,
            "_group_regions",
            tuple(
                tuple(i for i, r in enumerate(self.regions) if g in r.group_ids)
                for g in range(self.num_groups)
            ),
        )
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
    def group_regions(self) -> tuple[tuple[int, ...], ...]:
        """Per transfer group, the indices of the regions whose pages some layer of the
        group uses (:attr:`Region.group_ids`), in region order: the only regions a
        transfer of that group's blocks touches. A region shared by several groups (a
        hybrid allocator's tensors, shared by layer index) is in each of theirs and in
        no other group's: where groups hold other layer counts, a block of the group
        with fewer layers is a page of its own tensors only (issue 47)."""
        return self._group_regions

    @property
    def region_names(self) -> list[str]:
        """Each region's name (its first member layer)."""
        return [r.name for r in self.regions]

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
