"""Scan targets against the class sets: the audit as a function, for the CLI and tests."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
    known = universe.names
    needles = _needles(known) + KIND_TOKENS
    # Each module is scanned as soon as it is parsed and its tree dropped (trees of a
    # whole vLLM held at once make the cyclic GC crawl). A module that imports from a
    # module defining class tuples is scanned again once all tuples are known.
    scanned: dict[Path, tuple[list[RawSite], frozenset[str]]] = {}
    exports: dict[str, dict[str, tuple[str, ...]]] = {}
    definitions: dict[tuple[str, str], ClassDefinition] = {}
    lookups: dict[str, set[str]] = {}  # tables looked up by type anywhere in the scan
    unmatched: list[Path] = []
    seen = 0
    packages: dict[Path, str] = {}
    groups, fields = universe.group_names, universe.group_attributes

    matched: list[tuple[Path, bytes]] = []
    for path in iter_source_files(targets, exclude=exclude, errors=errors):
        seen += 1
        data = read_source(path, max_bytes=max_file_bytes)
        if isinstance(data, FileError):
            errors.append(data)
        elif _mentions(data, needles):
            matched.append((path, data))
        else:
            unmatched.append(path)
    # Spec subclasses the scanned code defines are spec classes too.
    candidates = _candidate_classes((d for _, d in matched), known)
    if candidates:
        known = known | candidates

    def scan(path: Path, data: bytes, with_exports: bool) -> None:
        module_scan = _module_scan(path, data, known, packages, errors)
        if module_scan is None:
            return
        try:
            raw = module_scan.sites(
                groups=groups, group_attributes=fields, exports=exports if with_exports else None
            )
            if candidates and not with_exports:
                for d in module_scan.class_definitions():
                    definitions.setdefault((d.module, d.name), d)
        except RecursionError:
            errors.append(FileError(path=str(path), error="cannot scan: nested too deeply"))
            return
        if module_scan.class_sets and not with_exports:
            exports[module_scan.resolver.module] = module_scan.class_sets
        for name, how in module_scan.type_lookups().items():
            lookups.setdefault(name, set()).update(how)
        scanned[path] = raw, module_scan.imported_modules()

    for path, data in matched:
        scan(path, data, with_exports=False)
    del matched
    if exports:
        exported = tuple(n.encode() for sets in exports.values() for n in sets)
        again = [p for p, (_, imported) in scanned.items() if imported & exports.keys()]
        for path in again + unmatched:
            data = read_source(path, max_bytes=max_file_bytes)
            if isinstance(data, FileError) or not (path in scanned or _mentions(data, exported)):
                continue
            scan(path, data, with_exports=True)
    if definitions:
        universe = universe.with_definitions(definitions.values())
    confirmed = universe.names
    # A raise guarded by a spec class check states a domain limit for the package (the
    # folder): `HiSparse does not support DeepSeek V4` in one module holds for its
    # siblings too.
    refused: dict[Path, set[str]] = {}
    for path, (raws, _) in scanned.items():
        for raw in raws:
            refused.setdefault(path.parent, set()).update(raw.refused)
    sites = [
        infer(
            dataclasses.replace(
                raw,
                refused=tuple(sorted(refused[path.parent])),
                lookup=lookup_of(raw.table, lookups) if raw.form == "class-dict" else "",
            ),
            universe,
            path=_display(path, display_root),
        )
        for path, (raws, _) in scanned.items()
        for raw in raws
        if raw.kinds or any(c in confirmed for c in raw.classes)
    ]
    sites.sort(key=lambda s: (s.path, s.raw.line, s.raw.col))
    errors = sorted(
        (FileError(path=_display(Path(e.path), display_root), error=e.error) for e in errors),
        key=lambda e: e.path,
    )
    return AuditResult(
        sites=tuple(sites),
        errors=tuple(errors),
        files_seen=seen,
        files_parsed=len(scanned),
        universe=universe,
    )
