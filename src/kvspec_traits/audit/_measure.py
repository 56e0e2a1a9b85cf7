"""Scoring an audit against a hand-checked list of sites (benchmarks/bench_audit_real.py
on real trees, tests/test_audit_measure.py on the fixtures).

The list is data: per tree, every class-check site (path within the tree, line, the sha1 of
the stripped line to tell the version) and a reader's verdict (``miss`` / ``not-miss``,
a pattern label and why) on every site an audit flagged and on every true miss.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvspec_traits.audit._audit import AuditResult

__all__ = ["PATTERNS", "TRUTHS", "Reported", "Score", "line_sha", "reported_sites", "score"]

TRUTHS: Final = ("miss", "not-miss")
PATTERNS: Final = (
    "true-miss",
    "elif",
    "early-exit",
    "trait-guard",
    "deliberate",
    "assertion",
    "assert-unwrap",
    "validation",
    "chain-raises",
    "domain-limit",
    "platform-subclass",
    "group-property",
    "identity",
    "enum-kind",
    "flag-flow",
    "test-assertion",
    "spec-module",
    "no-effect",
)
"""Why a reader gave a verdict: a true miss, or the pattern that makes a flag wrong."""


@dataclass(frozen=True, slots=True)
class Reported:
    """A site as the audit reported it: where, and whether its verdict is ``miss``."""

    path: str
    line: int
    end_line: int
    miss: bool
    warning: bool = False
    """A warning: verdict ``miss`` or ``exact-type`` (an exact type check that skips
    subclasses); the notes and the other verdicts are not."""


@dataclass(frozen=True, slots=True)
class Score:
    """Counts of one tree: misses flagged and how many the reader agrees with, true misses
    and how many are flagged, listed sites and how many lie inside a reported site."""

    flagged: int
    flagged_true: int
    unchecked: tuple[str, ...]
    true_misses: int
    true_flagged: int
    sites: int
    sites_found: int
    warned: int = 0
    warned_true: int = 0
    true_warned: int = 0

    @property
    def precision(self) -> float:
        """MISSES precision (1.0 when nothing is flagged)."""
        return self.flagged_true / self.flagged if self.flagged else 1.0

    @property
    def recall(self) -> float:
        """True misses flagged (1.0 when there are none)."""
        return self.true_flagged / self.true_misses if self.true_misses else 1.0

    @property
    def warning_precision(self) -> float:
        """Warnings (``miss`` and ``exact-type`` verdicts) the reader calls a miss (1.0
        when there are none)."""
        return self.warned_true / self.warned if self.warned else 1.0

    @property
    def warning_recall(self) -> float:
        """True misses that get a warning (1.0 when there are none)."""
        return self.true_warned / self.true_misses if self.true_misses else 1.0

    @property
    def found(self) -> float:
        """Listed sites found."""
        return self.sites_found / self.sites if self.sites else 1.0


def line_sha(root: Path, path: str, line: int) -> str | None:
    """The first 12 hex of the sha1 of the stripped line (None: no such line)."""
    try:
        text = (root / path).read_text(errors="replace").splitlines()[line - 1]
    except (OSError, IndexError):
        return None
    return hashlib.sha1(text.strip().encode()).hexdigest()[:12]


def reported_sites(result: AuditResult, root: Path) -> list[Reported]:
    """The result's sites with paths relative to ``root``."""
    found = []
    for s in result.sites:
        path = Path(s.path)
        try:
            rel = path.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            rel = s.path
        warn = s.verdict in ("miss", "exact-type")
        found.append(Reported(rel, s.raw.line, s.raw.end_line, s.has_miss, warn))
    return found


def score(tree: Mapping[str, Any], reported: Iterable[Reported]) -> Score:
    """Compare one tree's reported sites with its hand-checked entries. A flagged site the
    list has no verdict for counts against precision (and is named in ``unchecked``)."""
    sites = list(reported)
    truth = {(c["path"], c["line"]): c["truth"] for c in tree["checked"]}
    flagged = [r for r in sites if r.miss]
    flagged_true = sum(truth.get((r.path, r.line)) == "miss" for r in flagged)
    unchecked = tuple(f"{r.path}:{r.line}" for r in flagged if (r.path, r.line) not in truth)
    true_misses = [key for key, t in truth.items() if t == "miss"]
    misses_at = {(r.path, r.line) for r in flagged}
    spans: dict[str, list[tuple[int, int]]] = {}
    for r in sites:
        spans.setdefault(r.path, []).append((r.line, r.end_line))
    found = sum(
        any(a <= s["line"] <= b for a, b in spans.get(s["path"], ())) for s in tree["sites"]
    )
    warned = [r for r in sites if r.warning or r.miss]
    warned_at = {(r.path, r.line) for r in warned}
    return Score(
        warned=len(warned),
        warned_true=sum(truth.get((r.path, r.line)) == "miss" for r in warned),
        true_warned=sum(key in warned_at for key in true_misses),
        flagged=len(flagged),
        flagged_true=flagged_true,
        unchecked=unchecked,
        true_misses=len(true_misses),
        true_flagged=sum(key in misses_at for key in true_misses),
        sites=len(tree["sites"]),
        sites_found=found,
    )
