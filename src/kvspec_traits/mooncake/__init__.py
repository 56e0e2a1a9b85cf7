"""Mooncake backend: register a :class:`~kvspec_traits.transfer.RegionPlan` with
Mooncake's transfer engine, exchange plans on its own side channel, move a request's
blocks with ``batch_transfer_sync_read`` / ``_write``.

Everything it knows about a layout comes from :mod:`kvspec_traits.transfer` (the plan,
the plan record and fingerprint, the peer checks, the TP reads, the block-id checks);
it never imports :mod:`kvspec_traits.nixl`, numpy or vLLM. It needs Mooncake's engine
(the ``[mooncake]`` extra, and the system's libibverbs1) only when an engine is built: a
missing one is a :class:`~kvspec_traits.MissingDependencyError` naming both. Host memory
over TCP; see ``docs/mooncake.md``.

    producer = TraitsMooncakeEngine(); producer.register_plan(plan_p)
    server = producer.serve_record()
    consumer = TraitsMooncakeEngine(); consumer.register_plan(plan_d)
    peer = consumer.connect(fetch_record("127.0.0.1", server.port), "127.0.0.1")
    consumer.read_blocks(peer, block_ids)          # one id list per cache group
"""

from kvspec_traits.mooncake._channel import RecordServer, fetch_record
from kvspec_traits.mooncake._engine import (
    HOST_MEMORY,
    MooncakePeer,
    TraitsMooncakeEngine,
    TransferResult,
)
from kvspec_traits.mooncake._errors import MissingPeerError, TransferFailedError
from kvspec_traits.mooncake._moves import Moves, Route, pieces_of, request_moves, routes_of
from kvspec_traits.mooncake._wire import PeerRecord, decode_record, encode_record

__all__ = [
    "HOST_MEMORY",
    "MissingPeerError",
    "MooncakePeer",
    "Moves",
    "PeerRecord",
    "RecordServer",
    "Route",
    "TraitsMooncakeEngine",
    "TransferFailedError",
    "TransferResult",
    "decode_record",
    "encode_record",
    "fetch_record",
    "pieces_of",
    "request_moves",
    "routes_of",
]
