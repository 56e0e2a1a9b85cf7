"""A prefill/decode pair whose KV layouts differ is refused at the NIXL handshake.

In its own module so the pairs of test_pd_serving.py (module-scoped) are stopped before
this one starts: never two server pairs at once on the 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.pd_harness import (
    RequestFailedError,
    complete,
    connector_config,
    disaggregated_complete,
    metric_total,
    running_pair,
    scrape_metrics,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm032_only]

MODULE = "kvspec_traits.vllm_connector"
CONNECTOR = "TraitsNixlConnector"


@pytest.mark.timeout(600)
def test_mismatched_pair_is_refused_at_handshake(tiny_models: Path, tmp_path: Path) -> None:
    """A decode server whose KV head size differs (llama-hd16) must not accept the
    producer's blocks: the handshake fails with the named diff, the request fails
    with an error status (no HTTP 200 with garbage), and nothing is transferred.

    vLLM's compatibility hash (checked first, as upstream orders the handshake) would
    already refuse this pair, since the model paths differ; the decode side turns it
    off (``enforce_handshake_compat``: false), so the traits fingerprint, checked after
    the agent metadata is decoded, is what must refuse it."""
    with running_pair(
        prefill_model=tiny_models / "llama",
        decode_model=tiny_models / "llama-hd16",
        served_model_name="tiny",
        workdir=tmp_path,
        prefill_kv=connector_config("kv_producer", CONNECTOR, MODULE),
        decode_kv=connector_config(
            "kv_consumer", CONNECTOR, kv_connector_extra_config={"enforce_handshake_compat": False}
        ),
    ) as servers:
        complete(servers.prefill, "warm up", 2)
        before = scrape_metrics(servers.decode)
        with pytest.raises(RequestFailedError) as failed:
            disaggregated_complete(servers, "hello world, once upon a time", 24)
        after = scrape_metrics(servers.decode)
        log = servers.decode.log_tail(4000)

    # kv_load_failure_policy "fail" (the default): the request ends in an error.
    assert failed.value.status == 500
    assert "KV layout handshake refused" in log, log[-4000:]
    refusal = next(line for line in log.splitlines() if "KV layout handshake refused" in line)
    # The diff names the region, its layers and the traits that differ, with both values.
    assert "model.layers.0.self_attn.attn" in refusal, refusal
    # Decode (local) pages: 2 KV heads x 16 x K,V x float32 x 128 tokens; prefill: x 32.
    assert "block_len: local=32768 remote=65536" in refusal, refusal
    # vLLM's hash check was off: the refusal above is the fingerprint's.
    assert "compatibility hash mismatch" not in log
    assert metric_total(after, "vllm:nixl_bytes_transferred_sum") == metric_total(
        before, "vllm:nixl_bytes_transferred_sum"
    )
