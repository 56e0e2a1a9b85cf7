"""The registry's caches, every one bounded, and the warm path that reads them.

- per class (:data:`MAX_CLASSES` entries): the resolution plan of a spec class, dropped
  oldest first when full;
- per spec (:data:`MAX_SPECS` specs): the answers by ``id(spec)`` (the warm path), by
  value (equal specs share one answer) and the snapshots of unhashable specs, all
  emptied together when full. An entry keeps its spec alive, so while it exists no other
  object can have that id.

Nothing in a cache outlives a change of registrations (the registry empties them all),
and dropping an entry only costs a recomputation: no bound can make an answer stale.

A frozen spec whose only unhashable field is a plain dict of hashable values (vLLM's
``UniformTypeKVCacheSpecs``) is answered on the warm path too, guarded by the dict's
version: CPython gives every dict a version tag that changes on each mutation (PEP 509,
``ma_version_tag``), viewed here in place through ``ctypes`` as a one-item memoryview. Its
warm entry, a :class:`Watched`, holds that view and a copy of it taken before the answer;
the two are compared per call in C (``now == then``, no int built). A Watched is an empty
dict, so falsy, while every traits object the warm cache holds is truthy
(:func:`warm_entry`): one truth test tells a group from a single spec, cheaper than the
type test it replaces, for singles too. A probe, on the first group, checks that this
interpreter keeps that tag where it is read and that every kind of mutation makes the
compare fail; where it does not (PyPy, a free-threaded or future CPython), the dict is not
watched and such a spec takes the snapshot path, answered afresh after any mutation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, final

from kvspec_traits._traits import KVLayoutTraits

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "MAX_CLASSES",
    "MAX_SPECS",
    "Watched",
    "put_bounded",
    "warm_entry",
    "warm_path",
    "watch_of",
    "watches_dicts",
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


# -- dict versions ------------------------------------------------------------------------

# PyDictObject on CPython 3.11-3.13 (default build): ob_refcnt, ob_type, ma_used, then
# ma_version_tag, each 8 bytes on a 64-bit build.
_TYPE_OFFSET: Final = 8
_USED_OFFSET: Final = 16
_VERSION_OFFSET: Final = 24


def _version_tag(d: dict[Any, Any]) -> memoryview:
    """``d``'s version tag in place, as a one-item memoryview of native ``Q``."""
    import ctypes  # (here, not at import: only a group spec needs it)

    cells = (ctypes.c_uint64 * 1).from_address(id(d) + _VERSION_OFFSET)
    return memoryview(cells).cast("B").cast("Q")


def _copy_of(tag: memoryview) -> memoryview:
    """A frozen copy of ``tag`` in the same format: ``tag == copy`` compares the two
    native ``Q`` items in C, with no int built per call (``tag[0] == version`` builds one)."""
    return memoryview(tag.tobytes()).cast("Q")


def _probe() -> bool:
    """Whether this interpreter's dicts carry a version tag where it is read, changed by
    every mutation the probe tries, as seen by the compare the warm path makes (never read
    unless the layout checks out first)."""
    gil_disabled = getattr(sys, "_is_gil_enabled", lambda: True)() is False
    if sys.implementation.name != "cpython" or gil_disabled or sys.maxsize != 2**63 - 1:
        return False
    import ctypes

    d: dict[str, object] = {"a": 1, "b": 2}
    if ctypes.c_void_p.from_address(id(d) + _TYPE_OFFSET).value != id(
        dict
    ) or ctypes.c_ssize_t.from_address(id(d) + _USED_OFFSET).value != len(d):
        return False
    tag = _version_tag(d)
    mutations: tuple[Callable[[dict[str, object]], object], ...] = (
        lambda m: m.__setitem__("a", 3),  # a value replaced, same size
        lambda m: m.__setitem__("c", 4),
        lambda m: m.pop("c"),
        lambda m: m.update(a=5),
        lambda m: m.setdefault("d", 6),
        lambda m: m.popitem(),
        lambda m: m.__delitem__("a"),
        lambda m: m.clear(),
    )
    for mutate in mutations:
        then = _copy_of(tag)
        if tag != then:
            return False
        mutate(d)
        if tag == then:
            return False
    return True


_watching: bool | None = None


def watches_dicts() -> bool:
    """Whether dict mutations are seen in O(1) here (else groups take the snapshot path);
    probed once, the first time a group spec is resolved."""
    global _watching
    if _watching is None:
        _watching = _probe()
    return _watching


@final
class Watched(dict[Any, Any]):
    """A warm answer valid while ``now``, its spec's dict's version tag read in place,
    equals ``then``, that tag copied when the answer was cached; ``members`` holds the
    dict alive, so ``now`` reads that dict's memory.

    Always an empty dict, so falsy in C (no ``__bool__`` call): the warm path tells it
    from a traits object by ``if hit:``, which costs a single spec less than a type test
    (every other value of the warm cache is truthy, see :func:`warm_entry`).
    """

    __slots__ = ("members", "now", "then", "traits")
    traits: KVLayoutTraits
    now: memoryview
    then: memoryview
    members: dict[Any, Any] | None

    def __init__(
        self,
        traits: KVLayoutTraits,
        now: memoryview,
        then: memoryview,
        members: dict[Any, Any] | None,
    ) -> None:
        super().__init__()
        self.traits, self.now, self.then, self.members = traits, now, then, members

    def __repr__(self) -> str:
        return f"Watched({self.traits!r}, valid: {self.now == self.then})"

    if TYPE_CHECKING:  # (declared for mypy only: at run time dict's C length answers)

        def __bool__(self) -> Literal[False]: ...


# Two views of one constant: a Watched holding them is always valid.
_SAME: Final = memoryview(bytes(8)).cast("Q")


def warm_entry(traits: KVLayoutTraits) -> KVLayoutTraits | Watched:
    """What the warm cache holds for a spec answered without a guard: ``traits`` itself
    when its class cannot make it falsy (no ``__bool__`` or ``__len__`` in its MRO, as for
    every built-in traits class), else an always-valid :class:`Watched`, so that a falsy
    value there is always a Watched."""
    if any("__bool__" in vars(c) or "__len__" in vars(c) for c in type(traits).__mro__):
        return Watched(traits, _SAME, _SAME, None)
    return traits


def watch_of(
    spec: object, field_names: tuple[str, ...]
) -> tuple[memoryview, memoryview, dict[Any, Any]] | None:
    """The guard of a spec whose only unhashable field is one plain dict: that dict's
    version tag, a copy of it now, and the dict (the arguments of :class:`Watched` after
    the traits). None unless the spec is a frozen dataclass, every other field value is
    hashable and so is everything in the dict (a frozen spec's fields are trusted as a
    hashable spec's are; a mutable member's own changes would not show in the dict's
    version), or when this interpreter cannot watch dicts."""
    params = getattr(type(spec), "__dataclass_params__", None)
    if params is None or not params.frozen or not watches_dicts():
        return None
    found: dict[Any, Any] | None = None
    for name in field_names:
        value = getattr(spec, name, None)
        try:
            if type(value) is dict and found is None:
                found = value
                hash(tuple(value.items()))
            else:
                hash(value)
        except Exception:
            return None
    if found is None:
        return None
    tag = _version_tag(found)
    return tag, _copy_of(tag), found


def warm_path(
    by_id: dict[int, KVLayoutTraits | Watched], resolve: Callable[[KVCacheSpec], KVLayoutTraits]
) -> Callable[[KVCacheSpec], KVLayoutTraits]:
    """``traits_of`` as a closure over the per-spec cache: a hit is one frame, one id(),
    one dict subscript and one truth test (plus, for a watched group, one compare of its
    dict's version tag with its copy); the wheel is pure Python (py3-none-any), so this
    is the whole warm path."""

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
            hit = by_id[id(spec)]
        except KeyError:
            pass
        else:
            if hit:  # traits (warm_entry keeps them truthy); a Watched is falsy
                return hit
            # So hit is a Watched, which mypy cannot infer from a truth test on a protocol
            # (a cast or an annotated local would cost bytecodes on every call).
            if hit.now == hit.then:  # type: ignore[union-attr]  # its dict is unchanged
                return hit.traits  # type: ignore[union-attr]
        # Outside the except block: an error of resolve() is not chained to the KeyError.
        return resolve(spec)

    return traits_of
