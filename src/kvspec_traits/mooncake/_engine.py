"""A Mooncake transfer engine that registers a :class:`RegionPlan` and moves a
request's blocks with ``batch_transfer_sync_read`` / ``_write``.

The only module of the backend that touches Mooncake. Mooncake's Python API is untyped,
so its engine is held as ``Any`` here and nowhere else; ``mooncake.engine`` is imported
when an engine is built. No metadata server: engines find each other by Mooncake's P2P
handshake (``host:rpc_port``), and plans travel on this backend's own side channel::

    producer = TraitsMooncakeEngine(); producer.register_plan(plan_p)
    server = producer.serve_record()                 # the side channel: host, port
    consumer = TraitsMooncakeEngine(); consumer.register_plan(plan_d)
    peer = consumer.connect(fetch_record(host, server.port), host)   # checked, then kept
    consumer.read_blocks(peer, block_ids)            # or producer.write_blocks(...)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvspec_traits._deps import MOONCAKE_INSTALL, needs
from kvspec_traits._errors import MissingDependencyError
from kvspec_traits.mooncake._channel import RecordServer
from kvspec_traits.mooncake._errors import MissingPeerError, TransferFailedError
from kvspec_traits.mooncake._moves import Route, pieces_of, request_moves, routes_of
from kvspec_traits.mooncake._ratio_moves import RatioRoute, SlotParts
from kvspec_traits.mooncake._wire import PeerRecord, decode_record, encode_record
from kvspec_traits.transfer import (
    MalformedMetadataError,
    PeerRegion,
    RegionPlan,
    UnsupportedLayoutError,
    check_peer,
)
from kvspec_traits.transfer._blocks import IdLists

__all__ = ["HOST_MEMORY", "MooncakePeer", "TraitsMooncakeEngine", "TransferResult", "load_engine"]

HOST_MEMORY: Final = "DRAM"
"""The memory type this backend registers (``Region.mem_type`` of a CPU tensor)."""

_FEATURE: Final = "TraitsMooncakeEngine (kvspec_traits.mooncake)"


def load_engine() -> Any:
    """Mooncake's ``TransferEngine`` class. A missing wheel, or a wheel whose
    ``engine.so`` cannot load the system's libibverbs1, is a
    :class:`~kvspec_traits.MissingDependencyError` naming both."""
    with needs(_FEATURE):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            if isinstance(exc, ModuleNotFoundError) or not any(
                lib in str(exc) for lib in ("libibverbs", "libnl")
            ):
                raise
            raise MissingDependencyError(
                "mooncake",
                f"{_FEATURE} (Mooncake's engine.so could not load a system library: {exc})",
                MOONCAKE_INSTALL,
            ) from exc
    return TransferEngine


@dataclass(slots=True)
class MooncakePeer:
    """A connected peer rank: its checked record and the session that addresses its
    engine (``host:rpc_port``, the host the record was fetched from)."""

    record: PeerRecord
    session: str
    regions: tuple[PeerRegion, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.regions = self.record.plan.regions

    @property
    def tokens(self) -> tuple[int | None, ...]:
        """Tokens per block of each of the peer's regions (its fingerprint's
        ``block_sizes``, where one)."""
        found: list[int | None] = []
        for record in self.record.plan.fingerprint.regions:
            sizes = record.get("block_sizes")
            one = isinstance(sizes, list) and len(sizes) == 1 and type(sizes[0]) is int
            found.append(sizes[0] if one and sizes is not None else None)
        return tuple(found)

    @property
    def tp_rank(self) -> int:
        return self.record.plan.tp_rank

    @property
    def tp_size(self) -> int:
        return self.record.plan.tp_size


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A finished transfer: every byte of the requested blocks moved."""

    entries: int
    """Entries passed to Mooncake's batch calls (moves contiguous on both sides merged)."""
    nbytes: int
    seconds: float


class TraitsMooncakeEngine:
    """One Mooncake transfer engine with one registered plan.

    ``host`` is the address peers reach the engine at (Mooncake's RPC and TCP ports
    listen on every interface whatever it is, and authenticate no one: firewall them,
    ``docs/mooncake.md``); ``protocol`` Mooncake's transport (``"tcp"``: host memory over
    TCP, what the non-CUDA wheel moves).
    """

    def __init__(self, host: str = "127.0.0.1", *, protocol: str = "tcp") -> None:
        engine_class = load_engine()
        self._engine: Any = engine_class()
        code = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if code != 0:
            raise TransferFailedError(
                f"Mooncake's TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', "
                f"{protocol!r}, '') returned {code}",
                code=code,
            )
        self.host = host
        self.rpc_port: int = int(self._engine.get_rpc_port())
        self.session = f"{host}:{self.rpc_port}"
        self._plan: RegionPlan | None = None
        self._slot_parts: SlotParts | None = None
        self._registered: list[int] = []
        self._published = False
        self._peers: dict[str, MooncakePeer] = {}
        self._routes: dict[
            tuple[bool, tuple[tuple[int, str], ...]], tuple[Route | RatioRoute, ...]
        ] = {}
        self._servers: list[RecordServer] = []

    # -- registration ------------------------------------------------------------------

    @property
    def plan(self) -> RegionPlan:
        if self._plan is None:
            raise RuntimeError(f"engine {self.session}: call register_plan() first")
        return self._plan

    def register_plan(self, plan: RegionPlan, *, slot_parts: SlotParts | None = None) -> None:
        """Register every memory range of ``plan`` with the engine. Must precede
        :meth:`record`. A plan with memory other than host memory is refused by name
        (:class:`~kvspec_traits.transfer.UnsupportedLayoutError`) before anything is
        registered; a registration the engine refuses is undone.

        ``slot_parts``: per region of ``plan``, how a head slot of its blocks holds its
        tokens (:func:`~kvspec_traits.transfer.block_reads`' ``parts``; None: rows of
        token bytes), as the attention kernel that writes the cache lays them out. Only a
        peer of another block size needs it; without it such a peer's reads are refused
        by name."""
        if self._published:
            raise RuntimeError(
                f"engine {self.session}: register_plan() after record() would register "
                f"memory its peers were not told of; build a new engine"
            )
        if self._plan is not None:
            raise RuntimeError(f"engine {self.session}: a plan is already registered")
        if not plan.regions:
            raise ValueError(
                "the plan has no regions (every layer was skipped: see "
                "RegionPlan.skipped_layers); there is nothing to register"
            )
        if slot_parts is not None and len(slot_parts) != len(plan.regions):
            raise ValueError(
                f"slot_parts has {len(slot_parts)} entries for a plan of "
                f"{len(plan.regions)} regions; give one per region (None for token rows)"
            )
        for region in plan.regions:
            if region.mem_type != HOST_MEMORY:
                raise UnsupportedLayoutError(
                    region.name,
                    f"its memory is {region.mem_type}; the Mooncake backend registers host "
                    f"({HOST_MEMORY}) memory only: use kvspec_traits.nixl for device memory",
                )
        bases = [r.base for r in plan.registrations]
        code = self._engine.batch_register_memory(bases, [r.length for r in plan.registrations])
        if code != 0:
            self._engine.batch_unregister_memory(bases)
            raise TransferFailedError(
                f"Mooncake refused to register the plan's {len(bases)} memory ranges ({code})",
                code=code,
            )
        self._registered = bases
        self._plan = plan
        self._slot_parts = None if slot_parts is None else tuple(slot_parts)

    def record(self) -> bytes:
        """The handshake record for peers (fingerprint, region geometry, registrations,
        this engine's RPC port). Freezes registration."""
        plan = self.plan
        self._published = True
        return encode_record(plan, self.rpc_port)

    def serve_record(self, port: int = 0) -> RecordServer:
        """Serve :meth:`record` on this engine's host (the side channel; port 0: a free
        one, the server's ``port``). Closed with the engine."""
        server = RecordServer(self.record(), self.host, port)
        self._servers.append(server)
        return server

    # -- peers -------------------------------------------------------------------------

    def connect(self, record: bytes, host: str) -> MooncakePeer:
        """Decode a peer's record (fetched from ``host``), check it as every backend
        checks a peer, and only then keep it.

        Raises, before the peer can be named in a transfer:
        :class:`~kvspec_traits.transfer.MalformedMetadataError` (bad or hostile bytes,
        geometry its own fingerprint contradicts, a region outside the memory that holds
        its layers, a shifted or swapped base, this engine itself or a peer already
        connected), :class:`~kvspec_traits.transfer.HandshakeMismatchError` (a region
        differs), :class:`~kvspec_traits.transfer.MemoryTypeMismatchError`, and
        :class:`~kvspec_traits.transfer.UnsupportedLayoutError` for a region that cannot
        move between the two TP sizes, or between the two block sizes (a state, a ring).
        """
        peer_record = decode_record(record)
        plan = peer_record.plan
        check_peer(
            self.plan,
            plan.fingerprint,
            plan.regions,
            plan.tp_size,
            registrations=plan.registrations,
            peer=f"peer {host}:{peer_record.rpc_port}",
            # Token-paged regions move between block sizes (transfer.block_reads).
            block_ratio=True,
        )
        session = f"{host}:{peer_record.rpc_port}"
        if session in self._peers or session == self.session:
            raise MalformedMetadataError(
                f"engine {session} is already connected (or is this engine)"
            )
        peer = MooncakePeer(peer_record, session)
        for write in (False, True):  # every region can move both ways, or the peer is refused
            pieces_of(
                self.plan,
                peer.tp_size,
                {peer.tp_rank: peer.regions},
                write=write,
                remote_tokens=peer.tokens,
                slot_parts=self._slot_parts,
            )
        self._peers[session] = peer
        return peer

    def knows(self, session: str) -> bool:
        """Whether a peer of ``session`` (``host:rpc_port``) is connected, i.e. could be
        named in a transfer."""
        return session in self._peers

    # -- transfers ---------------------------------------------------------------------

    def read_blocks(
        self,
        peers: MooncakePeer | Mapping[int, MooncakePeer],
        block_ids: IdLists,
        remote_block_ids: IdLists | None = None,
        *,
        request_tokens: int | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> TransferResult:
        """Fill our ``block_ids`` (one list per cache group) from the peers'
        ``remote_block_ids`` (default: the same ids) with ``batch_transfer_sync_read``.

        ``peers`` is one peer of the same TP size, or the remote ranks by TP rank
        (head-sharded regions are split or gathered by heads, replicated ones read from
        one rank). Every id is checked before a byte moves (the block-id errors of
        :mod:`kvspec_traits.transfer`, :class:`MissingPeerError`);
        :class:`TransferFailedError` if Mooncake reports a failure.

        Between block sizes, ``request_tokens`` places lists shorter than the request
        (a sliding window's tail, as vLLM clips it at each side's block size)
        end-aligned, ``windows[g]`` the tokens group ``g``'s window keeps (the tokens
        the reader needs); without ``request_tokens`` lists start at the request's
        first block.
        """
        return self._transfer(
            peers, block_ids, remote_block_ids, write=False,
            request_tokens=request_tokens, windows=windows,
        )  # fmt: skip

    def write_blocks(
        self,
        peers: MooncakePeer | Mapping[int, MooncakePeer],
        block_ids: IdLists,
        remote_block_ids: IdLists | None = None,
        *,
        request_tokens: int | None = None,
        windows: Sequence[int | None] | None = None,
    ) -> TransferResult:
        """Push our ``block_ids`` into the peers' ``remote_block_ids`` (default: the
        same) with ``batch_transfer_sync_write``: the peers are consumer ranks by TP
        rank, each given the pieces of its blocks this rank holds (the consumer's reads
        from this rank, reversed). Destinations (the peers' ids) must be distinct; the
        errors, ``request_tokens`` and ``windows`` are :meth:`read_blocks`'."""
        return self._transfer(
            peers, block_ids, remote_block_ids, write=True,
            request_tokens=request_tokens, windows=windows,
        )  # fmt: skip

    def _transfer(
        self,
        peers: MooncakePeer | Mapping[int, MooncakePeer],
        block_ids: IdLists,
        remote_block_ids: IdLists | None,
        *,
        write: bool,
        request_tokens: int | None,
        windows: Sequence[int | None] | None,
    ) -> TransferResult:
        start = time.perf_counter()
        by_rank = {peers.tp_rank: peers} if isinstance(peers, MooncakePeer) else dict(peers)
        moves = request_moves(
            self._routes_for(by_rank, write),
            self.plan.num_groups,
            block_ids,
            remote_block_ids,
            write=write,
            request_tokens=request_tokens,
            windows=windows,
        )
        call = (
            self._engine.batch_transfer_sync_write
            if write
            else self._engine.batch_transfer_sync_read
        )
        for batch in moves:
            session = by_rank[batch.remote_rank].session
            code = call(session, batch.local, batch.remote, batch.lengths)
            if code != 0:
                raise TransferFailedError(
                    f"Mooncake's batch_transfer_sync_{'write' if write else 'read'} with "
                    f"{session} ({len(batch.lengths)} entries, {batch.nbytes} bytes) "
                    f"returned {code}",
                    code=code,
                )
        return TransferResult(
            entries=sum(len(m.lengths) for m in moves),
            nbytes=sum(m.nbytes for m in moves),
            seconds=time.perf_counter() - start,
        )

    def _routes_for(
        self, by_rank: Mapping[int, MooncakePeer], write: bool
    ) -> tuple[Route | RatioRoute, ...]:
        """:func:`routes_of` for these peers, computed once per set of peers."""
        if not by_rank:
            raise ValueError("a transfer needs at least one peer")
        key = (write, tuple(sorted((rank, peer.session) for rank, peer in by_rank.items())))
        found = self._routes.get(key)
        if found is not None:
            return found
        remote_tp = next(iter(by_rank.values())).tp_size
        for rank, peer in by_rank.items():
            if self._peers.get(peer.session) is not peer:
                raise MissingPeerError(
                    None, rank, sorted(by_rank), f": {peer.session} is not connected"
                )
            if peer.tp_rank != rank or peer.tp_size != remote_tp:
                raise MissingPeerError(
                    None,
                    rank,
                    sorted(p.tp_rank for p in by_rank.values()),
                    f": peer {peer.session} is TP rank {peer.tp_rank} of {peer.tp_size}, "
                    f"passed as rank {rank} of {remote_tp}",
                )
        routes = routes_of(
            self.plan,
            remote_tp,
            {rank: p.regions for rank, p in by_rank.items()},
            write=write,
            remote_tokens=next(iter(by_rank.values())).tokens,
            slot_parts=self._slot_parts,
        )
        self._routes[key] = routes
        return routes

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the side channel, forget peers and unregister memory."""
        for server in self._servers:
            server.close()
        self._servers.clear()
        self._peers.clear()
        self._routes.clear()
        if self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered = []

    def __enter__(self) -> TraitsMooncakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
