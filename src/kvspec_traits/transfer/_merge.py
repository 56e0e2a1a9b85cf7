"""Merging region candidates (pieces) into regions: the members of a region must agree
on every fact the transfer needs (:class:`RegionConflictError` otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import gcd
from typing import TypeVar

from kvspec_traits._traits import PageComponent, TPLayout, has_ring, is_state
from kvspec_traits.transfer._errors import RegionConflictError
from kvspec_traits.transfer._geometry import Piece
from kvspec_traits.transfer._region import (
    SHARED_REGION_GROUP_ID,
    Region,
    StateComponent,
)

__all__ = ["merge_region"]

_T = TypeVar("_T")


def _agree(region: str, layers: Sequence[str], trait: str, values: Mapping[str, _T]) -> _T:
    """The members' common value of ``trait``; RegionConflictError if they differ."""
    distinct = set(values.values())
    if len(distinct) > 1:
        raise RegionConflictError(region, layers, trait, values)
    return next(iter(distinct))


def merge_region(index: int, members: list[Piece]) -> Region:
    first = members[0]
    name = first.layer
    layers = tuple(dict.fromkeys(m.layer for m in members))
    _agree(name, layers, "block_stride", {m.layer: m.block_stride for m in members})
    _agree(name, layers, "num_blocks", {m.layer: m.num_blocks for m in members})
    _agree(name, layers, "head_segment", {m.layer: m.head_segment for m in members})
    paged = [m for m in members if not is_state(m.traits)]
    states = [m for m in members if is_state(m.traits)]

    state_layout, components, replicated_state = _state_facts(name, layers, states)
    deciding = _deciding(paged, states)
    layout = _agree(name, layers, "tp_layout", {m.layer: m.traits.tp_layout for m in deciding})
    shards = _agree(name, layers, "tp_shards", {m.layer: m.traits.tp_shards for m in deciding})
    replicated = layout is TPLayout.REPLICATED
    heads = None if replicated else _head_slots(name, layers, paged)
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
        scratch=has_ring(m.traits for m in members),
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
        block_sizes=tuple(sorted({m.traits.block_size for m in paged if m.traits.block_size})),
        page_head_slots=tuple(
            sorted({m.traits.num_head_slots for m in paged if m.traits.num_head_slots})
        ),
        state_group_ids=tuple(sorted({m.group_id for m in states})),
    )


def _state_facts(
    name: str, layers: tuple[str, ...], states: list[Piece]
) -> tuple[TPLayout | None, tuple[StateComponent, ...], bool]:
    """The state members' TP layout and components, and whether a replicated state is
    among them. A replicated state (the PLE state of CSA-linear models) may share a
    region with a TP-sharded one (vLLM registers both there): the sharded states' layout
    and components describe the region's state; the replicated one is flagged."""
    if not states:
        return None, (), False
    sharded_states = [m for m in states if m.traits.tp_layout is not TPLayout.REPLICATED]
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
        {m.layer: tuple(_component(c) for c in m.traits.components) for m in described},
    )
    offset, parts = 0, []
    for comp_name, nbytes, runs in shapes:
        parts.append(StateComponent(name=comp_name, offset=offset, nbytes=nbytes, runs=runs))
        offset += nbytes
    return state_layout, tuple(parts), len(sharded_states) < len(states)


def _deciding(paged: list[Piece], states: list[Piece]) -> list[Piece]:
    """The members whose replication decides the region's.

    Members that disagree on replication: a head-sharded member with one head slot
    holds the same bytes on every rank (vLLM replicates a single KV head), so a
    replicated member decides; otherwise the split members decide, and a replicated
    member of a split region is read in slices from ranks that all hold its bytes,
    which is right (REPLICATE over heads would not be). vLLM's class list gives the
    same answers for the layouts it registers (MLA with a ring; main KV with states)."""
    sharded_states = [m for m in states if m.traits.tp_layout is not TPLayout.REPLICATED]
    deciding = paged or sharded_states or states
    split = [m for m in deciding if m.traits.tp_layout is not TPLayout.REPLICATED]
    if len(split) < len(deciding) and any(m.traits.num_head_slots != 1 for m in split):
        return split
    if len(split) < len(deciding):
        return [m for m in deciding if m.traits.tp_layout is TPLayout.REPLICATED]
    return deciding


def _head_slots(name: str, layers: tuple[str, ...], paged: list[Piece]) -> int | None:
    """Head slots of a head-sharded region on this rank (``None`` without paged
    members). Pages of other head counts at one base (MiMo-V2: full layers of 4 KV heads
    and window layers of 8, paged to equal bytes), each heads-outermost: a block splits
    into gcd(slots) byte slices that each hold whole heads of every member, which is
    what a TP split reads."""
    if not paged:
        return None
    slots = {
        m.layer: m.traits.num_head_slots
        for m in paged
        if m.traits.tp_layout is not TPLayout.REPLICATED
    }
    if len(set(slots.values())) > 1 and all(
        m.head_major and m.traits.kv_head_contiguous for m in paged
    ):
        return gcd(*slots.values())
    return _agree(name, layers, "num_head_slots", slots)


def _component(component: PageComponent) -> tuple[str, int, tuple[int, ...] | None]:
    """A state component as a region keeps it: name, bytes and the bytes of each run
    its ``tp_split`` names (elements along the first dimension times the row bytes)."""
    split = component.tp_split
    if split is None or not component.shape or component.nbytes % component.shape[0]:
        return component.name, component.nbytes, None
    row = component.nbytes // component.shape[0]
    return component.name, component.nbytes, tuple(n * row for n in split)
