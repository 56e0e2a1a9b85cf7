"""The connector treats the peer's region addresses as untrusted: once the peer's
fingerprint matched ours, the geometry in its vLLM agent metadata must be what that
fingerprint implies, or the handshake is refused before vLLM builds a descriptor.

Real workers (tests/test_connector_differential.py's ``build``: vLLM's own worker beside
ours over the same tensors, real NIXL agents); the peer's metadata is our own worker's,
decoded as vLLM's handshake decodes it, then forged one field at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvspec_traits.transfer import MalformedMetadataError, MemoryTypeMismatchError
from kvspec_traits.vllm_connector._connector import TraitsNixlAgentMetadata
from tests.test_connector_differential import AGREE, Built, build, distributed

pytestmark = pytest.mark.timeout(600)
__all__ = ["build", "distributed"]  # fixtures, imported for their names


def _own_metadata(built: Built) -> TraitsNixlAgentMetadata:
    payload = built.traits.xfer_handshake_metadata
    if payload is None:
        raise RuntimeError("the worker registered no caches")
    return msgspec.msgpack.Decoder(TraitsNixlAgentMetadata).decode(payload.agent_metadata_bytes)


def _forged(
    meta: TraitsNixlAgentMetadata, **lists: Callable[[list[int]], list[int]]
) -> TraitsNixlAgentMetadata:
    changes: dict[str, Any] = {k: f(list(getattr(meta, k))) for k, f in lists.items()}
    return dataclasses.replace(meta, **changes)


FORGERIES: dict[str, tuple[dict[str, Callable[[list[int]], list[int]]], str]] = {
    # Stride 0 would read block 0 of the producer for every block asked.
    "stride_zero": ({"block_strides": lambda v: [0] * len(v)}, "block_stride 0 < block_len"),
    # A block length other than the page: the peer would send half a page, or two.
    "half_page": ({"block_lens": lambda v: [n // 2 for n in v]}, "but its fingerprint implies"),
    # The last block past 2^64: no such address.
    "past_64_bits": (
        {"kv_caches_base_addr": lambda v: [2**64 - 4096] * len(v)},
        "does not fit in 64 bits",
    ),
    # One base address fewer than regions: every list must describe every region.
    "short_list": ({"kv_caches_base_addr": lambda v: v[:-1]}, "per-region lists"),
}


def test_the_honest_peer_passes(build: Callable[..., Built]) -> None:
    built = build(AGREE["gqa"])
    built.traits.check_remote_fingerprint(_own_metadata(built))


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_geometry_is_refused_by_name(name: str, build: Callable[..., Built]) -> None:
    built = build(AGREE["gqa"])
    meta = _own_metadata(built)
    forgery, message = FORGERIES[name]
    # Hand-computed: the gqa family's pages are 128 tokens x K,V x 2 heads x 32 x 4 B
    # (float32) = 65,536 B, one region per layer (two layers).
    assert meta.block_lens == [128 * 2 * 2 * 32 * 4] * 2
    with pytest.raises(MalformedMetadataError, match=message):
        built.traits.check_remote_fingerprint(_forged(meta, **forgery))


def _upstream_peer(meta: TraitsNixlAgentMetadata) -> TraitsNixlAgentMetadata:
    """The same worker as upstream's NixlConnector would advertise it: no fingerprint."""
    return dataclasses.replace(meta, kvspec_traits_fingerprint=None)


def test_a_peer_without_fingerprint_is_accepted_only_with_sane_addresses(
    build: Callable[..., Built],
) -> None:
    # Upstream's NixlConnector sends no fingerprint; it is accepted as upstream accepts
    # it (vLLM's compatibility hash came first), but its addresses are still checked.
    built = build(AGREE["gqa"])
    meta = _upstream_peer(_own_metadata(built))
    built.traits.check_remote_fingerprint(meta)
    for name in ("stride_zero", "past_64_bits", "short_list"):
        forgery, message = FORGERIES[name]
        with pytest.raises(MalformedMetadataError, match=message):
            built.traits.check_remote_fingerprint(_forged(meta, **forgery))


def test_a_device_memory_peer_is_refused_as_the_nixl_agent_refuses_it(
    build: Callable[..., Built],
) -> None:
    """Failure mode (issue 24 item 3): ``check_remote_fingerprint`` accepted a peer
    whose regions are on device memory ("VRAM") when its fingerprint matched (the
    memory type is not part of it), where the NIXL agent path raises
    :class:`MemoryTypeMismatchError`. Both now run ``transfer.check_peer``."""
    built = build(AGREE["gqa"])
    meta = _own_metadata(built)
    assert meta.region_mem_types == ["DRAM", "DRAM"]  # CPU tensors, one region per layer
    for forged_type in ("VRAM", ""):
        forged = dataclasses.replace(meta, region_mem_types=[forged_type, forged_type])
        with pytest.raises(MemoryTypeMismatchError, match=f"holds it in {forged_type!r}"):
            built.traits.check_remote_fingerprint(forged)


def test_region_names_and_members_must_be_the_fingerprints(build: Callable[..., Built]) -> None:
    """Failure mode: vLLM's metadata names each region and its member layers; a peer
    whose lists were reordered against its own fingerprint (the addresses then belong
    to other layers than the fingerprint describes) was accepted."""
    built = build(AGREE["gqa"])
    meta = _own_metadata(built)
    assert meta.region_names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    forgeries = [dataclasses.replace(meta, region_names=meta.region_names[::-1])]
    if meta.region_members:  # carried where the series' metadata has the field filled
        forgeries.append(dataclasses.replace(meta, region_members=meta.region_members[::-1]))
    for forged in forgeries:
        with pytest.raises(MalformedMetadataError, match="differ from its fingerprint"):
            built.traits.check_remote_fingerprint(forged)
