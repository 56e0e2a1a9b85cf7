"""The migration as functions: plan (audit, locate, rewrite in memory), show, write."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from kvspec_traits.audit import Site, Universe, audit_paths
from kvspec_traits.audit._files import DEFAULT_MAX_FILE_BYTES
from kvspec_traits.migrate._hoist import hoist_traits
from kvspec_traits.migrate._narrow import narrow_casts
from kvspec_traits.migrate._plan import Edit, Skip, keep_context, plan_site
from kvspec_traits.migrate._rewrite import rewrite_module
from kvspec_traits.migrate._source import SourceIndex

__all__ = ["FilePlan", "MigrationPlan", "Refusal", "plan_migration", "write_plan"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A file not rewritten (it fails to parse, changed since it was read, ...)."""

    path: str
    error: str

    def as_json(self) -> dict[str, str]:
        return {"path": self.path, "error": self.error}


@dataclass(frozen=True, slots=True, kw_only=True)
class FilePlan:
    """One file: its text and hash as read, its text after the edits."""

    path: Path
    display: str
    sha256: str
    before: str
    after: str
    edits: tuple[Edit, ...]

    def diff(self) -> str:
        """A unified diff (``a/``, ``b/`` prefixes), headed by one ``# kvspec-traits:``
        line per edit that fixes a miss (``patch`` and ``git apply`` skip lines before
        ``---``)."""
        notes = [
            f"# kvspec-traits: {self.display}:{e.line} fixes a miss "
            f"(the original leaves out {', '.join(e.missing)}): {e.before} -> {e.after}\n"
            for e in self.edits
            if e.fixes_miss
        ]
        notes += [
            f"# kvspec-traits: {self.display}:{e.line} answers otherwise for "
            f"{', '.join(e.differs_on)} (another page kind; not compared by the "
            f"audit)\n"
            for e in self.edits
            if e.differs_on
        ]
        body = difflib.unified_diff(
            self.before.splitlines(keepends=True),
            self.after.splitlines(keepends=True),
            fromfile=f"a/{self.display}",
            tofile=f"b/{self.display}",
        )
        lines = [
            line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
            for line in body
        ]
        return "".join(notes + lines)


@dataclass(slots=True)
class MigrationPlan:
    """Every file with edits, every site left alone, every file refused."""

    files: list[FilePlan] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    repeated_traits: int = 0
    """Subjects a function still asks ``traits_of`` more than once, where one call
    before the first would ask on a path the code did not (``_hoist``)."""
    sites: int = 0
    casts: int = 0
    """``typing.cast`` narrowings written where a rewritten check had narrowed the spec
    for a type checker (``_narrow``)."""

    @property
    def edits(self) -> list[Edit]:
        return [e for f in self.files for e in f.edits]

    def as_json(self) -> dict[str, object]:
        return {
            "sites": self.sites,
            "edits": [e.as_json() for e in self.edits],
            "skips": [s.as_json() for s in self.skips],
            "refused": [r.as_json() for r in self.refused],
            "files_changed": [f.display for f in self.files],
        }


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _display(path: Path) -> str:
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return path.as_posix()


def _site_skip(s: Site, display: str, reason: str) -> Skip:
    return Skip(
        path=display,
        line=s.raw.line,
        text=s.raw.text,
        verdict=s.verdict,
        reason=reason,
        match=s.answer.match if s.answer else "",
    )


def _edit_skip(e: Edit, display: str, reason: str) -> Skip:
    return Skip(
        path=display, line=e.line, text=e.before, verdict=e.verdict, reason=reason, match=e.match
    )


def _split_planned(
    planned: Iterable[Edit | Skip], display: str, *, strict: bool
) -> tuple[list[Edit], list[Skip]]:
    # The edits to make, and the sites left (``--strict`` leaves an edit whose query
    # answers otherwise for a class of another page kind).
    edits: list[Edit] = []
    skips: list[Skip] = []
    for one in planned:
        if isinstance(one, Edit) and strict and one.differs_on:
            skips.append(
                _edit_skip(
                    one,
                    display,
                    f"--strict: {one.after} answers otherwise for "
                    f"{', '.join(one.differs_on)} (another page kind)",
                )
            )
        elif isinstance(one, Edit):
            edits.append(one)
        else:
            skips.append(one)
    return edits, skips


@dataclass(frozen=True, slots=True)
class _Options:
    """What every file of one migration is planned with."""

    universe: Universe
    strict: bool
    base_attributes: frozenset[str] | None


def _plan_file(plan: MigrationPlan, path: Path, sites: list[Site], options: _Options) -> None:
    # One file's rewrite, in memory, added to ``plan`` (or its refusal, every site left).
    display = _display(path)
    sites = [_with_path(s, display) for s in sites]
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
        index = SourceIndex(text)
        cst.parse_module(text)
    except (UnicodeDecodeError, SyntaxError, ValueError, cst.ParserSyntaxError) as exc:
        plan.refused.append(Refusal(path=display, error=f"cannot parse: {exc}"))
        plan.skips.extend(_site_skip(s, display, "the file does not parse") for s in sites)
        return
    pairs = [(site, plan_site(site, index, options.universe)) for site in sites]
    edits, skips = _split_planned(keep_context(pairs), display, strict=options.strict)
    plan.skips.extend(skips)
    after, applied = rewrite_module(text, edits)
    if applied and "traits_of" not in text:
        # Only the calls the rewrite wrote: a module that asked traits already is its
        # author's to arrange.
        after, casts = narrow_casts(after, applied, options.base_attributes)
        plan.casts += casts
        after, left = hoist_traits(after)
        plan.repeated_traits += left
    plan.skips.extend(
        _edit_skip(e, display, "LibCST did not find the check's span")
        for e in edits
        if e not in applied
    )
    if applied and after != text:
        plan.files.append(
            FilePlan(
                path=path,
                display=display,
                sha256=_sha(data),
                before=text,
                after=after,
                edits=applied,
            )
        )


def plan_migration(
    targets: Sequence[Path],
    universe: Universe,
    *,
    exclude: Sequence[str] = (),
    strict: bool = False,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> MigrationPlan:
    """Audit ``targets`` and rewrite, in memory, every site with an exact trait question
    (and every miss, which the question fixes). Nothing is written. ``strict`` leaves
    the sites whose query answers otherwise for a class of another page kind."""
    roots = [t.resolve() for t in targets]
    result = audit_paths(
        roots, universe, exclude=exclude, max_file_bytes=max_file_bytes, display_root=Path("/")
    )
    plan = MigrationPlan(sites=len(result.sites))
    options = _Options(universe=universe, strict=strict, base_attributes=_base_attributes(universe))
    plan.refused.extend(
        Refusal(path=_display(Path("/") / e.path), error=e.error) for e in result.errors
    )
    by_file: dict[Path, list[Site]] = {}
    for site in result.sites:
        by_file.setdefault(Path("/") / site.path, []).append(site)
    for path, sites in by_file.items():
        _plan_file(plan, path, sites, options)
    plan.skips.sort(key=lambda s: (s.path, s.line))
    return plan


def _base_attributes(universe: Universe) -> frozenset[str] | None:
    """What every spec has: the attributes of the root spec class (vLLM's ``KVCacheSpec``),
    read without a cast after a rewritten check; None when it cannot be imported."""
    roots = [c for c in universe.classes.values() if len(c.mro) == 1]
    if len(roots) != 1:
        return None
    try:
        cls = getattr(importlib.import_module(roots[0].module), roots[0].name)
    except Exception:  # no vLLM here (classes from a file): cast every read
        return None
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names.update(f.name for f in dataclasses.fields(cls))
    return frozenset(names)


def _with_path(site: Site, display: str) -> Site:

    return dataclasses.replace(site, path=display)


def write_plan(plan: MigrationPlan) -> list[Refusal]:
    """Write every planned file whose content is still what was read; the others are
    refused (returned, and left as they are)."""
    refused: list[Refusal] = []
    for f in plan.files:
        try:
            now = f.path.read_bytes()
        except OSError as exc:
            refused.append(Refusal(path=f.display, error=f"cannot read again: {exc}"))
            continue
        if _sha(now) != f.sha256:
            refused.append(
                Refusal(
                    path=f.display,
                    error="changed since it was read; not rewritten (run migrate again)",
                )
            )
            continue
        f.path.write_bytes(f.after.encode("utf-8"))
    return refused
