"""Adapter registry: spec class -> adapter, resolved along the MRO, accounted, verified, cached.

The registry never imports vLLM itself. Built-in adapters live in ``_vllm_adapters`` and
register through :func:`register_adapter` like any third party; they are loaded the first
time a registration or a resolution needs them, and the ``kvspec_traits.adapters`` entry
points the first time a spec is resolved (never from inside a registration, so a module
that registers by decorator and by entry point cannot import itself half-initialised).

Resolving a spec, once per distinct spec:

1. find the adapter of its class or nearest ancestor (the MRO walk);
2. account for its fields: every dataclass field of its class, own and inherited, is
   either declared by the adapter (read, or known not to affect layout) or holds its
   default; otherwise :class:`UnsupportedSpecError` names the field and its value;
3. call the adapter and check that it returned valid traits;
4. check the traits against the spec's own byte math (``_verify``);
5. refuse a subclass without an adapter of its own that overrides a member the answer
   depends on (``page_size_bytes``, ``merge``, a window, ...): its parent's answer may
   not describe it, even when the byte math agrees.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Final, TypeVar, overload

from kvspec_traits._deps import needs
from kvspec_traits._errors import (
    AdapterConflictError,
    AdapterError,
    AdapterPluginError,
    AdapterResultError,
    KVSpecTraitsError,
    MixedGroupTraitsError,
    TraitsMismatchError,
    UnsupportedSpecError,
)
from kvspec_traits._traits import (
    KVLayoutTraits,
    PageComponent,
    TokenScope,
    TPLayout,
    trait_names,
)
from kvspec_traits._verify import CHECKED_PROPERTIES, first_mismatch

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "LAYOUT_MEMBERS",
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
# A resolution superseded by a registration is answered again, at most this many times.
_MAX_ATTEMPTS: Final = 8

LAYOUT_MEMBERS: Final = frozenset(
    {
        *CHECKED_PROPERTIES,
        "max_memory_usage_bytes",
        "merge",
        "merge_window_sizes",
        "get_num_kernel_states",
        "max_num_blocks_per_req",
        "max_admission_blocks_per_request",
        "num_retained_tokens",
        "prefix_replay_tokens",
        "copy_with_new_block_size",
        "get_block_stride_alignment",
        "block_table_token_alignment",
        "has_layer_views",
        "is_uniform_with_collection",
        "sliding_window",
        "attention_chunk_size",
        "rswa_window",
    }
)
"""Members of vLLM's spec API that decide a page's layout or which blocks a request
keeps. A subclass that overrides one of these (or a member its ancestor's adapter
``reads``) without an adapter of its own is refused: the parent's answer may not hold."""

SpecT = TypeVar("SpecT", bound="KVCacheSpec")
TraitsT = TypeVar("TraitsT", bound=KVLayoutTraits)
Adapter = Callable[[SpecT], KVLayoutTraits]

_resolving: contextvars.ContextVar[Registry] = contextvars.ContextVar("kvspec_traits_resolving")
_NO_DEFAULT: Final = object()


def resolving_registry() -> Registry:
    """The registry whose adapter is running now (the default one outside adapters).

    A group adapter resolves its members through it, so a test's isolated registry is
    used for the members too.
    """
    return _resolving.get(default_registry)


@dataclasses.dataclass(frozen=True, slots=True)
class _Accounting:
    """What one registration declares: ``reads`` None means 'the fields the class itself
    declares, plus what its nearest adapted ancestor accounts for'."""

    reads: frozenset[str] | None
    ignores: frozenset[str]


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """Everything resolution needs to know about one spec class, computed once."""

    owner: type[Any]
    adapter: Callable[[Any], KVLayoutTraits]
    adapter_name: str
    field_names: tuple[str, ...]
    # Unaccounted fields that must hold their default: (name, default).
    at_default: tuple[tuple[str, object], ...]
    # Unaccounted fields without a default: the class is refused outright.
    required: tuple[str, ...]
    # Overridden layout members of a subclass without its own adapter.
    members: tuple[str, ...]


class Registry:
    """Maps spec classes to adapters and answers :meth:`traits_of`.

    ``Registry()`` loads the built-in vLLM adapters and the entry-point adapters on first
    use; ``Registry(builtins=False, entry_points=False)`` starts empty. :meth:`copy`
    gives an isolated registry for tests.
    """

    def __init__(
        self, *, builtins: bool = True, entry_points: bool = True, name: str = "registry"
    ) -> None:
        self.name = name
        self._adapters: dict[type[Any], Callable[[Any], KVLayoutTraits]] = {}
        self._accounting: dict[type[Any], _Accounting] = {}
        self._want_builtins = builtins
        self._want_entry_points = entry_points
        self._builtins_loaded = not builtins
        self._loaded = not (builtins or entry_points)
        self._loading = False
        self._hooks_done: set[str] = set()
        self._lock = threading.RLock()
        # Bumped by every change of adapters: an answer computed under an older
        # generation is never cached.
        self._generation = 0
        self._by_type: dict[type[Any], _Plan] = {}
        # id(spec) -> traits: the warm path. `_alive` holds every spec cached here, so while
        # an entry exists no other live object can have that id; both are cleared together.
        self._by_id: dict[int, KVLayoutTraits] = {}
        self._alive: list[object] = []
        # equal specs share one verified answer (unhashable ones by their snapshot).
        self._by_value: dict[object, KVLayoutTraits] = {}
        # Unhashable specs (a group spec holds a dict): id -> (spec, snapshot, traits).
        # Never on the warm path: each call compares the snapshot, so a mutated spec is
        # answered afresh instead of from a stale entry.
        self._mutable: dict[int, tuple[object, object, KVLayoutTraits]] = {}
        self.traits_of: Callable[[KVCacheSpec], KVLayoutTraits] = _warm_path(
            self._by_id, self._resolve
        )
        """The verified traits of ``spec`` (see :func:`kvspec_traits.traits_of`)."""

    def __repr__(self) -> str:
        return f"<Registry {self.name!r}: {len(self._adapters)} adapters>"

    # -- registration -----------------------------------------------------------------

    def register(
        self,
        spec_type: type[SpecT],
        adapter: Callable[[SpecT], TraitsT],
        *,
        replace: bool = False,
        reads: Iterable[str] | None = None,
        ignores: Iterable[str] = (),
    ) -> None:
        """Register ``adapter`` for ``spec_type`` (and, through the MRO walk, for
        subclasses whose fields, members and byte math it accounts for).

        ``reads`` names the spec fields (and properties) the adapter's answer depends on,
        ``ignores`` the fields it knows do not affect the layout. Resolution refuses a
        spec whose class has a dataclass field in neither set holding a value other than
        its default. Without ``reads``, the adapter accounts for the fields ``spec_type``
        declares itself and inherits the accounting of its nearest adapted ancestor (or,
        with no adapted ancestor, every field ``spec_type`` has).

        Identical re-registration is a no-op; a different adapter (or accounting) for a
        class that has one raises :class:`AdapterConflictError` unless ``replace=True``.
        """
        if not isinstance(spec_type, type):
            raise TypeError(
                f"register_adapter takes a class, got {spec_type!r} "
                f"({type(spec_type).__qualname__}); pass the spec class itself"
            )
        if not callable(adapter):
            raise TypeError(
                f"adapter for {spec_type.__qualname__} must be callable, got {adapter!r}"
            )
        accounting = _Accounting(
            None if reads is None else _names(spec_type, "reads", reads),
            _names(spec_type, "ignores", ignores),
        )
        # Built-ins first, so a clash with them is refused now. Entry points are not
        # loaded from here: a module registering by decorator may itself be one.
        self._ensure_builtins()
        with self._lock:
            existing = self._adapters.get(spec_type)
            if (
                existing is adapter
                and not replace
                and (
                    self._accounting.get(spec_type) == accounting
                    or (reads is None and not accounting.ignores)
                )
            ):
                return  # the same registration again (a decorator and an entry point)
            if (
                existing is not None
                and not replace
                and (existing is not adapter or self._accounting.get(spec_type) != accounting)
            ):
                raise AdapterConflictError(spec_type, existing, adapter)
            self._adapters[spec_type] = adapter
            self._accounting[spec_type] = accounting
            self._invalidate()

    @overload
    def adapter(
        self,
        spec_type: type[SpecT],
        *,
        replace: bool = False,
        reads: Iterable[str] | None = None,
        ignores: Iterable[str] = (),
    ) -> Callable[[Callable[[SpecT], TraitsT]], Callable[[SpecT], TraitsT]]: ...
    @overload
    def adapter(
        self,
        spec_type: type[SpecT],
        fn: Callable[[SpecT], TraitsT],
        *,
        replace: bool = False,
        reads: Iterable[str] | None = None,
        ignores: Iterable[str] = (),
    ) -> Callable[[SpecT], TraitsT]: ...

    def adapter(
        self,
        spec_type: type[SpecT],
        fn: Callable[[SpecT], TraitsT] | None = None,
        *,
        replace: bool = False,
        reads: Iterable[str] | None = None,
        ignores: Iterable[str] = (),
    ) -> Any:
        """Decorator form of :meth:`register`; returns the adapter unchanged."""

        def decorate(f: Callable[[SpecT], TraitsT]) -> Callable[[SpecT], TraitsT]:
            self.register(spec_type, f, replace=replace, reads=reads, ignores=ignores)
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
        with self._lock:
            new._adapters = dict(self._adapters)
            new._accounting = dict(self._accounting)
        return new

    # -- questions about classes --------------------------------------------------------

    def owner_of(self, spec_type: type[Any]) -> type[Any]:
        """The class whose adapter serves ``spec_type`` (itself or an ancestor)."""
        return self._plan(spec_type).owner

    def accounted_fields(self, spec_type: type[Any]) -> frozenset[str]:
        """The names the adapter serving ``spec_type`` accounts for (reads or ignores)."""
        owner = self._plan(spec_type).owner
        with self._lock:
            return self._accounted(owner)

    def read_fields(self, spec_type: type[Any]) -> frozenset[str]:
        """The names the adapter serving ``spec_type`` reads (a subset of
        :meth:`accounted_fields`; the rest it knows do not affect the layout)."""
        owner = self._plan(spec_type).owner
        with self._lock:
            return self._reads(owner)

    def unaccounted_fields(self, spec_type: type[Any]) -> tuple[str, ...]:
        """The dataclass fields of ``spec_type`` (own and inherited) that the adapter
        serving it does not account for. Each must hold its default, or the spec is
        refused; a field without a default refuses the class outright."""
        plan = self._plan(spec_type)
        return (*(name for name, _ in plan.at_default), *plan.required)

    def overridden_members(self, spec_type: type[Any]) -> tuple[str, ...]:
        """Layout members that ``spec_type`` or a class between it and the class whose
        adapter serves it overrides (empty when the class has its own adapter)."""
        return self._plan(spec_type).members

    # -- resolution ---------------------------------------------------------------------

    def _resolve(self, spec: KVCacheSpec) -> KVLayoutTraits:
        hit = self._mutable.get(id(spec))
        if hit is not None and hit[0] is spec:
            plan = self._by_type.get(type(spec))
            if plan is not None and _snapshot(spec, plan.field_names) == hit[1]:
                return hit[2]
        traits: KVLayoutTraits | None = None
        for _ in range(_MAX_ATTEMPTS):
            generation = self._generation
            plan = self._plan(type(spec))
            snapshot: object = None
            key: object = None
            try:
                hash(spec)
                key = spec
            except TypeError:  # unhashable: keyed by a snapshot of its fields
                snapshot = _snapshot(spec, plan.field_names)
                try:
                    hash(snapshot)
                    key = (type(spec), snapshot)
                except TypeError:
                    key = None
            traits = self._by_value.get(key) if key is not None else None
            if traits is None:
                traits = self._answer(spec, plan)
            with self._lock:
                if generation != self._generation:
                    continue  # a registration superseded this adapter: answer again
                if len(self._alive) >= _MAX_CACHED_SPECS:
                    self._clear_answers()
                if key is not None:
                    self._by_value[key] = traits
                self._alive.append(spec)
                if snapshot is None:
                    self._by_id[id(spec)] = traits
                else:
                    self._mutable[id(spec)] = (spec, snapshot, traits)
            return traits
        # Registrations kept arriving: the latest answer, not cached.
        if traits is None:  # pragma: no cover - the loop runs at least once
            raise RuntimeError("unreachable")
        return traits

    def _answer(self, spec: KVCacheSpec, plan: _Plan) -> KVLayoutTraits:
        spec_type = type(spec)
        if plan.required:
            raise UnsupportedSpecError(
                spec_type,
                f"its field(s) {', '.join(plan.required)} have no default and no adapter "
                f"accounts for them (the adapter for {plan.owner.__qualname__} does not "
                "declare them)",
                field=plan.required[0],
                adapter=plan.adapter_name,
            )
        for name, default in plan.at_default:
            value = getattr(spec, name, _NO_DEFAULT)
            if not _same(value, default):
                raise UnsupportedSpecError(
                    spec_type,
                    f"its field {name}={value!r} is not the default {default!r}, and the "
                    f"adapter for {plan.owner.__qualname__} does not account for "
                    f"{name!r}: it would answer as if the field did not exist",
                    field=name,
                    value=value,
                    adapter=plan.adapter_name,
                )
        token = _resolving.set(self)
        try:
            traits = plan.adapter(spec)
        except KVSpecTraitsError as err:
            if plan.members and not isinstance(err, UnsupportedSpecError):
                raise self._members_error(spec_type, plan) from err
            err._set_adapter(plan.adapter_name)
            raise
        except Exception as err:
            if plan.members:
                raise self._members_error(spec_type, plan) from err
            raise AdapterError(spec, plan.adapter_name, err) from err
        finally:
            _resolving.reset(token)
        _check_result(spec, traits, plan.adapter_name)
        try:
            mismatch = first_mismatch(spec, traits)
        except KVSpecTraitsError as err:
            err._set_adapter(plan.adapter_name)
            raise
        if mismatch is not None:
            trait, got, want = mismatch
            if plan.owner is spec_type:
                raise TraitsMismatchError(spec, trait, got, want, plan.adapter_name)
            raise UnsupportedSpecError(
                spec_type,
                f"the nearest adapter, for {plan.owner.__qualname__}, would give "
                f"{trait}={got!r} but this spec's own math says {want!r}, so the "
                f"subclass is not laid out like its parent",
                field=trait,
                adapter=plan.adapter_name,
            )
        if plan.members:
            raise self._members_error(spec_type, plan)
        return traits

    @staticmethod
    def _members_error(spec_type: type[Any], plan: _Plan) -> UnsupportedSpecError:
        return UnsupportedSpecError(
            spec_type,
            f"it overrides {', '.join(plan.members)}, which the adapter for "
            f"{plan.owner.__qualname__} relies on, so that adapter's answer may not "
            "describe it",
            members=plan.members,
            adapter=plan.adapter_name,
        )

    def _plan(self, spec_type: type[Any]) -> _Plan:
        plan = self._by_type.get(spec_type)
        if plan is not None:
            return plan
        self._ensure_loaded()
        with self._lock:
            for klass in spec_type.__mro__:
                adapter = self._adapters.get(klass)
                if adapter is not None:
                    plan = self._make_plan(spec_type, klass, adapter)
                    self._by_type[spec_type] = plan
                    return plan
        raise UnsupportedSpecError(
            spec_type,
            "neither it nor any of its bases has an adapter (is it a vLLM KV cache spec? "
            "traits_of takes a spec instance, such as a FullAttentionSpec)",
            fixable=False,
        )

    def _make_plan(
        self, spec_type: type[Any], owner: type[Any], adapter: Callable[[Any], KVLayoutTraits]
    ) -> _Plan:
        accounted = self._accounted(owner)
        fields = dataclasses.fields(spec_type) if dataclasses.is_dataclass(spec_type) else ()
        at_default: list[tuple[str, object]] = []
        required: list[str] = []
        for f in fields:
            if f.name in accounted:
                continue
            if f.default is not dataclasses.MISSING:
                at_default.append((f.name, f.default))
            elif f.default_factory is not dataclasses.MISSING:
                at_default.append((f.name, f.default_factory()))
            else:
                required.append(f.name)
        field_names = tuple(f.name for f in fields)
        members: list[str] = []
        if owner is not spec_type:
            relied_on = LAYOUT_MEMBERS | self._reads(owner)
            for klass in spec_type.__mro__:
                if klass is owner:
                    break
                members.extend(
                    name
                    for name in vars(klass)
                    if name in relied_on and name not in field_names and name not in members
                )
        return _Plan(
            owner=owner,
            adapter=adapter,
            adapter_name=_adapter_name(adapter),
            field_names=field_names,
            at_default=tuple(at_default),
            required=tuple(required),
            members=tuple(sorted(members)),
        )

    def _accounted(self, klass: type[Any]) -> frozenset[str]:
        """Names the registration for ``klass`` accounts for (reads and ignores)."""
        declared = self._accounting.get(klass, _Accounting(None, frozenset()))
        if declared.reads is not None:
            return declared.reads | declared.ignores
        return _own_fields(klass) | self._inherited(klass) | declared.ignores

    def _reads(self, klass: type[Any]) -> frozenset[str]:
        declared = self._accounting.get(klass, _Accounting(None, frozenset()))
        if declared.reads is not None:
            return declared.reads
        return _own_fields(klass) | self._inherited(klass, reads_only=True)

    def _inherited(self, klass: type[Any], *, reads_only: bool = False) -> frozenset[str]:
        for parent in klass.__mro__[1:]:
            if parent in self._adapters:
                return self._reads(parent) if reads_only else self._accounted(parent)
        # No adapted ancestor accounts for the inherited fields: the adapter written for
        # this class is taken to account for every field it has.
        return _all_fields(klass)

    def _invalidate(self) -> None:
        # Under self._lock (or before the registry is shared).
        self._generation += 1
        self._by_type.clear()
        self._clear_answers()

    def _clear_answers(self) -> None:
        self._by_id.clear()
        self._alive.clear()
        self._by_value.clear()
        self._mutable.clear()

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
        for spec_type, adapter in builtins._adapters.items():
            if spec_type not in self._adapters:
                self._adapters[spec_type] = adapter
                self._accounting[spec_type] = builtins._accounting[spec_type]
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
                    if _importing(ep.module):
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
        where = f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r}"
        try:
            hook = ep.load()
        except Exception as exc:
            raise AdapterPluginError(ep.name, f"{where} failed to import: {exc!r}") from exc
        if not callable(hook):
            raise AdapterPluginError(
                ep.name,
                f"{where} must name a function "
                "`register(registry: kvspec_traits.Registry) -> None`",
            )
        try:
            hook(self)
        except Exception as exc:
            raise AdapterPluginError(
                ep.name, f"{where} raised {exc!r}; fix or uninstall that package"
            ) from exc


def _names(spec_type: type[Any], what: str, names: Iterable[str]) -> frozenset[str]:
    if isinstance(names, str):
        raise TypeError(
            f"{what} for {spec_type.__qualname__} takes field names, not one "
            f"string: write {what}=({names!r},)"
        )
    result = frozenset(names)
    bad = [n for n in result if not isinstance(n, str) or not n.isidentifier()]
    if bad:
        raise TypeError(f"{what} for {spec_type.__qualname__} must be field names, got {bad!r}")
    return result


def _own_fields(klass: type[Any]) -> frozenset[str]:
    """The dataclass fields ``klass`` declares in its own body."""
    if not dataclasses.is_dataclass(klass):
        return frozenset()
    annotations = vars(klass).get("__annotations__", {})
    return frozenset(f.name for f in dataclasses.fields(klass) if f.name in annotations)


def _all_fields(klass: type[Any]) -> frozenset[str]:
    if not dataclasses.is_dataclass(klass):
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(klass))


def _importing(module: str) -> bool:
    found = sys.modules.get(module)
    spec = getattr(found, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _same(value: object, default: object) -> bool:
    if value is default:
        return True
    if type(value) is not type(default):
        return False
    try:
        return bool(value == default)
    except Exception:  # a value that cannot be compared is not the default
        return False


def _frozen(value: object) -> object:
    # One level: a group spec's dict holds frozen member specs, compared by identity
    # first. Built in C (items(), tuple()), so a 61-layer group costs a few microseconds.
    if isinstance(value, dict):
        return (dict, tuple(value.items()))
    if isinstance(value, list):
        return (list, tuple(value))
    if isinstance(value, set):
        return (set, frozenset(value))
    return value


def _snapshot(spec: object, field_names: tuple[str, ...]) -> object:
    """The spec's field values, with containers turned into tuples: equal snapshots mean
    an unchanged spec (members compare by identity first, so this is cheap)."""
    if field_names:
        return tuple(_frozen(getattr(spec, name, None)) for name in field_names)
    return _frozen(dict(getattr(spec, "__dict__", {})))


# trait -> (accepted types, may be None)
_INT: Final = (int,)
_NUM: Final = (int, Fraction)
_TRAIT_TYPES: Final[dict[str, tuple[tuple[type[Any], ...], bool]]] = {
    "spec_name": ((str,), False),
    "is_mla": ((bool,), False),
    "tp_layout": ((TPLayout,), False),
    "tp_shards": (_INT, True),
    "token_scope": ((TokenScope,), False),
    "window_tokens": (_INT, True),
    "block_size": (_INT, False),
    "num_head_slots": (_INT, False),
    "kv_head_contiguous": ((bool,), False),
    "tokens_per_state": (_NUM, True),
    "states_per_block": (_INT, False),
    "state_bytes": (_INT, False),
    "unpadded_page_size_bytes": (_INT, False),
    "page_size_bytes": (_INT, False),
    "per_token_bytes": (_NUM, True),
    "dtype": ((str,), True),
    "kv_quant_mode": ((str,), False),
    "components": ((tuple,), False),
    "prefix_cacheable": ((bool,), False),
    "uses_slot_mapping": ((bool,), False),
    "transferable": ((bool,), False),
}
_POSITIVE: Final = frozenset(
    {"block_size", "num_head_slots", "states_per_block", "tp_shards", "tokens_per_state"}
)
_NON_NEGATIVE: Final = frozenset(
    {"state_bytes", "unpadded_page_size_bytes", "page_size_bytes", "per_token_bytes"}
)
_WINDOWED: Final = frozenset(
    {TokenScope.SLIDING_WINDOW, TokenScope.CHUNKED, TokenScope.PROMPT_AND_WINDOW, TokenScope.RING}
)


def _check_result(spec: object, traits: object, adapter: str) -> None:
    """Raise :class:`AdapterResultError` unless ``traits`` is a valid KVLayoutTraits."""
    values: dict[str, object] = {}
    for name in trait_names():
        accepted, optional = _TRAIT_TYPES[name]
        try:
            value = getattr(traits, name)
        except MixedGroupTraitsError:
            continue  # a group whose members disagree: a valid answer, asked per layer
        except AttributeError:
            raise AdapterResultError(spec, adapter, name, traits, "is missing") from None
        except Exception as exc:
            raise AdapterResultError(
                spec, adapter, name, traits, f"raised {type(exc).__name__}: {exc}"
            ) from exc
        if value is None and optional:
            values[name] = value
            continue
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            want = " or ".join(t.__name__ for t in accepted) + (" or None" if optional else "")
            raise AdapterResultError(
                spec, adapter, name, traits, f"is {value!r} ({type(value).__name__}), not {want}"
            )
        if name in _POSITIVE and value <= 0:
            raise AdapterResultError(spec, adapter, name, traits, f"is {value!r}, not > 0")
        if name in _NON_NEGATIVE and value < 0:
            raise AdapterResultError(spec, adapter, name, traits, f"is {value!r}, not >= 0")
        values[name] = value
    components = values.get("components", ())
    if isinstance(components, tuple) and not all(isinstance(c, PageComponent) for c in components):
        raise AdapterResultError(
            spec, adapter, "components", traits, "holds something other than PageComponent"
        )
    scope, window = values.get("token_scope"), values.get("window_tokens", _NO_DEFAULT)
    if window is _NO_DEFAULT or scope is None:
        pass  # a group whose members disagree on one of them
    elif scope in _WINDOWED and (not isinstance(window, int) or window <= 0):
        raise AdapterResultError(
            spec,
            adapter,
            "window_tokens",
            traits,
            f"is {window!r} for the windowed scope {scope}; a positive "
            "number of tokens is required",
        )
    elif scope not in _WINDOWED and window is not None:
        raise AdapterResultError(
            spec,
            adapter,
            "window_tokens",
            traits,
            f"is {window!r} for the unwindowed scope {scope}; it must be None",
        )
    page, unpadded = values.get("page_size_bytes"), values.get("unpadded_page_size_bytes")
    if isinstance(page, int) and isinstance(unpadded, int) and page < unpadded:
        raise AdapterResultError(
            spec,
            adapter,
            "page_size_bytes",
            traits,
            f"is {page}, smaller than its content {unpadded}",
        )


def _warm_path(
    by_id: dict[int, KVLayoutTraits], resolve: Callable[[KVCacheSpec], KVLayoutTraits]
) -> Callable[[KVCacheSpec], KVLayoutTraits]:
    # A closure, pure Python (the wheel is py3-none-any): a hit is one frame, one id() and
    # one dict subscript, with no attribute lookups; the try costs nothing on a hit.
    def traits_of(spec: KVCacheSpec) -> KVLayoutTraits:
        """The verified traits of a vLLM KV cache spec.

        Raises :class:`UnsupportedSpecError` when no adapter can answer for its class or
        one of its fields, :class:`InvalidSpecError` when a field holds a value that
        describes no layout, and :class:`TraitsMismatchError` when its adapter
        contradicts the spec's own byte math (all :class:`KVSpecTraitsError`). The first
        call per distinct spec resolves and verifies; later calls for the same object
        are one dict lookup.
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
def register_adapter(
    spec_type: type[SpecT],
    *,
    registry: Registry | None = None,
    replace: bool = False,
    reads: Iterable[str] | None = None,
    ignores: Iterable[str] = (),
) -> Callable[[Callable[[SpecT], TraitsT]], Callable[[SpecT], TraitsT]]: ...
@overload
def register_adapter(
    spec_type: type[SpecT],
    fn: Callable[[SpecT], TraitsT],
    *,
    registry: Registry | None = None,
    replace: bool = False,
    reads: Iterable[str] | None = None,
    ignores: Iterable[str] = (),
) -> Callable[[SpecT], TraitsT]: ...


def register_adapter(
    spec_type: type[SpecT],
    fn: Callable[[SpecT], TraitsT] | None = None,
    *,
    registry: Registry | None = None,
    replace: bool = False,
    reads: Iterable[str] | None = None,
    ignores: Iterable[str] = (),
) -> Any:
    """Register an adapter for ``spec_type``: ``@register_adapter(MySpec)`` on
    ``def adapt(spec: MySpec) -> KVLayoutTraits``.

    The adapter's parameter type must accept ``spec_type`` (mypy checks it), and the
    function is returned unchanged. ``registry`` defaults to the default registry;
    ``reads`` and ``ignores`` declare the fields it accounts for (see
    :meth:`Registry.register`).
    """
    target = default_registry if registry is None else registry
    if fn is None:
        return target.adapter(spec_type, replace=replace, reads=reads, ignores=ignores)
    return target.adapter(spec_type, fn, replace=replace, reads=reads, ignores=ignores)
