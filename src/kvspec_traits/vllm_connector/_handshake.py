"""The traits half of vLLM's NIXL handshake: the agent metadata that carries the
per-region traits fingerprint, and the check of a peer's fingerprint and region
addresses against this rank's plan (functions the connector's worker calls from vLLM's
handshake, after the compatibility hash matched and the peer's metadata decoded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
from vllm.logger import init_logger

from kvspec_traits._traits import KVLayoutTraits, TokenScope, TPLayout
from kvspec_traits.transfer import (
    HandshakeMismatchError,
    MalformedMetadataError,
    MemoryTypeMismatchError,
    PlanFingerprint,
    RegionPlan,
    check_peer,
    check_region_bounds,
    decode_fingerprint,
)
from kvspec_traits.vllm_connector._errors import (
    PeerWithoutTraitsError,
    UnsupportedPipelineParallelError,
    UnsupportedRingTPError,
    UpstreamDisagreesError,
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
    "decoding_traits_metadata",
    "handshake_with",
    "requires_traits_peer",
]

# The connector's logger (under "vllm." so vLLM's log configuration applies).
logger = init_logger("vllm.kvspec_traits.connector")


@dataclasses.dataclass
class TraitsNixlAgentMetadata(NixlAgentMetadata):
    """vLLM's agent metadata plus the canonical per-region traits fingerprint.

    Upstream decoders ignore the extra field, so the wire stays readable by vLLM. Only
    this connector's worker decodes into it (:func:`decoding_traits_metadata`); vLLM's
    ``NixlAgentMetadata`` is left as vLLM defined it.
    """

    kvspec_traits_fingerprint: bytes | None = None

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


_T = TypeVar("_T")


def decoding_traits_metadata(handshake: Callable[..., _T]) -> Callable[..., _T]:
    """vLLM's bound ``_nixl_handshake`` method, run so that the agent metadata it
    decodes is a :class:`TraitsNixlAgentMetadata` (the peer's fingerprint kept for the
    check that follows the decode).

    Upstream's handshake decodes with its module's global ``NixlAgentMetadata``. The
    function runs here with a copy of that module's globals, taken at each call, in
    which the name is our class: vLLM's module (and upstream's connector, or any other
    reader in the process) keeps its own class. Raises :class:`UpstreamDisagreesError`
    when the series' handshake no longer decodes by that name (the fingerprint would be
    dropped silently otherwise).
    """
    func = getattr(handshake, "__func__", None)
    owner = getattr(handshake, "__self__", None)
    if not isinstance(func, types.FunctionType) or "NixlAgentMetadata" not in (
        func.__code__.co_names
    ):
        raise UpstreamDisagreesError(
            "how the handshake decodes the peer's agent metadata",
            getattr(handshake, "__qualname__", handshake),
            "a method that decodes with its module's NixlAgentMetadata",
        )
    scope = dict(func.__globals__)
    scope["NixlAgentMetadata"] = TraitsNixlAgentMetadata
    clone = types.FunctionType(
        func.__code__, scope, func.__name__, func.__defaults__, func.__closure__
    )
    clone.__kwdefaults__ = func.__kwdefaults__
    return cast("Callable[..., _T]", types.MethodType(clone, owner))


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
    local: RegionPlan | None,
    agent_metadata: Any,
    *,
    require_traits_peer: Callable[[], bool],
) -> None:
    """Check the peer's per-region traits fingerprint and regions against ``local``
    (this rank's plan) with the checks every backend runs
    (:func:`~kvspec_traits.transfer.check_peer`).

    A layout mismatch raises :class:`~kvspec_traits.transfer.HandshakeMismatchError`
    naming the region and every differing trait; a region on another memory type than
    ours (a device-memory peer of a host-memory cache) raises
    :class:`~kvspec_traits.transfer.MemoryTypeMismatchError`; a peer without a
    fingerprint raises :class:`PeerWithoutTraitsError` when ``require_traits_peer()``
    (asked only then: the configuration is read for a peer without a fingerprint
    alone); one that is not a fingerprint, whose region addresses contradict it (block
    length other than the page it implies at the peer's TP size, overlapping blocks,
    regions that share bytes where ours do not, past 64 bits), or whose region names
    and members differ from the fingerprint's,
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
        regions = peer_regions_of(agent_metadata)
    except MalformedMetadataError as exc:
        raise MalformedMetadataError(f"peer {peer}: {exc.reason}") from exc
    try:
        # vLLM's metadata carries no registrations: placement is checked against
        # our plan's overlaps and rows (check_peer_placement), not bound to them.
        check_peer(local, remote, regions, remote.tp_size, peer=f"peer {peer}")
        _check_members(remote, agent_metadata)
    except (HandshakeMismatchError, MemoryTypeMismatchError) as err:
        _refuse(peer, agent_metadata, err)
        raise
    except MalformedMetadataError as exc:
        _refuse(peer, agent_metadata, exc)
        raise MalformedMetadataError(f"peer {peer}: {exc.reason}") from exc
    logger.info(
        "%s: peer %s has the same KV layout (fingerprint %s)",
        CONNECTOR_NAME,
        peer,
        remote.digest[:16],
    )


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
