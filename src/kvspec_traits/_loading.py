"""Loading adapters into a registry: the built-in vLLM adapters (copied from
``_vllm_adapters.BUILTINS`` the first time they are needed) and the
``kvspec_traits.adapters`` entry points (all or nothing: a failing plugin leaves the
registry as it was, and is named)."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Final

from kvspec_traits._accounting import Accounting, Declared, Registration
from kvspec_traits._deps import needs
from kvspec_traits._errors import AdapterPluginError

__all__ = ["ENTRY_POINT_GROUP", "Loader"]

ENTRY_POINT_GROUP: Final = "kvspec_traits.adapters"
_BUILTIN_MODULE: Final = "kvspec_traits._vllm_adapters"


class Loader:
    """Loads the built-in adapters and the entry points into one registry's
    :class:`~kvspec_traits._accounting.Accounting`, each the first time it is needed.

    ``registry`` is what each entry point's hook is called with; ``changed`` is called
    (under ``lock``) after every load that may have changed the registrations.
    """

    def __init__(
        self,
        registry: object,
        accounting: Accounting,
        lock: threading.RLock,
        changed: Callable[[], None],
        *,
        builtins: bool,
        entry_points: bool,
    ) -> None:
        self._target = registry
        self._accounting = accounting
        self._lock = lock
        self._changed = changed
        self._want_entry_points = entry_points
        self._builtins_loaded = not builtins
        self._loaded = not (builtins or entry_points)
        self._loading = False
        # name=value of each entry point whose hook has run.
        self._hooks_done: set[str] = set()

    def ensure_builtins(self) -> None:
        """Copy the built-in adapters in, unless done (a registration asks this first,
        so that a clash with a built-in is refused when it is made)."""
        if self._builtins_loaded:
            return
        with self._lock:
            self._copy_builtins()

    def _copy_builtins(self) -> None:
        if self._builtins_loaded:  # another thread copied them while we waited
            return
        # The built-in adapters import vLLM and torch, never pinned by us.
        with needs("resolving vLLM KV cache specs (kvspec_traits.traits_of)"):
            builtins = importlib.import_module(_BUILTIN_MODULE).BUILTINS
        theirs: Mapping[type[Any], Registration] = builtins.registrations()
        for spec_type, registration in theirs.items():
            if spec_type not in self._accounting.adapters:
                self._accounting.set(
                    spec_type,
                    registration.adapter,
                    Declared(registration.reads, registration.ignores),
                )
        self._builtins_loaded = True
        self._changed()

    def ensure_loaded(self) -> None:
        """Load the built-ins and the entry points, unless done (or loading now: an entry
        point's hook registers through the registry, which must not load again)."""
        if not self._loaded and not self._loading:
            self._load()

    def _load(self) -> None:
        self.ensure_builtins()
        with self._lock:
            if self._loaded or self._loading:
                return
            if not self._want_entry_points:
                self._loaded = True
                return
            self._loading = True
            before = self._accounting.saved(), set(self._hooks_done)
            deferred = False
            try:
                for ep in entry_points(group=ENTRY_POINT_GROUP):
                    key = f"{ep.name}={ep.value}"
                    if key in self._hooks_done:
                        continue
                    if _importing(_module_of(ep)):
                        # Its module is importing right now (it registers by decorator
                        # and asked for traits before finishing): load it next time.
                        deferred = True
                        continue
                    self._run_hook(ep)
                    self._hooks_done.add(key)
            except BaseException:
                # All or nothing: a failing plugin leaves the registry as it was, and the
                # next call tries again (and fails again, naming the plugin).
                self._accounting.restore(before[0])
                self._hooks_done = before[1]
                raise
            else:
                self._loaded = not deferred
            finally:
                self._loading = False
                self._changed()

    def _run_hook(self, ep: EntryPoint) -> None:
        where = _where(ep)
        try:
            hook = ep.load()
        except Exception as exc:
            raise AdapterPluginError(ep.name, f"{where} failed to import: {exc!r}") from exc
        if not callable(hook):
            raise AdapterPluginError(
                ep.name,
                f"{where} must name a function "
                "`register(registry: kvspec_traits.extend.Registry) -> None`",
            )
        try:
            hook(self._target)
        except Exception as exc:
            raise AdapterPluginError(
                ep.name, f"{where} raised {exc!r}; fix or uninstall that package"
            ) from exc


def _where(ep: EntryPoint) -> str:
    """The entry point and the installed distribution that declares it."""
    dist = getattr(ep, "dist", None)
    try:
        package = f" of the installed package {dist.name!r} {dist.version}" if dist else ""
    except Exception:  # metadata broken too: the entry point still names the plugin
        package = ""
    return f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r}{package}"


def _module_of(ep: EntryPoint) -> str:
    """The module an entry point names. An unparsable value (``my-plugin.mod:register``)
    is a plugin that cannot load: :class:`AdapterPluginError` naming it, as for one that
    fails to import (importlib itself would raise an AttributeError about ``None``)."""
    try:
        module = ep.module
    except Exception as exc:
        raise AdapterPluginError(
            ep.name,
            f"{_where(ep)} is not a valid entry point: its value must be "
            "'dotted.module:function' (Python identifiers, no '-'); fix or uninstall "
            "that package",
        ) from exc
    return module


def _importing(module: str) -> bool:
    found = sys.modules.get(module)
    spec = getattr(found, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
