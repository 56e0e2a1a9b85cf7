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
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar, overload

from kvspec_traits._accounting import (
    LAYOUT_MEMBERS,
    Accounting,
    Declared,
    Plan,
    Registration,
    field_names_of,
    members_error,
)
from kvspec_traits._caches import Answers, Guard, Snapshot, member_guard
from kvspec_traits._errors import (
    AdapterConflictError,
    AdapterError,
    InvalidSpecError,
    KVSpecTraitsError,
    TraitsMismatchError,
    UnsupportedSpecError,
    not_a_spec_error,
)
from kvspec_traits._loading import ENTRY_POINT_GROUP, Loader
from kvspec_traits._result_check import check_result as _check_result
from kvspec_traits._result_check import same as _same
from kvspec_traits._result_check import snapshot as _snapshot
from kvspec_traits._result_check import value_types
from kvspec_traits._traits import KVLayoutTraits
from kvspec_traits._verify import first_mismatch, inherited_page_property

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

# A resolution superseded by a registration or a mutation is answered again, at most this often.
_MAX_ATTEMPTS: Final = 8

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


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Final = _Unset()


def _check_built(spec: object, plan: Plan) -> None:
    """Refuse a spec made without its constructor (``object.__new__``): its fields are
    unset, so even hashing it would fail with a bare AttributeError."""
    for name in plan.field_names:
        if not hasattr(spec, name):
            raise InvalidSpecError(
                spec,
                name,
                _UNSET,
                f"set by {type(spec).__qualname__}(...): this spec was made without its "
                "constructor (object.__new__, or an __init__ that failed part-way)",
            )


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
        self._lock = threading.RLock()
        # Bumped by every change of adapters: an answer computed under an older
        # generation is never cached.
        self._generation = 0
        # Its parts, each an object it owns (none inherited, none shared with another
        # registry): the registrations and each class's plan; what loads built-ins and
        # entry points into them; the per-spec answers the warm path reads. One lock
        # guards all three, and every change of registrations empties plans and answers.
        self._accounting = Accounting()
        self._answers = Answers()
        self._loader = Loader(
            self,
            self._accounting,
            self._lock,
            self._invalidate,
            builtins=builtins,
            entry_points=entry_points,
        )
        self.traits_of: Callable[[KVCacheSpec], KVLayoutTraits] = self._answers.warm_path(
            self._resolve
        )
        """The verified traits of ``spec`` (see :func:`kvspec_traits.traits_of`)."""

    def __repr__(self) -> str:
        return f"<Registry {self.name!r}: {len(self._accounting.adapters)} adapters>"

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
        its default. Without ``reads`` the adapter declares none (inherited fields
        included). A name that is neither a field nor a member of ``spec_type`` (nor a
        name of vLLM's spec API from the built-in field lists) raises
        :class:`UnknownFieldNameError`.

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
        # Without reads= the adapter declares none: each field it does not ignore must
        # hold its default (a field counted as read must be named, never assumed).
        declared = Declared(
            field_names_of(spec_type, "reads", () if reads is None else reads),
            field_names_of(spec_type, "ignores", ignores),
        )
        # Built-ins first, so a clash with them is refused now. Entry points are not
        # loaded from here: a module registering by decorator may itself be one.
        self._loader.ensure_builtins()
        with self._lock:
            existing = self._accounting.adapters.get(spec_type)
            before = self._accounting.declared.get(spec_type)
            if (
                existing is adapter
                and not replace
                and (before == declared or (reads is None and not declared.ignores))
            ):
                return  # the same registration again (a decorator and an entry point)
            if (
                existing is not None
                and not replace
                and (existing is not adapter or before != declared)
            ):
                raise AdapterConflictError(spec_type, existing, adapter)
            self._accounting.set(spec_type, adapter, declared)
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
        self._loader.ensure_loaded()
        return dict(self._accounting.adapters)

    def registrations(self) -> Mapping[type[Any], Registration]:
        """A snapshot of the registrations by class: each adapter with the fields it
        declared it reads and ignores (loads built-ins first)."""
        self._loader.ensure_loaded()
        with self._lock:
            return self._accounting.registrations()

    def copy(self, *, name: str | None = None) -> Registry:
        """An isolated registry with the same adapters (built-ins loaded)."""
        self._loader.ensure_loaded()
        new = Registry(builtins=False, entry_points=False, name=name or f"copy of {self.name}")
        with self._lock:
            new._accounting.restore(self._accounting.saved())
        return new

    # -- questions about classes --------------------------------------------------------

    def owner_of(self, spec_type: type[Any]) -> type[Any]:
        """The class whose adapter serves ``spec_type`` (itself or an ancestor)."""
        return self._plan(spec_type).owner

    def accounted_fields(self, spec_type: type[Any]) -> frozenset[str]:
        """The names the adapter serving ``spec_type`` accounts for (reads or ignores)."""
        owner = self._plan(spec_type).owner
        with self._lock:
            return self._accounting.accounted(owner)

    def read_fields(self, spec_type: type[Any]) -> frozenset[str]:
        """The names the adapter serving ``spec_type`` reads (a subset of
        :meth:`accounted_fields`; the rest it knows do not affect the layout)."""
        owner = self._plan(spec_type).owner
        with self._lock:
            return self._accounting.reads(owner)

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

    def _plan(self, spec_type: type[Any]) -> Plan:
        plan = self._accounting.plans.get(spec_type)
        if plan is not None:
            return plan
        self._loader.ensure_loaded()
        with self._lock:
            return self._accounting.plan(spec_type)

    def _plan_of(self, spec: object) -> Plan:
        """The plan of ``spec``'s class; for a spec's look-alike (a class, a cache group,
        a config) that has none, :class:`NotASpecError` naming the call to make."""
        try:
            return self._plan(type(spec))
        except UnsupportedSpecError:
            mistaken = not_a_spec_error(spec)
            if mistaken is None:
                raise
            raise mistaken from None

    # -- resolution ---------------------------------------------------------------------

    def _resolve(self, spec: KVCacheSpec) -> KVLayoutTraits:
        """The answer for a spec the warm path does not hold (or whose guard failed):
        from an equal spec's answer when there is one, else computed and verified; then
        kept for the warm path, unless a registration or a mutation of the spec
        superseded it while it was answered (then answered again)."""
        traits: KVLayoutTraits | None = None
        for _ in range(_MAX_ATTEMPTS):
            generation = self._generation
            plan = self._plan_of(spec)
            _check_built(spec, plan)
            key: object = None
            guard: Guard | None = None
            try:
                hash(spec)
                key = (spec, value_types(spec, plan.field_names))
            except Exception:  # unhashable: guarded, and keyed by a snapshot of its fields
                guard = member_guard(spec, plan.field_names)  # taken before the snapshot
                snapshot = _snapshot(spec, plan.field_names)
                if guard is None:
                    guard = Snapshot(plan.field_names, snapshot)
                try:
                    hash(snapshot)
                    key = (type(spec), snapshot)
                except Exception:
                    key = None
            traits = self._answers.by_value.get(key) if key is not None else None
            if traits is None:
                traits = self._answer(spec, plan)
            if guard is not None and not guard.holds(spec):
                continue  # changed while answered: answer it again
            with self._lock:
                if generation != self._generation:
                    continue  # a registration superseded this adapter: answer again
                self._answers.store(spec, key, traits, guard)
            return traits
        # Registrations kept arriving: the latest answer, not cached.
        if traits is None:  # pragma: no cover - the loop runs at least once
            raise RuntimeError("unreachable")
        return traits

    def _answer(self, spec: KVCacheSpec, plan: Plan) -> KVLayoutTraits:
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
                raise members_error(spec_type, plan) from err
            err._set_adapter(plan.adapter_name)
            raise
        except Exception as err:
            if plan.members:
                raise members_error(spec_type, plan) from err
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
                why = inherited_page_property(spec, trait, traits)  # the spec's fault?
                raise TraitsMismatchError(spec, trait, got, want, plan.adapter_name, inherited=why)
            raise UnsupportedSpecError(
                spec_type,
                f"the nearest adapter, for {plan.owner.__qualname__}, would give "
                f"{trait}={got!r} but this spec's own math says {want!r}, so the "
                f"subclass is not laid out like its parent",
                field=trait,
                adapter=plan.adapter_name,
            )
        if plan.members:
            raise members_error(spec_type, plan)
        return traits

    def _invalidate(self) -> None:
        # Under self._lock (or before the registry is shared).
        self._generation += 1
        self._accounting.plans.clear()
        self._answers.clear()


default_registry: Final = Registry(name="default")

# The default registry's answers, which traits_of reads directly: a warm lookup is then one
# call, one id() and one dict subscript, as fast as the closure Registry.traits_of (module
# globals cost what closure cells do). Answers.clear() empties these dicts in place and
# never rebinds them, so they stay the registry's own.
_by_id: Final = default_registry._answers.by_id
_guarded: Final = default_registry._answers.guarded
_resolve: Final = default_registry._resolve


def traits_of(spec: KVCacheSpec) -> KVLayoutTraits:
    """The verified traits of a vLLM KV cache spec, answered by the default registry
    (the built-in adapters and every installed extension's).

    Raises :class:`UnsupportedSpecError` when no adapter can answer for its class or one
    of its fields (a non-spec too: :class:`NotASpecError`), :class:`InvalidSpecError`
    when a field holds a value that describes no layout, and :class:`TraitsMismatchError`
    when its adapter contradicts the spec's own byte math (all
    :class:`KVSpecTraitsError`). The first call per distinct spec resolves and verifies;
    later calls for the same object are one dict lookup (for a group spec, two and a
    check that its members are the same objects). ``Registry.traits_of`` answers the
    same question for another registry.
    """
    try:
        return _by_id[id(spec)]
    except KeyError:
        pass
    # Outside the except block: an error of resolve() is not chained to the KeyError.
    entry = _guarded.get(id(spec))
    if entry is not None and entry.guard.holds(spec):
        return entry.traits
    return _resolve(spec)


# One function for both spellings: default_registry.traits_of is kvspec_traits.traits_of.
default_registry.traits_of = traits_of


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
    ``def adapt(spec: MySpec) -> LayoutTraits``.

    The adapter's parameter type must accept ``spec_type`` (mypy checks it), and the
    function is returned unchanged. ``registry`` defaults to the default registry;
    ``reads`` and ``ignores`` declare the fields it accounts for (see
    :meth:`Registry.register`).
    """
    target = default_registry if registry is None else registry
    if fn is None:
        return target.adapter(spec_type, replace=replace, reads=reads, ignores=ignores)
    return target.adapter(spec_type, fn, replace=replace, reads=reads, ignores=ignores)
