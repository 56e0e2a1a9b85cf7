"""Different block sizes on prefill and decode through ``TraitsNixlConnectorWorker``
(issue 48): real NIXL agents, vLLM's own request path (handshake, ``start_load_kv``,
``get_finished``), the reads planned by ``kvspec_traits.transfer.block_reads``.
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

from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA
from tests.nixl_helpers.receive import receive, serving
from tests.test_block_ratio import LAYOUT, MODELS, NB, _rank, _request_ids, _truth, _write_request
from tests.test_connector_differential import _construct, _vllm_config, distributed

pytestmark = [pytest.mark.timeout(300)]

__all__ = ["distributed"]  # a fixture, imported for its name


@pytest.fixture
def rank_worker(
    distributed: None, tiny_models: pathlib.Path
) -> Iterator[Callable[..., tuple[Any, dict[str, torch.Tensor]]]]:
    """``rank_worker(name, engine, tp, rank, block)``: our worker as TP rank ``rank`` of
    ``tp`` of model ``name`` (test_block_ratio's MODELS) at ``block`` tokens a block, its
    caches (zeros) registered."""
    made: list[Any] = []

    def _make(
        name: str, engine: str, tp: int, rank: int, block: int
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        model = MODELS[name]
        vllm_config = _vllm_config(tiny_models / LLAMA, LAYOUT, None)
        vllm_config.parallel_config.tensor_parallel_size = tp
        vllm_config.cache_config.block_size = block
        if model.kv_heads is not None:
            vllm_config.model_config.model_arch_config.total_num_kv_heads = model.kv_heads
        config = layouts.kv_cache_config(model.groups(tp, block), NB, LAYOUT)
        caches = layouts.allocate(config, LAYOUT)
        with (
            set_current_vllm_config(vllm_config),
            patch.object(base_worker, "get_tensor_model_parallel_rank", return_value=rank),
            patch.object(base_worker, "get_tensor_model_parallel_world_size", return_value=tp),
        ):
            worker = _construct(lambda: TraitsNixlConnectorWorker(vllm_config, engine, config))
            made.append(worker)
            worker.register_kv_caches(caches)
        return worker, caches

    yield _make
    for worker in made:
        worker.shutdown()


def move(
    rank_worker: Callable[..., tuple[Any, dict[str, torch.Tensor]]],
    name: str, p_tp: int, d_tp: int, p_block: int, d_block: int,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One request of test_block_ratio's TOKENS tokens from prefill to decode: per decode
    rank, (its whole allocation after the read, its share computed by hand)."""
    truth = _truth(name)
    groups = len(MODELS[name].groups(1, p_block))
    p_ids, d_ids = _request_ids(groups, p_block), _request_ids(groups, d_block)
    producers = []
    for rank in range(p_tp):
        worker, caches = rank_worker(name, "prefill", p_tp, rank, p_block)
        p = _rank(name, p_tp, rank, p_block)
        layouts.fill_pattern(caches, 7 + rank)
        _write_request(type(p)(p.config, caches, p.plan), truth, p_tp, rank, p_block, p_ids)
        producers.append(worker)
    out = {}
    with serving(producers) as port:
        for rank in range(d_tp):
            consumer, caches = rank_worker(name, f"decode-{rank}", d_tp, rank, d_block)
            receive(consumer, port=port, local=d_ids, remote=p_ids, remote_tp=p_tp)
            want = _rank(name, d_tp, rank, d_block)
            _write_request(want, truth, d_tp, rank, d_block, d_ids)
            out[rank] = (layouts.backing(caches).clone(), want.raw)
            consumer.shutdown()
    return out


RATIOS = [(32, 64), (64, 32), (32, 128), (128, 32)]  # (prefill tokens a block, decode)
TP = [(1, 1), (2, 1), (1, 2)]
CELLS = [(name, p, d, bp, bd) for name in MODELS for p, d in TP for bp, bd in RATIOS]


@pytest.mark.parametrize(
    ("name", "p_tp", "d_tp", "p_block", "d_block"),
    CELLS,
    ids=[f"{n}-P{p}D{d}-{bp}to{bd}" for n, p, d, bp, bd in CELLS],
)
def test_a_block_size_ratio_moves_each_token_to_its_row(
    rank_worker: Callable[..., Any], name: str, p_tp: int, d_tp: int, p_block: int, d_block: int
) -> None:
    for rank, (got, want) in move(rank_worker, name, p_tp, d_tp, p_block, d_block).items():
        assert torch.equal(got, want), (rank, int((got != want).sum()))
