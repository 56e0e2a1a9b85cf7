"""The registry's answers, every cache bounded, and the warm path that reads them.

- per class (:data:`MAX_CLASSES` entries, held by ``_accounting.Accounting``): the
  resolution plan of a spec class, dropped oldest first when full;
- per spec (:data:`MAX_SPECS` specs, an :class:`Answers`): the answers of hashable specs
  by ``id(spec)`` (the warm path), the guarded answers of unhashable ones by ``id(spec)``,
  and the answers by value (equal specs share one), all emptied together when full. An
  entry keeps its spec alive, so while it exists no other object can have that id.

Nothing in a cache outlives a change of registrations (the registry empties them all),
and dropping an entry only costs a recomputation: no bound can make an answer stale.

An unhashable spec (vLLM's group spec, ``UniformTypeKVCacheSpecs``, is frozen but holds a
plain dict of member specs) is answered on the warm path behind a guard that tells whether
it still holds what it held when answered. For a frozen spec whose only unhashable fields
are plain dicts of hashable keys and values, the guard (:class:`Members`) is the identity
of each dict and of every key and value in it, compared in C (``map(operator.is_, ...)``):
any mutation of the dict (a member added, removed, replaced by another object, even an
equal one, or reordered) fails it, and the spec is answered afresh; the members' own
answers are cached by id like any hashable spec's, so the group's fresh answer reads them
warm. Any other unhashable spec is guarded by a snapshot of its fields
(:class:`Snapshot`), taken again on every call. Neither reads anything below the
language.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from operator import is_
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

from kvspec_traits._result_check import snapshot
from kvspec_traits._traits import KVLayoutTraits

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "MAX_CLASSES",
    "MAX_SPECS",
    "Answers",
    "Guard",
    "Members",
    "Snapshot",
    "member_guard",
    "put_bounded",
]

MAX_CLASSES: Final = 256
"""Spec classes whose resolution plan is kept (vLLM 0.34 has about 30)."""
MAX_SPECS: Final = 4096
"""Spec objects whose answers are kept; past this many, the per-spec caches start afresh."""

K = TypeVar("K")
V = TypeVar("V")


def put_bounded(cache: dict[K, V], key: K, value: V, limit: int) -> None:
    """``cache[key] = value``, first dropping the oldest entries past ``limit - 1``
    (callers hold the registry's lock)."""
    while len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value


# -- guards of unhashable specs ---------------------------------------------------------------


@final
class Members:
    """The guard of a frozen spec whose unhashable fields are plain dicts of hashable
    keys and values: each such field's dict, with its keys and values as they were.

    :meth:`holds` is true while every one of those fields is still the same dict holding
    the same key and value objects in the same order (identity, not equality: an equal
    member may differ in a field's type, which decides whether it is refused). It keeps
    the dicts, keys and values alive, so no other object can take their ids.
    """

    __slots__ = ("_fields",)

    def __init__(self, fields: tuple[tuple[str, dict[Any, Any]], ...]) -> None:
        self._fields = tuple(
            (name, held, tuple(held), tuple(held.values())) for name, held in fields
        )

    def holds(self, spec: object) -> bool:
        for name, held, keys, values in self._fields:
            now = getattr(spec, name, None)
            if (
                now is not held
                or len(held) != len(keys)
                or not all(map(is_, held, keys))
                or not all(map(is_, held.values(), values))
            ):
                return False
        return True

    def __repr__(self) -> str:
        return f"Members({', '.join(f'{name}: {len(keys)}' for name, _, keys, _ in self._fields)})"


@final
class Snapshot:
    """The guard of any other unhashable spec: a snapshot of its fields
    (``_result_check.snapshot``), taken again and compared on every call."""

    __slots__ = ("_field_names", "_snapshot")

    def __init__(self, field_names: tuple[str, ...], taken: object) -> None:
        self._field_names, self._snapshot = field_names, taken

    def holds(self, spec: object) -> bool:
        return bool(snapshot(spec, self._field_names) == self._snapshot)

    def __repr__(self) -> str:
        return "Snapshot(...)"


Guard = Members | Snapshot


def member_guard(spec: object, field_names: tuple[str, ...]) -> Members | None:
    """The :class:`Members` guard of ``spec``, taken now; None unless the spec is a
    frozen dataclass whose field values are all hashable but for plain dicts of hashable
    keys and values (a frozen spec's fields are trusted as a hashable spec's are; a
    hashable member's answer is cached by its id like any hashable spec's)."""
    params = getattr(type(spec), "__dataclass_params__", None)
    if params is None or not params.frozen:
        return None
    found: list[tuple[str, dict[Any, Any]]] = []
    for name in field_names:
        value = getattr(spec, name, None)
        try:
            if type(value) is dict:
                hash(tuple(value.items()))
                found.append((name, value))
            else:
                hash(value)
        except Exception:
            return None
    return Members(tuple(found)) if found else None


# -- the per-spec answers ---------------------------------------------------------------------


@dataclasses.dataclass(eq=False, slots=True)
class _Guarded:
    traits: KVLayoutTraits
    guard: Guard


class Answers:
    """The per-spec answers of one registry, bounded by :data:`MAX_SPECS` and emptied
    together (callers that change them hold the registry's lock)."""

    def __init__(self) -> None:
        # id(spec) -> its answer: hashable specs, the warm path's one lookup.
        self.by_id: dict[int, KVLayoutTraits] = {}
        # id(spec) -> its answer and the guard that says it still holds: unhashable specs.
        self.guarded: dict[int, _Guarded] = {}
        # Equal specs share one verified answer (unhashable ones by their snapshot).
        self.by_value: dict[object, KVLayoutTraits] = {}
        # Every spec cached here, kept alive so that no other object has its id.
        self.alive: list[object] = []

    def __len__(self) -> int:
        return len(self.alive)

    def clear(self) -> None:
        self.by_id.clear()
        self.guarded.clear()
        self.by_value.clear()
        self.alive.clear()

    def store(self, spec: object, key: object, traits: KVLayoutTraits, guard: Guard | None) -> None:
        """Keep ``traits`` as the answer of ``spec`` (of a hashable spec when ``guard`` is
        None) and, when ``key`` is not None, of every spec of that value."""
        if len(self.alive) >= MAX_SPECS:
            self.clear()
        if key is not None:
            self.by_value[key] = traits
        self.alive.append(spec)
        if guard is None:
            self.by_id[id(spec)] = traits
        else:
            self.guarded[id(spec)] = _Guarded(traits, guard)

    def warm_path(
        self, resolve: Callable[[KVCacheSpec], KVLayoutTraits]
    ) -> Callable[[KVCacheSpec], KVLayoutTraits]:
        """``traits_of`` as a closure over these answers: a hashable spec's hit is one
        frame, one id(), one dict subscript; an unhashable spec's adds a second lookup
        and its guard's check. The wheel is pure Python (py3-none-any), so this is the
        whole warm path."""
        by_id, guarded = self.by_id, self.guarded

        def traits_of(spec: KVCacheSpec) -> KVLayoutTraits:
            """The verified traits of a vLLM KV cache spec.

            Raises :class:`UnsupportedSpecError` when no adapter can answer for its class
            or one of its fields, :class:`InvalidSpecError` when a field holds a value
            that describes no layout, and :class:`TraitsMismatchError` when its adapter
            contradicts the spec's own byte math (all :class:`KVSpecTraitsError`). The
            first call per distinct spec resolves and verifies; later calls for the same
            object are one dict lookup (for a group spec, two and a check that its
            members are the same objects).
            """
            try:
                return by_id[id(spec)]
            except KeyError:
                pass
            # Outside the except block: an error of resolve() is not chained to the KeyError.
            entry = guarded.get(id(spec))
            if entry is not None and entry.guard.holds(spec):
                return entry.traits
            return resolve(spec)

        traits_of.__qualname__ = "Registry.traits_of"  # what a repr of it should say
        return traits_of
