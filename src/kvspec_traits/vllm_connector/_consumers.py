"""Which consumers of a pull producer run this connector: a traits consumer announces
itself, and the producer logs the first contact of one that did not.

In pull mode the producer never sees its consumer's metadata: the consumer asks vLLM's
side channel for the producer's (its request names only the ranks it wants), registers
it, reads, and notifies (``"<request>:<readers>"`` when a read is done, ``"HB:<ids>"``
heartbeats), each notification keyed by the consumer's NIXL agent name, a UUID. Nothing
of that differs between upstream's consumer and ours, so a traits consumer says so: once
per producer agent, right after its handshake (before any read or heartbeat it sends
there), it sends :data:`HELLO`, which has vLLM's heartbeat form and names no request. An
upstream producer handles it as a heartbeat for no request (nothing happens, 0.32-0.34:
``_handle_heartbeat`` extends only the requests it holds); a traits producer records the
agent. The first notification of an agent that sent no hello first is a consumer on
upstream's connector (or a kvspec-traits before this announcement): logged once per
agent and counted (``vllm:kvspec_traits_upstream_peers_total``).

Pure: imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final

from kvspec_traits import __version__

__all__ = ["HELLO", "HELLO_PREFIX", "ConsumerCensus", "ReplayedNotifs"]

HELLO_PREFIX: Final = b"HB:kvspec-traits-consumer/"
HELLO: Final = HELLO_PREFIX + __version__.encode()
"""What a traits consumer sends each producer agent after its handshake."""
MAX_AGENTS: Final = 4096
"""Agents remembered (consumers restarted get new agents): past it, the oldest go."""


class ConsumerCensus:
    """A producer's consumer agents: ``True`` for those that announced themselves.
    ``on_upstream(agent)`` is called at the first notification of an agent whose first
    message was not :data:`HELLO`."""

    def __init__(self, on_upstream: Callable[[str], None]) -> None:
        self._on_upstream = on_upstream
        self._agents: dict[str, bool] = {}

    def saw(self, notifs: Mapping[str, Sequence[bytes]]) -> None:
        """Note the notifications of one poll (NIXL's ``get_new_notifs()``: agent ->
        messages in the order they arrived)."""
        for agent, messages in notifs.items():
            if agent in self._agents or not messages:
                continue
            first = messages[0]
            announced = isinstance(first, bytes) and first.startswith(HELLO_PREFIX)
            if len(self._agents) >= MAX_AGENTS:
                del self._agents[next(iter(self._agents))]
            self._agents[agent] = announced
            if not announced:
                self._on_upstream(agent)

    def announced(self, agent: str) -> bool | None:
        """Whether ``agent`` announced itself (``None``: not seen)."""
        return self._agents.get(agent)


class ReplayedNotifs:
    """A worker's NIXL agent whose ``get_new_notifs()`` answers ``notifs`` (once, then
    nothing), every other call forwarded: what the worker's ``nixl_wrapper`` is while
    vLLM's own notification handling runs on notifications the census saw first."""

    def __init__(self, agent: object, notifs: Mapping[str, Sequence[bytes]]) -> None:
        self._agent = agent
        self._notifs: Mapping[str, Sequence[bytes]] | None = notifs

    def get_new_notifs(self, *args: object, **kwargs: object) -> Mapping[str, Sequence[bytes]]:
        notifs, self._notifs = self._notifs, None
        return {} if notifs is None else notifs

    def __getattr__(self, name: str) -> object:
        return getattr(self._agent, name)
