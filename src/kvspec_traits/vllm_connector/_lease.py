"""Expired leases fail closed: a pull consumer never hands the model blocks that its
producer may already have released.

vLLM's pull producer holds a finished prefill's blocks for ``kv_lease_duration`` (30 s
by default). Each heartbeat from the consumer that the producer handles extends the lease
to 2/3 of that duration after it is handled. When the lease expires, the producer releases
the blocks and may reuse them. vLLM's consumer reads whenever it reaches the request. NIXL then
reports a read of released, reused blocks as successful, so the answer is silently wrong
(measured: docs/vllm.md "Soak", "Leases"). Upstream exports a deadline only for the
turn-2 readback of bidirectional transfers.

Here the producer (``TraitsNixlConnector``) adds its deadline and its extension to
``kv_transfer_params`` under :data:`LEASE_KEY`. The deadline is in the producer
scheduler's ``perf_counter``, the clock that vLLM's handshake measures the offset
against. The consumer keeps a lower bound on each request's deadline in its own clock:
the exported deadline less the handshake's clock offset. Heartbeats do not raise it.
vLLM's heartbeat is a one-way NIXL notification that the producer never acknowledges, so
the consumer learns neither whether nor when the producer handled one, and a heartbeat
sent in time may be handled after the deadline, when the blocks are gone: with the link
between the two down longer than the lease, UCX over TCP delivers the queued heartbeats
once it returns (tests/e2e/test_pd_netns.py, a 40 s outage: the consumer used to raise its
bound at each heartbeat it sent, and kept reads of released blocks). The one deadline the
producer is known to keep is the one it exported. The consumer declines a read that would
start within ``margin`` of the bound, and it fails a read that completes within ``margin``
of it; ``kv_lease_duration`` must therefore cover a request's wait on the consumer (from
the prefill's end to its read's end), which heartbeats do not stretch for this check.
vLLM's failure path then applies the consumer's ``kv_load_failure_policy``: the blocks
are recomputed, or the request ends with an error. The answer is never wrong.

A producer that exports no lease (upstream's ``NixlConnector``) leaves the consumer
with upstream's behaviour, and the consumer logs this once per engine. A malformed
lease value is refused for its request, because it comes from the wire.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from kvspec_traits._errors import KVSpecTraitsError
from kvspec_traits.vllm_connector._errors import ConnectorOptionError
from kvspec_traits.vllm_connector._log import logger
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME

__all__ = [
    "LEASES_ATTR",
    "LEASE_KEY",
    "LEASE_MARGIN_KEY",
    "LeaseBook",
    "LeaseMarginError",
    "LeaseOffer",
    "MalformedLeaseError",
    "lease_offer",
    "parse_lease_offer",
]

LEASE_KEY: Final = "kvspec_lease"
"""``kv_transfer_params`` key: the producer's ``{"expiry": float, "extension": float}``."""
LEASES_ATTR: Final = "kvspec_leases"
"""The attribute of the connector metadata that hands the consumer's workers each
received request's :data:`LEASE_KEY` value (upstream's ``ReqMeta`` drops unknown keys)."""
LEASE_MARGIN_KEY: Final = "kvspec_lease_margin"
"""``kv_connector_extra_config`` key: seconds of slack the consumer keeps before a
lease's bound (clock-offset error, notification delivery). Default 2.0."""
DEFAULT_MARGIN: Final = 2.0


@dataclass(frozen=True, slots=True)
class LeaseOffer:
    """A producer's lease on one request's blocks: ``expiry`` in the producer
    scheduler's ``perf_counter``, ``extension`` the seconds one heartbeat adds once the
    producer handles it (on the wire for the record; the consumer's bound uses none)."""

    expiry: float
    extension: float


class MalformedLeaseError(KVSpecTraitsError, ValueError):
    """A ``kv_transfer_params`` lease that is not ``{"expiry": finite number,
    "extension": finite number >= 0}`` (the consumer logs it and does not read)."""


class LeaseMarginError(ConnectorOptionError):
    """``kv_connector_extra_config`` :data:`LEASE_MARGIN_KEY` is not a finite number of
    seconds >= 0 (checked by :class:`~._options.ConnectorOptions`)."""


def lease_offer(expiry: float, lease_duration: float) -> dict[str, float]:
    """The producer's :data:`LEASE_KEY` value for a deadline (vLLM's heartbeat extends
    a lease by ``lease_duration * 2 // 3``, ``base_worker._lease_extension``)."""
    return {"expiry": float(expiry), "extension": float(int(lease_duration) * 2 // 3)}


def _finite(value: object, what: str) -> float:
    # bool is an int subclass: a JSON true is not a time.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedLeaseError(f"{LEASE_KEY}.{what} is {value!r}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise MalformedLeaseError(f"{LEASE_KEY}.{what} is {value!r}, not a finite number")
    return number


def parse_lease_offer(value: object) -> LeaseOffer:
    """Check a peer's :data:`LEASE_KEY` value (untrusted: it came over the wire)."""
    if not isinstance(value, Mapping):
        raise MalformedLeaseError(f"{LEASE_KEY} is {value!r}, not a mapping")
    expiry = _finite(value.get("expiry"), "expiry")
    extension = _finite(value.get("extension"), "extension")
    if extension < 0:
        raise MalformedLeaseError(f"{LEASE_KEY}.extension is {extension}, below 0")
    return LeaseOffer(expiry, extension)


@dataclass(slots=True)
class _Tracked:
    engine_id: str
    remote_request_id: str
    offer: LeaseOffer | None  # None: the offer was malformed (refused)


class LeaseBook:
    """A consumer's lower bounds on its producers' lease deadlines, in its own clock.

    Pure bookkeeping (no vLLM, no clock of its own): the worker passes the times and
    the handshake's clock offsets (``remote = local + offset``).
    """

    def __init__(self, margin: float = DEFAULT_MARGIN) -> None:
        self.margin = margin  # a checked option (ConnectorOptions.lease_margin)
        self._tracked: dict[str, _Tracked] = {}
        self._unleased_engines: set[str] = set()

    def track(self, req_id: str, engine_id: str, remote_request_id: str, raw: object) -> None:
        """Start guarding ``req_id`` with ``raw``, the :data:`LEASE_KEY` value of its
        ``kv_transfer_params`` (``None`` when the producer exported none)."""
        if raw is None:
            if engine_id not in self._unleased_engines:
                self._unleased_engines.add(engine_id)
                logger.warning(
                    "%s: producer engine %s exports no lease (%s): its requests are read "
                    "as upstream's NixlConnector reads them, without an expiry check",
                    CONNECTOR_NAME,
                    engine_id,
                    LEASE_KEY,
                )
            return
        try:
            offer: LeaseOffer | None = parse_lease_offer(raw)
        except MalformedLeaseError as err:
            logger.error(
                "%s: request %s from engine %s: %s; its blocks will not be read",
                CONNECTOR_NAME,
                req_id,
                engine_id,
                err,
            )
            offer = None
        self._tracked[req_id] = _Tracked(engine_id, remote_request_id, offer)

    def bound(self, req_id: str, clock_offset: float | None) -> float | None:
        """The local time before which the producer still holds ``req_id``'s blocks;
        ``None`` for a request read without a check; ``-inf`` when it must not be read
        (a malformed lease, or no clock offset to place the deadline with)."""
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return None
        if tracked.offer is None or clock_offset is None or not math.isfinite(clock_offset):
            return -math.inf
        # The exported deadline, never a heartbeat's extension (see the module's docstring).
        return tracked.offer.expiry - clock_offset

    def expired(self, req_id: str, clock_offset: float | None, now: float) -> bool:
        """Whether ``req_id``'s blocks may be gone at local time ``now`` (with margin)."""
        bound = self.bound(req_id, clock_offset)
        return bound is not None and now + self.margin >= bound

    def forget(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)

    def tracked(self) -> set[str]:
        """The guarded requests."""
        return set(self._tracked)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._tracked

    def __len__(self) -> int:
        """How many requests are guarded."""
        return len(self._tracked)
