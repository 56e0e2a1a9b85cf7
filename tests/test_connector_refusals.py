"""Layouts the traits connector refuses where vLLM's own tests pass with upstream's worker:
each one shown here to be one upstream cannot transfer either (the proof the
expected-difference list in tools/kvspec_workbench/conformance/expected_differences.toml cites).
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
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)

from kvspec_traits import traits_of
from kvspec_traits.transfer import PlanLayout, UnsupportedLayoutError, plan_regions
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from tests.mla_backends import CPU_MLA
from tests.nixl_helpers.layouts import DSV2
from tests.test_connector_differential import LBHNC, _construct, _vllm_config, distributed
from tests.test_connector_kernel_blocks import _one_row_per_block

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
    paged = {
        f"paged.{i}": MLAAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=64, dtype=torch.float16
        )
        for i in range(2)
    }
    rings = {
        f"ring.{i}": CircularBufferSpec(
            block_size=6, num_kv_heads=1, head_size=32, head_size_v=0, dtype=torch.float16
        )
        for i in range(2)
    }
    regions = (("paged.0",), ("paged.1", "ring.0", "ring.1"))
    config = KVCacheConfig(
        num_blocks=2,
        kv_cache_tensors=[
            KVCacheTensor(
                size=1024, layers=[name], layer_stride=512, block_stride=256, offset=index * 512
            )
            for index, names in enumerate(regions)
            for name in names
        ],
        kv_cache_groups=[_group(dict(paged)), _group(dict(rings))],
    )
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
        with (
            set_current_vllm_config(vllm_config),
            patch.object(base_worker, "select_common_block_size", return_value=4),
        ):
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
    group_spec = _ring_layout()[0].kv_cache_groups[0].kv_cache_spec
    page = traits_of(group_spec.kv_cache_specs["paged.0"]).page_size_bytes  # type: ignore[attr-defined]
    assert page == 4 * 64 * 2 == 512
    with pytest.raises(Exception, match="NIXL_ERR") as upstream_error:
        register(NixlPullConnectorWorker)
    assert type(upstream_error.value).__module__.startswith("nixl")
    with pytest.raises(
        UnsupportedLayoutError, match="pages of 512 bytes overlap at block stride 256"
    ):
        register(TraitsNixlConnectorWorker)


def _interleaved_hybrid() -> tuple[
    KVCacheConfig, MambaSpec, dict[str, torch.Tensor], list[torch.Tensor]
]:
    """vLLM's test_register_kv_caches_hybrid_mla_dual_purpose_regions
    (test_nixl_connector_hma.py, vLLM 0.32.0): an MLA group (12-token blocks of 6 fp16
    = 144 B pages, 4-token kernel blocks of 48 B) and two KDA groups (GDN conv 8 x 3
    fp16 = 48 B, then SSM 1 x 4 x 4 fp32 = 64 B, padded to the 144 B page) over two
    [12, 48] views of one [12, 96] buffer: layer .0 and layer .1 alternate by kernel
    row, so a 144 B page of layer .0 is its rows 3b, 3b+1, 3b+2, 96 B apart."""
    mla = MLAAttentionSpec(block_size=12, num_kv_heads=1, head_size=6, dtype=torch.float16)
    kda = MambaSpec(
        block_size=12,
        shapes=((8, 3), (1, 4, 4)),
        dtypes=(torch.float16, torch.float32),
        page_size_padded=144,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    tensors = [
        KVCacheTensor(
            size=2 * 4 * 144, layers=[f"{p}.0", f"{p}.1"], layer_stride=4 * 144, block_stride=144
        )
        for p in ("mla", "kda_a", "kda_b")
    ]
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=tensors,
        kv_cache_groups=[
            KVCacheGroupSpec(["mla.0", "mla.1"], mla),
            KVCacheGroupSpec(["kda_a.0", "kda_a.1"], kda),
            KVCacheGroupSpec(["kda_b.0", "kda_b.1"], kda),
        ],
    )
    backing = torch.zeros(12, 96, dtype=torch.uint8)
    views = [backing[:, :48], backing[:, 48:]]
    caches = {f"{p}.{i}": views[i] for i in range(2) for p in ("kda_a", "mla", "kda_b")}
    return config, kda, caches, views


def test_state_pages_split_across_interleaved_kernel_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream registers the MLA geometry (2 regions, kernel rows 96 B apart; vLLM's
    test asserts it) and reads each KDA state as one run from the start of its block
    (``_build_mamba_local``: base + b x 96 x 3, conv parts then 64 SSM bytes at +48).
    In these views a state page is three 48 B rows 96 B apart, so upstream's SSM
    descriptor of layer .0 covers layer .1's row and the conv descriptors of layer .1
    cover the same bytes (two layers' states in one place), and part of each layer's
    state is never read. The planner refuses the layout by name."""
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        derive_mamba_conv_split,
    )

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    config, kda, caches, views = _interleaved_hybrid()
    ratio, blocks, row = 3, 4, 96
    base = views[0].data_ptr()
    # Upstream's own descriptor code on the geometry it registers for this layout.
    upstream = object.__new__(NixlPullConnectorWorker)
    upstream.shutdown = lambda: None  # type: ignore[method-assign]  # skeleton
    split = derive_mamba_conv_split(kda, 1)
    upstream._conv_decomp = split
    upstream._mamba_ssm_size = split.ssm_sizes
    assert split.ssm_sizes == (8 * 3 * 2, 4 * 4 * 4)  # conv fp16, SSM fp32 bytes
    upstream._logical_num_blocks = blocks
    upstream._physical_blocks_per_logical_kv_block = ratio
    upstream.device_id = 0
    upstream._ssm_region_indices = [0, 1]
    upstream.block_stride_per_layer = [row, row]
    upstream._ple_region_index = None
    descs = _one_row_per_block(
        upstream._build_mamba_local([views[0].data_ptr(), views[1].data_ptr()])
    )
    per_region = len(descs) // 2

    def covered(region: int, block: int) -> set[int]:
        return {
            a - base
            for start, length, _ in descs[region * per_region :][:per_region]
            if (int(start) - base) // (row * ratio) == block
            for a in range(int(start), int(start) + int(length))
        }

    def state_bytes(layer: int, block: int) -> set[int]:
        # The 112 state bytes of the layer's 144 B page, through its own view: the
        # page is its kernel rows 3b..3b+2 (vLLM's kernel-block view of a block).
        rows = [views[layer][block * ratio + k] for k in range(ratio)]
        addrs = [r.data_ptr() - base + i for r in rows for i in range(r.nbytes)]
        return set(addrs[: sum(split.ssm_sizes)])

    for block in range(blocks):
        layer0, layer1 = covered(0, block), covered(1, block)
        assert layer0 & state_bytes(1, block)  # reads layer .1's bytes as layer .0's
        assert layer0 & layer1  # two layers' states in the same bytes
        assert state_bytes(0, block) - layer0 - layer1  # and leaves state bytes behind
    with pytest.raises(UnsupportedLayoutError, match="state pages of 144 bytes at stride 288"):
        plan_regions(caches, config, layout=PlanLayout(sub_blocks=ratio))
