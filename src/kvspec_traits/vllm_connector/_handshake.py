"""The traits half of vLLM's NIXL handshake: the agent metadata that carries the
per-region traits fingerprint, and the check of a peer's fingerprint and region
addresses against this rank's plan (functions the connector's worker calls from vLLM's
handshake, after the compatibility hash matched and the peer's metadata decoded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
from vllm.logger import init_logger

from kvspec_traits._traits import KVLayoutTraits, TokenScope, TPLayout
from kvspec_traits.transfer import (
    HandshakeMismatchError,
    MalformedMetadataError,
    PlanFingerprint,
    RegionPlan,
    check_handshake,
    check_peer_geometry,
    check_region_bounds,
    decode_fingerprint,
)
from kvspec_traits.vllm_connector._errors import (
    PeerWithoutTraitsError,
    UnsupportedPipelineParallelError,
    UnsupportedRingTPError,
)
from kvspec_traits.vllm_connector._fields import peer_regions_of
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME, REQUIRE_TRAITS_PEER

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "TraitsNixlAgentMetadata",
    "check_parallel_pair",
    "check_pipeline_parallel",
    "check_ring_tp",
    "check_remote_fingerprint",
    "handshake_with",
    "requires_traits_peer",
]

# The connector's logger (under "vllm." so vLLM's log configuration applies).
logger = init_logger("vllm.kvspec_traits.connector")


@dataclasses.dataclass
class TraitsNixlAgentMetadata(NixlAgentMetadata):
    """vLLM's agent metadata plus the canonical per-region traits fingerprint.

    Upstream decoders ignore the extra field, so the wire stays readable by vLLM.
    """

    kvspec_traits_fingerprint: bytes | None = None

    def __eq__(self, other: object) -> bool:
        # Against upstream's own class (what vLLM's code and tests decode with), equal
        # when every field upstream knows is: the fingerprint is ours alone, and the
        # handshake decodes into this subclass, so a strict class check would make the
        # same peer metadata unequal to itself as upstream reads it.
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


# vLLM's handshake decodes the peer's agent metadata as base_worker.NixlAgentMetadata
# (after its compatibility-hash check). That name is made this subclass, whose one extra
# field is optional, so the decode keeps the peer's fingerprint for the check that
# follows it; for every other reader the value is the same metadata.
setattr(_bw, "NixlAgentMetadata", TraitsNixlAgentMetadata)  # noqa: B010 (not re-exported)
# The peer address of the handshake running on this thread (handshakes run on vLLM's
# background executor), for the refusal messages.
_handshake_peer = threading.local()


def check_pipeline_parallel(pp_size: int, remote_pp_size: int) -> None:
    """Refuse pipeline parallelism on either side: the fingerprint covers one stage's
    regions only, so comparing it with remote PP rank 0 would refuse a good pair or
    check one stage of several."""
    if remote_pp_size > 1 or pp_size > 1:
        raise UnsupportedPipelineParallelError(pp_size, remote_pp_size)


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
    pipeline parallelism (:func:`check_pipeline_parallel`) and a replicated ring in a
    split region between TP sizes (:func:`check_ring_tp`)."""
    check_pipeline_parallel(worker.pp_size, remote_pp)
    plan = worker.region_plan
    # Workers that vLLM's tests build without register_kv_caches have no plan (and
    # maybe no KV cache config to take layer traits from): nothing to check.
    if plan is not None and worker.world_size != remote_tp:
        check_ring_tp(plan, worker._layout_facts().layer_traits, worker.world_size, remote_tp)


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


def requires_traits_peer(vllm_config: VllmConfig) -> bool:
    """Whether ``kv_connector_extra_config`` sets :data:`REQUIRE_TRAITS_PEER`."""
    config = vllm_config.kv_transfer_config
    return config is not None and bool(config.get_from_extra_config(REQUIRE_TRAITS_PEER, False))


def _refuse(peer: str, agent_metadata: Any, err: Exception) -> None:
    logger.error(
        "%s: refusing NIXL peer %s (engine %s): %s",
        CONNECTOR_NAME,
        peer,
        agent_metadata.engine_id,
        err,
    )


def check_remote_fingerprint(
    local: PlanFingerprint | None,
    agent_metadata: Any,
    *,
    require_traits_peer: Callable[[], bool],
) -> None:
    """Compare the peer's per-region traits fingerprint with ``local`` (this rank's).

    A layout mismatch raises :class:`~kvspec_traits.transfer.HandshakeMismatchError`
    naming the region and every differing trait; a peer without a fingerprint raises
    :class:`PeerWithoutTraitsError` when ``require_traits_peer()`` (asked only then: the
    configuration is read for a peer without a fingerprint alone); one that is not a
    fingerprint, or whose region addresses contradict it (block length other than the
    page it implies at the peer's TP size, overlapping blocks, past 64 bits; see
    :func:`~kvspec_traits.transfer.check_peer_geometry`),
    :class:`~kvspec_traits.transfer.MalformedMetadataError`.
    """
    if local is None:
        raise RuntimeError(f"{CONNECTOR_NAME}: handshake before register_kv_caches")
    peer = getattr(_handshake_peer, "name", None) or "unknown address"
    fingerprint = getattr(agent_metadata, "kvspec_traits_fingerprint", None)
    if fingerprint is None:
        # The peer sent upstream's NixlAgentMetadata: it runs vLLM's NixlConnector,
        # which this connector is a drop-in for. vLLM's checks (the compatibility
        # hash, the geometry checks of add_remote_agent) guard the pair, as between
        # two upstream connectors; the opt-in refuses such peers.
        if require_traits_peer():
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
        return
    try:  # hostile JSON (deep, huge integers, not UTF-8) is a named error too
        remote = decode_fingerprint(fingerprint)
    except MalformedMetadataError as exc:
        raise MalformedMetadataError(f"peer {peer}: {exc.reason}") from exc
    try:
        check_handshake(local, remote)
    except HandshakeMismatchError as err:
        _refuse(peer, agent_metadata, err)
        raise
    # The same layout, claimed: now the addresses the peer sends must be what that
    # layout implies, before vLLM builds a descriptor from them.
    try:
        check_peer_geometry(remote, peer_regions_of(agent_metadata), remote.tp_size)
    except MalformedMetadataError as exc:
        _refuse(peer, agent_metadata, exc)
        raise MalformedMetadataError(f"peer {peer}: {exc.reason}") from exc
    logger.info(
        "%s: peer %s has the same KV layout (fingerprint %s)",
        CONNECTOR_NAME,
        peer,
        local.digest[:16],
    )
