"""Expired leases fail closed (``vllm_connector._lease``): a pull consumer reads a
request's blocks only while its producer still holds them.

vLLM's producer releases a prefill's blocks ``kv_lease_duration`` after the prefill,
or 2/3 of that duration after the last consumer heartbeat it handled if that is later
(``base_worker._handle_heartbeat``). Upstream's consumer reads later regardless. In
``make soak`` and in CI's short soak such reads returned released, reused blocks as
successful reads, and the answers were wrong (docs/vllm.md "Soak"). The heartbeat is a
one-way notification, so the consumer's bound is the producer's exported deadline alone.

The expected values are computed by hand from those rules. The worker tests run
vLLM's own receive path (real workers, a real handshake with its measured clock offset,
a real NIXL read, and vLLM's failure path); the scheduler tests use vLLM's own
``request_finished`` and ``build_connector_meta``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    HeartbeatInfo,
    NixlConnectorMetadata,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from kvspec_traits import KVSpecTraitsError
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from kvspec_traits.vllm_connector._lease import (
    LEASE_KEY,
    LEASES_ATTR,
    LeaseBook,
    MalformedLeaseError,
    lease_offer,
    parse_lease_offer,
)
from kvspec_traits.vllm_connector._scheduler import TraitsNixlConnectorScheduler
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA
from tests.test_connector_differential import LBHNC, _serve_handshake, _vllm_config, distributed
from tests.test_connector_kernel_blocks import FAMILIES, make

pytestmark = pytest.mark.timeout(600)
__all__ = ["distributed", "make"]  # fixtures, imported for their names

# -- the bookkeeping, by hand -----------------------------------------------------------


def test_the_bound_is_the_producers_deadline_in_the_consumers_clock() -> None:
    # The producer's deadline is 100.0 on its clock. The handshake measured
    # remote = local + 40.0, so the deadline is 60.0 locally. With margin 2.0 a read
    # at 57.9 may start (57.9 + 2 < 60), and at 58.0 it may not.
    book = LeaseBook(margin=2.0)
    book.track("r", "P", "p-r", {"expiry": 100.0, "extension": 20.0})
    assert book.bound("r", 40.0) == 60.0
    assert not book.expired("r", 40.0, now=57.9)
    assert book.expired("r", 40.0, now=58.0)


def test_lease_offer_uses_vllms_heartbeat_extension() -> None:
    # base_worker: self._lease_extension = kv_lease_duration * 2 // 3 (integer seconds).
    assert lease_offer(12.5, 30) == {"expiry": 12.5, "extension": 20.0}
    assert lease_offer(0.0, 7) == {"expiry": 0.0, "extension": 4.0}


def test_an_untracked_request_is_read_as_upstream_reads_it() -> None:
    book = LeaseBook()
    book.track("r", "P", "p-r", None)  # the producer exported no lease
    assert "r" not in book
    assert book.bound("r", 0.0) is None
    assert not book.expired("r", 0.0, now=1e12)


@pytest.mark.parametrize(
    "raw",
    [
        "soon",
        {"expiry": "100", "extension": 20},
        {"expiry": math.nan, "extension": 20},
        {"expiry": math.inf, "extension": 20},
        {"expiry": True, "extension": 20},
        {"expiry": 100.0},
        {"expiry": 100.0, "extension": -1},
    ],
    ids=["string", "str-expiry", "nan", "inf", "bool", "no-extension", "negative"],
)
def test_a_malformed_lease_is_refused_and_its_blocks_are_never_read(raw: object) -> None:
    with pytest.raises(MalformedLeaseError) as err:
        parse_lease_offer(raw)
    assert isinstance(err.value, KVSpecTraitsError)
    assert LEASE_KEY in str(err.value)
    book = LeaseBook()
    book.track("r", "P", "p-r", raw)
    assert book.bound("r", 0.0) == -math.inf
    assert book.expired("r", 0.0, now=-1e12)


def test_no_clock_offset_means_no_read() -> None:
    book = LeaseBook()
    book.track("r", "P", "p-r", {"expiry": 100.0, "extension": 20.0})
    assert book.expired("r", None, now=0.0)
    assert book.expired("r", math.nan, now=0.0)


# -- vLLM's scheduler: the producer exports its lease, the consumer hands it on ----------


@pytest.fixture(scope="module")
def scheduler_config(tiny_models: pathlib.Path) -> Any:
    return _vllm_config(tiny_models / LLAMA, LBHNC, None)


def _scheduler(vllm_config: Any, engine_id: str) -> TraitsNixlConnectorScheduler:
    groups = layouts.llama_gqa(1, layers=2, block_size=16, num_kv_heads=2, head_size=32)
    config = layouts.kv_cache_config(groups, 64, LBHNC)
    return TraitsNixlConnectorScheduler(vllm_config, engine_id, config)


def _request(req_id: str, params: dict[str, Any], tokens: int = 40) -> Request:
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(req_id, list(range(tokens)), sampling, None)


@pytest.fixture
def schedulers(scheduler_config: Any) -> Iterator[Callable[[str], TraitsNixlConnectorScheduler]]:
    made: list[TraitsNixlConnectorScheduler] = []

    def _make(engine_id: str) -> TraitsNixlConnectorScheduler:
        made.append(_scheduler(scheduler_config, engine_id))
        return made[-1]

    yield _make
    for scheduler in made:
        scheduler.shutdown()  # type: ignore[no-untyped-call]  # vLLM


def test_the_producer_exports_its_own_deadline_and_the_consumer_hands_it_on(
    schedulers: Callable[[str], TraitsNixlConnectorScheduler],
) -> None:
    producer = schedulers("producer")
    request = _request("p-req", {"do_remote_decode": True})
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = 40
    before = time.perf_counter()
    delay, params = producer.request_finished(request, ([1, 2, 3],))
    after = time.perf_counter()
    assert delay and params is not None and params["do_remote_prefill"]
    # The deadline is the one vLLM's producer keeps (perf_counter at request_finished
    # + kv_lease_duration, 30 s by default); the extension is 30 * 2 // 3.
    offer = params[LEASE_KEY]
    assert offer == {"expiry": producer._reqs_need_send["p-req"], "extension": 20.0}
    assert before + 30 <= offer["expiry"] <= after + 30

    consumer = schedulers("consumer")
    received = _request("d-req", params)
    allocated = KVCacheBlocks(blocks=([KVCacheBlock(i) for i in (7, 8, 9)],))
    consumer.update_state_after_alloc(received, allocated, 32)
    meta = consumer.build_connector_meta(_empty_output())
    assert set(meta.reqs_to_recv) == {"d-req"}
    assert getattr(meta, LEASES_ATTR) == {"d-req": offer}


def test_a_request_that_keeps_its_blocks_on_the_producer_exports_no_lease(
    schedulers: Callable[[str], TraitsNixlConnectorScheduler],
) -> None:
    # Not a prefill for a remote decode: vLLM frees the blocks at once, nothing to lease.
    producer = schedulers("producer")
    request = _request("plain", {"do_remote_decode": False, "do_remote_prefill": False})
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = producer.request_finished(request, ([1, 2, 3],))
    assert params is None or LEASE_KEY not in params


def _empty_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


# -- vLLM's worker: the receive path declines or fails what the lease no longer covers ---


def _pair(
    make: Callable[..., Any], margin: float
) -> tuple[Any, Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    def prepare(worker: Any) -> None:
        # The connector hands its worker the options it read (tests/test_connector_options.py).
        worker.options = dataclasses.replace(worker.options, lease_margin=margin)

    producer, p_caches = make("attention", TraitsNixlConnectorWorker, "producer")
    consumer, d_caches = make("attention", TraitsNixlConnectorWorker, "consumer", prepare)
    layouts.fill_pattern(p_caches, seed=11)
    return producer, consumer, p_caches, d_caches


LOCAL, REMOTE = ([4, 1], [4, 1]), [[2, 5], [2, 5]]


def _metadata(producer: Any, port: int, req_id: str, lease: object) -> NixlConnectorMetadata:
    metadata = NixlConnectorMetadata()  # type: ignore[no-untyped-call]
    groups = len(FAMILIES["attention"].groups(1))
    metadata.add_new_req_to_recv(
        request_id=req_id,
        local_block_ids=LOCAL[:groups],
        kv_transfer_params={
            "remote_block_ids": REMOTE[:groups],
            "remote_engine_id": producer.engine_id,
            "remote_request_id": f"p-{req_id}",
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": 1,
        },
    )
    setattr(metadata, LEASES_ATTR, {req_id: lease})
    return metadata


def _poll(consumer: Any, req_id: str, after: float = 0.0) -> None:
    """Steps (empty metadata) until ``req_id`` is reported done; the first poll of the
    finished read no sooner than ``after`` (perf_counter)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        consumer.start_load_kv(NixlConnectorMetadata())  # type: ignore[no-untyped-call]
        if time.perf_counter() >= after:
            _, done = consumer.get_finished()
            if req_id in done:
                return
        time.sleep(0.02)
    raise AssertionError(f"{req_id} was not reported done in 120 s")


@dataclass
class _Pair:
    producer: Any
    consumer: Any
    port: int
    p_caches: dict[str, torch.Tensor]
    d_caches: dict[str, torch.Tensor]


@contextlib.contextmanager
def _handshaken(make: Callable[..., Any], margin: float) -> Iterator[_Pair]:
    """A producer serving its handshake and a consumer (lease margin ``margin``) that has
    made it (and measured its clock offset) through a first request with a lease far
    ahead, whose read must succeed."""
    producer, consumer, p_caches, d_caches = _pair(make, margin)
    port, stop = _serve_handshake(producer)
    try:
        far = {"expiry": time.perf_counter() + 3600, "extension": 20.0}
        consumer.start_load_kv(_metadata(producer, port, "warm", far))
        _poll(consumer, "warm")
        assert consumer.get_block_ids_with_load_errors() == set()
        assert producer.engine_id in consumer._engine_clock_offset
        yield _Pair(producer, consumer, port, p_caches, d_caches)
    finally:
        stop.set()


def test_a_live_lease_reads_and_an_expired_one_reads_nothing(make: Callable[..., Any]) -> None:
    with _handshaken(make, margin=0.5) as pair:
        producer, consumer, port, d_caches = pair.producer, pair.consumer, pair.port, pair.d_caches
        # Zero the consumer's blocks, then ask for a request whose lease ran out a
        # second ago (same host: the measured offset is a few microseconds).
        for cache in d_caches.values():
            cache.zero_()
        expired = {"expiry": time.perf_counter() - 1.0, "extension": 20.0}
        consumer.start_load_kv(_metadata(producer, port, "late", expired))
        _poll(consumer, "late")
        # vLLM's failure path: the request is done, its blocks are load errors (the
        # kv_load_failure_policy recomputes them or fails the request), nothing was read.
        assert consumer.get_block_ids_with_load_errors() == set(LOCAL[0])
        assert all(int(c.count_nonzero()) == 0 for c in d_caches.values())
        assert len(consumer.xfer_stats.data["num_kv_expired_reqs"]) == 1
        # Both requests left vLLM's receive bookkeeping, and their leases with them.
        assert len(consumer._leases()) == 0


def test_a_read_that_completes_after_the_lease_counts_as_failed(make: Callable[..., Any]) -> None:
    with _handshaken(make, margin=0.2) as pair:
        producer, consumer, port = pair.producer, pair.consumer, pair.port
        # The lease holds when the read starts (now + 0.2 < now + 2.0) and has run out
        # when the consumer first sees the read done (polled from 2.5 s on).
        soon = time.perf_counter() + 2.0
        consumer.start_load_kv(
            _metadata(producer, port, "slow", {"expiry": soon, "extension": 0.0})
        )
        _poll(consumer, "slow", after=soon + 0.5)
        assert consumer.get_block_ids_with_load_errors() == set(LOCAL[0])


def test_a_heartbeat_does_not_keep_a_read_past_the_exported_deadline(
    make: Callable[..., Any],
) -> None:
    """vLLM's heartbeat is a one-way NIXL notification: the consumer learns neither that
    nor when the producer got it, and the producer extends the lease from the moment it
    handles it, after its deadline if the heartbeat was late (a link down longer than
    the lease: UCX over TCP delivers the queued heartbeats when the link returns, after
    the producer released the blocks; tests/e2e/test_pd_netns.py, 40 s). So a heartbeat
    sent in time must not move the consumer's bound: a read seen done after the exported
    deadline fails, heartbeat or not. (Before this rule the consumer raised its bound to
    the send time + the extension, here 60 s, and kept the read.)"""
    with _handshaken(make, margin=0.2) as pair:
        producer, consumer, port = pair.producer, pair.consumer, pair.port
        # The step that starts the read also sends vLLM's heartbeat for the request (a
        # real NIXL notification to the producer's agent). Deadline 2.0 s from now,
        # margin 0.2: the read starts in time (now + 0.2 < now + 2.0) and is first seen
        # done at 2.5 s, past the deadline.
        soon = time.perf_counter() + 2.0
        metadata = _metadata(producer, port, "beat", {"expiry": soon, "extension": 60.0})
        metadata.heartbeat_by_engine = {
            producer.engine_id: HeartbeatInfo(
                req_ids={"p-beat"}, host="127.0.0.1", port=port, tp_size=1
            )
        }
        drained = producer.nixl_wrapper.get_new_notifs()  # the warm-up read's
        consumer.start_load_kv(metadata)
        _poll(consumer, "beat", after=soon + 0.5)
        # The heartbeat went out (the producer's agent has it), and the read failed all
        # the same: vLLM's failure path, its blocks load errors.
        notifs = producer.nixl_wrapper.get_new_notifs()
        assert any(m.startswith(b"HB:") for msgs in notifs.values() for m in msgs), (
            drained,
            notifs,
        )
        assert consumer.get_block_ids_with_load_errors() == set(LOCAL[0])
        assert len(consumer.xfer_stats.data["num_kv_expired_reqs"]) == 1
