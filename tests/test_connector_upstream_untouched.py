"""Our connector leaves vLLM's classes as vLLM defined them (issue 21 item 4): importing
it replaced ``base_worker.NixlAgentMetadata`` for the whole process; now only our
worker's handshake decodes into :class:`TraitsNixlAgentMetadata`, and upstream's worker
in the same process decodes as it always did.

Real workers (tests/test_connector_differential.py's ``build``: vLLM's own worker and
ours over the same tensors) and vLLM's own handshake listener and socket.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest.mock import patch

import pytest

from tests.test_connector_differential import AGREE, Built, _serve_handshake, build, distributed

pytestmark = pytest.mark.timeout(600)
__all__ = ["build", "distributed"]  # fixtures, imported for their names


def test_importing_the_connector_leaves_nixl_agent_metadata_alone() -> None:
    """Failure mode: ``import kvspec_traits.vllm_connector`` rebound
    ``base_worker.NixlAgentMetadata`` to our subclass for every reader in the process."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, metadata

    import kvspec_traits.vllm_connector._connector as ours

    assert vars(base_worker)["NixlAgentMetadata"] is metadata.NixlAgentMetadata
    assert ours.TraitsNixlAgentMetadata is not metadata.NixlAgentMetadata


def test_upstreams_handshake_in_the_same_process_decodes_upstreams_class(
    build: Callable[..., Built],
) -> None:
    """Upstream's worker and ours, in one process, each handshake with the same peer
    (our worker's payload, which carries a fingerprint): upstream's decode gives
    vLLM's ``NixlAgentMetadata`` (the fingerprint ignored, as any upstream reader
    ignores it), ours gives :class:`TraitsNixlAgentMetadata` with the fingerprint;
    afterwards vLLM's module still holds its own class."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, metadata

    from kvspec_traits.vllm_connector._connector import TraitsNixlAgentMetadata

    built = build(AGREE["gqa"])
    port, stop = _serve_handshake(built.traits)
    try:
        received: dict[str, object] = {}
        for name, worker in (("upstream", built.upstream), ("traits", built.traits)):
            with patch.object(worker, "add_remote_agent", return_value="agent") as added:
                worker._nixl_handshake("127.0.0.1", port, 1, built.traits.engine_id)
            received[name] = added.call_args.args[0]
    finally:
        stop.set()
    assert type(received["upstream"]) is metadata.NixlAgentMetadata
    assert type(received["traits"]) is TraitsNixlAgentMetadata
    fingerprint = getattr(received["traits"], "kvspec_traits_fingerprint", None)
    assert fingerprint is not None and built.traits.traits_fingerprint is not None
    assert fingerprint == built.traits.traits_fingerprint.canonical()
    assert vars(base_worker)["NixlAgentMetadata"] is metadata.NixlAgentMetadata
