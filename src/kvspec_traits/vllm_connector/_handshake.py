"""The traits half of vLLM's NIXL handshake: the agent metadata that carries the
per-region traits fingerprint, and the check of a peer's fingerprint and region
addresses against this rank's plan (functions the connector's worker calls from vLLM's
handshake, after the compatibility hash matched and the peer's metadata decoded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
from vllm.logger import init_logger

from kvspec_traits._traits import KVLayoutTraits, TokenScope, TPLayout
from kvspec_traits.transfer import (
    HandshakeMismatchError,
    MalformedMetadataError,
    MemoryTypeMismatchError,
    PeerRegion,
    PlanFingerprint,
    RegionPlan,
    StageLayersError,
    UnsupportedLayoutError,
    check_peer,
    check_peer_geometry,
    check_region_bounds,
    decode_fingerprint,
    pair_stages,
)
from kvspec_traits.transfer._fingerprint import record_page
from kvspec_traits.vllm_connector._errors import (
    PeerWithoutTraitsError,
    UnsupportedPipelineParallelError,
    UnsupportedRingTPError,
    UnsupportedStagePairingError,
    UnsupportedStateTPError,
)
from kvspec_traits.vllm_connector._facts import StateSplit
from kvspec_traits.vllm_connector._fields import peer_regions_of
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME, REQUIRE_TRAITS_PEER

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "PipelineStage",
    "TraitsNixlAgentMetadata",
    "check_decode_stage",
    "check_parallel_pair",
    "check_pipeline_parallel",
    "check_ring_tp",
    "check_state_tp",
    "check_remote_fingerprint",
    "handshake_with",
    "other_block_sizes",
    "peer_block_tokens",
    "pipeline_stage",
    "stage_view",
]

# The connector's logger (under "vllm." so vLLM's log configuration applies).
logger = init_logger("vllm.kvspec_traits.connector")


@dataclasses.dataclass
class TraitsNixlAgentMetadata(NixlAgentMetadata):
    """vLLM's agent metadata plus the canonical per-region traits fingerprint.

    Upstream decoders ignore the extra field, so the wire stays readable by vLLM. Only
    this connector's worker decodes into it (its ``peer_metadata_class``, which
    :class:`~._seam.SeamWorker` hands vLLM's handshake); vLLM's ``NixlAgentMetadata``
    is left as vLLM defined it.
    """

    kvspec_traits_fingerprint: bytes | None = None
    kvspec_traits_stage_view: bytes | None = None
    """A PP 1 push worker whose regions are whole rows of several layers: the
    fingerprint of its layers as a pipeline stage lays them out (a region per page, as
    vLLM expands ``packed_member_layouts``), which a stage's regions pair with."""

    def __eq__(self, other: object) -> bool:
        # The same peer metadata as vLLM's class decodes it (no fingerprint field) is
        # equal when every field that class has is: vLLM's own handshake test compares
        # what the handshake hands add_remote_agent with the peer's metadata decoded
        # by vLLM's class. Python tries this method for both orders of `==` (a
        # subclass's), so the comparison is symmetric; two of ours compare every field.
        if type(other) is NixlAgentMetadata:
            return all(
                getattr(self, f.name) == getattr(other, f.name)
                for f in dataclasses.fields(NixlAgentMetadata)
            )
        if isinstance(other, TraitsNixlAgentMetadata):
            return all(
                getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self)
            )
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it extends


# The peer address of the handshake running on this thread (handshakes run on vLLM's
# background executor), for the refusal messages.
_handshake_peer = threading.local()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineStage:
    """A worker's pipeline stage and how its vLLM series pairs stages, for the checks of
    its handshakes (the worker's ``pipeline_stage()``)."""

    rank: int = 0
    size: int = 1
    push: bool = False
    """Whether the worker transfers in push mode (the one mode that pairs stages)."""
    series: str = ""
    region_offset: int | None = None
    """vLLM 0.32/0.33 pairing by position: the first region of a PP 1 peer that a
    stage's regions pair with when the peer has more (the worker's
    ``remote_region_offset``);
    ``None`` where vLLM pairs regions by their layers."""


def pipeline_stage(worker: Any) -> PipelineStage:
    """A vLLM NIXL worker's pipeline stage: its rank as vLLM places layers on stages
    (``ModelConfig.get_layers_start_end_indices``: ``rank // tp % pp``), its transfer
    mode, and how its series pairs stages."""
    push = worker.transfer_mode == "push"
    series = worker._policy.quirks.series
    if worker.pp_size == 1:
        return PipelineStage(push=push, series=series)
    parallel = worker.vllm_config.parallel_config
    tp_size = max(1, int(parallel.tensor_parallel_size))
    return PipelineStage(
        rank=int(parallel.rank) // tp_size % worker.pp_size,
        size=worker.pp_size,
        push=push,
        series=series,
        region_offset=(worker.remote_region_offset if worker.stage_regions_by_position() else None),
    )


def stage_view(worker: Any, kv_caches: Any, plan: RegionPlan) -> RegionPlan | None:
    """A PP 1 push worker's plan as a pipeline stage lays out the same caches, where it
    differs: whole rows of several layers (``Region.packed_members``) are a page per
    layer for a stage (as vLLM expands a peer's packed rows); ``None`` otherwise."""
    if worker.pp_size > 1 or worker.transfer_mode != "push":
        return None
    if not any(region.packed_members for region in plan.regions):
        return None
    view: RegionPlan = worker.plan(kv_caches, pp_size=2)
    return view


def check_decode_stage(vllm_config: VllmConfig, series: str) -> None:
    """Refuse a decode engine (``kv_consumer``) with pipeline parallelism, before a
    NIXL agent exists (vLLM refuses it in its worker's constructor too; this names the
    series and what to run instead)."""
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    config = vllm_config.kv_transfer_config
    if pp_size > 1 and config is not None and config.kv_role == "kv_consumer":
        raise UnsupportedPipelineParallelError(pp_size, 1, series=series, decode_side=True)


def check_pipeline_parallel(stage: PipelineStage, remote_pp_size: int) -> None:
    """Refuse pipeline parallelism on either side in pull mode: vLLM's pull worker
    reads every layer from the peer's stage 0 (push mode pairs stages by layers)."""
    if (remote_pp_size > 1 or stage.size > 1) and not stage.push:
        raise UnsupportedPipelineParallelError(stage.size, remote_pp_size, series=stage.series)


def check_ring_tp(
    plan: RegionPlan | None,
    layer_traits: Mapping[str, KVLayoutTraits],
    local_tp: int,
    remote_tp: int,
) -> None:
    """Refuse different TP sizes when a replicated ring shares a SPLIT region
    (:class:`UnsupportedRingTPError`): vLLM would read the region's blocks in head
    slices, and a slice of identical ring rows is not the other TP size's ring (issue
    26: Step5's CSA tail ring over its main KV page)."""
    if plan is None or local_tp == remote_tp:
        return
    for region in plan.regions:
        if region.replicated or not region.scratch:
            continue
        rings = tuple(
            layer
            for layer in region.layers
            if layer_traits[layer].token_scope is TokenScope.RING
            and layer_traits[layer].tp_layout is TPLayout.REPLICATED
        )
        if rings:
            raise UnsupportedRingTPError(region.name, rings, local_tp, remote_tp)


def check_parallel_pair(worker: Any, remote_tp: int, remote_pp: int) -> None:
    """Refuse, before vLLM's handshake, the pairs the fingerprint cannot vouch for:
    pipeline parallelism in pull mode (:func:`check_pipeline_parallel`) and a
    replicated ring in a split region between TP sizes (:func:`check_ring_tp`)."""
    check_pipeline_parallel(pipeline_stage(worker), remote_pp)
    plan = worker.region_plan
    # Workers that vLLM's tests build without register_kv_caches have no plan (and
    # maybe no KV cache config to take layer traits from): nothing to check.
    if plan is not None and worker.world_size != remote_tp:
        facts = worker._layout_facts()
        check_ring_tp(plan, facts.layer_traits, worker.world_size, remote_tp)
        check_state_tp(facts.state_split, worker.world_size, remote_tp)


def check_state_tp(split: StateSplit | None, local_tp: int, remote_tp: int) -> None:
    """Refuse different TP sizes when the TP-sharded recurrent state's traits do not
    say how it divides across ranks (:class:`UnsupportedStateTPError`): vLLM's reads
    would slice it by runs the traits never described."""
    if split is not None and local_tp != remote_tp and not split.tp_movable:
        raise UnsupportedStateTPError(split.spec_name, split.layer, local_tp, remote_tp)


@contextlib.contextmanager
def handshake_with(host: str, port: int) -> Iterator[None]:
    """Name the peer of the handshake running on this thread in the refusals of
    :func:`check_remote_fingerprint` (vLLM's handshake calls it with the decoded
    metadata only)."""
    _handshake_peer.name = f"{host}:{port}"
    try:
        yield
    finally:
        _handshake_peer.name = None


def _refuse(peer: str, agent_metadata: Any, err: Exception) -> None:
    logger.error(
        "%s: refusing NIXL peer %s (engine %s): %s",
        CONNECTOR_NAME,
        peer,
        agent_metadata.engine_id,
        err,
    )


def check_remote_fingerprint(
    local: RegionPlan | None,
    agent_metadata: Any,
    *,
    require_traits_peer: bool,
    stage_of: Callable[[], PipelineStage] = PipelineStage,
    stage_view: RegionPlan | None = None,
    keep_region_offset: Callable[[int], None] | None = None,
    read_ratio: Callable[[int, tuple[int, ...] | None], None] | None = None,
) -> None:
    """Check the peer's per-region traits fingerprint and regions against ``local``
    (this rank's plan, held by pipeline stage ``stage_of()``, asked once the peer's
    fingerprint decoded; default: no pipeline parallelism) with the checks every
    backend runs
    (:func:`~kvspec_traits.transfer.check_peer`).

    Where either side is a pipeline stage (push mode only, else
    :class:`UnsupportedPipelineParallelError`), regions pair as :func:`_region_pairs`
    says (``keep_region_offset``: where vLLM pairs them by position, the first peer
    region paired).

    A peer of other tokens per block (issue 48) is compared per token where the worker
    moves between block sizes (pull and push): ``read_ratio`` (called once the peer
    passed, with its TP size and tokens per block of each region, ``None`` for our
    sizes) plans the reads or raises the planner's
    :class:`~kvspec_traits.transfer.UnsupportedLayoutError`; elsewhere (pipeline
    stages) it is a mismatch naming both block sizes.

    A layout mismatch raises :class:`~kvspec_traits.transfer.HandshakeMismatchError`
    naming the region and every differing trait; a region on another memory type than
    ours (a device-memory peer of a host-memory cache) raises
    :class:`~kvspec_traits.transfer.MemoryTypeMismatchError`; a peer without a
    fingerprint raises :class:`PeerWithoutTraitsError` when ``require_traits_peer``
    (the worker's ``ConnectorOptions``); one that is not a fingerprint, whose region
    addresses contradict it (block length other than the page it implies at the peer's
    TP size, overlapping blocks, regions that share bytes where ours do not, past 64
    bits), or whose region names and members differ from the fingerprint's,
    :class:`~kvspec_traits.transfer.MalformedMetadataError`.
    """
    if local is None:
        raise RuntimeError(f"{CONNECTOR_NAME}: handshake before register_kv_caches")
    peer = getattr(_handshake_peer, "name", None) or "unknown address"
    fingerprint = getattr(agent_metadata, "kvspec_traits_fingerprint", None)
    if fingerprint is None:
        _accept_upstream_peer(agent_metadata, peer, require_traits_peer=require_traits_peer)
        return
    try:  # hostile JSON (deep, huge integers, not UTF-8) is a named error too
        remote = decode_fingerprint(fingerprint)
        regions = peer_regions_of(agent_metadata)
    except MalformedMetadataError as exc:
        raise MalformedMetadataError(f"peer {peer}: {exc.reason}") from exc
    stage = stage_of()
    check_pipeline_parallel(stage, remote.pp[1])
    view = _peer_stage_view(agent_metadata, peer) if stage.size > 1 else None
    tokens = peer_block_tokens(local, remote)
    ratio = read_ratio is not None and tokens is not None and view is None
    ratio = ratio and stage.size == 1 and remote.pp[1] == 1
    try:
        pairs = _region_pairs(
            local, remote, regions, agent_metadata, peer, stage, view, stage_view, ratio=ratio
        )
        _check_positions(stage, pairs, len(remote.regions), keep_region_offset)
        _check_members(remote, agent_metadata)
        if read_ratio is not None:  # the planner's reads (or its refusal); None: same size
            read_ratio(remote.tp_size, tokens if ratio else None)
    except (
        HandshakeMismatchError,
        MemoryTypeMismatchError,
        StageLayersError,
        UnsupportedLayoutError,
    ) as err:
        _refuse(peer, agent_metadata, err)
        raise
    except MalformedMetadataError as exc:
        _refuse(peer, agent_metadata, exc)
        raise MalformedMetadataError(f"peer {peer}: {exc.reason}") from exc
    _log_accepted(peer, local, remote, tokens if ratio else None)


def _region_pairs(
    local: RegionPlan,
    remote: PlanFingerprint,
    regions: Sequence[PeerRegion],
    agent_metadata: Any,
    peer: str,
    stage: PipelineStage,
    view: PlanFingerprint | None,
    stage_view: RegionPlan | None,
    *,
    ratio: bool,
) -> tuple[tuple[int, int], ...]:
    """Our regions paired with the peer's, ``(local index, remote index)``, after the
    checks every backend runs (:func:`~kvspec_traits.transfer.check_peer`; per token
    with ``ratio``).

    Where either side is a pipeline stage (push mode only, else
    :class:`UnsupportedPipelineParallelError`), the stage's regions are paired with the
    peer's by the layers they hold: a stage layer the peer lacks raises
    :class:`~kvspec_traits.transfer.StageLayersError`, a paired region laid out
    otherwise :class:`~kvspec_traits.transfer.HandshakeMismatchError`; where vLLM pairs
    them by position (0.32/0.33 without layer-name routing), the first peer region
    paired is the offset vLLM slices the peer's regions from (``keep_region_offset``
    is called with it), and a pairing that is not one run of the peer's regions raises
    :class:`UnsupportedStagePairingError`. A PP 1 side registering
    whole rows of several layers pairs by its ``stage_view`` (ours) or the peer's
    ``kvspec_traits_stage_view``: its layers' pages as the stage lays them out.
    """
    if view is not None:
        # The peer registers whole rows: our pages pair with the pages of its rows
        # (vLLM addresses them by packed_member_layouts, checked against the view).
        check_peer_geometry(remote, regions, remote.tp_size)
        pairs = pair_stages(local.fingerprint(pp=(stage.rank, stage.size)), view)
        _check_packed_pages(view, agent_metadata)
        return pairs
    # vLLM's metadata carries no registrations: placement is checked against
    # our plan's overlaps and rows (check_peer_placement), not bound to them.
    mine = stage_view if stage_view is not None and remote.pp[1] > 1 else local
    return check_peer(
        mine,
        remote,
        regions,
        remote.tp_size,
        peer=f"peer {peer}",
        pp=(stage.rank, stage.size),
        block_ratio=ratio,
    )


def peer_block_tokens(local: RegionPlan, remote: PlanFingerprint) -> tuple[int, ...] | None:
    """The peer's tokens per block of each region where its block sizes differ from
    ours (region for region), else ``None``. A region of several block sizes on the
    peer counts as 0 (the planner refuses it by name)."""
    if len(local.regions) != len(remote.regions):
        return None
    theirs = [record.get("block_sizes") for record in remote.regions]
    if all(list(r.block_sizes) == t for r, t in zip(local.regions, theirs, strict=True)):
        return None
    return tuple(
        t[0] if isinstance(t, list) and len(t) == 1 and type(t[0]) is int else 0 for t in theirs
    )


def other_block_sizes(local: RegionPlan | None, agent_metadata: Any) -> bool:
    """Whether the peer's fingerprint (where it sends one that decodes) names other
    tokens per block than ``local``'s: a peer whose checks run as a ratio peer's."""
    fingerprint = getattr(agent_metadata, "kvspec_traits_fingerprint", None)
    if local is None or fingerprint is None:
        return False
    try:
        remote = decode_fingerprint(fingerprint)
    except MalformedMetadataError:
        return False  # refused by the checks that follow, in their order
    return peer_block_tokens(local, remote) is not None


def _log_accepted(
    peer: str, local: RegionPlan, remote: PlanFingerprint, tokens: tuple[int, ...] | None
) -> None:
    ours = [r.block_sizes[0] if len(r.block_sizes) == 1 else 0 for r in local.regions]
    logger.info(
        "%s: peer %s has the same KV layout (fingerprint %s%s)",
        CONNECTOR_NAME,
        peer,
        remote.digest[:16],
        "" if tokens is None else f"; tokens per block here {ours}, the peer {list(tokens)}",
    )


def _accept_upstream_peer(agent_metadata: Any, peer: str, *, require_traits_peer: bool) -> None:
    """A peer that sent upstream's NixlAgentMetadata runs vLLM's NixlConnector, which
    this connector is a drop-in for. vLLM's checks (the compatibility hash, the geometry
    checks of add_remote_agent) guard the pair, as between two upstream connectors; the
    opt-in refuses such peers (:class:`PeerWithoutTraitsError`)."""
    if require_traits_peer:
        raise PeerWithoutTraitsError(peer)
    # No layout to check its addresses against; they must still address
    # something sane before vLLM builds descriptors from them.
    try:
        check_region_bounds(peer_regions_of(agent_metadata))
    except MalformedMetadataError as exc:
        raise MalformedMetadataError(f"peer {peer}: {exc.reason}") from exc
    logger.warning(
        "%s: NIXL peer %s (engine %s) runs upstream's NixlConnector "
        "(no kvspec-traits fingerprint); its layout is checked by "
        "vLLM's compatibility hash only. Set kv_connector_extra_config "
        "%s=true to refuse such peers.",
        CONNECTOR_NAME,
        peer,
        agent_metadata.engine_id,
        REQUIRE_TRAITS_PEER,
    )


def _peer_stage_view(agent_metadata: Any, peer: str) -> PlanFingerprint | None:
    """The peer's ``kvspec_traits_stage_view``, decoded (``None`` if it sent none)."""
    data = getattr(agent_metadata, "kvspec_traits_stage_view", None)
    if data is None:
        return None
    try:
        return decode_fingerprint(data)
    except MalformedMetadataError as exc:
        raise MalformedMetadataError(f"peer {peer}: stage view: {exc.reason}") from exc


def _check_packed_pages(view: PlanFingerprint, agent_metadata: Any) -> None:
    """vLLM addresses each page of a peer's whole rows by its
    ``packed_member_layouts`` ``(offset, length)``: each length is the page the peer's
    stage view says, and every layer of the view has one."""
    packed = getattr(agent_metadata, "packed_member_layouts", None) or {}
    for index, record in enumerate(view.regions):
        for layer in record.get("layers") or ():
            if layer not in packed:
                continue  # a layer outside the rows: its own region
            page = record_page(record, index, view.tp_size)
            offset, length = packed[layer]
            if length != page or offset < 0:
                raise MalformedMetadataError(
                    f"packed_member_layouts places layer {layer!r} as {length} bytes at "
                    f"{offset}, its stage view a page of {page} bytes"
                )


def _check_positions(
    stage: PipelineStage,
    pairs: Sequence[tuple[int, int]],
    remote_regions: int,
    keep_region_offset: Callable[[int], None] | None,
) -> None:
    """Where vLLM pairs a stage's regions with its peer's by position (0.32/0.33: the
    peer's regions from ``region_offset`` on when the peer has more, else from 0), the
    connector decides that offset from the pairs by layers (``keep_region_offset``
    sets the worker's): the first peer region paired. Pairs that are not one run of
    the peer's regions in the stage's order (or, with as many regions on both sides,
    not the peer's regions from 0) cannot be addressed by position:
    :class:`UnsupportedStagePairingError`."""
    if stage.size == 1 or stage.region_offset is None:
        return
    ours = [remote for _, remote in pairs]
    start = ours[0] if ours and remote_regions > len(pairs) else 0
    if ours != list(range(start, start + len(pairs))):
        raise UnsupportedStagePairingError((stage.rank, stage.size), ours, stage.series)
    if keep_region_offset is not None and remote_regions > len(pairs):
        keep_region_offset(start)


def _check_members(remote: PlanFingerprint, agent_metadata: Any) -> None:
    """The region names and member layers vLLM's metadata carries (where it carries
    them) are the ones the peer's fingerprint names: the addresses belong to the
    layers the fingerprint describes, not to a reordering of them."""
    names = getattr(agent_metadata, "region_names", None)
    claimed = [r.get("name") for r in remote.regions]
    if names is not None and list(names) != claimed:
        raise MalformedMetadataError(
            f"region names {list(names)[:8]} differ from its fingerprint's {claimed[:8]}"
        )
    members = getattr(agent_metadata, "region_members", None)
    layers = [list(r.get("layers") or ()) for r in remote.regions]
    if members and [list(m) for m in members] != layers:
        raise MalformedMetadataError(
            f"region members {[list(m) for m in members][:4]} differ from its "
            f"fingerprint's {layers[:4]}"
        )
