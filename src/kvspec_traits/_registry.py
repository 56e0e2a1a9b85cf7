"""Adapter registry: spec class -> adapter, resolved along the MRO, verified, cached.

The registry never imports vLLM itself. Built-in adapters live in ``_vllm_adapters`` and
register through :func:`register_adapter` like any third party; they are loaded the first
time a spec has to be resolved, together with the ``kvspec_traits.adapters`` entry points.
"""

from __future__ import annotations

import contextvars
import importlib
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Final, TypeVar, overload

from kvspec_traits._deps import needs
from kvspec_traits._errors import AdapterConflictError, AdapterPluginError, UnsupportedSpecError
from kvspec_traits._traits import KVLayoutTraits
from kvspec_traits._verify import first_mismatch, verify

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "Adapter",
    "Registry",
    "default_registry",
    "register_adapter",
    "resolving_registry",
    "traits_of",
]

ENTRY_POINT_GROUP: Final = "kvspec_traits.adapters"
_BUILTIN_MODULE: Final = "kvspec_traits._vllm_adapters"
# A spec cache keyed by id() keeps its specs alive; past this many it starts afresh.
_MAX_CACHED_SPECS: Final = 1 << 16

SpecT = TypeVar("SpecT", bound="KVCacheSpec")
TraitsT = TypeVar("TraitsT", bound=KVLayoutTraits)
Adapter = Callable[[SpecT], KVLayoutTraits]

_resolving: contextvars.ContextVar[Registry] = contextvars.ContextVar("kvspec_traits_resolving")


def resolving_registry() -> Registry:
    """The registry whose adapter is running now (the default one outside adapters).

    A group adapter resolves its members through it, so a test's isolated registry is
    used for the members too.
    """
    return _resolving.get(default_registry)


class Registry:
    """Maps spec classes to adapters and answers :meth:`traits_of`.

    ``Registry()`` loads the built-in vLLM adapters and the entry-point adapters on first
    use; ``Registry(builtins=False, entry_points=False)`` starts empty. :meth:`copy`
    gives an isolated registry for tests.
    """

    def __init__(self, *, builtins: bool = True, entry_points: bool = True,
                 name: str = "registry") -> None:
        self.name = name
        self._adapters: dict[type[Any], Callable[[Any], KVLayoutTraits]] = {}
        self._want_builtins = builtins
        self._want_entry_points = entry_points
        self._loaded = not (builtins or entry_points)
        self._loading = False
        self._lock = threading.RLock()
        # type -> (owning class, adapter); filled on first resolution of a class.
        self._by_type: dict[type[Any], tuple[type[Any], Callable[[Any], KVLayoutTraits]]] = {}
        # id(spec) -> traits: the warm path. `_alive` holds every spec cached here, so while
        # an entry exists no other live object can have that id; both are cleared together.
        self._by_id: dict[int, KVLayoutTraits] = {}
        self._alive: list[object] = []
        # equal (hashable) specs share one verified answer.
        self._by_value: dict[object, KVLayoutTraits] = {}
        self.traits_of: Callable[[KVCacheSpec], KVLayoutTraits] = _warm_path(
            self._by_id, self._resolve)
        """The verified traits of ``spec`` (see :func:`kvspec_traits.traits_of`)."""

    def __repr__(self) -> str:
        return f"<Registry {self.name!r}: {len(self._adapters)} adapters>"

    # -- registration -----------------------------------------------------------------

    def register(self, spec_type: type[SpecT], adapter: Callable[[SpecT], TraitsT], *,
                 replace: bool = False) -> None:
        """Register ``adapter`` for ``spec_type`` (and, through the MRO walk, for
        subclasses whose byte math it reproduces).

        Identical re-registration is a no-op; a different adapter for a class that has
        one raises :class:`AdapterConflictError` unless ``replace=True``.
        """
        if not isinstance(spec_type, type):
            raise TypeError(
                f"register_adapter takes a class, got {spec_type!r} "
                f"({type(spec_type).__qualname__}); pass the spec class itself"
            )
        if not callable(adapter):
            raise TypeError(f"adapter for {spec_type.__qualname__} must be callable, "
                            f"got {adapter!r}")
        # Built-ins and entry points first, so a clash with them is refused now, not
        # silently overridden by whichever of the two comes first.
        self._ensure_loaded()
        with self._lock:
            existing = self._adapters.get(spec_type)
            if existing is not None and existing is not adapter and not replace:
                raise AdapterConflictError(spec_type, existing, adapter)
            self._adapters[spec_type] = adapter
            self._invalidate()

    @overload
    def adapter(self, spec_type: type[SpecT], *, replace: bool = False
                ) -> Callable[[Callable[[SpecT], TraitsT]], Callable[[SpecT], TraitsT]]: ...
    @overload
    def adapter(self, spec_type: type[SpecT], fn: Callable[[SpecT], TraitsT], *,
                replace: bool = False) -> Callable[[SpecT], TraitsT]: ...

    def adapter(self, spec_type: type[SpecT], fn: Callable[[SpecT], TraitsT] | None = None,
                *, replace: bool = False) -> Any:
        """Decorator form of :meth:`register`; returns the adapter unchanged."""
        def decorate(f: Callable[[SpecT], TraitsT]) -> Callable[[SpecT], TraitsT]:
            self.register(spec_type, f, replace=replace)
            return f
        return decorate if fn is None else decorate(fn)

    def adapters(self) -> Mapping[type[Any], Callable[[Any], KVLayoutTraits]]:
        """A snapshot of the registered adapters by class (loads built-ins first)."""
        self._ensure_loaded()
        return dict(self._adapters)

    def copy(self, *, name: str | None = None) -> Registry:
        """An isolated registry with the same adapters (built-ins loaded)."""
        self._ensure_loaded()
        new = Registry(builtins=False, entry_points=False, name=name or f"copy of {self.name}")
        new._adapters = dict(self._adapters)
        return new

    # -- resolution ---------------------------------------------------------------------

    def owner_of(self, spec_type: type[Any]) -> type[Any]:
        """The class whose adapter serves ``spec_type`` (itself or an ancestor)."""
        return self._lookup(spec_type)[0]

    def _resolve(self, spec: KVCacheSpec) -> KVLayoutTraits:
        spec_type = type(spec)
        owner, adapter = self._lookup(spec_type)
        try:
            key: object = spec
            cached = self._by_value.get(key)
        except TypeError:  # unhashable (a group spec holds a dict)
            key, cached = None, None
        if cached is None:
            token = _resolving.set(self)
            try:
                traits = adapter(spec)
            finally:
                _resolving.reset(token)
            if owner is spec_type:
                verify(spec, traits, adapter=_adapter_name(adapter))
            else:
                mismatch = first_mismatch(spec, traits)
                if mismatch is not None:
                    field, got, want = mismatch
                    raise UnsupportedSpecError(
                        spec_type,
                        f"the nearest adapter, for {owner.__qualname__}, would give "
                        f"{field}={got!r} but this spec's own math says {want!r}, so the "
                        f"subclass is not laid out like its parent",
                    )
            if key is not None:
                self._by_value[key] = traits
            cached = traits
        if len(self._by_id) >= _MAX_CACHED_SPECS:
            self._by_id.clear()
            self._alive.clear()
            self._by_value.clear()
        self._alive.append(spec)
        self._by_id[id(spec)] = cached
        return cached

    def _lookup(self, spec_type: type[Any]) -> tuple[type[Any], Callable[[Any], KVLayoutTraits]]:
        found = self._by_type.get(spec_type)
        if found is not None:
            return found
        self._ensure_loaded()
        with self._lock:
            for klass in spec_type.__mro__:
                adapter = self._adapters.get(klass)
                if adapter is not None:
                    self._by_type[spec_type] = (klass, adapter)
                    return klass, adapter
        raise UnsupportedSpecError(
            spec_type,
            "neither it nor any of its bases has an adapter (is it a vLLM KV cache spec? "
            "traits_of takes a spec instance, such as a FullAttentionSpec)",
            fixable=False,
        )

    def _invalidate(self) -> None:
        self._by_type.clear()
        self._by_id.clear()
        self._alive.clear()
        self._by_value.clear()

    def _ensure_loaded(self) -> None:
        if not self._loaded and not self._loading:
            self._load()

    def _load(self) -> None:
        with self._lock:
            if self._loaded or self._loading:
                return
            # Entry points call back into register(), which must not load again.
            self._loading = True
            before = dict(self._adapters)
            try:
                if self._want_builtins:
                    # The built-in adapters import vLLM and torch, never pinned by us.
                    with needs("resolving vLLM KV cache specs (kvspec_traits.traits_of)"):
                        builtins = importlib.import_module(_BUILTIN_MODULE).BUILTINS
                    for spec_type, adapter in builtins._adapters.items():
                        self._adapters.setdefault(spec_type, adapter)
                if self._want_entry_points:
                    for ep in entry_points(group=ENTRY_POINT_GROUP):
                        self._run_hook(ep)
            except BaseException:
                # All or nothing: a failing plugin leaves the registry as it was, and the
                # next call tries again (and fails again, naming the plugin).
                self._adapters.clear()
                self._adapters.update(before)
                raise
            else:
                self._loaded = True
            finally:
                self._loading = False
                self._invalidate()

    def _run_hook(self, ep: EntryPoint) -> None:
        where = f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r}"
        try:
            hook = ep.load()
        except Exception as exc:
            raise AdapterPluginError(ep.name, f"{where} failed to import: {exc!r}") from exc
        if not callable(hook):
            raise AdapterPluginError(
                ep.name, f"{where} must name a function "
                "`register(registry: kvspec_traits.Registry) -> None`")
        try:
            hook(self)
        except Exception as exc:
            raise AdapterPluginError(ep.name, f"{where} raised {exc!r}; fix or uninstall "
                                     "that package") from exc


def _warm_path(by_id: dict[int, KVLayoutTraits],
               resolve: Callable[[KVCacheSpec], KVLayoutTraits]
               ) -> Callable[[KVCacheSpec], KVLayoutTraits]:
    # A closure, pure Python (the wheel is py3-none-any): a hit is one frame, one id() and
    # one dict subscript, with no attribute lookups; the try costs nothing on a hit.
    def traits_of(spec: KVCacheSpec) -> KVLayoutTraits:
        """The verified traits of a vLLM KV cache spec.

        Raises :class:`UnsupportedSpecError` when no adapter can answer for its class and
        :class:`TraitsMismatchError` when its adapter contradicts the spec's own byte math.
        The first call per distinct spec resolves and verifies; later calls for the same
        object are one dict lookup.
        """
        try:
            return by_id[id(spec)]
        except KeyError:
            pass
        # Outside the except block: an error of resolve() is not chained to the KeyError.
        return resolve(spec)

    return traits_of


def _adapter_name(adapter: object) -> str:
    return f"{getattr(adapter, '__module__', '?')}.{getattr(adapter, '__qualname__', adapter)}"


default_registry: Final = Registry(name="default")

# The bound method itself, not a wrapper: a warm lookup is then one call and one dict get.
traits_of: Final = default_registry.traits_of


@overload
def register_adapter(spec_type: type[SpecT], *, registry: Registry | None = None,
                     replace: bool = False
                     ) -> Callable[[Callable[[SpecT], TraitsT]], Callable[[SpecT], TraitsT]]: ...
@overload
def register_adapter(spec_type: type[SpecT], fn: Callable[[SpecT], TraitsT], *,
                     registry: Registry | None = None, replace: bool = False
                     ) -> Callable[[SpecT], TraitsT]: ...


def register_adapter(spec_type: type[SpecT], fn: Callable[[SpecT], TraitsT] | None = None, *,
                     registry: Registry | None = None, replace: bool = False) -> Any:
    """Register an adapter for ``spec_type``: ``@register_adapter(MySpec)`` on
    ``def adapt(spec: MySpec) -> KVLayoutTraits``.

    The adapter's parameter type must accept ``spec_type`` (mypy checks it), and the
    function is returned unchanged. ``registry`` defaults to the default registry.
    """
    target = default_registry if registry is None else registry
    if fn is None:
        return target.adapter(spec_type, replace=replace)
    return target.adapter(spec_type, fn, replace=replace)
