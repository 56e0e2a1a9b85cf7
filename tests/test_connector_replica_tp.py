"""Fewer KV heads than TP ranks through ``TraitsNixlConnectorWorker`` (issue 47): real
NIXL agents, vLLM's own request path (handshake, ``start_load_kv``, ``get_finished``).

vLLM builds a rank's attention spec with ``max(1, H // tp)`` KV heads and no
``max_tp_shards`` (``Attention.get_kv_cache_spec``), so one head of one at TP 2 and one
head of two at TP 2 are the same spec; the model's total (``get_total_num_kv_heads``,
what vLLM's ``TransferTopology`` reads) is what tells them apart. The connector now plans
with it (``plan_regions(total_kv_heads=...)``): the fingerprint agrees across TP sizes,
and a consumer with more ranks than the producer reads each head from the rank holding
it. Each consumer rank's whole allocation is compared with its share computed by hand:
rank ``r`` of TP ``t`` holds head ``r // (t / H)`` when ``H < t`` (vLLM's
``num_kv_head_replicas``), heads ``[r H/t, (r+1) H/t)`` otherwise; requested blocks hold
that share of the producer's truth, every other byte stays zero.

A producer of more ranks than the consumer whose ranks hold replicas moves too (vLLM's
handshake validation asserted the pair away; the connector's topology answers that the
consumer gathers, ``_seam.gathering_topology``). Every cell is read by the connector's
planned reads (``_tp_peer``: the planner's ``tp_reads``, each head from the first rank
holding it), never by vLLM's descriptor path (``receive(planned=True)`` fails it).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import _families as families
from kvspec_traits.vllm_connector import VllmHandshakeRefusalError
from kvspec_traits.vllm_connector._connector import TraitsNixlAgentMetadata
from tests.nixl_helpers import layouts
from tests.nixl_helpers.receive import receive, serving
from tests.test_connector_differential import distributed, llama_rank_worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

__all__ = ["distributed"]  # a fixture, imported for its name

NB = 6
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
REMOTE_BLOCKS, LOCAL_BLOCKS = [2, 5], [4, 1]
LAYOUT = KVCacheLayout.LBHNC


def _groups(kv_heads: int, tp: int) -> list[Any]:
    # CPU attention's kernel blocks are multiples of 32 (the worker checks its block).
    spec = families.llama_gqa(block_size=32, num_kv_heads=kv_heads, head_size=64, tp=tp)
    return [layouts.group(LAYERS, spec)]


@pytest.fixture
def rank_worker(
    distributed: None, tiny_models: pathlib.Path
) -> Iterator[Callable[..., tuple[Any, dict[str, torch.Tensor]]]]:
    """``rank_worker(kv_heads, engine, tp, rank)``: our worker as TP rank ``rank`` of
    ``tp`` of a model with ``kv_heads`` KV heads, its caches registered."""
    made: list[Any] = []

    make = llama_rank_worker(tiny_models, made, NB, LAYOUT)

    def _make(
        kv_heads: int, engine: str, tp: int, rank: int
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        return make(_groups(kv_heads, tp), engine, tp, rank, 32, kv_heads)

    yield _make
    for worker in made:
        worker.shutdown()


def _truth(kv_heads: int) -> dict[str, torch.Tensor]:
    config = layouts.kv_cache_config(_groups(kv_heads, 1), NB, LAYOUT)
    caches = layouts.allocate(config, LAYOUT)
    layouts.fill_pattern(caches, 47)
    return caches


def _share(truth: torch.Tensor, kv_heads: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s heads (dimension 1 of a ``[blocks, heads, tokens, K|V]`` view)."""
    heads = max(1, kv_heads // tp)
    first = rank * heads if kv_heads >= tp else rank // (tp // kv_heads)
    return truth[:, first : first + heads]


CELLS = [(1, 1, 2), (2, 1, 4), (2, 2, 4), (1, 1, 4), (1, 2, 1), (2, 4, 1), (2, 4, 2)]
"""(KV heads, producer TP, consumer TP): every consumer rank reads each of its heads from
the producer rank that holds it (upstream moves the first four; it asserts on the last
three, a producer of replicas with more ranks than the consumer)."""


@pytest.mark.parametrize(("kv_heads", "producer_tp", "consumer_tp"), CELLS)
def test_a_consumer_of_more_ranks_reads_each_replica_exactly(
    kv_heads: int, producer_tp: int, consumer_tp: int, rank_worker: Callable[..., Any]
) -> None:
    truth = _truth(kv_heads)
    producers = []
    for rank in range(producer_tp):
        worker, caches = rank_worker(kv_heads, "prefill", producer_tp, rank)
        for layer in LAYERS:
            caches[layer].copy_(_share(truth[layer], kv_heads, producer_tp, rank))
        producers.append(worker)
    with serving(producers) as port:
        for rank in range(consumer_tp):
            consumer, caches = rank_worker(kv_heads, f"decode-{rank}", consumer_tp, rank)
            receive(
                consumer, port=port, local=[LOCAL_BLOCKS], remote=[REMOTE_BLOCKS],
                remote_tp=producer_tp, planned=True,
            )  # fmt: skip
            for layer in LAYERS:
                want = torch.zeros_like(caches[layer])
                share = _share(truth[layer], kv_heads, consumer_tp, rank)
                for local, remote in zip(LOCAL_BLOCKS, REMOTE_BLOCKS, strict=True):
                    want[local] = share[remote]
                # Bytes, not values: seeded bytes hold NaNs, which compare unequal.
                assert torch.equal(caches[layer].view(torch.uint8), want.view(torch.uint8)), (
                    layer, rank,
                )  # fmt: skip
            consumer.shutdown()


def test_a_vllm_handshake_assert_on_a_peer_rank_is_a_named_refusal(
    rank_worker: Callable[..., Any],
) -> None:
    """vLLM's handshake code past the connector's checks asserts bare (here: "TP workers
    that handshake with same remote have same #blocks", a rank 1 whose block count
    differs from rank 0's); the connector raises it as ``VllmHandshakeRefusalError``
    naming the peer and rank, still an ``AssertionError`` for vLLM's callers."""
    producers = [rank_worker(2, "prefill", 2, rank)[0] for rank in range(2)]
    consumer, _ = rank_worker(2, "decode", 1, 0)
    first, second = (
        msgspec.msgpack.Decoder(TraitsNixlAgentMetadata).decode(
            p.xfer_handshake_metadata.agent_metadata_bytes
        )
        for p in producers
    )
    consumer.add_remote_agent(first, remote_tp_rank=0, remote_tp_size=2)
    bad = dataclasses.replace(second, num_blocks=second.num_blocks + 1)
    with pytest.raises(VllmHandshakeRefusalError) as refused:
        consumer.add_remote_agent(bad, remote_tp_rank=1, remote_tp_size=2)
    assert isinstance(refused.value, AssertionError)
    assert (refused.value.engine_id, refused.value.remote_rank) == ("prefill", 1)
    assert "rank 1 of peer engine prefill" in str(refused.value)
    consumer.shutdown()


def test_a_planned_read_from_an_invalidated_peer_fails_as_vllm_fails_it(
    rank_worker: Callable[..., Any],
) -> None:
    """vLLM declines a read from a peer it invalidated (its heartbeat or a read failed;
    ``_invalid_remote_engines``) and fails the request; the connector's planned reads of
    a peer of another TP size leave such a request to vLLM: it finishes failed, its
    blocks reported as load errors, none of its bytes written."""
    producer, caches = rank_worker(1, "prefill", 1, 0)
    layouts.fill_pattern(caches, 5)
    consumer, local = rank_worker(1, "decode-0", 2, 0)
    with serving([producer]) as port:
        receive(consumer, port=port, local=[[1]], remote=[[1]], remote_tp=1, planned=True)
        consumer._invalid_remote_engines.add("prefill")
        before = layouts.backing(local).clone()
        metadata = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
        metadata.add_new_req_to_recv(
            request_id="req2",
            local_block_ids=([LOCAL_BLOCKS[0]],),
            kv_transfer_params={
                "remote_block_ids": [[REMOTE_BLOCKS[0]]],
                "remote_engine_id": "prefill",
                "remote_request_id": "prefill-req2",
                "remote_host": "127.0.0.1",
                "remote_port": port,
                "tp_size": 1,
            },
        )
        consumer.start_load_kv(metadata)
        deadline = time.monotonic() + 30
        while "req2" not in consumer.get_finished()[1]:
            assert time.monotonic() < deadline, "the declined read was never reported"
            time.sleep(0.05)
    assert LOCAL_BLOCKS[0] in consumer.get_block_ids_with_load_errors()
    assert torch.equal(layouts.backing(local), before)
