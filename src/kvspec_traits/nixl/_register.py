"""Registering a plan's memory with a NIXL agent: the one registration loop, shared by
:class:`~kvspec_traits.nixl.TraitsNixlAgent` and the vLLM connector's worker."""

from __future__ import annotations

import contextlib
from collections.abc import Container, Sequence
from typing import Any

from kvspec_traits.transfer._region import MemoryRange

__all__ = ["deregister_all", "register_ranges"]


def register_ranges(
    agent: Any,
    registrations: Sequence[MemoryRange],
    backends: Sequence[str] | None,
    registered: list[Any],
    *,
    skip: Container[str] = (),
) -> None:
    """Register ``registrations`` with the NIXL agent ``agent`` (a ``nixl_agent``), one
    descriptor list per memory type in sorted order, appending each to ``registered``;
    memory types in ``skip`` are left out. If NIXL refuses one, the lists this call
    registered are deregistered (and removed from ``registered``) before the error
    propagates: a refused registration leaves nothing behind. ``backends`` goes to NIXL
    as a list, or ``None`` as vLLM's worker may hold it (NIXL's default backends)."""
    start = len(registered)
    try:
        for kind in sorted({r.mem_type for r in registrations}):
            if kind in skip:
                continue
            rows = [
                (r.base, r.length, r.device_id, "") for r in registrations if r.mem_type == kind
            ]
            descs = agent.get_reg_descs(rows, kind)
            agent.register_memory(descs, backends=_names(backends))
            registered.append(descs)
    except BaseException:
        done = registered[start:]
        del registered[start:]
        deregister_all(agent, done, backends)
        raise


def deregister_all(agent: Any, registered: list[Any], backends: Sequence[str] | None) -> None:
    """Deregister every list in ``registered`` (errors suppressed) and empty it."""
    for descs in registered:
        with contextlib.suppress(Exception):
            agent.deregister_memory(descs, backends=_names(backends))
    registered.clear()


def _names(backends: Sequence[str] | None) -> list[str] | None:
    return None if backends is None else list(backends)
