"""Host staging buffers: ``kv_buffer_device: "cpu"`` on an accelerator whose memory NIXL
cannot register (TPU, some XPUs), where vLLM's worker keeps ``use_host_buffer``.

vLLM allocates one host tensor per layer (``initialize_host_xfer_buffer``: the device
cache's shape and dtype, on the CPU, heads permuted for an ``LBNHC`` cache) and copies
blocks device-to-host before a send (``save_kv_to_host``) and host-to-device after a
receive (``sync_recved_kv_to_device``), with the copy operation the model runner hands
over (``set_host_xfer_buffer_ops``). All of that is upstream's, inherited. What NIXL
registers and moves is the host buffer, so the regions, their REPLICATE/SPLIT flags and
the fingerprint are planned over it, by the same planner and traits as device caches:
a host buffer that mirrors its device cache layer for layer plans to the same
fingerprint (only addresses, strides and the memory type differ, none of which the
fingerprint covers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvspec_traits.vllm_connector._errors import UnsupportedHostBufferError

if TYPE_CHECKING:
    import torch

__all__ = ["transfer_caches"]


def transfer_caches(worker: Any, kv_caches: Mapping[str, torch.Tensor]) -> Mapping[str, Any]:
    """What ``worker`` (a traits NIXL worker) registers for ``kv_caches``: the caches,
    or, in host-buffer mode, the host buffer vLLM allocates for them.

    Raises :class:`UnsupportedHostBufferError` where vLLM's host buffer cannot mirror
    the cache: a ring buffer (vLLM's own refusal: "NIXL host staging does not preserve
    CSA-linear shared tensors") or a recurrent state (the host buffer gives each layer a
    tensor of its own, so a state no longer shares its pages with the attention layers
    as vLLM's hybrid allocation lays them out; upstream's worker registers it and then
    fails to prepare its state descriptors, NIXL_ERR_NOT_FOUND).
    """
    if not worker.use_host_buffer:
        return kv_caches
    facts = worker._layout_facts()
    if facts.has_ring:
        raise UnsupportedHostBufferError(
            "a ring buffer shares its rows with other caches (CSA-linear), and a host "
            "copy per layer would not preserve that sharing"
        )
    if facts.has_state:
        raise UnsupportedHostBufferError(
            "a recurrent-state layer shares its pages with attention layers in vLLM's "
            "hybrid allocation, and the host buffer (one tensor per layer) does not"
        )
    worker.initialize_host_xfer_buffer(kv_caches=kv_caches)
    buffers: Mapping[str, Any] = worker.host_xfer_buffers
    if set(buffers) != set(kv_caches):
        raise UnsupportedHostBufferError(
            f"vLLM's host buffer holds layers {sorted(buffers)}, the KV caches {sorted(kv_caches)}"
        )
    return buffers
