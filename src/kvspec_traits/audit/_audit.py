"""Scan targets against the class sets: the audit as a function, for the CLI and tests."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kvspec_traits.audit._files import (
    DEFAULT_MAX_FILE_BYTES,
    FileError,
    iter_source_files,
    module_name,
    parse_source,
    read_source,
)
from kvspec_traits.audit._infer import Site, infer
from kvspec_traits.audit._scan import KIND_TOKENS, ClassDefinition, ModuleScan, RawSite
from kvspec_traits.audit._tables import lookup_of
from kvspec_traits.audit._universe import Universe

__all__ = ["AuditResult", "audit_paths"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditResult:
    """Every site found (in file then line order), every file that could not be scanned,
    and how many files were looked at and parsed."""

    sites: tuple[Site, ...]
    errors: tuple[FileError, ...]
    files_seen: int
    files_parsed: int
    universe: Universe

    def at_least(self, confidence: str) -> AuditResult:
        """The same result with only the sites whose confidence is ``confidence`` or
        higher."""
        return dataclasses.replace(
            self, sites=tuple(s for s in self.sites if s.at_least(confidence))
        )

    @property
    def misses(self) -> tuple[Site, ...]:
        """Sites that leave out a class they most likely mean."""
        return tuple(s for s in self.sites if s.has_miss)


def _needles(names: Iterable[str]) -> tuple[bytes, ...]:
    # The fewest substrings that every name contains one of ("AttentionSpec" covers
    # "FullAttentionSpec"): `in` on bytes is far faster than a regex alternation.
    ordered = sorted(set(names), key=len)
    kept: list[str] = []
    for name in ordered:
        if not any(k in name for k in kept):
            kept.append(name)
    return tuple(k.encode() for k in kept)


def _mentions(data: bytes, needles: tuple[bytes, ...]) -> bool:
    return any(n in data for n in needles)


_CLASS_LINE: Final = re.compile(rb"^[ \t]*class[ \t]+(\w+)[ \t]*\(([^)]*)\)", re.MULTILINE)


def _candidate_classes(texts: Iterable[bytes], known: frozenset[str]) -> frozenset[str]:
    # Classes whose base list names a spec class (or another such class): candidates
    # for out-of-tree spec classes, confirmed by the scanner's name resolution.
    found: dict[str, set[str]] = {}
    for data in texts:
        if b"class" not in data:
            continue
        for m in _CLASS_LINE.finditer(data):
            words = set(re.findall(rb"\w+", m.group(2)))
            found.setdefault(m.group(1).decode(), set()).update(w.decode() for w in words)
    names = set(known)
    grew = True
    while grew:
        grew = False
        for name, bases in found.items():
            if name not in names and bases & names:
                names.add(name)
                grew = True
    return frozenset(names - known)


def _display(path: Path, root: Path | None) -> str:
    if root is not None:
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            pass
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return path.as_posix()


def _module_scan(
    path: Path,
    data: bytes,
    known: frozenset[str],
    packages: dict[Path, str],
    errors: list[FileError],
) -> ModuleScan | None:
    tree = parse_source(data, path)
    if isinstance(tree, FileError):
        errors.append(tree)
        return None
    module, is_package = module_name(path, packages)
    try:
        return ModuleScan(tree, module=module, is_package=is_package, known=known, source=data)
    except RecursionError:
        errors.append(FileError(path=str(path), error="cannot scan: nested too deeply"))
        return None


@dataclass(slots=True)
class _Scan:
    """The modules scanned so far: their sites and imports, the class sets they export,
    the spec subclasses they define and the tables they look up by type."""

    known: frozenset[str]
    candidates: frozenset[str]
    groups: frozenset[str]
    group_attributes: frozenset[str]
    errors: list[FileError]
    scanned: dict[Path, tuple[list[RawSite], frozenset[str]]] = field(default_factory=dict)
    exports: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    definitions: dict[tuple[str, str], ClassDefinition] = field(default_factory=dict)
    lookups: dict[str, set[str]] = field(default_factory=dict)  # tables looked up by type
    packages: dict[Path, str] = field(default_factory=dict)
    built: set[str] = field(default_factory=set)  # spec classes some module builds
    builds_matter: bool = False  # are there vendor classes, whose bases' builds are read

    def scan(self, path: Path, data: bytes, *, with_exports: bool) -> None:
        module_scan = _module_scan(path, data, self.known, self.packages, self.errors)
        if module_scan is None:
            return
        try:
            raw = module_scan.sites(
                groups=self.groups,
                group_attributes=self.group_attributes,
                exports=self.exports if with_exports else None,
            )
            if self.builds_matter and not with_exports:
                self.built.update(module_scan.built_classes())
            if self.candidates and not with_exports:
                for d in module_scan.class_definitions():
                    self.definitions.setdefault((d.module, d.name), d)
        except RecursionError:
            self.errors.append(FileError(path=str(path), error="cannot scan: nested too deeply"))
            return
        if module_scan.class_sets and not with_exports:
            self.exports[module_scan.resolver.module] = module_scan.class_sets
        for name, how in module_scan.type_lookups().items():
            self.lookups.setdefault(name, set()).update(how)
        self.scanned[path] = raw, module_scan.imported_modules()

    def rescan(self, unmatched: list[Path], max_file_bytes: int) -> None:
        # A module that imports from a module defining class tuples is scanned again once
        # all tuples are known, and so is an unmatched one that names a tuple.
        if not self.exports:
            return
        exported = tuple(n.encode() for sets in self.exports.values() for n in sets)
        again = [p for p, (_, imported) in self.scanned.items() if imported & self.exports.keys()]
        for path in again + unmatched:
            data = read_source(path, max_bytes=max_file_bytes)
            if isinstance(data, FileError) or not (
                path in self.scanned or _mentions(data, exported)
            ):
                continue
            self.scan(path, data, with_exports=True)

    def refused(self) -> dict[Path, set[str]]:
        # A raise guarded by a spec class check states a domain limit for the package (the
        # folder): `HiSparse does not support DeepSeek V4` in one module holds for its
        # siblings too.
        refused: dict[Path, set[str]] = {}
        for path, (raws, _) in self.scanned.items():
            for raw in raws:
                refused.setdefault(path.parent, set()).update(raw.refused)
        return refused


def _gather(
    targets: Sequence[Path],
    needles: tuple[bytes, ...],
    *,
    exclude: Sequence[str],
    max_file_bytes: int,
    errors: list[FileError],
) -> tuple[int, list[tuple[Path, bytes]], list[Path]]:
    # How many files were seen; those whose text names a spec class (with it); the others.
    seen = 0
    matched: list[tuple[Path, bytes]] = []
    unmatched: list[Path] = []
    for path in iter_source_files(targets, exclude=exclude, errors=errors):
        seen += 1
        data = read_source(path, max_bytes=max_file_bytes)
        if isinstance(data, FileError):
            errors.append(data)
        elif _mentions(data, needles):
            matched.append((path, data))
        else:
            unmatched.append(path)
    return seen, matched, unmatched


def _built_bases(raw: RawSite, universe: Universe, built: set[str]) -> tuple[str, ...]:
    # The bases (themselves included) of the classes the check and the code around it
    # name that the scanned code builds.
    named = [*raw.classes, *raw.exited_on, *(n for c in raw.constraints for n in c.classes)]
    bases = {m for c in named if c in universe.classes for m in universe.classes[c].mro}
    return tuple(sorted(bases & built))


def _sites(scan: _Scan, universe: Universe, display_root: Path | None) -> list[Site]:
    confirmed = universe.names
    refused = scan.refused()
    sites = [
        infer(
            dataclasses.replace(
                raw,
                refused=tuple(sorted(refused[path.parent])),
                lookup=lookup_of(raw.table, scan.lookups) if raw.form == "class-dict" else "",
                built=_built_bases(raw, universe, scan.built),
            ),
            universe,
            path=_display(path, display_root),
        )
        for path, (raws, _) in scan.scanned.items()
        for raw in raws
        if raw.kinds or any(c in confirmed for c in raw.classes)
    ]
    sites.sort(key=lambda s: (s.path, s.raw.line, s.raw.col))
    return sites


def audit_paths(
    targets: Sequence[Path],
    universe: Universe,
    *,
    exclude: Sequence[str] = (),
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    display_root: Path | None = None,
) -> AuditResult:
    """Scan ``targets`` (files or folders) for class checks on spec classes.

    Only files whose text names a spec class (or a class tuple another scanned module
    defines) are parsed. Paths in the result are relative to ``display_root`` (else to
    the working directory) when they are below it.
    """
    errors: list[FileError] = []
    needles = _needles(universe.names) + KIND_TOKENS
    seen, matched, unmatched = _gather(
        targets, needles, exclude=exclude, max_file_bytes=max_file_bytes, errors=errors
    )
    # Spec subclasses the scanned code defines are spec classes too.
    candidates = _candidate_classes((d for _, d in matched), universe.names)
    scan = _Scan(
        known=universe.names | candidates,
        candidates=candidates,
        # whether a miss can be latent: only beside a vendor class (docs/audit.md,
        # "Vendor subclasses"); a scan of vLLM's classes alone walks no module for builds
        builds_matter=bool(candidates) or any(c.vendor for c in universe.classes.values()),
        groups=universe.group_names,
        group_attributes=universe.group_attributes,
        errors=errors,
    )
    # Each module is scanned as soon as it is parsed and its tree dropped (trees of a
    # whole vLLM held at once make the cyclic GC crawl).
    for path, data in matched:
        scan.scan(path, data, with_exports=False)
    del matched
    scan.rescan(unmatched, max_file_bytes)
    if scan.definitions:
        universe = universe.with_definitions(scan.definitions.values())
    sites = _sites(scan, universe, display_root)
    errors = sorted(
        (FileError(path=_display(Path(e.path), display_root), error=e.error) for e in errors),
        key=lambda e: e.path,
    )
    return AuditResult(
        sites=tuple(sites),
        errors=tuple(errors),
        files_seen=seen,
        files_parsed=len(scan.scanned),
        universe=universe,
    )
