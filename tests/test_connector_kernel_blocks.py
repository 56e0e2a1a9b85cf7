"""Kernel blocks smaller than manager blocks (vLLM's ``_physical_blocks_per_logical_kv_block
> 1``): FlashMLA/FlashInfer under a large ``--block-size``, and hybrid Mamba/GDN/KDA models
whose attention block grows to the state page while the kernel keeps its own block.

Manager block 64, kernel block 16 (ratio 4), views made by vLLM's own
``create_kv_cache_views`` (the attention groups split into kernel-block rows, the state
groups not), for attention, MLA and an MLA + 2 x KDA hybrid (every group aliasing the same
storage, as vLLM allocates them). The kernel block is what the backend reports; here
vLLM's ``select_common_block_size`` is made to answer 16, as FlashMLA's 64/16 would on a GPU
(the CPU backend never splits).

For each: the traits worker's registered descriptors equal upstream's (which vLLM's
unchanged descriptor-id code indexes in kernel blocks), every descriptor lies inside the
registered allocation, and a real NIXL read of manager blocks through vLLM's own request
path (handshake, ``start_load_kv``, ``get_finished``) gives the consumer exactly the
producer's bytes of those blocks and touches no other byte. On the connector of commit
d8572c7 (regions planned in manager blocks) every case fails: 6 descriptors of 147456 B
per MLA region where vLLM's id code indexes 24 kernel blocks of 36864 B, and the reads
fail (NIXL_ERR_NOT_FOUND on ids past the registered range).
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.kv_cache_interface import (
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)

from kvspec_traits import _families as families
from kvspec_traits import traits_of
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from tests.mla_backends import CPU_MLA
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import DSV2, LLAMA, Family
from tests.nixl_helpers.receive import receive
from tests.test_connector_differential import (
    F32,
    LBHNC,
    TINY_GDN,
    _construct,
    _serve_handshake,
    _vllm_config,
    compared_fields,
    distributed,
)

pytestmark = pytest.mark.timeout(600)
__all__ = ["distributed"]  # a fixture, imported for its name

NB = 6  # manager blocks
BLOCK, KERNEL = 64, 16
RATIO = BLOCK // KERNEL


def _mla_spec() -> MLAAttentionSpec:
    return families.deepseek_v3_mla(block_size=BLOCK, dtype=F32, cache_dtype=None)


def _kda_spec() -> MambaSpec:
    # GDN-style state (TINY_GDN: conv [Q, K, V] 768 wide, 3 rows; state (4, 32, 32)),
    # padded to the MLA page as vLLM unifies hybrid page sizes.
    return families.gdn_state(
        **TINY_GDN,
        block_size=BLOCK,
        conv_layout="DS",
        page_size_padded=_mla_spec().page_size_bytes,
    )


def _mla_kda(tp: int) -> list[KVCacheGroupSpec]:
    """Kimi-Linear style: MLA plus two KDA groups, layer i of every group aliasing the
    same storage (vLLM's hybrid allocation)."""
    return [
        layouts.group(layouts.layer_names("model.layers.{}.self_attn.attn", range(2)), _mla_spec()),
        layouts.group(layouts.layer_names("model.layers.{}.kda_a", range(2)), _kda_spec()),
        layouts.group(layouts.layer_names("model.layers.{}.kda_b", range(2)), _kda_spec()),
    ]


FAMILIES: dict[str, Family] = {
    "attention": Family(
        lambda tp: layouts.llama_gqa(
            tp, layers=2, block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=F32
        ),
        LBHNC,
        LLAMA,
    ),
    "mla": Family(
        lambda tp: layouts.deepseek_v3(tp, 2, None, block_size=BLOCK, dtype=F32), LBHNC, DSV2
    ),
    "mla_kda_hybrid": Family(_mla_kda, LBHNC, DSV2),
}


def _kernels(groups: list[KVCacheGroupSpec]) -> list[int]:
    # vLLM splits attention groups into kernel blocks, never a state group.
    return [
        g.kv_cache_spec.block_size if isinstance(g.kv_cache_spec, MambaSpec) else KERNEL
        for g in groups
    ]


@pytest.fixture
def make(
    distributed: None, tiny_models: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Any]]:
    """``make(family, cls, engine_id)``: a worker (pull or push) over vLLM's kernel-block
    views of ``family`` (a name of FAMILIES, or a Family), caches registered
    (``prepare(worker)`` first, if given); shut down afterwards. ``stage=(pp_rank,
    pp_size)`` makes it that pipeline stage of its engine (the layers vLLM places there:
    ``get_layers_start_end_indices``), ``kv_role`` sets the config's role (default
    ``kv_both``); ``kernels=False`` keeps the family's own block size and layout, blocks
    unsplit (no kernel block of 16)."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    made: list[Any] = []

    def _make(
        family: str | Family,
        cls: type[NixlBaseConnectorWorker],
        engine_id: str,
        prepare: Callable[[Any], None] | None = None,
        *,
        stage: tuple[int, int] = (0, 1),
        kv_role: str | None = None,
        kernels: bool = True,
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        chosen = FAMILIES[family] if isinstance(family, str) else family
        groups = chosen.groups(1)
        layout = LBHNC if kernels else chosen.layout
        vllm_config = _vllm_config(tiny_models / chosen.model, layout, CPU_MLA)
        if kernels:
            vllm_config.cache_config.block_size = BLOCK
        if kv_role is not None and vllm_config.kv_transfer_config is not None:
            vllm_config.kv_transfer_config.kv_role = kv_role  # type: ignore[assignment]
        if stage[1] > 1:
            parallel = vllm_config.parallel_config
            parallel.pipeline_parallel_size, parallel.rank = stage[1], stage[0]
            held = range(*vllm_config.model_config.get_layers_start_end_indices(parallel))
            groups = layouts.stage_groups(groups, held)
        config = layouts.kv_cache_config(groups, NB, layout)
        caches = layouts.allocate(config, layout, _kernels(groups) if kernels else None)
        split = (
            patch.object(base_worker, "select_common_block_size", return_value=KERNEL)
            if kernels
            else contextlib.nullcontext()
        )
        with set_current_vllm_config(vllm_config), split:
            worker = _construct(lambda: cls(vllm_config, engine_id, config))
            made.append(worker)
            if prepare is not None:
                prepare(worker)
            worker.register_kv_caches(caches)
        return worker, caches

    yield _make
    for worker in made:
        worker.shutdown()


def _registered(worker: TraitsNixlConnectorWorker) -> list[tuple[int, int]]:
    assert worker.region_plan is not None
    return [(r.base, r.base + r.length) for r in worker.region_plan.registrations]


def _one_row_per_block(descs: np.ndarray) -> np.ndarray:
    """(addr, len, device) per block. vLLM 0.34 keeps strided rows (addr, len, device,
    stride, count: ``count`` blocks ``stride`` apart); 0.32/0.33 keep one row per block."""
    if descs.shape[1] == 3:
        return descs
    rows = [
        (int(a) + i * int(stride), int(n), int(dev))
        for a, n, dev, stride, count in descs
        for i in range(int(count))
    ]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def _relative(descs: np.ndarray, caches: dict[str, torch.Tensor]) -> np.ndarray:
    out = descs.astype(np.int64)
    out[:, 0] -= layouts.backing(caches).data_ptr()
    return out


def _state_bytes(spec: MambaSpec) -> int:
    return sum(c.nbytes for c in traits_of(spec).components)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernel_block_descriptors_match_upstream_and_stay_inside(
    family: str, make: Callable[..., Any]
) -> None:
    upstream, up_caches = make(family, NixlPullConnectorWorker, "upstream")
    ours, caches = make(family, TraitsNixlConnectorWorker, "traits")
    assert ours._physical_blocks_per_logical_kv_block == RATIO
    assert ours.block_size == KERNEL and ours.num_blocks == NB * RATIO
    # vLLM's descriptor-id code indexes these in kernel blocks: ours must be upstream's.
    # (Two allocations of the same layout: addresses compared as offsets into each.)
    same = {name: (getattr(upstream, name), getattr(ours, name)) for name in compared_fields()}
    assert {k: v for k, v in same.items() if v[0] != v[1]} == {}
    np.testing.assert_array_equal(
        _relative(upstream.src_blocks_data, up_caches), _relative(ours.src_blocks_data, caches)
    )
    # Every descriptor inside the registered allocation.
    ranges = _registered(ours)
    descs = _one_row_per_block(ours.src_blocks_data).astype(np.int64)
    inside = [any(lo <= int(a) and int(a) + int(n) <= hi for lo, hi in ranges) for a, n, _ in descs]
    assert all(inside) and len(descs) > 0
    # Hand-computed: a paged region's kernel page is the manager page / 4, there are
    # NB * 4 of them (vLLM's block_len_per_layer / num_blocks at kernel granularity).
    page = traits_of(
        _mla_spec() if family != "attention" else FAMILIES[family].groups(1)[0].kv_cache_spec
    ).page_size_bytes
    assert set(ours.block_len_per_layer) == {page // RATIO}


def _read(
    consumer: Any, producer: Any, local: tuple[list[int], ...], remote: list[list[int]]
) -> None:
    """One request through vLLM's receive path: handshake, start_load_kv, poll."""
    port, stop = _serve_handshake(producer)
    try:
        receive(consumer, port=port, local=local, remote=remote, remote_engine=producer.engine_id)
    finally:
        stop.set()


def _manager_block(cache: torch.Tensor, block: int, ratio: int) -> torch.Tensor:
    """The bytes of manager block ``block`` of a (possibly kernel-split) view."""
    rows = cache[block * ratio : (block + 1) * ratio]
    return rows.contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_kernel_block_read_moves_exactly_the_producers_blocks(
    family: str, make: Callable[..., Any]
) -> None:
    producer, p_caches = make(family, TraitsNixlConnectorWorker, "producer")
    consumer, d_caches = make(family, TraitsNixlConnectorWorker, "consumer")
    layouts.fill_pattern(p_caches, seed=7)
    before = layouts.backing(d_caches).clone()
    groups = FAMILIES[family].groups(1)
    local, remote = request_blocks(groups)
    _read(consumer, producer, local, list(remote))
    assert_moved_exactly(groups, local, remote, p_caches, d_caches, before)


def request_blocks(
    groups: list[KVCacheGroupSpec],
) -> tuple[tuple[list[int], ...], tuple[list[int], ...]]:
    """(consumer blocks, producer blocks) per group of one request, in manager blocks,
    distinct across groups (they share the pool, and in the hybrid every group's layer i
    aliases the same storage): attention groups move two blocks into two others, out of
    order; each state group its one state block."""
    state_blocks = iter([(3, 0), (0, 1)])
    local: list[list[int]] = []
    remote: list[list[int]] = []
    for g in groups:
        if isinstance(g.kv_cache_spec, MambaSpec):
            d, p = next(state_blocks)
            local.append([d])
            remote.append([p])
        else:
            local.append([4, 1])
            remote.append([2, 5])
    return tuple(local), tuple(remote)


def assert_moved_exactly(
    groups: list[KVCacheGroupSpec],
    local: tuple[list[int], ...],
    remote: tuple[list[int], ...],
    p_caches: dict[str, torch.Tensor],
    d_caches: dict[str, torch.Tensor],
    before: torch.Tensor,
) -> None:
    """The consumer's blocks ``local`` hold the producer's blocks ``remote`` (a state
    page's tensors, not its padding), and no other consumer byte changed."""
    after = layouts.backing(d_caches)
    changed = torch.zeros(after.numel(), dtype=torch.bool)
    for group, dst, src in zip(groups, local, remote, strict=True):
        spec = group.kv_cache_spec
        for layer in group.layer_names:
            d_view, p_view = d_caches[layer], p_caches[layer]
            ratio = d_view.shape[0] // NB
            for d_block, p_block in zip(dst, src, strict=True):
                want = _manager_block(p_view, p_block, ratio)
                got = _manager_block(d_view, d_block, ratio)
                if isinstance(spec, MambaSpec):
                    # The state's conv and SSM tensors move; the page's padding does not.
                    n = _state_bytes(spec)
                    want, got = want[:n], got[:n]
                assert torch.equal(got, want), (layer, d_block, p_block)
                start = d_view[d_block * ratio].data_ptr() - d_view.untyped_storage().data_ptr()
                changed[start : start + got.numel()] = True
    # Nothing outside the destination blocks was written, and all of them were.
    assert torch.equal(after[~changed], before[~changed])
    expected = 0
    for group, dst in zip(groups, local, strict=True):
        spec = group.kv_cache_spec
        per_block = (
            _state_bytes(spec) if isinstance(spec, MambaSpec) else traits_of(spec).page_size_bytes
        )
        expected += len(dst) * per_block * len(group.layer_names)
    assert int(changed.sum()) == expected
