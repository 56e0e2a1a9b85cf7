"""The connector in vLLM's own terms (issue 50): its log lines through vLLM's logger, the
lines a worker logs once its regions are planned, and its counters through vLLM's
KV-connector stats path into the log line and the Prometheus metrics vLLM builds.

Real objects throughout: vLLM's logging configuration, real workers (a real handshake
and NIXL read, tests/test_lease.py's pair), vLLM's ``KVOutputAggregator``, its msgpack
encoding of ``SchedulerStats``, its ``KVConnectorLogging`` and ``KVConnectorProm`` with
prometheus_client's own classes on a registry of the test's. Refusals are counted in
tests/test_connector_differential.py's handshake test.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import pathlib
import re
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvspec_traits
from kvspec_traits.vllm_connector._lease import LeaseBook
from kvspec_traits.vllm_connector._log import LOGGER_NAME
from kvspec_traits.vllm_connector._observe import REFUSAL_REASONS
from kvspec_traits.vllm_connector._stats import (
    LEASES_DECLINED,
    METRIC_NAMES,
    PEERS_REFUSED,
    PLANNED_BYTES,
    TraitsNixlKVConnectorStats,
)
from tests.test_connector_differential import (
    _model_runner_triton_check_lifted,
    _serve_handshake,
    distributed,
)
from tests.test_connector_kernel_blocks import make
from tests.test_lease import _handshaken, _metadata, _poll

pytestmark = pytest.mark.timeout(600)
__all__ = ["distributed", "make"]  # fixtures, imported for their names

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


# -- every log line through vLLM's logger ---------------------------------------------------


def _logger_names() -> list[tuple[str, int, object]]:
    """(file, line, name) of every getLogger / init_logger call under src/."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("getLogger", "init_logger"):
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Name) and arg.id == "LOGGER_NAME":
                    name: object = LOGGER_NAME  # _log's own constant
                elif isinstance(arg, ast.Constant):
                    name = arg.value
                else:
                    name = ast.dump(arg) if arg is not None else None
                found.append((str(path.relative_to(SRC)), node.lineno, name))
    return found


def test_every_logger_of_the_package_is_under_vllms() -> None:
    found = _logger_names()
    # The one logger, _log's (and _handshake's vLLM init_logger of the same name).
    assert {name for _, _, name in found} == {LOGGER_NAME}, found
    assert LOGGER_NAME.startswith("vllm.")
    assert "warnings.warn" not in "".join(p.read_text() for p in SRC.rglob("*.py"))


@pytest.fixture
def vllm_records(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[logging.LogRecord]]:
    """vLLM's logging configured as a server configures it (``configure_logging``, INFO:
    its ``vllm`` logger with its handler and format, not propagating to the root, so
    pytest's caplog would not see the records), and the records that logger handles;
    the configuration undone afterwards."""
    import vllm.logger
    from vllm.config.logging import LoggingConfig

    root = logging.getLogger("vllm")
    saved = (list(root.handlers), root.level, root.propagate, logging.getLogRecordFactory())
    # Restored by monkeypatch: vLLM remembers the configuration it applied.
    monkeypatch.setattr(
        vllm.logger, "_last_configured_logging_config", vllm.logger._last_configured_logging_config
    )
    vllm.logger.configure_logging(LoggingConfig(log_level="INFO", configure_logging=True))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign, assignment]
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        root.propagate = saved[2]
        logging.setLogRecordFactory(saved[3])


def test_the_lease_warning_goes_through_vllms_logger_format_and_level(
    vllm_records: list[logging.LogRecord],
) -> None:
    vllm_logger = logging.getLogger("vllm")
    vllm_handlers = [h for h in vllm_logger.handlers if h.formatter is not None]
    assert vllm_handlers and not vllm_logger.propagate
    LeaseBook().track("req-1", "engine-a", "p-req-1", None)  # an upstream producer
    (record,) = [r for r in vllm_records if "exports no lease" in r.getMessage()]
    assert record.name == LOGGER_NAME and record.levelno == logging.WARNING
    # vLLM's format: level, a timestamp, the source file.
    line = vllm_handlers[0].format(record)
    assert re.search(r"WARNING \d\d-\d\d \d\d:\d\d:\d\d \[_lease\.py:\d+\]", line), line
    # VLLM_LOGGING_LEVEL sets the "vllm" logger's level: a level above WARNING drops it.
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        LeaseBook().track("req-2", "engine-b", "p-req-2", None)
    finally:
        vllm_logger.setLevel(level)
    assert not [r for r in vllm_records if "engine-b" in r.getMessage()]


# -- the lines a worker logs once --------------------------------------------------------


def test_a_worker_logs_its_versions_options_and_regions_once(
    make: Callable[..., Any], vllm_records: list[logging.LogRecord]
) -> None:
    import vllm

    from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker

    worker, _ = make("attention", TraitsNixlConnectorWorker, "observed")
    lines = [r.getMessage() for r in vllm_records if r.name == LOGGER_NAME]
    plan = worker.region_plan
    heads = [line for line in lines if "kvspec-traits " in line]
    assert len(heads) == 1, lines
    head = heads[0]
    assert f"kvspec-traits {kvspec_traits.__version__} on vLLM {vllm.__version__}" in head
    assert "engine observed, TP rank 0 of 1" in head
    # The options as kv_connector_extra_config JSON: every key the connector reads, the
    # defaults but the test config's progress delay (tests/test_connector_differential.py).
    given = json.loads(head.split("(kv_connector_extra_config): ", 1)[1])
    assert given == {
        "kvspec_lease_margin": 2.0,
        "kvspec_nixl_progress_delay_us": 100,
        "kvspec_require_traits_peer": False,
        "kvspec_shm_wait": "yield",
        "transfer_mode": "pull",
    }
    regions = [line for line in lines if ": region " in line]
    assert len(regions) == len(plan.regions) >= 1
    # The attention family: 2 Llama layers (a region each), 2 KV heads of 32 float32,
    # blocks of 64 tokens split into kernel blocks of 16: a kernel block of one layer is
    # K and V x 16 tokens x 2 heads x 32 x 4 bytes = 8192 bytes; TP 1: both heads here.
    assert len(plan.regions) == 2
    for line, region in zip(regions, plan.regions, strict=True):
        assert f"region {region.index} {region.name!r}: {len(region.layers)} layer(s)" in line
        assert "TP head_sharded: SPLIT, 2 head slot(s) on rank 0 of 1" in line, line
        assert f"; {2 * 16 * 2 * 32 * 4} bytes per block, {region.num_blocks} blocks, DRAM" in line


# -- the counters, recorded by real workers -----------------------------------------------


def test_a_read_records_its_planned_bytes_and_an_expired_lease_a_declined_one(
    make: Callable[..., Any],
) -> None:
    import time

    with _handshaken(make, margin=0.5) as pair:
        consumer = pair.consumer
        stats = consumer.xfer_stats
        assert isinstance(stats, TraitsNixlKVConnectorStats)
        # The warm-up read: manager blocks [4, 1] of 64 tokens, of 2 layers' K and V of
        # 2 heads x 32 float32: 2 blocks x 2 layers x 2 (K, V) x 64 x 2 x 32 x 4 bytes.
        assert stats.data[PLANNED_BYTES] == [2 * 2 * 2 * 64 * 2 * 32 * 4]
        assert LEASES_DECLINED not in stats.data  # until the first is declined
        expired = {"expiry": time.perf_counter() - 1.0, "extension": 20.0}
        consumer.start_load_kv(_metadata(pair.producer, pair.port, "late", expired))
        _poll(consumer, "late")
        stats = consumer.xfer_stats  # vLLM may have taken (clone_and_reset) the stats
        taken = stats.data[LEASES_DECLINED]
        assert taken == [1] and stats.data[PLANNED_BYTES] == [131072]  # nothing new read
        # vLLM's collection: the stats leave the worker and it starts afresh.
        sent = consumer.get_kv_connector_stats()
        assert isinstance(sent, TraitsNixlKVConnectorStats)
        assert sent.data[LEASES_DECLINED] == [1]
        assert consumer.get_kv_connector_stats() is None


# -- through vLLM's stats path -------------------------------------------------------------


def _worker_stats(refused: list[str], planned: list[int], declined: int) -> Any:
    stats = TraitsNixlKVConnectorStats()
    for reason in refused:
        stats.record_refused_peer(reason)
    for nbytes in planned:
        stats.record_planned_bytes(nbytes)
    for _ in range(declined):
        stats.record_lease_declined()
    return stats


class _Prom:
    """vLLM's KVConnectorProm with prometheus_client's classes on the test's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.types = {
            Counter: partial(Counter, registry=registry),
            Gauge: partial(Gauge, registry=registry),
            Histogram: partial(Histogram, registry=registry),
        }


def test_the_counters_reach_vllms_log_line_and_prometheus_beside_upstreams() -> None:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from kvspec_traits.vllm_connector import register_with_vllm

    register_with_vllm()  # the factory resolves the connector class by name, as vLLM does
    # Two TP ranks' stats of one step, aggregated by vLLM's executor aggregator.
    rank0 = _worker_stats(["layout_mismatch"], [131072], declined=1)
    rank1 = _worker_stats(["layout_mismatch", "no_fingerprint"], [65536], declined=0)
    outputs = [  # vLLM's empty output of its series (0.34 dropped req_id_to_index)
        dataclasses.replace(
            EMPTY_MODEL_RUNNER_OUTPUT,
            kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
        )
        for stats in (rank0, rank1)
    ]
    aggregated = KVOutputAggregator(2).aggregate(outputs)  # type: ignore[arg-type]
    assert aggregated is not None and aggregated.kv_connector_output is not None
    sent = aggregated.kv_connector_output.kv_connector_stats
    assert sent is not None
    # What the engine core sends the front end: SchedulerStats, msgpack-encoded.
    wire = MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=sent.to_dict()))
    data = MsgpackDecoder(SchedulerStats).decode(wire).kv_connector_stats
    assert data is not None

    with _model_runner_triton_check_lifted():  # vLLM 0.34's CPU platform check
        config = VllmConfig(
            kv_transfer_config=KVTransferConfig(
                kv_connector="TraitsNixlConnector", kv_role="kv_both"
            )
        )
    logged: list[str] = []
    logging_stats = KVConnectorLogging(config.kv_transfer_config)
    logging_stats.observe(data)
    logging_stats.log(lambda fmt, *args: logged.append(fmt % args))  # type: ignore[no-untyped-call]
    (line,) = logged
    assert "Num successful transfers=0" in line  # upstream's fields stay
    assert "Num peers refused=3, Num fingerprint mismatches=2" in line, line
    assert "Num leases declined=1" in line
    # (131072 + 65536) / 2 bytes, in MB.
    assert f"Avg planned MB per request={round(98304 / 2**20, 3)}" in line

    registry = CollectorRegistry()
    prom_types = _Prom(registry).types

    class Prom(KVConnectorProm):
        _counter_cls = prom_types[Counter]  # type: ignore[assignment]
        _gauge_cls = prom_types[Gauge]  # type: ignore[assignment]
        _histogram_cls = prom_types[Histogram]  # type: ignore[assignment]

    prom = Prom(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(data, 0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[
            (name, tuple(sorted({"model_name": "tiny", "engine": "0", **labels}.items())))
        ]

    assert value("vllm:nixl_num_failed_transfers_total") == 0  # upstream's are there
    refused = f"{METRIC_NAMES[PEERS_REFUSED]}_total"
    assert value(refused, reason="layout_mismatch") == 2
    assert value(refused, reason="no_fingerprint") == 1
    for reason in set(REFUSAL_REASONS) - {"layout_mismatch", "no_fingerprint"}:
        assert value(refused, reason=reason) == 0  # every reason is there from the start
    assert value("vllm:kvspec_traits_fingerprint_mismatches_total") == 2
    assert value("vllm:kvspec_traits_upstream_peers_total") == 0
    assert value("vllm:kvspec_traits_leases_declined_total") == 1
    planned = METRIC_NAMES[PLANNED_BYTES]
    assert value(f"{planned}_count") == 2
    assert value(f"{planned}_sum") == 131072 + 65536


# -- a pull producer learns which consumers run upstream's connector --------------------


def test_a_pull_producer_logs_a_consumer_on_upstreams_connector_once(
    make: Callable[..., Any], vllm_records: list[logging.LogRecord]
) -> None:
    """In pull mode the producer sees no metadata of its consumers (_consumers): ours
    announces itself after its handshake, upstream's does not. Two real consumers read
    from one real producer through vLLM's handshake and NIXL; the producer's own
    notification handling (get_finished) is where it learns who read."""
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
    from kvspec_traits.vllm_connector._stats import UPSTREAM_PEERS

    producer, _ = make("attention", TraitsNixlConnectorWorker, "producer")
    ours, _ = make("attention", TraitsNixlConnectorWorker, "ours")
    theirs, _ = make("attention", NixlPullConnectorWorker, "theirs")
    port, stop = _serve_handshake(producer)
    far = {"expiry": time.perf_counter() + 3600, "extension": 20.0}
    try:
        for consumer, req_id in ((ours, "a"), (theirs, "b"), (theirs, "c")):
            consumer.start_load_kv(_metadata(producer, port, req_id, far))
            _poll(consumer, req_id)
            # The producer handles the notifications that arrived (each read's "done").
            deadline = time.monotonic() + 30
            census = None
            while time.monotonic() < deadline:
                producer.get_finished()
                census = producer.__dict__.get("_consumer_census")
                if census is not None and census.announced(consumer.nixl_wrapper.name) is not None:
                    break
                time.sleep(0.02)
    finally:
        stop.set()
    assert census is not None
    assert census.announced(ours.nixl_wrapper.name) is True
    assert census.announced(theirs.nixl_wrapper.name) is False
    warnings = [
        r.getMessage()
        for r in vllm_records
        if r.name == LOGGER_NAME and "without announcing kvspec-traits" in r.getMessage()
    ]
    # Once for upstream's consumer (two reads), never for ours.
    assert len(warnings) == 1, warnings
    assert f"agent {theirs.nixl_wrapper.name} reads from this producer" in warnings[0]
    assert producer.xfer_stats.data[UPSTREAM_PEERS] == [1]


# -- the pieces, on real plans -------------------------------------------------------------


def test_planned_bytes_count_each_region_as_vllms_worker_expands_it(
    make: Callable[..., Any],
) -> None:
    """Kimi-Linear style (MLA and two KDA groups aliasing one storage): vLLM's worker
    expands a request's block ids per region by its group (every group's ids for a
    region shared by groups, ``_block_ids_by_region``); the planned bytes are each
    region's block length times the ids vLLM moves in it."""
    from kvspec_traits.transfer import SHARED_REGION_GROUP_ID
    from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
    from kvspec_traits.vllm_connector._observe import planned_bytes

    worker, _ = make("mla_kda_hybrid", TraitsNixlConnectorWorker, "hybrid")
    plan = worker.region_plan
    ids = [[1, 2, 3, 4], [5], [6]]  # one list per transfer group, kernel blocks and states
    by_region = worker._block_ids_by_region(ids, plan.region_group_ids)
    expected = sum(len(b) * r.block_len for b, r in zip(by_region, plan.regions, strict=True))
    assert planned_bytes(plan, ids) == expected > 0
    # The aliased storages make every region one shared by the three groups.
    assert {r.group_id for r in plan.regions} == {SHARED_REGION_GROUP_ID}


def test_an_mla_worker_logs_replicated_regions(
    make: Callable[..., Any], vllm_records: list[logging.LogRecord]
) -> None:
    from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker

    worker, _ = make("mla", TraitsNixlConnectorWorker, "mla")
    lines = [r.getMessage() for r in vllm_records if ": region " in r.getMessage()]
    assert len(lines) == len(worker.region_plan.regions) >= 1
    # A latent of 512 + 64 float32 per token, kernel blocks of 16 tokens.
    for line in lines:
        assert "TP replicated: REPLICATE, the same bytes on each of 1 rank(s)" in line, line
        assert f"; {16 * (512 + 64) * 4} bytes per block" in line, line


def test_the_census_judges_an_agent_by_its_first_message_and_stays_bounded() -> None:
    from kvspec_traits.vllm_connector._consumers import HELLO, MAX_AGENTS, ConsumerCensus

    upstream: list[str] = []
    census = ConsumerCensus(upstream.append)
    # One poll: ours announced itself before its read's notification; theirs did not
    # (its heartbeat first). A later hello does not make theirs ours; nothing repeats.
    census.saw({"ours": [HELLO, b"p-1:1"], "theirs": [b"HB:p-2", b"p-2:1"]})
    census.saw({"theirs": [HELLO], "ours": [b"p-3:1"], "idle": []})
    assert upstream == ["theirs"]
    assert (census.announced("ours"), census.announced("theirs")) == (True, False)
    assert census.announced("idle") is None  # no message: not judged yet
    # Past MAX_AGENTS agents the oldest is forgotten (a restarted consumer is a new agent).
    census.saw({f"agent-{i}": [HELLO] for i in range(MAX_AGENTS)})
    assert census.announced("ours") is None and census.announced(f"agent-{MAX_AGENTS - 1}")
