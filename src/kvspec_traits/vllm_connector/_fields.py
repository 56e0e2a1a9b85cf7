"""A region plan as vLLM's NIXL worker keeps it (the mapping to the worker's fields is
:func:`~._seam.worker_fields`): each layer's place in a packed row, the replicated-state
region, and the region geometry a peer's vLLM agent metadata carries (pure: no vLLM
import)."""

from __future__ import annotations

from typing import Any

from kvspec_traits.transfer import MalformedMetadataError, PeerRegion, RegionPlan
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME

__all__ = ["packed_layouts", "peer_regions_of", "replicated_state_region"]


def packed_layouts(plan: RegionPlan) -> dict[str, tuple[int, int]]:
    """Each layer's ``(offset, page bytes)`` in the whole row it is registered in
    (vLLM's ``packed_member_layouts``, sent in the agent metadata so that a PP stage
    addresses its pages in the rows; empty without such rows)."""
    return {
        layer: (offset, length)
        for region in plan.regions
        for layer, offset, length in region.packed_members
    }


def replicated_state_region(plan: RegionPlan) -> int | None:
    """The region holding a TP-replicated recurrent-state member (the worker's
    ``ple_region_index`` in :mod:`._seam`), or None.

    A question about the plan's regions, in any model: raises ``ValueError`` for more
    than one such region (vLLM's worker keeps one index). It differs from
    :func:`~kvspec_traits.vllm_connector._facts.replicated_state_group`, the rule on
    cache groups of ring-buffer models asked before planning (one group of one layer,
    all of whose layers are replicated states): here several replicated-state layers
    may share the one region, and the region may hold other members too.
    """
    ple = [r.index for r in plan.regions if r.replicated_state]
    if len(ple) > 1:
        raise ValueError(
            f"{CONNECTOR_NAME}: at most one replicated recurrent-state "
            f"region is supported, got {ple}"
        )
    return ple[0] if ple else None


def peer_regions_of(meta: Any) -> list[PeerRegion]:
    """The region geometry in vLLM's agent metadata (per-region lists of one length)."""
    count = len(meta.kv_caches_base_addr)
    num_blocks = meta.region_num_blocks or [meta.num_blocks] * count
    mem_types = meta.region_mem_types or ["DRAM"] * count
    lists: dict[str, list[Any]] = {
        "block_lens": meta.block_lens,
        "block_strides": meta.block_strides,
        "region_num_blocks": num_blocks,
        "region_mem_types": mem_types,
    }
    uneven = {name: len(v) for name, v in lists.items() if len(v) != count}
    if uneven:
        raise MalformedMetadataError(
            f"{count} region base addresses but per-region lists of other lengths: {uneven}"
        )
    return [
        PeerRegion(
            base_addr=base,
            block_len=length,
            block_stride=stride,
            num_blocks=blocks,
            device_id=meta.device_id,
            mem_type=mem,
        )
        for base, length, stride, blocks, mem in zip(
            meta.kv_caches_base_addr,
            meta.block_lens,
            meta.block_strides,
            num_blocks,
            mem_types,
            strict=True,
        )
    ]
