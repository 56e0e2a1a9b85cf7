"""Push mode (``TraitsNixlPushConnector``): the prefill side WRITEs its blocks into the
decode side's, through vLLM's own push path, with real NIXL agents and real bytes.

Both sides are ``TraitsNixlPushConnectorWorker`` (vLLM's push worker over the pull
worker's traits half) over vLLM's kernel-block views (tests/test_connector_kernel_blocks.py:
manager block 64, kernel block 16, so the WRITE descriptors are computed in kernel
blocks from the planned regions), each serving its handshake on vLLM's side-channel
listener. The request goes as in a server: the decode worker gets the request to receive
and its block registration (what the push scheduler stages), sends it to the prefill side
as a ``PUSH_REG`` NIXL notification after its handshake with it; the prefill worker gets
the request's finished blocks, matches them with the registration, handshakes with the
decode side and WRITEs; the decode worker counts the completion notification.
Runs on every series (0.32, 0.33, 0.34 modules).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any
from unittest.mock import MagicMock, patch

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)

from kvspec_traits.transfer import HandshakeMismatchError
from kvspec_traits.vllm_connector._connector import TraitsWorkerBase
from kvspec_traits.vllm_connector._push import TraitsNixlPushConnectorWorker
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA, Family
from tests.test_connector_differential import F32, LBHNC, _serve_handshake, distributed
from tests.test_connector_kernel_blocks import (
    BLOCK,
    FAMILIES,
    assert_moved_exactly,
    make,
    request_blocks,
)

pytestmark = pytest.mark.timeout(600)
__all__ = ["distributed", "make"]  # fixtures, imported for their names

REQ = "cmpl-push-0"


def _registration(
    consumer: Any,
    d_port: int,
    p_port: int,
    producer: Any,
    blocks: tuple[list[int], ...],
    pp_size: int = 1,
) -> dict[str, Any]:
    """The decode side's block registration, with the fields vLLM's push scheduler
    stages in ``update_state_after_alloc`` (push_scheduler.py; ``remote_pp_size`` is the
    prefill engine's PP size, from its ``kv_transfer_params``)."""
    return {
        "request_id": REQ,
        "decode_engine_id": consumer.engine_id,
        "decode_host": "127.0.0.1",
        "decode_port": d_port,
        "decode_tp_size": 1,
        "local_block_ids": blocks,
        "remote_engine_id": producer.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p_port,
        "remote_tp_size": 1,
        "remote_pp_size": pp_size,
    }


def _push(
    producer: Any,
    consumer: Any,
    local: tuple[list[int], ...],
    remote: tuple[list[int], ...],
    *,
    timeout: float = 120,
) -> tuple[set[str], set[str]]:
    """One request through vLLM's push path; (prefill done_sending, decode done_recving)
    once the decode side reports it, or when ``timeout`` passes. ``producer`` may be a
    tuple of the prefill engine's pipeline stages (rank order): each is served at its
    PP rank, each gets the request's blocks and writes its layers, and the request is
    sent when every stage reports it."""
    stages: tuple[Any, ...] = producer if isinstance(producer, tuple) else (producer,)
    p_port, stop_p = _serve_handshake(stages[0], stages=stages)
    d_port, stop_d = _serve_handshake(consumer)
    try:
        for stage in stages:
            p_meta = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
            p_meta.reqs_in_batch.add(REQ)
            p_meta.reqs_to_send[REQ] = time.perf_counter() + 600
            p_meta.push_finished_blocks[REQ] = remote
            stage.start_load_kv(p_meta)

        d_meta = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
        d_meta.add_new_req_to_recv(
            request_id=REQ,
            local_block_ids=local,
            kv_transfer_params={
                "remote_block_ids": (),  # push: the decode side does not know them
                "remote_engine_id": stages[0].engine_id,
                "remote_request_id": REQ,
                "remote_host": "127.0.0.1",
                "remote_port": p_port,
                "tp_size": 1,
                "pp_size": len(stages),
            },
        )
        d_meta.push_registrations[REQ] = _registration(
            consumer, d_port, p_port, stages[0], local, len(stages)
        )
        consumer.start_load_kv(d_meta)

        sent: list[set[str]] = [set() for _ in stages]
        received: set[str] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and REQ not in received:
            # Each engine step's get_finished wakes the writer threads to drain notifs.
            for done, stage in zip(sent, stages, strict=True):
                done |= stage.get_finished()[0]
            received |= consumer.get_finished()[1]
            time.sleep(0.02)
        for done, stage in zip(sent, stages, strict=True):
            done |= stage.get_finished()[0]
        return set.intersection(*sent), received
    finally:
        stop_p.set()
        stop_d.set()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_push_writes_exactly_the_producers_blocks(family: str, make: Callable[..., Any]) -> None:
    """Attention, MLA and MLA + 2 x KDA state: the decode side's blocks hold the
    prefill side's blocks byte for byte after the WRITE, no other byte of the decode
    side changed, and both sides report the request done."""
    producer, p_caches = make(family, TraitsNixlPushConnectorWorker, "producer")
    consumer, d_caches = make(family, TraitsNixlPushConnectorWorker, "consumer")
    assert producer.region_plan is not None and consumer.region_plan is not None
    assert producer._TRANSFER_MODE == "push"  # vLLM's compatibility hash names the mode
    layouts.fill_pattern(p_caches, seed=11)
    before = layouts.backing(d_caches).clone()
    groups = FAMILIES[family].groups(1)
    local, remote = request_blocks(groups)
    sent, received = _push(producer, consumer, local, remote)
    assert REQ in received and REQ in sent
    assert consumer.get_block_ids_with_load_errors() == set()
    assert_moved_exactly(groups, local, remote, p_caches, d_caches, before)


# The attention family with KV head size 64 instead of 32: vLLM's compatibility hash
# (model, dtype, head count, backend) is the same, the pages are twice as long.
WIDE_HEADS = Family(
    lambda tp: layouts.llama_gqa(
        tp, layers=2, block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=F32
    ),
    LBHNC,
    LLAMA,
)


def test_decode_side_refuses_a_producer_of_another_layout_and_nothing_is_written(
    make: Callable[..., Any],
) -> None:
    """The decode side handshakes with the prefill side before it sends its block
    registration: on a layout mismatch it never sends it, so the prefill side has no
    blocks to write to, and the request fails on the decode side (vLLM's failed-receive
    path) with the decode cache untouched. Before the fingerprint check the pair's
    pages differ (32 vs 64 B per head and token) and vLLM's hash does not see it."""
    producer, p_caches = make(WIDE_HEADS, TraitsNixlPushConnectorWorker, "producer")
    consumer, d_caches = make("attention", TraitsNixlPushConnectorWorker, "consumer")
    layouts.fill_pattern(p_caches, seed=3)
    before = layouts.backing(d_caches).clone()
    failures: list[dict[str, Any]] = []
    log = consumer._log_failure

    def record(**kw: Any) -> None:
        failures.append(kw)
        log(**kw)

    groups = FAMILIES["attention"].groups(1)
    local, remote = request_blocks(groups)
    with patch.object(consumer, "_log_failure", side_effect=record):
        sent, _ = _push(producer, consumer, local, remote, timeout=20)
    assert REQ not in sent
    refused = [f for f in failures if f["failure_type"] == "push_reg_handshake_failed"]
    assert refused and isinstance(refused[0]["error"], HandshakeMismatchError)
    assert "block_len" in str(refused[0]["error"])
    assert torch.equal(layouts.backing(d_caches), before)


def test_prefill_side_refuses_a_consumer_of_another_layout_before_writing(
    make: Callable[..., Any],
) -> None:
    """The prefill side handshakes with the decode side named in the registration
    before its first WRITE: a consumer of another layout is refused there (vLLM logs
    ``handshake_setup_failed``, then ``push_handshake_failed``), and not one byte of the
    consumer's cache changes. The registration is handed to the prefill worker as its
    writer thread would have received it, so the consumer's own check (the test above)
    does not come first."""
    producer, p_caches = make("attention", TraitsNixlPushConnectorWorker, "producer")
    consumer, d_caches = make(WIDE_HEADS, TraitsNixlPushConnectorWorker, "consumer")
    layouts.fill_pattern(p_caches, seed=5)
    before = layouts.backing(d_caches).clone()
    groups = FAMILIES["attention"].groups(1)
    local, remote = request_blocks(groups)
    failures: list[dict[str, Any]] = []
    refused = threading.Event()
    log = producer._log_failure

    def record(**kw: Any) -> None:
        failures.append(kw)
        log(**kw)
        if kw["failure_type"] == "push_handshake_failed":  # after vLLM's handshake's own
            refused.set()

    d_port, stop_d = _serve_handshake(consumer)
    try:
        with patch.object(producer, "_log_failure", side_effect=record):
            producer._pending_d_registrations[REQ] = _registration(
                consumer, d_port, 1, producer, local
            )
            p_meta = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
            p_meta.push_finished_blocks[REQ] = remote
            producer.start_load_kv(p_meta)
            assert refused.wait(60), "the prefill side did not refuse the consumer"
    finally:
        stop_d.set()
    # vLLM's handshake logs the refusal, then the push worker drops the request's WRITE.
    assert [f["failure_type"] for f in failures] == [
        "handshake_setup_failed",
        "push_handshake_failed",
    ]
    assert all(isinstance(f["error"], HandshakeMismatchError) for f in failures)
    assert not producer._sending_transfers  # no WRITE was posted
    assert torch.equal(layouts.backing(d_caches), before)


# -- the conformance pass's four expected differences (vLLM's push tests that patch
#    ``NixlPushConnectorWorker.__mro__[1]``) -------------------------------------------------


def _bare_push_worker(cls: type[NixlPushConnectorWorker]) -> NixlPushConnectorWorker:
    """A push worker built as vLLM's tests build it (``object.__new__``, the state
    ``get_transfer_results`` reads)."""
    import queue
    from collections import defaultdict

    w = object.__new__(cls)
    w._push_writer_wake = threading.Event()
    w._sending_transfers = defaultdict(list)
    w._sending_transfers_lock = threading.Lock()
    w._send_failures = set()
    w._evict_finished_inbox = queue.Queue()
    w._reqs_to_send = {}
    w._reqs_to_process = set()
    w.consumer_notification_counts_by_req = defaultdict(int)
    return w


def _evicted(w: NixlPushConnectorWorker) -> set[str]:
    out: set[str] = set()
    while not w._evict_finished_inbox.empty():
        out.add(w._evict_finished_inbox.get_nowait())
    return out


class _UpstreamSubclass(NixlPushConnectorWorker):
    """Upstream's push worker, subclassed and nothing else."""


@pytest.mark.parametrize("cls", [NixlPushConnectorWorker, TraitsNixlPushConnectorWorker])
def test_push_completions_evict_writer_state_as_upstream(
    cls: type[NixlPushConnectorWorker],
) -> None:
    """What vLLM's ``test_get_transfer_results_*`` / ``test_empty_transfer_results_*`` /
    ``test_failed_push_transfer_*`` check, with the base worker's completions stubbed
    where they come from (``NixlBaseConnectorWorker``): our push worker enqueues one
    eviction per finished request and wakes its writer exactly as upstream's does."""
    w = _bare_push_worker(cls)
    done = KVConnectorTransferResults(finished_sending={"req-1", "req-2", "req-3"})
    with patch.object(NixlBaseConnectorWorker, "get_transfer_results", return_value=done):
        results = w.get_transfer_results()
    assert results.finished_sending == {"req-1", "req-2", "req-3"}
    assert _evicted(w) == {"req-1", "req-2", "req-3"}
    assert w._push_writer_wake.is_set()
    w._push_writer_wake.clear()
    with patch.object(
        NixlBaseConnectorWorker, "get_transfer_results", return_value=KVConnectorTransferResults()
    ):
        assert w.get_transfer_results().finished_sending == set()
    assert _evicted(w) == set() and w._push_writer_wake.is_set()
    # A failed WRITE: its handle released, the request finished (not sent) and no
    # eviction, as vLLM's test_failed_push_transfer_does_not_evict_writer_state checks.
    w.nixl_wrapper = MagicMock()
    w.nixl_wrapper.check_xfer_state.return_value = "ERR"
    w.xfer_stats = MagicMock()
    w._log_failure = MagicMock()  # type: ignore[method-assign]
    w._sending_transfers["req-failed"] = [17]
    w._reqs_to_send["req-failed"] = time.perf_counter() + 30
    w._reqs_to_process.add("req-failed")
    with patch.object(
        NixlBaseConnectorWorker, "get_transfer_results", return_value=KVConnectorTransferResults()
    ):
        assert w.get_transfer_results().finished_sending == set()
    assert "req-failed" not in w._sending_transfers
    w.nixl_wrapper.release_xfer_handle.assert_called_once_with(17)
    assert _evicted(w) == set()


@pytest.mark.parametrize("cls", [_UpstreamSubclass, TraitsNixlPushConnectorWorker])
def test_vllms_mro_patch_replaces_the_method_under_test_in_any_subclass(
    cls: type[NixlPushConnectorWorker],
) -> None:
    """Why those four of vLLM's tests cannot pass with any subclass bound: they stub the
    base's completions at ``NixlPushConnectorWorker.__mro__[1]``, assuming the class under
    test derives directly from the base worker. For a subclass, ``__mro__[1]`` is
    upstream's push worker itself (ours: the seam's push worker over it), so the patch
    replaces the very ``get_transfer_results`` under test and nothing is evicted: a
    subclass that adds nothing fails exactly as ours does."""
    assert cls.__mro__[1] is not NixlBaseConnectorWorker
    assert issubclass(cls.__mro__[1], NixlPushConnectorWorker)
    assert issubclass(TraitsNixlPushConnectorWorker, TraitsWorkerBase)
    w = _bare_push_worker(cls)
    done = KVConnectorTransferResults(finished_sending={"req-done"})
    with patch.object(cls.__mro__[1], "get_transfer_results", return_value=done):
        w.get_transfer_results()
    assert _evicted(w) == set()  # the eviction upstream's test expects never ran


def test_upstreams_own_peer_checks_come_before_the_fingerprint(make: Callable[..., Any]) -> None:
    """vLLM 0.34's push worker refuses a peer of another kernel block size after its
    super() call; ours runs it before the traits check, so a pair upstream refuses is
    refused with upstream's error, as upstream's own push worker answers on the same
    metadata (0.32/0.33 have no such check: both accept it). Before the ordering, ours
    answered the fingerprint's RuntimeError or mismatch first (vLLM 0.34's
    test_push_handshake_rejects_different_block_sizes)."""
    import dataclasses

    import msgspec

    from kvspec_traits.vllm_connector._handshake import TraitsNixlAgentMetadata

    ours, _ = make("attention", TraitsNixlPushConnectorWorker, "ours")
    upstream, _ = make("attention", NixlPushConnectorWorker, "upstream")
    same = msgspec.msgpack.decode(
        ours.xfer_handshake_metadata.agent_metadata_bytes, type=TraitsNixlAgentMetadata
    )
    assert _answer(ours, same) == _answer(upstream, same) == "accepted"
    other_kernel = dataclasses.replace(same, block_size=ours.block_size // 2)
    expected = _answer(upstream, other_kernel)
    assert expected in ("accepted", "NotImplementedError")  # 0.32/0.33, 0.34
    assert _answer(ours, other_kernel) == expected
    # The fingerprint is still checked, after upstream's checks: a peer both would
    # refuse gets upstream's answer where upstream has one (before the ordering, the
    # traits refusal came first on 0.34).
    assert ours.traits_fingerprint is not None
    foreign = dataclasses.replace(same, kvspec_traits_fingerprint=b"{}")
    assert _answer(ours, foreign) == "MalformedMetadataError"
    both = dataclasses.replace(foreign, block_size=ours.block_size // 2)
    assert _answer(ours, both) == (
        "NotImplementedError" if expected == "NotImplementedError" else "MalformedMetadataError"
    )


def _answer(worker: Any, metadata: Any) -> str:
    try:
        worker._validate_remote_parallel_config(metadata)
    except Exception as err:
        return type(err).__name__
    return "accepted"
