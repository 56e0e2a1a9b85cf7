"""Where vLLM series differ: the one place the connector branches on the installed
vLLM series, or probes a vLLM object for what its series keeps (every other decision
comes from traits and the planner's region facts). Pure: no vLLM import at import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from kvspec_traits.vllm_connector._gate import installed_vllm, vllm_series

__all__ = [
    "SeriesQuirks",
    "derive_region_sets",
    "has_packed_cache",
    "keep_dcp_replicated_groups",
    "keep_dst_region_group_mapping",
    "keep_group_region_indices",
    "metadata_has_layer_group_ids",
    "packed_member_layouts",
    "series_quirks",
    "stage_regions_by_position",
    "tracks_region_layers",
    "transfer_layer_region_indices",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeriesQuirks:
    """Where vLLM series register the same layout differently: the one place the
    connector branches on the installed vLLM series (every other decision comes from
    traits and the planner's region facts)."""

    series: str
    regions_keyed_by_block_len: bool
    """vLLM 0.34 keys a region by (base address, block length): overlaid groups paging
    the same bytes with different page sizes are separate regions. 0.32/0.33 key by
    base address only (one region, moving the longest page)."""
    packed_mla_rows: bool
    """vLLM 0.33+ pull workers register a block-outermost (``*B*`` first) MLA cache as
    whole block rows, one descriptor per block, and advertise each layer's page in the
    row (``packed_member_layouts``); 0.32 does so for push workers only."""


def series_quirks(version: str | None = None) -> SeriesQuirks:
    """The :class:`SeriesQuirks` of vLLM ``version`` (default: the imported vLLM)."""
    series = vllm_series(installed_vllm() if version is None else version)
    # "0.34" -> (0, 34); a series that is not numbers has no quirk (the gate refuses it).
    numbers = tuple(int(p) if p.isdigit() else -1 for p in series.split("."))
    return SeriesQuirks(
        series=series,
        regions_keyed_by_block_len=numbers >= (0, 34),
        packed_mla_rows=numbers >= (0, 33),
    )


# -- what a vLLM worker of each series keeps ------------------------------------------
# Probed on the worker (or vLLM's metadata class), not read from the series: vLLM's
# tests build workers with object.__new__ and set only the attributes they need, so an
# attribute is present exactly when the code reading it can be. Every hasattr/getattr
# the connector does on vLLM objects is here.


def has_packed_cache(worker: Any) -> bool:
    """vLLM 0.33+: the worker's cache layout is block-outermost (``_has_packed_cache``)."""
    return bool(getattr(worker, "_has_packed_cache", False))


def packed_member_layouts(worker: Any) -> dict[str, tuple[int, int]]:
    """vLLM 0.33+: each layer's (offset, length) in a packed row (``{}`` before)."""
    layouts: dict[str, tuple[int, int]] = getattr(worker, "_packed_member_layouts", {})
    return layouts


def transfer_layer_region_indices(worker: Any) -> list[int]:
    """vLLM 0.33: the regions of the transfer layers (0.32/0.34 keep no such list)."""
    return list(getattr(worker, "_transfer_layer_region_indices", []))


def tracks_region_layers(worker: Any) -> bool:
    """Whether the worker keeps each region's member layers: vLLM 0.33 only where it
    routes by layer name (``_tracks_region_layers()``); 0.32/0.34 always."""
    tracks = getattr(worker, "_tracks_region_layers", None)
    return tracks is None or bool(tracks())


def stage_regions_by_position(worker: Any) -> bool:
    """Whether a pipeline-parallel stage pairs its regions with its PP 1 peer's by
    position: vLLM 0.32/0.33 slice the peer's regions from the stage's first layer on
    (``_remote_region_offset``), unless the worker routes by layer name
    (``_requires_layer_name_routing()``: push with HMA or packed rows). vLLM 0.34 has
    neither: ``add_remote_agent`` pairs every region by the layers both sides hold."""
    routes_by_name = getattr(worker, "_requires_layer_name_routing", None)
    return routes_by_name is not None and not routes_by_name()


def metadata_has_layer_group_ids(metadata_class: type) -> bool:
    """vLLM 0.34's agent metadata names each region member's transfer group."""
    return "layer_group_ids" in {f.name for f in dataclasses.fields(metadata_class)}


def keep_dst_region_group_mapping(worker: Any, engine_id: str, uses_mapping: bool) -> None:
    """vLLM 0.32/0.33 keep, per engine, whether region group ids route transfers."""
    if hasattr(worker, "dst_uses_region_group_mapping"):
        worker.dst_uses_region_group_mapping[engine_id] = uses_mapping


def keep_group_region_indices(
    worker: Any, regions: Sequence[tuple[int, Collection[int]]], groups: int
) -> None:
    """vLLM 0.34: per transfer group (``groups`` of them), its regions in region order
    (``None`` for a group without one); ``regions``: each region's (index, group ids)."""
    if hasattr(worker, "_group_region_indices"):
        worker._group_region_indices = [
            [index for index, ids in regions if group in ids] or None for group in range(groups)
        ]


def derive_region_sets(worker: Any, packed_layouts: dict[str, tuple[int, int]]) -> None:
    """What vLLM 0.33+ derives from the regions once they are set: the head-sharded
    draft regions, and each layer's place in a packed row (``packed_layouts``: layer
    -> (offset, length), ``_fields.packed_layouts``)."""
    if hasattr(worker, "_get_head_sharded_draft_regions"):
        worker._head_sharded_draft_regions = worker._get_head_sharded_draft_regions()
    if hasattr(worker, "_packed_member_layouts"):
        worker._packed_member_layouts = dict(packed_layouts)


def keep_dcp_replicated_groups(
    worker: Any, replicated: Collection[int], groups: Sequence[Any]
) -> None:
    """vLLM 0.34: the transfer groups a DCP peer holds whole on every rank
    (``_dcp_replicated_groups``, which vLLM derives from MLA classes): here the groups
    whose layers are all TP-replicated (``replicated``), less those the spec marks as
    split over DCP ranks (``dcp_sharded``, a field of every vLLM spec)."""
    if hasattr(worker, "_dcp_replicated_groups"):
        worker._dcp_replicated_groups = {
            i for i in replicated if not getattr(groups[i].spec, "dcp_sharded", False)
        }
