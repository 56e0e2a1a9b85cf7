"""A connected peer as the agent keeps it, and the per-request descriptor ids of
``mode="prepped"`` (pure numpy: no NIXL call here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy.typing as npt

from kvspec_traits.nixl._descs import (
    BlockIds,
    DescIndex,
    Request,
    desc_ids_of,
    desc_index,
    request_pair,
)
from kvspec_traits.nixl._errors import MissingPeerError
from kvspec_traits.nixl._items import ReadCache, check_lengths
from kvspec_traits.nixl._wire import PeerMetadata
from kvspec_traits.transfer import RegionPlan
from kvspec_traits.transfer._errors import MemoryTypeMismatchError
from kvspec_traits.transfer._region import desc_offsets

__all__ = [
    "DESC_MODES",
    "DescMode",
    "RemotePeer",
    "TransferResult",
    "check_prepped_rank",
    "plan_mem_type",
    "prepped_desc_ids",
    "prepped_ids_of",
]

DescMode = Literal["prepped", "per_block", "merged"]
"""How a request's blocks become descriptors:

- ``"prepped"``: vLLM's way: the strided ``Nx5`` lists prepared once per peer, a
  request selects one descriptor per block per region (same TP size only);
- ``"per_block"``: ``Nx3`` rows built per request, one per block per region and read;
- ``"merged"``: as ``per_block``, with rows contiguous on both sides merged.
"""
DESC_MODES: tuple[DescMode, ...] = get_args(DescMode)


@dataclass(slots=True)
class RemotePeer:
    """A connected peer rank: its decoded metadata and, for equal TP sizes, the
    prepared strided descriptor list of its regions."""

    meta: PeerMetadata
    prepped: Any = None
    mem_type: str = "DRAM"
    """Memory type of the peer's regions (the type its descriptors are tagged with)."""
    region_num_blocks: tuple[int, ...] = field(init=False, repr=False)
    """The peer's block count of each region (they may differ from ours)."""
    desc_offsets: tuple[int, ...] = field(init=False, repr=False)
    """Flat id of each region's block 0 in the peer's prepared list."""
    reads: ReadCache | None = field(default=None, repr=False)
    """This agent's TP reads from this peer, kept across requests (set by connect)."""
    desc_index: DescIndex | None = field(default=None, repr=False)
    """Index of the peer's prepared list for block ids -> descriptor ids (kept)."""

    def __post_init__(self) -> None:
        self.region_num_blocks = tuple(r.num_blocks for r in self.meta.regions)
        self.desc_offsets = desc_offsets(self.region_num_blocks)

    @property
    def name(self) -> str:
        return self.meta.agent_name

    @property
    def tp_rank(self) -> int:
        return self.meta.tp_rank


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A finished read: every byte of the requested blocks arrived."""

    descriptors: int
    """Descriptors posted to NIXL."""
    per_block_descriptors: int
    """What one descriptor per block (per region, per TP read) would have been."""
    nbytes: int
    seconds: float


def prepped_desc_ids(
    plan: RegionPlan,
    peer: RemotePeer,
    block_ids: BlockIds,
    remote_block_ids: BlockIds | None = None,
) -> tuple[npt.NDArray[Any], npt.NDArray[Any], int]:
    """A request's descriptor ids into our prepared list and the peer's, and the bytes
    they move: the whole per-request descriptor work of ``mode="prepped"`` (vLLM's
    two ``_compute_desc_ids`` calls), with the ids validated first (types, one list per
    group, bounds on both sides, distinct destinations). The ids are int32 (NIXL's
    index type) unless a list holds 2^31 descriptors or more."""
    lreq, rreq = request_pair(block_ids, remote_block_ids, plan.num_groups)
    return prepped_ids_of(plan, peer, lreq, rreq)


def prepped_ids_of(
    plan: RegionPlan,
    peer: RemotePeer,
    lreq: Request,
    rreq: Request,
    *,
    local_checked: bool = False,
) -> tuple[npt.NDArray[Any], npt.NDArray[Any], int]:
    """:func:`prepped_desc_ids` of converted requests; ``local_checked``: the local
    ids were already checked against the plan (bounds, distinct destinations)."""
    check_lengths(lreq, rreq)
    local_index = desc_index(plan)
    if peer.desc_index is None:
        peer.desc_index = desc_index(plan, peer.region_num_blocks)
    if local_checked:
        local_ids = local_index.desc_ids(lreq, int32=True)
    else:
        local_ids = desc_ids_of(local_index, lreq, "local", int32=True)
    remote_ids = desc_ids_of(peer.desc_index, rreq, "remote", int32=True)
    return local_ids, remote_ids, local_index.nbytes(lreq)


def plan_mem_type(plan: RegionPlan) -> str:
    """The one memory type of ``plan``'s regions."""
    kinds = sorted({r.mem_type for r in plan.regions})
    if not kinds:
        raise ValueError(
            "the plan has no regions (every layer was skipped: see "
            "RegionPlan.skipped_layers); there is nothing to register"
        )
    if len(kinds) != 1:
        raise MemoryTypeMismatchError(
            None,
            kinds,
            "an agent registers one memory type: plan and register the "
            "caches of each memory type with their own agent",
        )
    return kinds[0]


def check_prepped_rank(plan: RegionPlan, peer: RemotePeer) -> None:
    """A prepared list reads every region whole from the one peer: that is this
    rank's data only if the peer is the same TP rank, or every region holds the
    same bytes on every rank."""
    if peer.tp_rank == plan.tp_rank:
        return
    for region in plan.regions:
        if not region.replicated or region.sharded_state:
            raise MissingPeerError(
                region.name,
                plan.tp_rank,
                [peer.tp_rank],
                f": mode='prepped' reads each block whole from peer {peer.name}, "
                f"whose rank {peer.tp_rank} holds other heads or state shards",
            )
