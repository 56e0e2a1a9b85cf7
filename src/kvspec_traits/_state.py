"""What a :class:`~kvspec_traits.extend.Registry` holds, declared and initialised in one place.

The registry's parts (field accounting, loading, resolution) are mixins that answer from
this state and hold none of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvspec_traits._accounting import Plan, _Accounting
    from kvspec_traits._traits import KVLayoutTraits

__all__ = ["RegistryState"]


class RegistryState:
    """Registrations, loading flags and the per-class cache of one registry."""

    def __init__(self, *, builtins: bool, entry_points: bool) -> None:
        self._adapters: dict[type[Any], Callable[[Any], KVLayoutTraits]] = {}
        self._accounting: dict[type[Any], _Accounting] = {}
        self._want_entry_points = entry_points
        self._builtins_loaded = not builtins
        self._loaded = not (builtins or entry_points)
        self._loading = False
        # name=value of each entry point whose hook has run.
        self._hooks_done: set[str] = set()
        self._lock = threading.RLock()
        # Bumped by every change of adapters: an answer computed under an older
        # generation is never cached.
        self._generation = 0
        # The resolution plan per class, bounded (kvspec_traits._caches.MAX_CLASSES).
        self._by_type: dict[type[Any], Plan] = {}

    if TYPE_CHECKING:  # one part asks another; each is defined where it belongs

        def _ensure_loaded(self) -> None: ...  # _loading.AdapterLoading

        def _invalidate(self) -> None: ...  # _registry.Registry
