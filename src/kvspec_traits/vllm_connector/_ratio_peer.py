"""Peers of another block size (issue 48): what the worker keeps of each (the planner's
lanes, the peer's regions per rank), the read of one request from them (pull) and the
write of one request into them (push: what each consumer rank would read from this
rank, turned around), with descriptors built by :mod:`kvspec_traits.nixl._ratio_descs`
from :func:`~kvspec_traits.transfer.block_reads`, never by vLLM's block-size branch.

vLLM's own read path splits each larger local block into contiguous chunks of the peer's
block length and permutes heads-outermost pages after the read; it asserts where decode
blocks are the smaller, and where the producer has more TP ranks. The connector keeps
vLLM's bookkeeping of the peer (agents, TP mapping, notifications, failure paths) by
handing ``add_remote_agent`` the peer's geometry at this worker's block size
(:func:`at_our_block_size`: the same bytes cut at our block length, inside the peer's
registered memory), so vLLM neither converts nor permutes what the connector read; the
reads and writes of such a peer are the connector's alone (:func:`read_request`,
:func:`write_request`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvspec_traits._errors import KVSpecTraitsError
from kvspec_traits._kinds import TokenScope
from kvspec_traits.nixl._ratio_descs import (
    RatioLane,
    ratio_reads,
    ratio_write_lanes,
    ratio_writes,
)
from kvspec_traits.transfer import PeerRegion, Region, RegionPlan, UnsupportedLayoutError
from kvspec_traits.vllm_connector import _seam as seam
from kvspec_traits.vllm_connector._fields import peer_regions_of
from kvspec_traits.vllm_connector._log import logger
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME
from kvspec_traits.vllm_connector._reads import post_reads, row_reads

__all__ = [
    "RATIO_REGISTRATION_KEY",
    "RatioPeer",
    "at_our_block_size",
    "read_request",
    "slot_parts",
    "windows",
    "write_request",
]

RATIO_REGISTRATION_KEY = "kvspec_traits_ratio"
"""The key of a push consumer's block registration under which its scheduler adds
where its block lists start (``computed``: per cache group, the blocks its prefix
cache held) and the request's tokens (``tokens``): what the producer needs to place a
consumer's suffix of blocks of another size. Upstream's writer ignores the key."""

CPU_ATTENTION = "CPU_ATTN"
K_TRANSPOSED_ISAS = frozenset({"vec", "vec16"})
"""The instruction sets for which vLLM-CPU's attention kernel writes a head's slot of a
block as K transposed (``[head_size, tokens]``) then V (``[tokens, head_size]``), as
``cpu_attn_reshape_and_cache`` does (measured in tests/test_connector_block_ratio.py);
the page's ``[heads, tokens, K|V]`` view is not where its bytes are."""


@dataclass
class RatioPeer:
    """A producer engine whose blocks hold other token counts than ours."""

    lanes: tuple[RatioLane, ...]
    remote_tp: int
    tokens: tuple[int, ...] = ()
    """The peer's tokens per block of each region."""
    parts: tuple[tuple[tuple[int, int], ...] | None, ...] = ()
    """How our (and so the peer's) head slots keep their tokens (:func:`slot_parts`)."""
    ranks: dict[int, list[PeerRegion]] = field(default_factory=dict)
    """Each handshaken remote rank's regions, as its metadata placed them."""
    writes: dict[int, tuple[RatioLane, ...]] = field(default_factory=dict)
    """Push: per handshaken consumer rank, what it would read from this rank."""
    remote_blocks_per_logical: int = 1

    def keep_rank(self, rank: int, metadata: Any, plan: RegionPlan | None = None) -> None:
        """Keep remote rank ``rank``'s regions; with ``plan`` (a push producer's), what
        this rank writes into it (refused by name where the planner cannot)."""
        regions = peer_regions_of(metadata)
        if plan is not None:
            self.writes[rank] = ratio_write_lanes(
                plan, self.remote_tp, rank, regions, self.tokens, self.parts
            )
        self.ranks[rank] = regions
        self.remote_blocks_per_logical = int(metadata.physical_blocks_per_logical_kv_block or 1)


def slot_parts(worker: Any, plan: RegionPlan) -> list[tuple[tuple[int, int], ...] | None]:
    """How each region's head slots hold their tokens, as the worker's attention kernel
    writes them (:func:`~kvspec_traits.transfer.block_reads`' ``parts``): an MLA
    latent's token rows (``None``); under vLLM-CPU's attention backend, K transposed
    then V. Raises :class:`~kvspec_traits.transfer.UnsupportedLayoutError` for pages of
    another attention backend or instruction set (the connector knows no other
    kernel's block interior), or a quantized KV cache."""
    facts = worker._layout_facts()
    out: list[tuple[tuple[int, int], ...] | None] = []
    for region in plan.regions:
        latent = region.layers and all(facts.layer_traits[n].is_mla for n in region.layers)
        if latent or region.state or region.scratch or not region.paged:
            out.append(None)  # token rows; a state or a ring: the planner refuses it
            continue
        out.append(_attention_parts(worker, region))
    return out


def _attention_parts(worker: Any, region: Region) -> tuple[tuple[int, int], ...]:
    def refuse(why: str) -> UnsupportedLayoutError:
        return UnsupportedLayoutError(
            region.name,
            f"{why}, so its blocks cannot be read between other block sizes; run prefill "
            f"and decode with the same --block-size",
        )

    backend = worker.backend_name
    cache_dtype = str(worker.vllm_config.cache_config.cache_dtype)
    if backend != CPU_ATTENTION or cache_dtype != "auto" or len(region.dtypes) != 1:
        raise refuse(
            f"its pages are written by attention backend {backend} (KV cache dtype "
            f"{cache_dtype}), whose block interior the connector does not know"
        )
    tokens = region.block_sizes[0] if region.block_sizes else 0
    slots = region.page_head_slots[0] if region.page_head_slots else 1
    dtype = getattr(torch, region.dtypes[0], None)
    if not isinstance(dtype, torch.dtype) or tokens < 1 or region.block_len % (tokens * slots):
        raise refuse(f"its pages ({region.dtypes}, {region.block_sizes}) are not K|V rows")
    elem = torch.empty(0, dtype=dtype).element_size()
    half = region.block_len // (tokens * slots) // 2  # K's (and V's) bytes of a token
    isa = seam.cpu_attention_isa(dtype, tokens, half // elem, cache_dtype)
    if isa not in K_TRANSPOSED_ISAS:
        raise refuse(f"vLLM-CPU's attention kernel packs its blocks for {isa!r}")
    return ((half, elem), (half, 0))


def windows(worker: Any) -> list[int | None]:
    """Per transfer group, the tokens its sliding window keeps (``None`` for a group
    with a layer that keeps more): where a window's tail of blocks of another size
    starts after ours, the tokens before the window are not read, and only those
    (:func:`~kvspec_traits.nixl._ratio_descs.ratio_reads`)."""
    facts = worker._layout_facts()
    out: list[int | None] = []
    for group in facts.transfer_groups:
        # A layer without traits here (none known) leaves the group's window unknown.
        kinds = [facts.layer_traits[n] for n in group.layer_names if n in facts.layer_traits]
        sizes = {t.window_tokens for t in kinds if t.token_scope is TokenScope.SLIDING_WINDOW}
        whole = len(sizes) == 1 and all(t.token_scope is TokenScope.SLIDING_WINDOW for t in kinds)
        out.append(next(iter(sizes)) if whole else None)
    return out


def at_our_block_size(metadata: Any, peer: RatioPeer, block_size: int, per_logical: int) -> Any:
    """The peer's metadata with its regions cut at our block length (``block_size``
    tokens a block, ``per_logical`` kernel blocks per block): vLLM's bookkeeping of the
    peer then sees no ratio to convert. The descriptors vLLM builds from it lie inside
    the peer's registered memory and are never read from (:func:`read_request` reads).
    Raises :class:`~kvspec_traits.transfer.UnsupportedLayoutError` where a region's
    block stride does not divide at our block length."""
    lanes = {lane.index: lane for lane in peer.lanes}
    if int(metadata.physical_blocks_per_logical_kv_block or 1) != per_logical:
        first = peer.lanes[0].name if peer.lanes else "(none)"
        raise UnsupportedLayoutError(
            first,
            f"the peer splits a block into {metadata.physical_blocks_per_logical_kv_block} "
            f"kernel blocks, this worker into {per_logical}; run both sides with one "
            f"attention backend, or the same --block-size",
        )

    def scaled(index: int, value: int) -> int:
        lane = lanes[index]
        if (value * lane.local_tokens) % lane.remote_tokens:
            raise UnsupportedLayoutError(
                lane.name,
                f"its {value}-byte block steps on the peer ({lane.remote_tokens} tokens a "
                f"block) do not divide into blocks of {lane.local_tokens} tokens; run both "
                f"sides with the same --block-size",
            )
        return value * lane.local_tokens // lane.remote_tokens

    def count(index: int, blocks: int) -> int:
        lane = lanes[index]
        return blocks * lane.remote_tokens // lane.local_tokens

    regions = range(len(metadata.kv_caches_base_addr))
    region_blocks = metadata.region_num_blocks
    return dataclasses.replace(
        metadata,
        block_size=block_size,
        block_lens=[scaled(i, n) for i, n in zip(regions, metadata.block_lens, strict=True)],
        block_strides=[scaled(i, n) for i, n in zip(regions, metadata.block_strides, strict=True)],
        num_blocks=min(count(i, metadata.num_blocks) for i in regions),
        region_num_blocks=None
        if region_blocks is None
        else [count(i, n) for i, n in zip(regions, region_blocks, strict=True)],
    )


def read_request(worker: Any, peer: RatioPeer, req_id: str, meta: Any) -> None:
    """Read request ``req_id`` (vLLM's ``ReqMeta``) from ``peer``: one NIXL read per
    remote rank the plan names, the producer's notification on each, and on every
    handshaken rank not read from (as vLLM's path notifies them). Ids that do not pair
    (:class:`~kvspec_traits.KVSpecTraitsError`) and a read NIXL refuses fail the
    request through vLLM's failed-read path, before (or instead of) any further read."""
    engine = meta.remote.engine_id
    worker.engine_last_active[engine] = time.perf_counter()
    worker.recving_transfers.setdefault(req_id, [])
    per_logical = worker.physical_blocks_per_logical_kv_block
    computed = getattr(meta, "local_num_computed_blocks", ()) or ()
    try:
        reads = ratio_reads(
            peer.lanes,
            peer.ranks,
            meta.local_physical_block_ids,
            worker.logical_to_kernel_block_ids(
                meta.remote.block_ids, peer.remote_blocks_per_logical
            ),
            [n * per_logical for n in computed] if computed else None,
            meta.remote.num_tokens or None,
            windows(worker),
        )
    except KVSpecTraitsError as err:
        logger.error("%s: request %s not read: %s", CONNECTOR_NAME, req_id, err)
        worker.fail_read(req_id)
        return
    remote_mem = {r.mem_type for regions in peer.ranks.values() for r in regions}
    rows = {rank: got.arrays() for rank, got in reads.items()}
    post_reads(worker, req_id, meta, rows.keys(), row_reads(worker, rows, next(iter(remote_mem))))


def write_request(
    worker: Any,
    peer: RatioPeer,
    meta: Any,
    placement: Any,
    handles: list[int],
) -> None:
    """Write one request (vLLM's push ``ReqMeta``: our blocks, the consumer's registered
    ones) into ``peer``: one NIXL WRITE per handshaken consumer rank, each carrying
    vLLM's completion notification, which a rank this one writes nothing to gets alone
    (as vLLM's consumer counts one per producer rank). ``placement``: what the
    consumer's scheduler added under :data:`RATIO_REGISTRATION_KEY` (where its lists
    start, the request's tokens; absent: lists from the request's first block). Each
    WRITE posted is appended to ``handles`` at once, so a later failure leaves the
    caller every handle to track. Ids that do not pair
    (:class:`~kvspec_traits.KVSpecTraitsError`) raise before any WRITE is posted."""
    extra = placement if isinstance(placement, dict) else {}
    computed = extra.get("computed") or ()
    tokens = extra.get("tokens")
    theirs = worker.logical_to_kernel_block_ids(
        meta.remote.block_ids, peer.remote_blocks_per_logical
    )
    starts = [int(n) * peer.remote_blocks_per_logical for n in computed] if computed else None
    rows = {  # our ids: kernel blocks already (vLLM's push ReqMeta)
        rank: ratio_writes(
            worker.region_plan,
            lanes,
            meta.local_physical_block_ids,
            theirs,
            starts,
            int(tokens) if tokens else None,
            windows(worker),  # the consumer's: the same model's layers
        )
        for rank, lanes in sorted(peer.writes.items())
    }
    notif = f"{meta.remote.request_id}:{worker.world_size}".encode()
    agent = worker.nixl_wrapper
    remote_mem = {r.mem_type for regions in peer.ranks.values() for r in regions}
    for (_, rank), name in sorted(worker.remote_agents[meta.remote.engine_id].items()):
        writes = rows.get(rank)
        if writes is None or not writes.local:
            agent.send_notif(name, notif_msg=notif)
            continue
        local, remote = writes.arrays()
        handle = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(local, worker.nixl_memory_type),
            agent.get_xfer_descs(remote, next(iter(remote_mem))),
            name,
            notif,
        )
        handles.append(handle)
        agent.transfer(handle)
