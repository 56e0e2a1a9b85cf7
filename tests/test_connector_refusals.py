"""Layouts the traits connector refuses where vLLM's own tests pass with upstream's worker:
each one shown here to be one upstream cannot transfer either (the proof the
expected-difference list in scripts/conformance/expected_differences.toml cites).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import patch

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)

from kvspec_traits import traits_of
from kvspec_traits.nixl import UnsupportedLayoutError
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from tests.mla_backends import CPU_MLA
from tests.test_connector_differential import DSV2, LBHNC, _construct, _vllm_config, distributed

pytestmark = pytest.mark.timeout(600)
__all__ = ["distributed"]  # a fixture, imported for its name


def _group(specs: dict[str, KVCacheSpec]) -> KVCacheGroupSpec:
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    if uniform is None:
        raise ValueError("specs are not uniform")
    return KVCacheGroupSpec(list(specs), uniform)


def _ring_layout() -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """vLLM's test_ring_scratch_without_mamba_registers_and_addresses_its_own_regions
    (test_nixl_desc_geometry.py, vLLM 0.32.0): MLA pages of 4 tokens x 64 x fp16 = 512 B,
    in views whose blocks are 256 B apart (a [2, 256] tensor per region)."""
    paged = {f"paged.{i}": MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=64,
                                            dtype=torch.float16) for i in range(2)}
    rings = {f"ring.{i}": CircularBufferSpec(block_size=6, num_kv_heads=1, head_size=32,
                                             head_size_v=0, dtype=torch.float16)
             for i in range(2)}
    regions = (("paged.0",), ("paged.1", "ring.0", "ring.1"))
    config = KVCacheConfig(
        num_blocks=2,
        kv_cache_tensors=[KVCacheTensor(size=1024, layers=[name], layer_stride=512,
                                        block_stride=256, offset=index * 512)
                          for index, names in enumerate(regions) for name in names],
        kv_cache_groups=[_group(dict(paged)), _group(dict(rings))])
    tensors = [torch.zeros((2, 256), dtype=torch.uint8) for _ in regions]
    caches = {name: tensors[index] for index, names in enumerate(regions) for name in names}
    return config, caches


@pytest.fixture
def register(distributed: None, tiny_models: pathlib.Path) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def _register(cls: type[NixlPullConnectorWorker]) -> None:
        config, caches = _ring_layout()
        vllm_config = _vllm_config(tiny_models / DSV2, LBHNC, CPU_MLA)
        vllm_config.cache_config.block_size = 4
        with (set_current_vllm_config(vllm_config),
              patch.object(base_worker, "select_common_block_size", return_value=4)):
            worker = _construct(lambda: cls(vllm_config, "engine", config))
            made.append(worker)
            worker.register_kv_caches(caches)

    yield _register
    for worker in made:
        worker.shutdown()


def test_pages_wider_than_their_block_stride(register: Callable[..., Any]) -> None:
    """A 512-byte page in a view whose blocks are 256 bytes apart: upstream registers
    blocks of 512 bytes at stride 256, so block 0 overlaps block 1 and block 1 ends 256
    bytes past the 512-byte tensor. vLLM's test passes because its recording NIXL wrapper
    accepts any descriptor; a real NIXL agent refuses upstream's descriptors when it
    prepares them, and the planner refuses the layout by name before any NIXL call."""
    page = traits_of(_ring_layout()[0].kv_cache_groups[0].kv_cache_spec
                     .kv_cache_specs["paged.0"]).page_size_bytes  # type: ignore[attr-defined]
    assert page == 4 * 64 * 2 == 512
    with pytest.raises(Exception, match="NIXL_ERR") as upstream_error:
        register(NixlPullConnectorWorker)
    assert type(upstream_error.value).__module__.startswith("nixl")
    with pytest.raises(UnsupportedLayoutError,
                       match="pages of 512 bytes overlap at block stride 256"):
        register(TraitsNixlConnectorWorker)
