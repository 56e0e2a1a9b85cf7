"""Host staging buffers (``kv_buffer_device: "cpu"`` on an accelerator NIXL cannot
register): real bytes through vLLM's host-buffer path, with real NIXL agents.

On an accelerator vLLM's worker keeps ``use_host_buffer``, allocates one host tensor per
layer (``initialize_host_xfer_buffer``), registers that with NIXL, and copies blocks
device-to-host before a send (``save_kv_to_host``, from the connector's
``wait_for_save``) and host-to-device after a receive (``sync_recved_kv_to_device``, from
``get_finished``), with the model runner's ``copy_kv_blocks``. On this CPU machine the
"device" caches are vLLM's CPU kernel-block views (tests/test_connector_kernel_blocks.py:
manager block 64, kernel block 16) and each worker is put into host-buffer mode the way
vLLM's own tests put it there (``use_host_buffer = True``, ``copy_blocks`` set: vLLM's
``set_host_xfer_buffer_ops`` is a no-op on a CPU platform). ``copy_kv_blocks`` is vLLM's;
only the platform's two block-copy primitives, which the CPU platform lacks, are given
as an accelerator's are (``CudaPlatform``: an indexed copy, then ``.to``/``.cpu()``).

The prefill side copies the request's blocks to its host buffer, the decode side reads
them with NIXL into its own host buffer and copies them to its caches: the decode caches
must then hold exactly the prefill caches' bytes of those blocks, and nothing else may
change. Before this, the connector refused host staging at ``register_kv_caches``
(``NotImplementedError``: "host staging buffers ... are upstream-only").
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils
from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

from kvspec_traits.vllm_connector import UnsupportedHostBufferError
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from tests.nixl_helpers import layouts
from tests.test_connector_differential import distributed
from tests.test_connector_kernel_blocks import (
    FAMILIES,
    _read,
    assert_moved_exactly,
    make,
    request_blocks,
)

pytestmark = pytest.mark.timeout(600)
__all__ = ["distributed", "make"]  # fixtures, imported for their names


def _insert_blocks_to_device(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    dst[dst_ids] = src[src_ids].to(dst.device)  # CudaPlatform.insert_blocks_to_device


def _swap_out_blocks_to_host(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    dst[dst_ids] = src[src_ids].cpu()  # CudaPlatform.swap_out_blocks_to_host


@pytest.fixture
def accelerator_copies() -> Any:
    """vLLM's ``copy_kv_blocks`` over an accelerator platform's block copies."""
    platform = SimpleNamespace(
        insert_blocks_to_device=_insert_blocks_to_device,
        swap_out_blocks_to_host=_swap_out_blocks_to_host,
    )
    with patch.object(kv_utils, "current_platform", platform):
        yield


def _staged(worker: Any) -> None:
    # As vLLM's tests force host-buffer mode on a CPU platform (test_nixl_connector_hma).
    worker.use_host_buffer = True
    worker.copy_blocks = copy_kv_blocks


def _inside(plan: Any, tensors: dict[str, torch.Tensor]) -> bool:
    spans = [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors.values()
    ]
    return all(
        any(lo <= r.base and r.base + r.length <= lo + n for lo, n in spans)
        for r in plan.registrations
    )


@pytest.mark.parametrize("family", ["attention", "mla"])
def test_host_buffer_moves_exactly_the_producers_blocks(
    family: str, make: Callable[..., Any], accelerator_copies: None
) -> None:
    producer, p_caches = make(family, TraitsNixlConnectorWorker, "producer", _staged)
    consumer, d_caches = make(family, TraitsNixlConnectorWorker, "consumer", _staged)
    for worker, caches in ((producer, p_caches), (consumer, d_caches)):
        # NIXL registers the host buffer, never the caches; planned with the same traits,
        # it has the fingerprint of the caches it mirrors (addresses are not in it).
        assert set(worker.host_xfer_buffers) == set(caches)
        assert _inside(worker.region_plan, worker.host_xfer_buffers)
        assert not _inside(worker.region_plan, caches)
        assert worker.traits_fingerprint == worker.plan(caches).fingerprint()
    layouts.fill_pattern(p_caches, seed=11)
    before = layouts.backing(d_caches).clone()
    groups = FAMILIES[family].groups(1)
    local, remote = request_blocks(groups)

    # Prefill: the finished request's blocks to the host buffer (vLLM's wait_for_save).
    saved = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
    saved.add_new_req_to_save("prefill-req", remote, {})
    producer.save_kv_to_host(saved)
    # Decode: NIXL reads host to host, then get_finished copies the blocks to the caches.
    _read(consumer, producer, local, list(remote))
    assert_moved_exactly(groups, local, remote, p_caches, d_caches, before)


def test_a_recurrent_state_is_refused_by_name(make: Callable[..., Any]) -> None:
    """vLLM's host buffer gives each layer a tensor of its own, so the MLA + KDA hybrid's
    states no longer share pages with the attention layers as vLLM allocates them:
    refused by name at registration (upstream's worker, on the same caches, registers
    its host buffer and then fails preparing its descriptors: NIXL_ERR_NOT_FOUND)."""
    with pytest.raises(UnsupportedHostBufferError, match="recurrent-state") as raised:
        make("mla_kda_hybrid", TraitsNixlConnectorWorker, "staged", _staged)
    assert "kv_buffer_device" in str(raised.value)
