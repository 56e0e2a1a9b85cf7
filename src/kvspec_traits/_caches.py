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
``ma_version_tag``), read here in place through ``ctypes``. A probe, on the first group,
checks that this interpreter keeps that tag where it is read and changes it on every kind of
mutation; where it does not (PyPy, a free-threaded or future CPython), the dict is not
watched and such a spec takes the snapshot path, answered afresh after any mutation.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

from kvspec_traits._traits import KVLayoutTraits

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "MAX_CLASSES",
    "MAX_SPECS",
    "Watched",
    "put_bounded",
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
    """``d``'s version tag in place, as a one-item memoryview of native ``Q``: ``tag[0]``
    is a plain subscript (no ctypes attribute on the warm path)."""
    import ctypes  # (here, not at import: only a group spec needs it)

    cells = (ctypes.c_uint64 * 1).from_address(id(d) + _VERSION_OFFSET)
    return memoryview(cells).cast("B").cast("Q")


def _probe() -> bool:
    """Whether this interpreter's dicts carry a version tag where it is read, changed by
    every mutation the probe tries (never read unless the layout checks out first)."""
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
        before = tag[0]
        mutate(d)
        if tag[0] == before:
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
@dataclasses.dataclass(frozen=True, slots=True)
class Watched:
    """A warm answer valid while its spec's dict keeps ``version``; ``members`` holds
    the dict alive, so ``tag`` reads that dict's memory."""

    traits: KVLayoutTraits
    tag: memoryview
    version: int
    members: dict[Any, Any]


def watch_of(
    spec: object, field_names: tuple[str, ...]
) -> tuple[memoryview, int, dict[Any, Any]] | None:
    """The guard of a spec whose only unhashable field is one plain dict: that dict's
    version tag, its version now, and the dict. None unless the spec is a frozen
    dataclass, every other field value is hashable and so is everything in the dict (a
    frozen spec's fields are trusted as a hashable spec's are; a mutable member's own
    changes would not show in the dict's version), or when this interpreter cannot
    watch dicts."""
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
    return tag, tag[0], found


def warm_path(
    by_id: dict[int, KVLayoutTraits | Watched], resolve: Callable[[KVCacheSpec], KVLayoutTraits]
) -> Callable[[KVCacheSpec], KVLayoutTraits]:
    """``traits_of`` as a closure over the per-spec cache: a hit is one frame, one id()
    and one dict subscript (plus the version compare of a watched group); the wheel is
    pure Python (py3-none-any), so this is the whole warm path."""

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
            if type(hit) is not Watched:  # (one test, no attribute: singles stay fast)
                return hit
            if hit.tag[0] == hit.version:
                return hit.traits
        # Outside the except block: an error of resolve() is not chained to the KeyError.
        return resolve(spec)

    return traits_of
