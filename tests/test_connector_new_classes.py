"""The next spec class, served with only an adapter (issue 34): spec classes vLLM has
never seen (``tests/new_class_specs.py``: an MLA-format latent and an RWKV-style state
deriving from ``KVCacheSpec`` directly, a windowed head-sharded cache deriving from
``AttentionSpec`` but not ``SlidingWindowSpec``), each with an adapter registered through
``kvspec_traits.extend`` and nothing else, moved by ``TraitsNixlConnectorWorker`` pairs
with real NIXL agents, alone and beside vLLM's own classes, at P TP 1 -> D TP 1, P TP 2
-> D TP 1 and P TP 1 -> D TP 2; and vLLM's own MLA + GQA mix at heterogeneous TP.

How each rank's bytes are known (hand-computed, not read back from a transfer): a
*model* writes every layer's page of a request from one global tensor per (layer,
request), and each TP rank holds its share of it, as the model's layers shard it:

- a TP-replicated page (a latent, vLLM's MLA): the whole tensor on every rank;
- a head-sharded page (``[heads, tokens, K|V]``, heads outermost in vLLM's LBHNC
  page): rank ``r`` of ``tp`` holds heads ``r * H / tp`` to ``(r + 1) * H / tp``;
- a TP-sharded state: rank ``r`` holds slice ``r`` of the shift vector, then slice
  ``r`` of the wkv matrix's heads (the page's padding is never written).

Every prefill rank writes its share into its blocks; each decode rank reads the request
through vLLM's receive path (handshake, ``start_load_kv``, ``get_finished``); its whole
allocation must then equal its initial bytes with exactly its own share of each read
page written in: every page right, and no other byte changed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest.mock import patch

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import TokenScope, TPLayout
from kvspec_traits.vllm_connector import (
    UnsupportedStateLayoutError,
    UnsupportedStateTPError,
)
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from kvspec_traits.vllm_connector._push import TraitsNixlPushConnectorWorker
from tests.new_class_specs import (
    REGISTRY,
    LatentPageSpec,
    UndescribedWkvStateSpec,
    WindowedHeadsSpec,
    WkvStateSpec,
)
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA
from tests.nixl_helpers.receive import receive, serving
from tests.test_connector_differential import _construct, _vllm_config, distributed
from tests.test_push_connector import REQ, _push

pytestmark = [pytest.mark.timeout(600)]

__all__ = ["distributed"]  # a fixture, imported for its name

F32 = torch.float32
NB = 8
BLOCK = 32  # vLLM-CPU's attention kernels take multiples of 32 tokens
LAYOUT = KVCacheLayout.LBHNC
KV_HEADS = 2  # the tiny Llama's: the TP mapping reads the model's KV-head count
HEAD = 32
TP_PAIRS = [(1, 1), (2, 1), (1, 2)]


# -- the models: what each layer's page holds on a rank ---------------------------------


@dataclass(frozen=True)
class Layer:
    """One layer of a test model: its name, its kind of sharding (``"replicated"``,
    ``"heads"``, ``"state"``) and its spec at a TP size."""

    name: str
    kind: str
    spec: Callable[[int], KVCacheSpec]


@dataclass(frozen=True)
class Model:
    """A model's cache groups: per group its layers, wrapped as vLLM's allocator
    groups them (one spec for the group, or ``uniform``: one
    ``UniformTypeKVCacheSpecs`` of its layers' specs); per group the request's remote
    and local block ids (disjoint across groups: vLLM's groups alias their pages)."""

    name: str
    groups: tuple[tuple[Layer, ...], ...]
    remote_blocks: tuple[tuple[int, ...], ...]
    local_blocks: tuple[tuple[int, ...], ...]
    uniform: bool = False
    side_by_side: bool = False
    """The groups' pages in allocations of their own, one after the other, instead of
    overlaid from byte 0 (vLLM's hybrid allocator overlays groups of one page size; these
    groups' pages differ in size, and the test's block ids need not avoid each other)."""

    def config(self, tp: int) -> KVCacheConfig:
        """The model's ``KVCacheConfig`` at TP size ``tp``, laid out as vLLM does."""
        groups = self.kv_groups(tp)
        if not self.side_by_side:
            return layouts.kv_cache_config(groups, NB, LAYOUT)
        parts = [layouts.kv_cache_config([g], NB, LAYOUT) for g in groups]
        total = sum(part.kv_cache_tensors[0].size for part in parts)
        tensors, offset = [], 0
        for part in parts:
            for t in part.kv_cache_tensors:
                tensors.append(dataclasses.replace(t, size=total, offset=offset + t.offset))
            offset += part.kv_cache_tensors[0].size
        return KVCacheConfig(
            num_blocks=NB,
            kv_cache_tensors=tensors,
            kv_cache_groups=groups,
            kv_cache_layout=LAYOUT.name,
        )

    def kv_groups(self, tp: int) -> list[KVCacheGroupSpec]:
        out = []
        for layers in self.groups:
            names = [layer.name for layer in layers]
            specs = {layer.name: layer.spec(tp) for layer in layers}
            if self.uniform:
                spec: KVCacheSpec = UniformTypeKVCacheSpecs(
                    block_size=BLOCK,
                    kv_cache_specs=specs,
                )
            else:
                (spec,) = set(specs.values())
            out.append(layers_group(names, spec))
        return out

    def layers(self) -> Iterator[tuple[int, Layer]]:
        for index, layers in enumerate(self.groups):
            for layer in layers:
                yield index, layer


def layers_group(names: list[str], spec: KVCacheSpec) -> KVCacheGroupSpec:
    return layouts.group(names, spec)


def full(tp: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=F32
    )


def windowed(tp: int) -> WindowedHeadsSpec:
    return WindowedHeadsSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=F32, window=40
    )


def latent(tp: int) -> LatentPageSpec:
    return LatentPageSpec(block_size=BLOCK, latent_size=64, dtype=F32)


def mla(tp: int) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=F32)


SHIFT, WKV_HEADS, WKV_DIM = 64, 4, 8  # the model's whole state, split by TP


def wkv(tp: int, cls: type[WkvStateSpec] = WkvStateSpec) -> WkvStateSpec:
    """The state padded to the full-attention page it shares blocks with (vLLM's hybrid
    allocator gives every group one page size)."""
    return cls(
        block_size=BLOCK,
        dim=SHIFT // tp,
        heads=WKV_HEADS // tp,
        head_dim=WKV_DIM,
        dtype=F32,
        page_size_padded=full(tp).page_size_bytes,
    )


def wkv_alone(tp: int) -> WkvStateSpec:
    """The state of a model with no attention layer: its page is its content."""
    return dataclasses.replace(wkv(tp), page_size_padded=None)


def undescribed_wkv(tp: int) -> WkvStateSpec:
    return wkv(tp, UndescribedWkvStateSpec)


def replicated_wkv(tp: int, *, padded: bool = True) -> WkvStateSpec:
    """The model's whole state on every rank (1280 B of content at every TP size),
    padded to the full-attention page where it shares blocks with one (16384 B at TP
    1, 8192 at TP 2: the padding differs by TP, the state does not)."""
    return WkvStateSpec(
        block_size=BLOCK,
        dim=SHIFT,
        heads=WKV_HEADS,
        head_dim=WKV_DIM,
        dtype=F32,
        tp_replicated=True,
        page_size_padded=full(tp).page_size_bytes if padded else None,
    )


def replicated_wkv_alone(tp: int) -> WkvStateSpec:
    return replicated_wkv(tp, padded=False)


def _layer(i: int, what: str, kind: str, spec: Callable[[int], KVCacheSpec]) -> Layer:
    return Layer(f"model.layers.{i}.{what}", kind, spec)


MODELS = {
    m.name: m
    for m in (
        # A latent class from outside vLLM's trees, alone.
        Model(
            "latent",
            (
                (
                    _layer(0, "latent", "replicated", latent),
                    _layer(1, "latent", "replicated", latent),
                ),
            ),
            ((2, 5),),
            ((4, 1),),
        ),
        # A windowed head-sharded class, alone, and beside vLLM's full attention in a
        # group of its own (both pages one size at every TP size).
        Model(
            "windowed",
            ((_layer(0, "attn", "heads", windowed), _layer(1, "attn", "heads", windowed)),),
            ((2, 5),),
            ((4, 1),),
        ),
        Model(
            "windowed+full",
            ((_layer(0, "attn", "heads", full),), (_layer(1, "attn", "heads", windowed),)),
            ((2, 5), (6,)),
            ((4, 1), (3,)),
        ),
        # The latent class beside vLLM's full attention in one group (vLLM groups layers
        # of one block size but other pages as one UniformTypeKVCacheSpecs).
        Model(
            "latent+full uniform",
            ((_layer(0, "attn", "heads", full), _layer(1, "latent", "replicated", latent)),),
            ((2, 5),),
            ((4, 1),),
            uniform=True,
        ),
        # vLLM's own MLA + GQA mix (a GQA model with an MLA draft) in one group.
        Model(
            "mla+gqa uniform",
            ((_layer(0, "attn", "heads", full), _layer(1, "draft", "replicated", mla)),),
            ((2, 5),),
            ((4, 1),),
            uniform=True,
        ),
        # vLLM's own MLA + GQA mix in groups of their own (pages of other sizes: side
        # by side in the allocation).
        Model(
            "mla+gqa groups",
            ((_layer(0, "attn", "heads", full),), (_layer(1, "draft", "replicated", mla),)),
            ((2, 5), (6,)),
            ((4, 1), (3,)),
            side_by_side=True,
        ),
        # The state class beside vLLM's full attention (a hybrid model: state and
        # attention groups, one page size).
        Model(
            "wkv+full",
            ((_layer(0, "wkv", "state", wkv),), (_layer(1, "attn", "heads", full),)),
            ((5,), (2, 6)),
            ((1,), (4, 3)),
        ),
        # A model whose only cache is the state (an RWKV-style model: no attention group).
        Model(
            "wkv alone",
            ((_layer(0, "wkv", "state", wkv_alone), _layer(1, "wkv", "state", wkv_alone)),),
            ((5, 2),),
            ((1, 6),),
        ),
        # The state class TP-replicated (every rank holds the model's whole state): alone
        # (two layers of one group), and beside vLLM's full attention in a group of its
        # own, its pages overlaying the attention pages (vLLM's hybrid allocator).
        Model(
            "replicated wkv",
            (
                (
                    _layer(0, "wkv", "replicated state", replicated_wkv_alone),
                    _layer(1, "wkv", "replicated state", replicated_wkv_alone),
                ),
            ),
            ((5, 2),),
            ((1, 6),),
        ),
        Model(
            "replicated wkv+full",
            (
                (_layer(0, "wkv", "replicated state", replicated_wkv),),
                (_layer(1, "attn", "heads", full),),
            ),
            ((5,), (2, 6)),
            ((1,), (4, 3)),
        ),
        Model(
            "undescribed wkv+full",
            ((_layer(0, "wkv", "state", undescribed_wkv),), (_layer(1, "attn", "heads", full),)),
            ((5,), (2, 6)),
            ((1,), (4, 3)),
        ),
    )
}


def _noise(key: str, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def rank_share(model: Model, layer: Layer, block: int, tp: int, rank: int) -> torch.Tensor:
    """The bytes rank ``rank`` of ``tp`` holds of ``layer``'s page for the request whose
    prefill block is ``block``: its share of the model's one tensor (module docstring)."""
    key = f"{model.name}/{layer.name}/{block}"
    if layer.kind == "replicated":
        return _noise(key, layer.spec(1).page_size_bytes)
    if layer.kind == "replicated state":  # the whole state, on every rank
        return rank_share(
            dataclasses.replace(model, name=model.name),
            dataclasses.replace(layer, kind="state"),
            block,
            1,
            0,
        )
    if layer.kind == "heads":
        whole = _noise(key, layer.spec(1).page_size_bytes).view(KV_HEADS, -1)
        per_rank = KV_HEADS // tp
        return whole[rank * per_rank : (rank + 1) * per_rank].flatten()
    shift = _noise(key + "/shift", SHIFT * 4).view(SHIFT, 4)
    matrix = _noise(key + "/wkv", WKV_HEADS * WKV_DIM * WKV_DIM * 4).view(WKV_HEADS, -1)
    s, h = SHIFT // tp, WKV_HEADS // tp
    return torch.cat(
        [shift[rank * s : (rank + 1) * s].flatten(), matrix[rank * h : (rank + 1) * h].flatten()]
    )


# -- workers -----------------------------------------------------------------------------


def _page_offset(caches: dict[str, torch.Tensor], layer: str, block: int) -> int:
    backing = layouts.backing(caches)
    return caches[layer][block].data_ptr() - backing.data_ptr()


def write_share(caches: dict[str, torch.Tensor], offset_of: int, share: torch.Tensor) -> None:
    layouts.backing(caches)[offset_of : offset_of + share.numel()].copy_(share)


@pytest.fixture
def rank_worker(
    distributed: None, tiny_models: pathlib.Path
) -> Iterator[Callable[..., tuple[Any, dict[str, torch.Tensor]]]]:
    """``rank_worker(model, engine, tp, rank)``: a traits NIXL worker as TP rank
    ``rank`` of ``tp`` (vLLM's parallel state patched to say so while it is built), over
    its own allocation of the model's caches (filled with seeded noise), registered."""
    made: list[Any] = []

    def _make(
        model: Model, engine: str, tp: int, rank: int, cls: type[Any] = TraitsNixlConnectorWorker
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        vllm_config = _vllm_config(tiny_models / LLAMA, LAYOUT, None)
        vllm_config.parallel_config.tensor_parallel_size = tp
        vllm_config.cache_config.block_size = BLOCK
        config = model.config(tp)
        caches = layouts.allocate(config, LAYOUT)
        layouts.fill_pattern(caches, seed=hash((engine, rank)) & 0xFFFF)
        with (
            set_current_vllm_config(vllm_config),
            patch.object(base_worker, "get_tensor_model_parallel_rank", return_value=rank),
            patch.object(base_worker, "get_tensor_model_parallel_world_size", return_value=tp),
        ):
            worker = _construct(lambda: cls(vllm_config, engine, config, registry=REGISTRY))
            made.append(worker)
            worker.register_kv_caches(caches)
        return worker, caches

    yield _make
    for worker in made:
        worker.shutdown()


def read_request(consumer: Any, model: Model, port: int, remote_tp: int) -> None:
    """One request through vLLM's receive path: the model's remote blocks into its
    local blocks, from a prefill engine of ``remote_tp`` ranks."""
    receive(
        consumer,
        port=port,
        local=model.local_blocks,
        remote=model.remote_blocks,
        remote_tp=remote_tp,
        # Another TP size: the connector's planned reads (the planner's tp_reads).
        planned=isinstance(consumer, TraitsNixlConnectorWorker)
        and consumer.region_plan is not None
        and consumer.region_plan.tp_size != remote_tp,
    )


def producers_for(
    rank_worker: Callable[..., tuple[Any, dict[str, torch.Tensor]]],
    model: Model,
    tp: int,
    cls: type[Any] = TraitsNixlConnectorWorker,
) -> list[Any]:
    """The prefill ranks, each with its share of every layer's page of each request
    block written in."""
    producers = []
    for rank in range(tp):
        worker, caches = rank_worker(model, "prefill", tp, rank, cls)
        for group, layer in model.layers():
            for block in model.remote_blocks[group]:
                share = rank_share(model, layer, block, tp, rank)
                write_share(caches, _page_offset(caches, layer.name, block), share)
        producers.append(worker)
    return producers


def expected_backing(
    model: Model, caches: dict[str, torch.Tensor], before: torch.Tensor, tp: int, rank: int
) -> torch.Tensor:
    """A decode rank's allocation as it must be after the read: its bytes before, with
    its own share of each read page written at that page (nothing else)."""
    want = before.clone()
    for group, layer in model.layers():
        for remote, local in zip(
            model.remote_blocks[group], model.local_blocks[group], strict=True
        ):
            share = rank_share(model, layer, remote, tp, rank)
            offset = _page_offset(caches, layer.name, local)
            want[offset : offset + share.numel()] = share
    return want


def assert_read_exactly(
    model: Model,
    caches: dict[str, torch.Tensor],
    before: torch.Tensor,
    tp: int,
    rank: int,
    what: str,
) -> None:
    got = layouts.backing(caches)
    want = expected_backing(model, caches, before, tp, rank)
    if not torch.equal(got, want):
        wrong = (got != want).nonzero().flatten()
        raise AssertionError(
            f"{model.name} {what} rank {rank}: {wrong.numel()} bytes differ, "
            f"first at {wrong[:4].tolist()}"
        )


def run_pair(
    rank_worker: Callable[..., tuple[Any, dict[str, torch.Tensor]]],
    model: Model,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    producers = producers_for(rank_worker, model, prefill_tp)
    with serving(producers) as port:
        for rank in range(decode_tp):
            consumer, caches = rank_worker(model, f"decode-{rank}", decode_tp, rank)
            before = layouts.backing(caches).clone()
            read_request(consumer, model, port, prefill_tp)
            assert_read_exactly(
                model, caches, before, decode_tp, rank, f"P{prefill_tp}->D{decode_tp}"
            )
            consumer.shutdown()


def push_request(
    producers: list[Any],
    consumers: list[Any],
    model: Model,
    *,
    timeout: float = 120,
) -> None:
    """One request (``REQ``) through vLLM's push path between a prefill engine of
    ``len(producers)`` TP ranks and a decode engine of ``len(consumers)``: each decode
    rank sends its block registration (vLLM's push scheduler's fields) to the prefill
    ranks it pairs with, each prefill rank WRITEs its share of the request's blocks
    into the decode ranks its TP mapping names; fails unless every decode rank reports
    the request received within ``timeout`` seconds with no block in error."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    local = tuple(list(b) for b in model.local_blocks)
    remote = tuple(list(b) for b in model.remote_blocks)
    with serving(producers) as p_port, serving(consumers) as d_port:
        for producer in producers:
            p_meta = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
            p_meta.reqs_in_batch.add(REQ)
            p_meta.reqs_to_send[REQ] = time.perf_counter() + 600
            p_meta.push_finished_blocks[REQ] = remote
            producer.start_load_kv(p_meta)
        for consumer in consumers:
            d_meta = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
            d_meta.add_new_req_to_recv(
                request_id=REQ,
                local_block_ids=local,
                kv_transfer_params={
                    "remote_block_ids": (),  # push: the decode side does not know them
                    "remote_engine_id": producers[0].engine_id,
                    "remote_request_id": REQ,
                    "remote_host": "127.0.0.1",
                    "remote_port": p_port,
                    "tp_size": len(producers),
                    "pp_size": 1,
                },
            )
            d_meta.push_registrations[REQ] = {
                "request_id": REQ,
                "decode_engine_id": consumer.engine_id,
                "decode_host": "127.0.0.1",
                "decode_port": d_port,
                "decode_tp_size": len(consumers),
                "local_block_ids": local,
                "remote_engine_id": producers[0].engine_id,
                "remote_host": "127.0.0.1",
                "remote_port": p_port,
                "remote_tp_size": len(producers),
                "remote_pp_size": 1,
            }
            consumer.start_load_kv(d_meta)
        received: list[set[str]] = [set() for _ in consumers]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(REQ in r for r in received):
            # Each engine step's get_finished wakes the writer threads.
            for producer in producers:
                producer.get_finished()
            for done, consumer in zip(received, consumers, strict=True):
                done |= consumer.get_finished()[1]
            time.sleep(0.02)
        missing = [rank for rank, r in enumerate(received) if REQ not in r]
        if missing:
            raise AssertionError(f"decode ranks {missing} did not receive in {timeout:.0f} s")
        for consumer in consumers:
            assert consumer.get_block_ids_with_load_errors() == set()


def push_pair(
    rank_worker: Callable[..., tuple[Any, dict[str, torch.Tensor]]],
    model: Model,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    """:func:`run_pair` in push mode: every decode rank's allocation compared with its
    hand-computed share after the prefill ranks' WRITEs."""
    push = TraitsNixlPushConnectorWorker
    producers = producers_for(rank_worker, model, prefill_tp, push)
    consumers, caches, before = [], [], []
    for rank in range(decode_tp):
        # One decode engine (its ranks served together), unlike run_pair's readers.
        consumer, cache = rank_worker(model, "decode", decode_tp, rank, push)
        consumers.append(consumer)
        caches.append(cache)
        before.append(layouts.backing(cache).clone())
    push_request(producers, consumers, model)
    for rank in range(decode_tp):
        assert_read_exactly(
            model, caches[rank], before[rank], decode_tp, rank, f"push P{prefill_tp}->D{decode_tp}"
        )


# -- tests -------------------------------------------------------------------------------


def test_the_classes_traits_come_from_their_adapters_alone() -> None:
    """What the connector plans with, hand-computed from each class's own page math
    (tests/new_class_specs.py): latent 32 tokens x 64 x 4 B = 8192 B, replicated;
    windowed 2 heads x 32 tokens x (32 + 32) x 4 B = 16384 B at TP 1, head-sharded;
    state (64 + 4 x 8 x 8) x 4 B = 1280 B of content at TP 1, 640 at TP 2, padded to
    the full-attention page."""
    lat, win = REGISTRY.traits_of(latent(1)), REGISTRY.traits_of(windowed(1))
    state = REGISTRY.traits_of(wkv(2))
    assert (lat.page_size_bytes, lat.is_mla, lat.tp_layout) == (8192, True, TPLayout.REPLICATED)
    assert (win.page_size_bytes, win.tp_layout, win.token_scope, win.window_tokens) == (
        16384,
        TPLayout.HEAD_SHARDED,
        TokenScope.SLIDING_WINDOW,
        40,
    )
    assert state.unpadded_page_size_bytes == 640
    assert state.page_size_bytes == full(2).page_size_bytes == 32 * 1 * 64 * 4
    assert [c.tp_split for c in state.components] == [(32,), (2,)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
@pytest.mark.parametrize(
    "name",
    [
        "latent",
        "windowed",
        "windowed+full",
        "latent+full uniform",
        "mla+gqa uniform",
        "mla+gqa groups",
    ],
)
def test_new_and_mixed_classes_move_byte_exact(
    name: str, prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """Pages of classes vLLM has never seen, alone and beside vLLM's own, and vLLM's
    MLA + GQA mix in one group: every decode rank holds exactly its share of each read
    page and nothing else changed, at equal and at different TP sizes (a replicated
    page read whole from one prefill rank, a head-sharded one gathered or split by
    heads, each region by its own traits)."""
    run_pair(rank_worker, MODELS[name], prefill_tp, decode_tp)


@pytest.mark.parametrize(
    "name",
    [
        "latent",
        "windowed+full",
        "latent+full uniform",
        "mla+gqa uniform",
        "wkv+full",
        "replicated wkv",
        "replicated wkv+full",
    ],
)
def test_push_writes_new_and_mixed_classes_byte_exact(
    name: str, rank_worker: Callable[..., Any]
) -> None:
    """Push mode (vLLM's push path, WRITE from prefill into decode): the same pages,
    every decode byte as the model's share says and no other byte changed."""
    model = MODELS[name]
    (producer,) = producers_for(rank_worker, model, 1, TraitsNixlPushConnectorWorker)
    consumer, caches = rank_worker(model, "decode-0", 1, 0, TraitsNixlPushConnectorWorker)
    before = layouts.backing(caches).clone()
    sent, received = _push(
        producer,
        consumer,
        tuple(list(b) for b in model.local_blocks),
        tuple(list(b) for b in model.remote_blocks),
    )
    assert REQ in sent and REQ in received
    assert_read_exactly(model, caches, before, 1, 0, "push P1->D1")


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
@pytest.mark.parametrize(
    "name",
    [
        "latent",
        "windowed+full",
        "latent+full uniform",
        "mla+gqa uniform",
        "wkv+full",
        "replicated wkv",
        "replicated wkv+full",
    ],
)
def test_push_writes_across_tp_sizes_byte_exact(
    name: str, prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """Push at P2->D1 and P1->D2: each prefill rank WRITEs its share into the decode
    ranks vLLM's TP mapping names (a head-sharded page gathered from two prefill ranks
    or split over two decode ranks, a replicated one written whole to each decode
    rank), every decode byte as the model's share says and nothing else changed."""
    push_pair(rank_worker, MODELS[name], prefill_tp, decode_tp)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
def test_a_state_class_with_a_described_split_moves_byte_exact(
    prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """The RWKV-style state (not a MambaSpec) beside full attention: its traits say each
    part splits by its leading dimension, so vLLM's state descriptors cut its shift
    vector and its wkv heads per rank, at equal and at different TP sizes."""
    run_pair(rank_worker, MODELS["wkv+full"], prefill_tp, decode_tp)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
def test_a_model_whose_only_cache_is_a_state_moves_byte_exact(
    prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """An RWKV-style model with no attention layer (issue 47): it hand-shakes like any
    other (vLLM's attention descriptors have no attention group to take their TP reads
    from; the connector gives them the state group's) and every decode byte is its
    share, at equal and at different TP sizes."""
    run_pair(rank_worker, MODELS["wkv alone"], prefill_tp, decode_tp)


def test_a_state_class_without_a_described_split_moves_at_equal_tp(
    rank_worker: Callable[..., Any],
) -> None:
    run_pair(rank_worker, MODELS["undescribed wkv+full"], 1, 1)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_a_state_class_without_a_described_split_is_refused_across_tp(
    prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """Its traits do not say how the state divides across ranks: refused by name
    (the class, the layer) before vLLM's handshake, and not one decode byte changes."""
    model = MODELS["undescribed wkv+full"]
    producers = producers_for(rank_worker, model, prefill_tp)
    with serving(producers) as port:
        consumer, caches = rank_worker(model, "decode-0", decode_tp, 0)
        before = layouts.backing(caches).clone()
        with pytest.raises(
            UnsupportedStateTPError,
            match=rf"'model.layers.0.wkv' \(UndescribedWkvStateSpec\) between TP "
            rf"{prefill_tp} and TP {decode_tp}.*tp_split",
        ) as raised:
            consumer._nixl_handshake("127.0.0.1", port, prefill_tp, "prefill")
        assert raised.value.spec_name == "UndescribedWkvStateSpec"
        assert torch.equal(layouts.backing(caches), before)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
@pytest.mark.parametrize("name", ["replicated wkv", "replicated wkv+full"])
def test_a_replicated_state_class_moves_byte_exact(
    name: str, prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """The RWKV-style state TP-replicated (its traits: REPLICATED, RECURRENT_STATE),
    alone and beside full attention whose pages it overlays: each decode rank holds
    the model's whole state (1280 B per page, hand-computed in ``rank_share``) read
    from one prefill rank's identical copy, its padding to the attention page (which
    differs by TP) untouched, and nothing else changed."""
    run_pair(rank_worker, MODELS[name], prefill_tp, decode_tp)


def test_a_replicated_state_moves_in_a_replicate_region_of_its_own(
    rank_worker: Callable[..., Any],
) -> None:
    """The connector's region decision for it (hand-computed): the state layer a region
    of its own at the attention layer's base, REPLICATE, moving the 1280 B of content
    at the 8192 B stride of the TP 2 page; the attention region SPLIT; each group's
    blocks addressed in its own region (vLLM's region group mapping), the state group
    as a replicated page group and never as vLLM's state descriptors."""
    worker, _ = rank_worker(MODELS["replicated wkv+full"], "d", 2, 1)
    plan = worker.region_plan
    state, attn = (
        next(r for r in plan.regions if f"model.layers.{i}.{w}" in r.layers)
        for i, w in ((0, "wkv"), (1, "attn"))
    )
    assert state.index != attn.index and state.base_addr == attn.base_addr
    assert (state.layers, state.replicated, state.block_len, state.block_stride) == (
        ("model.layers.0.wkv",),
        True,
        (SHIFT + WKV_HEADS * WKV_DIM * WKV_DIM) * 4,
        full(2).page_size_bytes,
    )
    assert (attn.replicated, attn.block_len) == (False, full(2).page_size_bytes)
    assert (worker.has_mamba, worker.use_mla, worker.ple_region_index) == (False, False, None)
    assert worker.uses_region_group_mapping


def test_a_replicated_state_beside_a_sharded_state_is_refused_before_an_agent(
    distributed: None, tiny_models: pathlib.Path
) -> None:
    """A replicated state beside a TP-sharded one outside a ring model: vLLM's state
    descriptors (which the sharded state needs) would address every region but its
    own as state regions and its pages in every region. Refused at construction,
    naming the class, the layer and the trait."""
    model = Model(
        "replicated wkv+wkv+full",
        (
            (_layer(0, "wkv", "state", wkv),),
            (_layer(1, "wkv", "replicated state", replicated_wkv),),
            (_layer(2, "attn", "heads", full),),
        ),
        ((5,), (3,), (2,)),
        ((1,), (6,), (4,)),
    )
    vllm_config = _vllm_config(tiny_models / LLAMA, LAYOUT, None)
    vllm_config.cache_config.block_size = BLOCK
    config = layouts.kv_cache_config(model.kv_groups(1), NB, LAYOUT)
    with (
        set_current_vllm_config(vllm_config),
        pytest.raises(
            UnsupportedStateLayoutError, match=r"'model.layers.1.wkv' \(WkvStateSpec\).*tp_layout"
        ) as raised,
    ):
        TraitsNixlConnectorWorker(vllm_config, "d", config, registry=REGISTRY)
    assert (raised.value.spec_name, raised.value.trait) == ("WkvStateSpec", "tp_layout")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["MAMBA1", "MAMBA2", "GDN_ATTN"])
def test_mamba_state_split_is_vllms_decomposition(
    kind: str, tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own Mamba kinds: the built-in adapter's ``tp_split`` and the connector's
    state split are exactly what vLLM's ``derive_mamba_conv_split`` computes (so a pair
    with upstream's worker cuts states into the same descriptors). The shapes are the
    families' (Jamba's Mamba-1 d_inner 8192, Qwen3.5's GDN conv 8192 of [Q, K, V] with
    32 value heads of 128, a Mamba-2 of 64 heads of 8 and B = C = 128), each split by TP.
    In vLLM's default SD conv layout no split is described (vLLM's NIXL transfer refuses
    that layout)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        derive_mamba_conv_split,
    )
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvspec_traits import _families, traits_of
    from kvspec_traits.vllm_connector._facts import state_split
    from kvspec_traits.vllm_connector._seam import conv_split_info

    # vLLM caches the layout for the process on first use: start and end uncached.
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    mamba_utils.get_conv_state_layout.cache_clear()
    request_cleanup = mamba_utils.get_conv_state_layout.cache_clear
    spec: MambaSpec
    if kind == "MAMBA1":
        spec = _families.mamba1_state(tp=tp, conv_layout="DS", mamba_type=kind)
    elif kind == "GDN_ATTN":
        spec = _families.gdn_state(tp=tp, conv_layout="DS", mamba_type=kind)
    else:
        spec = MambaSpec(
            block_size=16,
            shapes=(((64 * 8 + 2 * 128) // tp, 3), (64 // tp, 8)),
            dtypes=(torch.bfloat16, torch.float32),
        )
    vllm_split = derive_mamba_conv_split(spec, tp)
    traits = traits_of(spec)
    assert traits.components[0].tp_split == vllm_split.local_proj_dims
    assert traits.components[1].tp_split == (spec.shapes[1][0],)
    ours = state_split("layer", traits)
    assert ours.tp_movable
    assert conv_split_info(ours) == vllm_split

    # The SD layout's spec (conv state transposed, as vLLM builds it there).
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    conv, temporal = spec.shapes
    sd = dataclasses.replace(spec, shapes=((conv[1], conv[0]), temporal))
    assert all(c.tp_split is None for c in traits_of(sd).components)
    request_cleanup()


KERNEL_CASES = [
    # (state group?, window group?, remote kernel blocks per block, logical ids), as
    # vLLM's test_logical_to_kernel_block_ids_with_remote_ratio (ids homo_tp and
    # qwen35_4p2d: the same call; qwen35_2p4d; mamba_remote_physical_per_logical_1;
    # pure_fa; fa_swa) and test_read_blocks_for_req_expands_remote_ids[mamba_fa_ssm]
    # (the last): a state group's ids stay, every other group's block b becomes
    # b * ratio ... b * ratio + ratio - 1.
    (True, False, 10, ([0], [10]), [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10]]),
    (True, False, 6, ([0, 1], [10]), [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [10]]),
    (True, False, 1, ([0, 1, 2], [5]), [[0, 1, 2], [5]]),
    (False, False, 4, ([0, 1],), [[0, 1, 2, 3, 4, 5, 6, 7]]),
    (False, True, 3, ([0, 1], [2, 3]), [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
    (True, False, 34, ([5, 6], [2]), [list(range(170, 238)), [2]]),
]


def _kernel_config(state: bool, window: bool, spec_state: KVCacheSpec | None = None) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    groups = [layouts.group(["model.layers.0.attn"], full(1))]
    if window:
        swa = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=F32, sliding_window=64
        )
        groups.append(layouts.group(["model.layers.1.swa"], swa))
    if state:
        mamba = spec_state or MambaSpec(
            block_size=BLOCK, shapes=((16,), (16,)), dtypes=(torch.float16, torch.float16)
        )
        groups.append(layouts.group(["model.layers.1.mamba"], mamba))
    return layouts.kv_cache_config(groups, NB, LAYOUT)


@pytest.mark.parametrize(("state", "window", "ratio", "logical", "expected"), KERNEL_CASES)
def test_kernel_block_ids_follow_the_group_kinds_as_upstream(
    state: bool, window: bool, ratio: int, logical: tuple[list[int], ...], expected: Any
) -> None:
    """The worker's manager-to-kernel block ids, its group kinds from traits, are
    upstream's (vLLM's own cases: the expected ids hand-written in its test) on a
    well-formed config. vLLM's own test builds its state group as
    ``MambaSpec(shapes=((16,), (16,)), dtypes=(float16,))``, one dtype for two states,
    whose ``page_size_bytes`` counts the first state only: ours refuses it by name
    (the conformance pass lists those four tests), as its scheduler does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvspec_traits import InvalidSpecError

    config = _kernel_config(state, window)
    results = []
    for cls in (NixlPullConnectorWorker, TraitsNixlConnectorWorker):
        worker = object.__new__(cls)
        worker._physical_blocks_per_logical_kv_block = 2
        worker.kv_cache_config = config
        results.append([list(g) for g in worker._logical_to_kernel_block_ids(logical, ratio)])
    upstream, ours = results
    assert ours == upstream == expected

    if state:
        bad = MambaSpec(block_size=BLOCK, shapes=((16,), (16,)), dtypes=(torch.float16,))
        worker = object.__new__(TraitsNixlConnectorWorker)
        worker.kv_cache_config = _kernel_config(state, window, bad)
        with pytest.raises(InvalidSpecError, match="dtypes"):
            worker._logical_to_kernel_block_ids(logical, max(ratio, 2))


def test_vllms_one_dtype_state_fixture_is_refused_at_worker_construction(
    distributed: None, tiny_models: pathlib.Path
) -> None:
    """vLLM's kv_connector test fixture ``MambaSpec(shapes=((16,), (16,)),
    dtypes=(float16,))`` (``utils.make_kv_cache_config``): its ``page_size_bytes``
    zips shapes with dtypes and is 32 B (16 x 2 B, the first state only) for a state of
    two 16-element tensors. A worker built over it is refused at construction, before
    any NIXL agent exists, naming the field; so no read of it ever reaches
    ``_logical_to_kernel_block_ids``, which vLLM's tests call on a worker built with
    ``object.__new__`` (the conformance pass lists those four)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvspec_traits import InvalidSpecError

    bad = MambaSpec(block_size=BLOCK, shapes=((16,), (16,)), dtypes=(torch.float16,))
    assert bad.page_size_bytes == 16 * 2  # vLLM's own page math: one state of two
    vllm_config = _vllm_config(tiny_models / LLAMA, LAYOUT, None)
    vllm_config.cache_config.block_size = BLOCK
    built: list[Any] = []
    with (
        set_current_vllm_config(vllm_config),
        patch.object(base_worker, "NixlWrapper", side_effect=built.append),
        pytest.raises(InvalidSpecError, match="dtypes"),
    ):
        TraitsNixlConnectorWorker(vllm_config, "d", _kernel_config(True, False, bad))
    assert built == []  # no agent was made
