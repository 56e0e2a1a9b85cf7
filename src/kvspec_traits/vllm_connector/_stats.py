"""The connector's own counters, through vLLM's KV-connector stats path.

vLLM collects a connector's stats per worker step (``get_kv_connector_stats``, the
worker's ``xfer_stats``), aggregates them over the workers (``KVOutputAggregator``) and
sends their ``data`` to the front end, which rebuilds them with the connector class's
``build_kv_connector_stats``, logs their ``reduce()`` (``KV Transfer metrics: ...``) and
records them in Prometheus through its ``build_prom_metrics``. The classes here extend
upstream's NIXL ones (``NixlKVConnectorStats``, ``NixlPromMetrics``, the same in 0.32,
0.33 and 0.34), so every ``vllm:nixl_*`` metric stays and ours appear beside them:

- ``vllm:kvspec_traits_peers_refused_total{reason}``: handshakes the connector refused
  (:data:`~._observe.REFUSAL_REASONS`; a peer retried is counted again);
- ``vllm:kvspec_traits_fingerprint_mismatches_total``: of those, peers whose traits
  fingerprint differs from ours (``reason="layout_mismatch"``);
- ``vllm:kvspec_traits_upstream_peers_total``: peers accepted without a fingerprint
  (upstream's ``NixlConnector``), one per handshake;
- ``vllm:kvspec_traits_leases_declined_total``: reads a pull consumer declined or
  failed because the producer's lease may have run out (:mod:`._lease`);
- ``vllm:kvspec_traits_planned_bytes_per_request``: a histogram of the bytes this rank's
  region plan moves for each request it reads (pull consumers).

Stats are ``data`` lists (serialisable, as vLLM requires): one entry per event, the
reason of a refusal, the bytes of a request. A key of ours is there once its first event
is (until then the stats, their payload and their ``reduce()`` are upstream's).
"""

from __future__ import annotations

from typing import Any, Final, cast

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvspec_traits.vllm_connector._observe import REFUSAL_REASONS

__all__ = [
    "FINGERPRINT_MISMATCHES",
    "LEASES_DECLINED",
    "METRIC_NAMES",
    "PEERS_REFUSED",
    "PLANNED_BYTES",
    "TraitsNixlKVConnectorStats",
    "TraitsNixlPromMetrics",
    "TraitsStatsConnector",
    "UPSTREAM_PEERS",
    "traits_stats",
]

PEERS_REFUSED: Final = "kvspec_peers_refused"
FINGERPRINT_MISMATCHES: Final = "kvspec_fingerprint_mismatches"
UPSTREAM_PEERS: Final = "kvspec_upstream_peers"
LEASES_DECLINED: Final = "kvspec_leases_declined"
PLANNED_BYTES: Final = "kvspec_planned_bytes"
_KEYS: Final = (
    PEERS_REFUSED,
    FINGERPRINT_MISMATCHES,
    UPSTREAM_PEERS,
    LEASES_DECLINED,
    PLANNED_BYTES,
)

METRIC_NAMES: Final = {
    PEERS_REFUSED: "vllm:kvspec_traits_peers_refused",
    FINGERPRINT_MISMATCHES: "vllm:kvspec_traits_fingerprint_mismatches",
    UPSTREAM_PEERS: "vllm:kvspec_traits_upstream_peers",
    LEASES_DECLINED: "vllm:kvspec_traits_leases_declined",
    PLANNED_BYTES: "vllm:kvspec_traits_planned_bytes_per_request",
}
"""Each stats key's Prometheus metric (a counter's samples end in ``_total``)."""

# From 4 KiB to 64 GiB, every 4x: a request of one small page to a long MLA context.
_BYTE_BUCKETS: Final = [float(4096 * 4**i) for i in range(13)]


class TraitsNixlKVConnectorStats(NixlKVConnectorStats):
    """Upstream's NIXL transfer stats plus the connector's counters (this module's doc)."""

    def record_refused_peer(self, reason: str) -> None:
        # A string in vLLM's number lists (typed so by upstream's reset): msgpack carries
        # it, and the front end labels the counter with it.
        cast("list[Any]", self.data.setdefault(PEERS_REFUSED, [])).append(reason)
        if reason == "layout_mismatch":
            self.data.setdefault(FINGERPRINT_MISMATCHES, []).append(1)

    def record_upstream_peer(self) -> None:
        self.data.setdefault(UPSTREAM_PEERS, []).append(1)

    def record_lease_declined(self) -> None:
        self.data.setdefault(LEASES_DECLINED, []).append(1)

    def record_planned_bytes(self, nbytes: int) -> None:
        self.data.setdefault(PLANNED_BYTES, []).append(int(nbytes))

    def clone_and_reset(self) -> TraitsNixlKVConnectorStats:
        return cast("TraitsNixlKVConnectorStats", super().clone_and_reset())

    def is_empty(self) -> bool:
        ours = any(self.data.get(key) for key in _KEYS)
        return not ours and bool(super().is_empty())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = dict(super().reduce())
        if not any(self.data.get(key) for key in _KEYS):
            return reduced  # upstream's line, as upstream's stats give it
        planned = self.data.get(PLANNED_BYTES, [])
        reduced.update(
            {
                "Num peers refused": len(self.data.get(PEERS_REFUSED, [])),
                "Num fingerprint mismatches": len(self.data.get(FINGERPRINT_MISMATCHES, [])),
                "Num upstream peers": len(self.data.get(UPSTREAM_PEERS, [])),
                "Num leases declined": len(self.data.get(LEASES_DECLINED, [])),
                "Avg planned MB per request": round(sum(planned) / len(planned) / 2**20, 3)
                if planned
                else 0,
            }
        )
        return reduced


class TraitsNixlPromMetrics(NixlPromMetrics):
    """Upstream's ``vllm:nixl_*`` metrics plus the connector's (:data:`METRIC_NAMES`);
    every refusal reason is created at 0, so each series is there before a peer is."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # The classes vLLM hands in (its own, or wrappers); typed by vLLM as one union.
        counter: Any = metric_types[Counter]
        histogram: Any = metric_types[Histogram]
        refused = counter(
            name=METRIC_NAMES[PEERS_REFUSED],
            documentation="NIXL handshakes TraitsNixlConnector refused, by reason "
            "(a peer retried is counted again).",
            labelnames=[*labelnames, "reason"],
        )
        self.kvspec_peers_refused = {
            engine: {reason: refused.labels(*values, reason) for reason in REFUSAL_REASONS}
            for engine, values in per_engine_labelvalues.items()
        }
        self._refused = refused
        self.kvspec_counters: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                counter(name=METRIC_NAMES[key], documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, doc in (
                (FINGERPRINT_MISMATCHES, "NIXL peers refused: their traits fingerprint differs."),
                (UPSTREAM_PEERS, "NIXL peers accepted without a kvspec-traits fingerprint."),
                (LEASES_DECLINED, "Reads declined or failed: the producer's lease may be over."),
            )
        }
        self.kvspec_planned_bytes: dict[int, Any] = create_metric_per_engine(
            histogram(
                name=METRIC_NAMES[PLANNED_BYTES],
                documentation="Bytes the region plan moves per request read.",
                buckets=_BYTE_BUCKETS,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        refused = self.kvspec_peers_refused[engine_idx]
        for reason in transfer_stats_data.get(PEERS_REFUSED, ()):
            if reason not in refused:  # from a newer worker: counted, not dropped
                values = self.per_engine_labelvalues[engine_idx]
                refused[reason] = self._refused.labels(*values, reason)
            refused[reason].inc()
        for key, counter in self.kvspec_counters.items():
            for count in transfer_stats_data.get(key, ()):
                counter[engine_idx].inc(count)
        for nbytes in transfer_stats_data.get(PLANNED_BYTES, ()):
            self.kvspec_planned_bytes[engine_idx].observe(nbytes)


def traits_stats(worker: Any) -> TraitsNixlKVConnectorStats:
    """``worker``'s stats as ours: the connector's worker sets them when built; a worker
    built without its ``__init__`` (vLLM's tests) gets them here, keeping what vLLM's
    recorded so far."""
    stats = getattr(worker, "xfer_stats", None)
    if isinstance(stats, TraitsNixlKVConnectorStats):
        return stats
    data = dict(stats.data) if isinstance(stats, KVConnectorStats) else {}
    ours = TraitsNixlKVConnectorStats(data=data)
    worker.xfer_stats = ours
    return ours


class TraitsStatsConnector(NixlBaseConnector):
    """Where vLLM's stats path asks the connector class (both modes' connectors derive
    from it before upstream's): its stats and Prometheus metrics are ours."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return (
            TraitsNixlKVConnectorStats(data=data)
            if data is not None
            else (TraitsNixlKVConnectorStats())
        )

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return TraitsNixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
