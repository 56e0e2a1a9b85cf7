"""The spec classes of the installed vLLM and of the installed extensions, and each class's
answer to every trait question.

This is the only part of the audit that imports vLLM, and only on a cache miss: through
:mod:`kvspec_traits.catalog` (the answers come from the adapters applied to the catalog's
representative real specs), and for vLLM's own ``get_kv_cache_spec_kind`` (so
``KVCacheSpecKind`` comparisons are read with vLLM's mapping from classes to kinds). The
installed extensions (the ``kvspec_traits.adapters`` entry points) are loaded the way a
registry loads them: their spec classes join the class tree, with the answers of the
representatives they provide, or none. The result is plain data (class names, MRO names,
value labels, kinds) cached as JSON, so scanning never imports vLLM and never compares
classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from kvspec_traits._errors import AdapterPluginError, KVSpecTraitsError
from kvspec_traits._traits import KVLayoutTraits
from kvspec_traits.audit._cache import (
    cache_file,
    default_cache_dir,
    file_stat,
    installed_extensions,
    installed_vllm_dir,
    read_json,
    write_json,
)
from kvspec_traits.audit._questions import QUESTIONS

__all__ = [
    "ClassInfo",
    "ClassSetsUnavailableError",
    "Universe",
    "build_universe",
    "default_cache_dir",
    "installed_extensions",
    "installed_vllm_dir",
    "load_universe",
]

_FORMAT: Final = 4


class ClassDefinitionLike(Protocol):
    """A class the scanned code defines (the scanner's ``ClassDefinition``)."""

    @property
    def name(self) -> str: ...
    @property
    def module(self) -> str: ...
    @property
    def bases(self) -> tuple[str, ...]: ...
    @property
    def adds_fields(self) -> bool: ...


class ClassSetsUnavailableError(KVSpecTraitsError, RuntimeError):
    """The class sets could not be computed: vLLM (or the catalog) failed to import, or an
    installed extension does not load."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassInfo:
    """One spec class: its module, its MRO as names (itself first, ``object`` left out),
    how many catalog representatives it has (0: abstract or not in the catalog) and
    whether its traits are a group's (a wrapper of member specs)."""

    name: str
    module: str
    mro: tuple[str, ...]
    representatives: int
    group: bool = False
    out_of_tree: bool = False
    adds_fields: bool = False

    @property
    def vendor(self) -> bool:
        """Whether the class is not vLLM's: the scanned code's or an installed extension's."""
        return self.out_of_tree or self.module.partition(".")[0] != "vllm"


@dataclass(frozen=True, slots=True, kw_only=True)
class Universe:
    """Class names and per-question answers, keyed ``answers[question][class]`` to the
    set of value labels its representatives gave (more than one: the class *varies*).

    ``group_attributes`` are the attributes only a group class has (its members,
    ``first_spec``, group-only methods): using one is what handling a group means.
    """

    vllm_version: str
    vllm_path: str
    classes: Mapping[str, ClassInfo]
    answers: Mapping[str, Mapping[str, frozenset[str]]]
    group_attributes: frozenset[str] = frozenset()
    sources: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    kinds: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """``get_kv_cache_spec_kind``'s answer (a ``KVCacheSpecKind`` member name) for each
    class's representatives; empty where vLLM has no such function."""
    extensions: tuple[str, ...] = ()
    """The installed extensions whose classes are in :attr:`classes`, as
    ``"name version"`` (see :func:`installed_extensions`)."""

    @property
    def out_of_tree(self) -> frozenset[str]:
        """Classes the scanned code defines on spec classes (see :meth:`with_definitions`)."""
        return frozenset(n for n, c in self.classes.items() if c.out_of_tree)

    @property
    def unknown(self) -> frozenset[str]:
        """Out-of-tree classes whose traits cannot be told (they add fields)."""
        return frozenset(
            n for n, c in self.classes.items() if c.out_of_tree and not c.representatives
        )

    def with_definitions(self, definitions: Iterable[ClassDefinitionLike]) -> Universe:
        """This universe plus the spec subclasses the scanned code defines.

        A class that adds no fields gets its first spec base's answers (its instances
        are laid out as the base's); one that adds fields is *unknown*: in the class
        tree, so ``isinstance`` against its bases takes it, but in no trait set. A name
        vLLM already defines is left as vLLM's.
        """
        pending = [d for d in definitions if d.name not in self.classes]
        if not pending:
            return self
        classes = dict(self.classes)
        answers = {q: dict(per) for q, per in self.answers.items()}
        kinds = dict(self.kinds)
        progress = True
        while pending and progress:
            progress = False
            for d in list(pending):
                bases = [b for b in d.bases if b in classes]
                if len(bases) < len(d.bases) and any(
                    b in {p.name for p in pending} for b in d.bases
                ):
                    continue  # a base defined in the tree is not placed yet
                pending.remove(d)
                progress = True
                if not bases or d.name in classes:
                    continue
                mro = [d.name]
                for b in bases:
                    mro.extend(m for m in classes[b].mro if m not in mro)
                parent = classes[bases[0]]
                inherits = not d.adds_fields and parent.representatives > 0
                classes[d.name] = ClassInfo(
                    name=d.name,
                    module=d.module,
                    mro=tuple(mro),
                    representatives=parent.representatives if inherits else 0,
                    group=parent.group and inherits,
                    out_of_tree=True,
                    adds_fields=d.adds_fields,
                )
                if inherits:
                    for per in answers.values():
                        if parent.name in per:
                            per[d.name] = per[parent.name]
                    if parent.name in kinds:
                        kinds[d.name] = kinds[parent.name]
        return dataclasses.replace(self, classes=classes, answers=answers, kinds=kinds)

    @property
    def names(self) -> frozenset[str]:
        """Every spec class name."""
        return frozenset(self.classes)

    @property
    def group_names(self) -> frozenset[str]:
        """Classes whose traits are a group's (vLLM's wrapper of same-type layers)."""
        return frozenset(n for n, c in self.classes.items() if c.group)

    @property
    def concrete(self) -> frozenset[str]:
        """Classes with representatives that are not groups: the ones trait sets hold."""
        return frozenset(n for n, c in self.classes.items() if c.representatives and not c.group)

    def subclasses(self, names: Iterable[str]) -> frozenset[str]:
        """Concrete classes that ``isinstance`` against any of ``names`` accepts."""
        wanted = set(names)
        return frozenset(n for n in self.concrete if wanted.intersection(self.classes[n].mro))

    def values(self, question: str, name: str) -> frozenset[str]:
        """The labels ``name``'s representatives give for ``question`` (empty: none)."""
        return self.answers.get(question, {}).get(name, frozenset())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "vllm_version": self.vllm_version,
            "vllm_path": self.vllm_path,
            "classes": {
                n: {
                    "module": c.module,
                    "mro": list(c.mro),
                    "representatives": c.representatives,
                    "group": c.group,
                }
                for n, c in self.classes.items()
            },
            "answers": {
                q: {n: sorted(v) for n, v in per.items()} for q, per in self.answers.items()
            },
            "group_attributes": sorted(self.group_attributes),
            "sources": {p: list(s) for p, s in self.sources.items()},
            "kinds": {n: sorted(v) for n, v in self.kinds.items()},
            "extensions": list(self.extensions),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Universe:
        """Inverse of :meth:`to_json`; ``ValueError`` if the data is of another format."""
        if data.get("format") != _FORMAT:
            raise ValueError(
                f"class-set data has format {data.get('format')!r}, "
                f"expected {_FORMAT}; rebuild it with --refresh-classes"
            )
        return cls(
            vllm_version=str(data["vllm_version"]),
            vllm_path=str(data["vllm_path"]),
            classes={
                n: ClassInfo(
                    name=n,
                    module=str(c["module"]),
                    mro=tuple(c["mro"]),
                    representatives=int(c["representatives"]),
                    group=bool(c["group"]),
                )
                for n, c in data["classes"].items()
            },
            answers={
                q: {n: frozenset(v) for n, v in per.items()} for q, per in data["answers"].items()
            },
            group_attributes=frozenset(data.get("group_attributes", ())),
            sources={p: (int(s[0]), int(s[1])) for p, s in data.get("sources", {}).items()},
            kinds={n: frozenset(v) for n, v in data.get("kinds", {}).items()},
            extensions=tuple(str(e) for e in data.get("extensions", ())),
        )


@dataclass(slots=True)
class _Answered:
    """What the representatives answered so far: how many each class has, which classes
    are groups (and the attributes only a group has), each question's value labels per
    class and vLLM's kinds per class."""

    reps: dict[str, int] = field(default_factory=dict)
    groups: set[str] = field(default_factory=set)
    group_attributes: set[str] = field(default_factory=set)
    answers: dict[str, dict[str, set[str]]] = field(
        default_factory=lambda: {q.name: {} for q in QUESTIONS}
    )
    kinds: dict[str, set[str]] = field(default_factory=dict)
    kind_of: Callable[[Any], Any] | None = field(default_factory=lambda: _kind_function())

    def add(self, spec: Any, traits_of: Callable[[Any], KVLayoutTraits]) -> None:
        from kvspec_traits import GroupTraits

        name = type(spec).__qualname__
        try:
            traits = traits_of(spec)
        except Exception:  # `kvspec-traits report` shows why; here: no answers for it
            return
        self.reps[name] = self.reps.get(name, 0) + 1
        if self.kind_of is not None:
            with contextlib.suppress(Exception):  # vLLM's answer, when it has one
                self.kinds.setdefault(name, set()).add(str(self.kind_of(spec).name))
        if isinstance(traits, GroupTraits):
            self.groups.add(name)
            self.group_attributes.update(_group_attributes(type(spec)))
            return
        for q in QUESTIONS:
            self.answers[q.name].setdefault(name, set()).add(q.read(traits))


def _sources(objects: list[Any], hook_modules: set[str]) -> dict[str, tuple[int, int]]:
    # The files defining the classes, the catalog and the extensions' representatives
    # (their hook modules), with their size and mtime.
    sources: dict[str, tuple[int, int]] = {}
    watched = [*objects, *(sys.modules[m] for m in sorted(hook_modules) if m in sys.modules)]
    for obj in watched:
        try:
            src = inspect.getsourcefile(obj)
        except TypeError:  # defined in C: no file
            continue
        st = file_stat(src) if src else None
        if src and st:
            sources[src] = st
    return sources


def build_universe(*, extensions: bool = True) -> Universe:
    """Import vLLM through the catalog and compute every class's answers.

    With ``extensions`` (the default) the installed extensions' entry points are loaded
    and their spec classes join the sets: with the answers of the representatives their
    entry-point module's ``representative_specs()`` returns, or with none (a check on one
    then lists it under ``no_representative``). Raises :class:`ClassSetsUnavailableError`
    if vLLM or the catalog cannot be imported, or an extension does not load.
    """
    try:
        from kvspec_traits import catalog  # the one way the audit imports vLLM
    except Exception as exc:  # any import failure of vLLM means: no class sets
        raise ClassSetsUnavailableError(
            f"cannot import vLLM to compute the spec class sets ({type(exc).__name__}: "
            f"{exc}); run the audit in the environment where vLLM is installed, or pass "
            f"--classes FILE saved there with --save-classes FILE"
        ) from exc
    from kvspec_traits.extend import Registry

    # A registry of its own (the built-ins and the installed extensions' entry points), so
    # adapters registered elsewhere in this process do not change the class sets.
    registry = Registry(entry_points=extensions, name="audit class sets")
    traits_of = registry.traits_of
    try:
        extension_classes = catalog.extension_spec_classes(registry) if extensions else []
        extension_entries = catalog.extension_specs() if extensions else []
    except AdapterPluginError as exc:
        raise ClassSetsUnavailableError(
            f"an installed extension does not load ({exc}); fix or uninstall it, or leave "
            f"the extensions out with --no-extensions"
        ) from exc
    spec_classes = catalog.spec_classes()
    vllm_names = {cls.__qualname__ for cls in spec_classes}
    # An extension's class named like one of vLLM's is left out (the name is vLLM's).
    added = [cls for cls in extension_classes if cls.__qualname__ not in vllm_names]
    added_names = {cls.__qualname__ for cls in added}
    by_type = {cls: cls.__qualname__ for cls in [*spec_classes, *added]}
    entries = [
        *catalog.representative_specs(),
        # only instances of the extensions' own classes: vLLM's classes keep the
        # catalog's representatives
        *(e for e in extension_entries if type(e.spec).__qualname__ in added_names),
    ]
    answered = _Answered()
    for entry in entries:
        answered.add(entry.spec, traits_of)
    sources = _sources(
        [*by_type, catalog], {e.source.rpartition(".")[0] for e in extension_entries}
    )
    classes = {
        name: ClassInfo(
            name=name,
            module=cls.__module__,
            mro=tuple(k.__qualname__ for k in cls.__mro__ if k is not object),
            representatives=answered.reps.get(name, 0),
            group=name in answered.groups,
        )
        for cls, name in by_type.items()
    }
    vdir = installed_vllm_dir()
    return Universe(
        vllm_version=str(getattr(sys.modules.get("vllm"), "__version__", "unknown")),
        vllm_path=str(vdir) if vdir else "",
        classes=classes,
        answers={
            q: {n: frozenset(v) for n, v in per.items()} for q, per in answered.answers.items()
        },
        group_attributes=frozenset(answered.group_attributes),
        sources=sources,
        kinds={n: frozenset(v) for n, v in answered.kinds.items()},
        extensions=installed_extensions() if extensions else (),
    )


def _kind_function() -> Callable[[Any], Any] | None:
    # vLLM's `get_kv_cache_spec_kind` (0.32 on), so `KVCacheSpecKind.X` comparisons
    # are read with vLLM's own mapping from classes to kinds.
    try:
        module = importlib.import_module("vllm.v1.kv_cache_interface")
    except Exception:  # no vLLM: no kinds
        return None
    found = getattr(module, "get_kv_cache_spec_kind", None)
    return found if callable(found) else None


def _group_attributes(cls: type[Any]) -> set[str]:
    # What only the group class has (its members' field, `first_spec`, group-only
    # methods): a branch that touches none of them treats the group as one layer.
    def attributes(klass: type[Any]) -> set[str]:
        names = set(dir(klass))
        if dataclasses.is_dataclass(klass):
            names.update(f.name for f in dataclasses.fields(klass))
        return names

    own = attributes(cls)
    for base in cls.__bases__:
        own -= attributes(base)
    return {name for name in own if not name.startswith("__")}


def load_universe(
    *, cache_dir: Path | None = None, refresh: bool = False, extensions: bool = True
) -> Universe:
    """The class sets of the vLLM Python would import and of the installed extensions
    (without ``extensions``: of vLLM alone), from the cache when it is fresh.

    The cache is keyed by the vLLM directory, the kvspec-traits sources (every source
    file of the package, by path and stat: :func:`kvspec_traits.audit._cache.library_stamp`)
    and the installed extensions (name and version), and is stale when any file defining a
    spec class changed (size or mtime). ``refresh`` rebuilds.
    Raises :class:`ClassSetsUnavailableError` when it must be built and vLLM is missing.
    """
    vdir = installed_vllm_dir()
    if vdir is None:
        raise ClassSetsUnavailableError(
            "no vLLM package found on sys.path: the audit computes which classes each trait "
            "covers from the installed vLLM; install it, or pass --classes FILE"
        )
    installed = installed_extensions() if extensions else ()
    path = cache_file(cache_dir or default_cache_dir(), vdir, installed)
    if not refresh:
        cached = _read_cache(path)
        if (
            cached is not None
            and cached.vllm_path == str(vdir)
            and cached.extensions == installed
            and all(file_stat(p) == s for p, s in cached.sources.items())
        ):
            return cached
    universe = build_universe(extensions=extensions)
    write_json(path, universe.to_json())
    return universe


def _read_cache(path: Path) -> Universe | None:
    data = read_json(path)
    try:
        return Universe.from_json(data) if isinstance(data, dict) else None
    except (ValueError, KeyError, TypeError):
        return None  # a damaged cache is rebuilt
