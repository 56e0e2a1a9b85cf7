"""Prefill and decode at different block sizes on real vLLM-CPU servers (issue 48): the
tiny Llama, prefill at ``--block-size 128`` and decode at 256, and the reverse.
``TraitsNixlConnector`` in pull mode on both sides: the decode server reads with the
connector's descriptors planned by ``transfer.block_reads`` with the head slot as
vLLM-CPU's attention kernel keeps it (K transposed, ``[head_size, tokens]``, then V
``[tokens, head_size]``: each of K's rows of a 256-token block holds two 128-token
blocks' runs; read as token rows instead, every answer here was wrong). Every answer
token-exact against the prefill server
serving the same prompt without disaggregation (the block size itself changes no token),
no failed transfer, bytes moved wherever the decode server lacked the prompt's KV, and
the decode server's later plain requests stay exact (no poisoned prefix cache: issue 48
saw upstream's connector keep corrupted KV there).

Two server pairs, about a minute each to start on two cores: ``make conformance``
(marker ``block_ratio``), not ``make test``.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import pytest

from kvspec_traits.vllm_connector import CONNECTOR_NAME
from tests.e2e import pd_harness as h
from tests.e2e.test_pd_serving import MAX_TOKENS, MODULE, PROMPTS

pytestmark = [pytest.mark.block_ratio, pytest.mark.vllm032_only, pytest.mark.timeout(900)]

MODEL = "llama"
BLOCKS = [(128, 256), (256, 128)]  # (prefill tokens a block, decode)


def _serving(block: int) -> h.Serving:
    serving = h.DEFAULT_SERVING
    return h.Serving(
        backend=serving.backend,
        dtype=serving.dtype,
        flags=(*serving.flags, "--block-size", str(block)),
    )


@pytest.fixture(scope="module", params=BLOCKS, ids=[f"{p}to{d}" for p, d in BLOCKS])
def pair(
    request: pytest.FixtureRequest,
    tiny_models: pathlib.Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[h.ServerPair]:
    p_block, d_block = request.param
    workdir = tmp_path_factory.mktemp(f"block-ratio-{p_block}-{d_block}")

    def server(name: str, role: str, core: int, block: int) -> h.VllmServer:
        return h.VllmServer(
            name=name,
            model=tiny_models / MODEL,
            served_model_name=MODEL,
            core=core,
            workdir=workdir,
            serving=_serving(block),
            kv_transfer_config=h.connector_config(role, CONNECTOR_NAME, MODULE),
        )

    servers = h.ServerPair(
        prefill=server("prefill", "kv_producer", 0, p_block),
        decode=server("decode", "kv_consumer", 1, d_block),
    )
    with h._machine_wide_pair_lock():
        try:
            for s in servers.servers():
                s.start()
            deadline = time.monotonic() + h.START_TIMEOUT_S
            for s in servers.servers():
                s.wait_ready(deadline)
            yield servers
        finally:
            for s in servers.servers():
                s.stop()


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_different_block_sizes_are_token_exact(pair: h.ServerPair, prompt_name: str) -> None:
    prompt = PROMPTS[prompt_name]
    expected = h.complete(pair.prefill, prompt, MAX_TOKENS)["choices"][0]["text"]
    before = h.scrape_metrics(pair.decode)
    got = h.disaggregated_complete(pair, prompt, MAX_TOKENS)
    prompt_tokens = int(got.decode_response["usage"]["prompt_tokens"])
    after = h.scrape_metrics(pair.decode)

    def delta(name: str) -> float:
        return h.metric_total(after, name) - h.metric_total(before, name)

    deadline = time.monotonic() + 10
    while (
        delta("vllm:prefix_cache_hits_total") < prompt_tokens
        and delta("vllm:nixl_bytes_transferred_sum") == 0
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)  # the decode side's stats reach /metrics after the request
        after = h.scrape_metrics(pair.decode)

    assert got.text == expected, (prompt_name, got.text, expected)
    assert delta("vllm:nixl_num_failed_transfers_total") == 0
    if delta("vllm:prefix_cache_hits_total") < prompt_tokens:
        assert delta("vllm:nixl_bytes_transferred_sum") > 0, prompt_name
    # The decode server itself, asked plainly afterwards, answers as the single server.
    plain = h.complete(pair.decode, prompt, MAX_TOKENS)["choices"][0]["text"]
    assert plain == expected, (prompt_name, plain, expected)
