"""What the connector tells an operator, in vLLM's own terms: the lines a worker logs
once its regions are planned, the bytes a request's plan moves, and the reason a refused
peer is counted under (``_stats`` carries the counts to vLLM's metrics; the logger is
``_log``'s).

Pure: imports no vLLM.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Final

from kvspec_traits._kinds import TPLayout
from kvspec_traits.transfer import (
    SHARED_REGION_GROUP_ID,
    HandshakeMismatchError,
    MalformedMetadataError,
    MemoryTypeMismatchError,
    Region,
    RegionPlan,
    StageLayersError,
)
from kvspec_traits.vllm_connector._errors import (
    PeerWithoutTraitsError,
    UnsupportedPipelineParallelError,
    UnsupportedRingTPError,
    UnsupportedStagePairingError,
    UnsupportedStateTPError,
    VllmHandshakeRefusalError,
)
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME

if TYPE_CHECKING:
    from kvspec_traits.vllm_connector._options import ConnectorOptions

__all__ = [
    "REFUSAL_REASONS",
    "planned_bytes",
    "refusal_reason",
    "startup_lines",
]

# Why the connector refused a peer at the handshake, by the error it raised (most
# specific first): the ``reason`` label of vllm:kvspec_traits_peers_refused_total.
_REASONS: Final[tuple[tuple[type[Exception], str], ...]] = (
    (HandshakeMismatchError, "layout_mismatch"),
    (MemoryTypeMismatchError, "memory_type"),
    (MalformedMetadataError, "malformed_metadata"),
    (PeerWithoutTraitsError, "no_fingerprint"),
    (StageLayersError, "pipeline_stages"),
    (UnsupportedStagePairingError, "pipeline_stages"),
    (UnsupportedPipelineParallelError, "pipeline_parallel"),
    (UnsupportedRingTPError, "tp_size"),
    (UnsupportedStateTPError, "tp_size"),
    (VllmHandshakeRefusalError, "vllm_handshake"),
)
REFUSAL_REASONS: Final = tuple(dict.fromkeys(reason for _, reason in _REASONS))
"""Every reason a peer is refused for, in the order the docs list them."""


def refusal_reason(error: BaseException) -> str | None:
    """The reason the connector refused a peer with ``error``; ``None`` for an error
    that is not one of the connector's refusals (vLLM's own, a dead socket), which
    vLLM counts itself (``vllm:nixl_num_failed_transfers``)."""
    for cls, reason in _REASONS:
        if isinstance(error, cls):
            return reason
    return None


def planned_bytes(plan: RegionPlan, block_ids: Sequence[Sequence[int]]) -> int:
    """The bytes this rank's ``plan`` moves for a request whose blocks are ``block_ids``
    (one list per transfer group, in the plan's block units: vLLM's kernel blocks): each
    region's block length times its blocks, those of its group, or of every group for a
    region shared by several groups (as vLLM's worker expands them by region)."""
    every = sum(len(ids) for ids in block_ids)
    total = 0
    for region in plan.regions:
        if region.group_id == SHARED_REGION_GROUP_ID:
            count = every
        elif region.group_id < len(block_ids):
            count = len(block_ids[region.group_id])
        else:
            count = 0
        total += region.block_len * count
    return total


def _layers(region: Region) -> str:
    if len(region.layers) <= 2:
        return ", ".join(region.layers)
    return f"{region.layers[0]} .. {region.layers[-1]}"


def _tp_text(region: Region, tp_rank: int, tp_size: int) -> str:
    if region.replicated:
        return (
            f"TP {region.tp_layout.value}: REPLICATE, the same bytes on each of {tp_size} rank(s)"
        )
    if region.tp_layout is TPLayout.HEAD_SHARDED and region.num_head_slots is not None:
        return (
            f"TP {region.tp_layout.value}: SPLIT, {region.num_head_slots} head slot(s) "
            f"on rank {tp_rank} of {tp_size}"
        )
    return f"TP {region.tp_layout.value}: SPLIT, rank {tp_rank}'s shard of {tp_size}"


def region_line(region: Region, tp_rank: int, tp_size: int) -> str:
    """One region as the startup log says it: layers, cache group, TP layout, bytes."""
    group = (
        "shared by several groups"
        if region.group_id == SHARED_REGION_GROUP_ID
        else (str(region.group_id))
    )
    return (
        f"{CONNECTOR_NAME}: region {region.index} {region.name!r}: "
        f"{len(region.layers)} layer(s) ({_layers(region)}), cache group {group}, "
        f"{_tp_text(region, tp_rank, tp_size)}; {region.block_len} bytes per block, "
        f"{region.num_blocks} blocks, {region.mem_type}"
    )


def options_json(options: ConnectorOptions) -> str:
    """The options in effect as ``kv_connector_extra_config`` JSON, every key the
    connector reads (defaults included), by key."""
    given = {f.metadata["key"]: getattr(options, f.name) for f in fields(options)}
    return json.dumps(dict(sorted(given.items())))


def startup_lines(
    *,
    version: str,
    vllm_version: str,
    engine_id: str,
    tp_rank: int,
    tp_size: int,
    options: ConnectorOptions,
    plan: RegionPlan,
) -> list[str]:
    """What a worker logs once, when its regions are planned: the kvspec-traits and vLLM
    versions, the options in effect, then one line per transfer region."""
    head = (
        f"{CONNECTOR_NAME}: kvspec-traits {version} on vLLM {vllm_version}, engine "
        f"{engine_id}, TP rank {tp_rank} of {tp_size}, {len(plan.regions)} transfer "
        f"region(s); options in effect (kv_connector_extra_config): {options_json(options)}"
    )
    return list(itertools.chain([head], (region_line(r, tp_rank, tp_size) for r in plan.regions)))
