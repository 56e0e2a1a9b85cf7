"""The errors a connector user hits, raised by the connector and exported by
``kvspec_traits.vllm_connector``. Pure: importing them needs no vLLM."""

from __future__ import annotations

import difflib
from collections.abc import Collection

from kvspec_traits._deps import SUPPORTED_VLLM_SERIES
from kvspec_traits._errors import KVSpecTraitsError, _short_repr
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME

__all__ = [
    "ConnectorOptionError",
    "PeerWithoutTraitsError",
    "UnknownConnectorOptionError",
    "UnknownStateBlocksError",
    "UnsupportedHostBufferError",
    "UnsupportedPipelineParallelError",
    "UnsupportedRingTPError",
    "UnsupportedStagePairingError",
    "UnsupportedStateLayoutError",
    "UnsupportedStateTPError",
    "UnsupportedTransferModeError",
    "UnsupportedVllmVersionError",
    "VllmHandshakeRefusalError",
]


class UnsupportedVllmVersionError(KVSpecTraitsError, RuntimeError):
    """The installed vLLM is not a series the connector supports.

    ``.installed`` is the installed version, ``.supported`` the supported series.
    """

    def __init__(
        self, installed: str, supported: tuple[str, ...] = SUPPORTED_VLLM_SERIES, detail: str = ""
    ) -> None:
        self.installed = installed
        self.supported = supported
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"{CONNECTOR_NAME} supports vLLM {', '.join(s + '.x' for s in supported)}, "
            f"but vLLM {installed} is installed{extra}. Install a supported vLLM, or use "
            f'upstream\'s NixlConnector (kv_connector: "NixlConnector").'
        )


class PeerWithoutTraitsError(KVSpecTraitsError, RuntimeError):
    """The NIXL peer sent no kvspec-traits fingerprint (it runs upstream's connector or
    an older kvspec-traits). ``.peer`` is ``host:port``."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        super().__init__(
            f"KV layout handshake refused: the NIXL peer at {peer} sent no kvspec-traits "
            f"layout fingerprint. Run both prefill and decode with "
            f'kv_connector "{CONNECTOR_NAME}" (or both with upstream "NixlConnector"), '
            f'or drop kv_connector_extra_config "kvspec_require_traits_peer" to accept '
            f"upstream peers on vLLM's compatibility hash alone."
        )


class UnsupportedPipelineParallelError(KVSpecTraitsError, NotImplementedError):
    """A pipeline-parallel pair that vLLM's NIXL connector of the installed series does
    not run, so neither does this one. vLLM 0.32, 0.33 and 0.34 run pipeline parallelism
    on the prefill side in push mode only: each stage writes its layers into a decode
    engine of pipeline-parallel size 1. Refused: a decode engine with PP above 1
    (``decode_side``: vLLM counts completions per decode rank), and PP on either side
    in pull mode (vLLM's pull worker reads every layer from stage 0's agent).

    ``.local_pp``, ``.remote_pp``, ``.series`` (the installed vLLM series),
    ``.decode_side``.
    """

    def __init__(
        self, local_pp: int, remote_pp: int, *, series: str, decode_side: bool = False
    ) -> None:
        self.local_pp = local_pp
        self.remote_pp = remote_pp
        self.series = series
        self.decode_side = decode_side
        push = 'kv_connector_extra_config {"transfer_mode": "push"}'
        if decode_side:
            what = (
                f"runs pipeline parallelism on the prefill side only, as vLLM's "
                f"NixlConnector does, but this decode engine has pipeline-parallel size "
                f"{local_pp}. Run the decode engine with --pipeline-parallel-size 1 (the "
                f"prefill engine may keep PP > 1 with {push})"
            )
        else:
            what = (
                f"pairs pipeline stages in push mode only: vLLM's pull worker reads every "
                f"layer from stage 0 (pipeline-parallel size {local_pp} here, {remote_pp} "
                f"on the peer). Set {push} on both engines, PP > 1 on the prefill side "
                f"only, or run both with --pipeline-parallel-size 1"
            )
        super().__init__(f"{CONNECTOR_NAME} on vLLM {series} {what}")


class UnsupportedStagePairingError(KVSpecTraitsError, NotImplementedError):
    """A pipeline stage whose regions pair with its PP 1 peer's (by the layers both
    hold) otherwise than as one run of the peer's regions, in order: vLLM 0.32/0.33
    address a stage's regions by position, as the peer's regions from one offset on
    (the connector sets that offset from the pairing), so no other pairing can be
    written. ``.stage`` (``(pp_rank, pp_size)``), ``.peer_regions`` (the peer's
    region paired with each of the stage's, in order), ``.series``."""

    def __init__(self, stage: tuple[int, int], peer_regions: list[int], series: str) -> None:
        self.stage = stage
        self.peer_regions = peer_regions
        self.series = series
        super().__init__(
            f"{CONNECTOR_NAME} on vLLM {series}: PP stage {stage[0]} of {stage[1]} pairs "
            f"its regions with the peer's regions {peer_regions[:8]} by their layers, "
            f"which is not one run of the peer's regions in order; vLLM {series} "
            f"addresses a stage's regions only as such a run. Pair stages of the same "
            f"model whose decode side registers its layers in model order, or use "
            f"vLLM 0.34 (it pairs regions by layer on every pair)."
        )


class UnsupportedRingTPError(KVSpecTraitsError, NotImplementedError):
    """A ring buffer whose rows are the same on every rank shares a head-sharded region
    (its page sized to the head-sharded page, as Step5's CSA tail ring is to its main KV
    page), and prefill and decode run different TP sizes: the ring holds as many rows as
    that page at each TP size, each token at ``pos % capacity``, so no head slice of one
    rank's block is another TP size's ring. ``.region``, ``.layers`` (the ring layers),
    ``.local_tp``, ``.remote_tp``."""

    def __init__(self, region: str, layers: tuple[str, ...], local_tp: int, remote_tp: int) -> None:
        self.region = region
        self.layers = layers
        self.local_tp = local_tp
        self.remote_tp = remote_tp
        super().__init__(
            f"{CONNECTOR_NAME} cannot move ring buffer {list(layers)} between TP "
            f"{remote_tp} and TP {local_tp}: its rows are the same on every rank, but it "
            f"shares head-sharded region {region!r}, whose page (and so the ring's "
            f"capacity) changes with the TP size. Run prefill and decode with equal "
            f"TP sizes."
        )


class ConnectorOptionError(KVSpecTraitsError, ValueError):
    """A ``kv_connector_extra_config`` key the connector reads holds a value it cannot
    use (the wrong JSON type, or out of range), refused when the connector is built
    (:class:`~kvspec_traits.vllm_connector.ConnectorOptions`). ``.key``, ``.value`` (as
    given); the message says what to give instead."""

    def __init__(self, key: str, value: object, instead: str) -> None:
        self.key = key
        self.value = value
        super().__init__(
            f"{CONNECTOR_NAME}: kv_connector_extra_config {key!r} is {_short_repr(value)}; "
            f"{instead}"
        )


class UnknownConnectorOptionError(ConnectorOptionError):
    """A ``kvspec_`` key in ``kv_connector_extra_config`` that the connector does not
    read (a typo would otherwise be ignored). ``.key``, ``.value``, ``.closest`` (the
    known key nearest to it, or None)."""

    def __init__(self, key: str, value: object, known: Collection[str]) -> None:
        matches = difflib.get_close_matches(key, sorted(known), n=1)
        self.closest = matches[0] if matches else None
        guess = f"; did you mean {self.closest!r}?" if self.closest else "."
        super().__init__(
            key,
            value,
            f"{CONNECTOR_NAME} reads no such key{guess} Its keys: "
            f'{", ".join(sorted(known))} (docs/vllm.md, "Options")',
        )


class UnsupportedTransferModeError(ConnectorOptionError):
    """``kv_connector_extra_config`` ``transfer_mode`` is neither ``"pull"`` nor ``"push"``
    (on a vLLM series whose factory reads it, as ours then does). ``.mode`` is the value."""

    def __init__(self, mode: object) -> None:
        self.mode = mode
        super().__init__(
            "transfer_mode",
            mode,
            'give "pull" (the default) or "push", as for vLLM\'s NixlConnector',
        )


class UnknownStateBlocksError(KVSpecTraitsError, TypeError):
    """A recurrent-state cache group's spec does not say how many speculative scratch
    slots trail its state per request (vLLM's ``MambaSpec.num_speculative_blocks``), so
    the scheduler cannot tell which slot holds the state. ``.spec_name``, ``.group``."""

    def __init__(self, spec_name: str, group: int) -> None:
        self.spec_name = spec_name
        self.group = group
        super().__init__(
            f"{CONNECTOR_NAME}: cache group {group} ({spec_name}) holds recurrent states "
            f"but its spec has no non-negative int num_speculative_blocks, so the "
            f"scheduler cannot tell the state slot from the speculative scratch slots "
            f"after it; give the spec that field (0 without speculative decoding)"
        )


class UnsupportedHostBufferError(KVSpecTraitsError, NotImplementedError):
    """Host staging (``kv_buffer_device: "cpu"`` on an accelerator) of a cache vLLM's
    host buffer cannot mirror. ``.reason`` names it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"{CONNECTOR_NAME}: NIXL host staging (kv_buffer_device cpu) cannot stage "
            f"this KV cache: {reason}. Register the caches directly (kv_buffer_device "
            f"as the accelerator's), as with vLLM's NixlConnector"
        )


class UnsupportedStateLayoutError(KVSpecTraitsError, NotImplementedError):
    """A recurrent-state layer whose traits describe a page the connector cannot cut
    into NIXL descriptors. ``.spec_name`` (the spec class), ``.layer``, ``.trait`` (the
    trait that decides it), ``.reason``."""

    def __init__(self, spec_name: str, layer: str, trait: str, reason: str) -> None:
        self.spec_name = spec_name
        self.layer = layer
        self.trait = trait
        self.reason = reason
        super().__init__(
            f"{CONNECTOR_NAME} cannot transfer recurrent-state layer {layer!r} "
            f"({spec_name}), by its trait {trait}: {reason}"
        )


class UnsupportedStateTPError(KVSpecTraitsError, NotImplementedError):
    """Prefill and decode run different TP sizes, and a TP-sharded recurrent state's
    traits do not say how it divides across ranks (a component without
    :attr:`~kvspec_traits.PageComponent.tp_split`, or a rest of the page in more than one
    run), so no rank of one TP size can find its share in the other's pages. Raised
    before the handshake: no byte moves. ``.spec_name``, ``.layer``, ``.local_tp``,
    ``.remote_tp``."""

    def __init__(self, spec_name: str, layer: str, local_tp: int, remote_tp: int) -> None:
        self.spec_name = spec_name
        self.layer = layer
        self.local_tp = local_tp
        self.remote_tp = remote_tp
        super().__init__(
            f"{CONNECTOR_NAME} cannot move recurrent-state layer {layer!r} ({spec_name}) "
            f"between TP {remote_tp} and TP {local_tp}: its traits' components do not "
            f"say how the state divides across TP ranks (PageComponent.tp_split). Run "
            f"prefill and decode with equal TP sizes, or give each state component a "
            f"tp_split in the spec's adapter"
        )


class VllmHandshakeRefusalError(KVSpecTraitsError, AssertionError):
    """vLLM's own handshake code (its validation asserts, its descriptor builders'
    ``next(...)``) refused a peer rank after the connector's checks accepted it: the
    pair's layouts match by their traits, and vLLM's bookkeeping of the peer cannot
    hold them. Kept an ``AssertionError`` (what vLLM raised, and what its callers
    catch). ``.engine_id``, ``.remote_rank``, ``.detail`` (vLLM's error)."""

    def __init__(self, engine_id: str, remote_rank: int, detail: str) -> None:
        self.engine_id = engine_id
        self.remote_rank = remote_rank
        self.detail = detail
        super().__init__(
            f"{CONNECTOR_NAME}: vLLM's handshake code refused rank {remote_rank} of peer "
            f"engine {engine_id} after the traits fingerprints matched ({detail}); no "
            f"byte moved. vLLM's bookkeeping of the peer cannot hold this pair: run "
            f"prefill and decode with the same TP and block sizes, and report the pair"
        )
