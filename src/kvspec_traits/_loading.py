"""Loading adapters into a registry: the built-in vLLM adapters (copied from
``_vllm_adapters.BUILTINS`` the first time they are needed) and the
``kvspec_traits.adapters`` entry points (all or nothing: a failing plugin leaves the
registry as it was, and is named)."""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Final

from kvspec_traits._accounting import _Accounting
from kvspec_traits._deps import needs
from kvspec_traits._errors import AdapterPluginError
from kvspec_traits._state import RegistryState

if TYPE_CHECKING:
    from kvspec_traits._registry import Registry


__all__ = ["ENTRY_POINT_GROUP", "AdapterLoading"]

ENTRY_POINT_GROUP: Final = "kvspec_traits.adapters"
_BUILTIN_MODULE: Final = "kvspec_traits._vllm_adapters"


class AdapterLoading(RegistryState):
    """Loading built-ins and entry points (mixed into :class:`~kvspec_traits.extend.Registry`;
    the state is :class:`RegistryState`'s)."""

    # -- loading ------------------------------------------------------------------------

    def _ensure_builtins(self) -> None:
        if self._builtins_loaded:
            return
        with self._lock:
            self._copy_builtins()

    def _copy_builtins(self) -> None:
        if self._builtins_loaded:  # another thread copied them while we waited
            return
        # The built-in adapters import vLLM and torch, never pinned by us.
        with needs("resolving vLLM KV cache specs (kvspec_traits.traits_of)"):
            builtins: Registry = importlib.import_module(_BUILTIN_MODULE).BUILTINS
        for spec_type, registration in builtins.registrations().items():
            if spec_type not in self._adapters:
                self._adapters[spec_type] = registration.adapter
                self._accounting[spec_type] = _Accounting(registration.reads, registration.ignores)
        self._builtins_loaded = True
        self._invalidate()

    def _ensure_loaded(self) -> None:
        if not self._loaded and not self._loading:
            self._load()

    def _load(self) -> None:
        self._ensure_builtins()
        with self._lock:
            if self._loaded or self._loading:
                return
            if not self._want_entry_points:
                self._loaded = True
                return
            # Entry points call back into register(), which must not load again.
            self._loading = True
            before = (dict(self._adapters), dict(self._accounting), set(self._hooks_done))
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
                self._adapters, self._accounting, self._hooks_done = before
                raise
            else:
                self._loaded = not deferred
            finally:
                self._loading = False
                self._invalidate()

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
            hook(self)
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
