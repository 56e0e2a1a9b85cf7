"""The three renderings of an audit: a table for people, JSON, and SARIF 2.1.0."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final, TextIO

from kvspec_traits.audit._audit import AuditResult
from kvspec_traits.audit._files import FileError
from kvspec_traits.audit._infer import Site
from kvspec_traits.audit._universe import Universe

__all__ = [
    "NOTE_VERDICTS",
    "RULES",
    "drop_notes",
    "render_json",
    "render_sarif",
    "render_table",
    "site_json",
    "summary",
]

TOOL_NAME: Final = "kvspec-traits audit"

RULES: Final = (
    (
        "KVT001",
        "spec-class-check",
        "A branch on a KV cache spec class: ask the spec's traits instead.",
    ),
    (
        "KVT002",
        "missed-spec-class",
        "A branch on spec classes leaves out classes with the trait value it most likely asks for.",
    ),
    (
        "KVT003",
        "exact-type-check",
        "An exact type check on a spec class skips that class's subclasses.",
    ),
    (
        "KVT004",
        "group-wrapper-not-unwrapped",
        "A check on the group wrapper spec whose guarded code uses nothing only the group has.",
    ),
)
_RULE_INDEX: Final = {rule_id: i for i, (rule_id, _, _) in enumerate(RULES)}


def _rule_of(site: Site) -> tuple[str, str]:
    if site.verdict == "miss":
        return "KVT002", "warning"
    if site.verdict == "possible-miss":
        return "KVT002", "note"
    if site.verdict == "group-wrapper":
        return "KVT004", "note"
    if site.verdict == "exact-type":
        return "KVT003", "warning"
    return "KVT001", "note"


_VERDICT_ORDER: Final = (
    "miss",
    "exact-type",
    "unknown-class",
    "possible-miss",
    "group-wrapper",
    "deliberate",
    "ok",
)


def _priority(site: Site) -> tuple[int, int]:
    # likely real misses first: by verdict, then by confidence (high first)
    return (_VERDICT_ORDER.index(site.verdict), -["low", "medium", "high"].index(site.confidence))


def _answer_text(site: Site) -> str:
    a = site.answer
    if a is None:
        if site.raw.unwraps is not None and not site.branch_classes:
            return "none (a group wrapper check; traits_of() answers for a group: GroupTraits)"
        if site.raw.form == "class-dict":
            return "none (a table keyed by spec class: key it by a trait value instead)"
        return "none fits (a class-identity question)"
    text = (
        f"{a.trait} = {a.value} ({a.match} match, similarity {a.similarity:.2f}) -> {a.expression}"
    )
    if a.other_value_classes:
        text += f"; also accepts {', '.join(a.other_value_classes)} (another value)"
    return text


def _message(site: Site) -> str:
    parts = [
        f"`{site.raw.text}` branches on spec classes; trait: {_answer_text(site)}.",
        f"Verdict: {site.verdict} ({site.confidence} confidence): {site.reason}.",
    ]
    if site.missing:
        parts.append(f"Misses {', '.join(site.missing)}.")
    if site.skipped_subclasses:
        parts.append(f"Exact type check: skips subclasses {', '.join(site.skipped_subclasses)}.")
    if site.wrapper_not_unwrapped:
        parts.append(
            "Tests the group wrapper, but the guarded code uses nothing only the group "
            "has (its members): it treats a group of layers as one layer."
        )
    return " ".join(parts)


NOTE_VERDICTS: Final = ("possible-miss", "group-wrapper")
"""Verdicts that are notes: right less than half the time on the hand-checked trees
(docs/audit.md, "Measured on real code"), so left out of a report unless asked for."""


def drop_notes(result: AuditResult) -> tuple[AuditResult, int]:
    """The result without its note sites (``NOTE_VERDICTS``), and how many were dropped."""
    kept = tuple(s for s in result.sites if s.verdict not in NOTE_VERDICTS)
    return dataclasses.replace(result, sites=kept), len(result.sites) - len(kept)


def summary(result: AuditResult) -> dict[str, int]:
    """Counts for the summary line and the JSON ``summary`` object."""
    sites = result.sites
    return {
        "sites": len(sites),
        "files_with_sites": len({s.path for s in sites}),
        "sites_with_misses": sum(s.has_miss for s in sites),
        "possible_misses": sum(s.verdict == "possible-miss" for s in sites),
        "deliberate": sum(s.verdict == "deliberate" for s in sites),
        "unknown_classes": sum(s.verdict == "unknown-class" for s in sites),
        "exact_type_checks_skipping_subclasses": sum(s.verdict == "exact-type" for s in sites),
        "group_wrappers_not_unwrapped": sum(s.verdict == "group-wrapper" for s in sites),
        "files_seen": result.files_seen,
        "files_parsed": result.files_parsed,
        "files_with_errors": len(result.errors),
    }


def _write_site(site: Site, u: Universe, out: TextIO) -> None:
    # One site of the table: its line, what hides its classes, its flags and verdict.
    out.write(f"  {site.raw.line:>5}  {site.raw.function}: {site.raw.text}\n")
    pad = " " * 9
    if any(c not in site.raw.text for c in site.raw.classes):
        # an alias or a class tuple hides what is tested
        out.write(f"{pad}classes: {', '.join(site.raw.classes)}\n")
    flags = {
        "miss": f"MISSES {', '.join(site.missing)}",
        "possible-miss": f"MAY MISS {', '.join(site.missing)}",
        "exact-type": f"EXACT TYPE: skips subclasses {', '.join(site.skipped_subclasses)}",
        "group-wrapper": (
            f"GROUP WRAPPER: the guarded code uses nothing only the group "
            f"has ({', '.join(sorted(u.group_attributes)) or 'its members'})"
        ),
        "unknown-class": f"UNKNOWN CLASS: {', '.join(site.unknown)}",
    }
    if site.verdict in flags:
        out.write(f"{pad}{flags[site.verdict]}\n")
    if site.no_representative:
        out.write(f"{pad}NO REPRESENTATIVE: {', '.join(site.no_representative)}\n")
    out.write(f"{pad}trait: {_answer_text(site)}\n")
    out.write(f"{pad}verdict: {site.verdict} ({site.confidence}): {site.reason}\n")


def _write_summary(result: AuditResult, out: TextIO, hidden_notes: int) -> None:
    if result.errors:
        out.write(f"\ncould not scan {len(result.errors)} file(s):\n")
        for err in result.errors:
            out.write(f"  {err.path}: {err.error}\n")
    n = summary(result)
    out.write(
        f"\n{_count(n['sites'], 'site')} in {_count(n['files_with_sites'], 'file')}; "
        f"{n['sites_with_misses']} with misses, {n['possible_misses']} possible, "
        f"{n['deliberate']} deliberate, "
        f"{_count(n['exact_type_checks_skipping_subclasses'], 'exact type check')} skipping "
        f"subclasses, {_count(n['group_wrappers_not_unwrapped'], 'group wrapper')} not "
        f"unwrapped; {_count(n['files_seen'], 'file')} seen, {n['files_parsed']} parsed, "
        f"{n['files_with_errors']} could not be scanned"
        + (f"; {_count(hidden_notes, 'note')} left out (--notes)" if hidden_notes else "")
        + "\n"
    )


def render_table(result: AuditResult, out: TextIO, *, hidden_notes: int = 0) -> None:
    """Sites grouped by file: files with misses first, misses first within a file.
    ``hidden_notes``: how many note sites :func:`drop_notes` left out (said at the end)."""
    u = result.universe
    with_ext = f" and {', '.join(u.extensions)}" if u.extensions else ""
    shipped = "" if u.vllm_path else " (shipped with kvspec-traits)"
    out.write(f"{TOOL_NAME}: class sets of vLLM {u.vllm_version}{shipped}{with_ext}\n")
    by_file: dict[str, list[Site]] = {}
    for site in result.sites:
        by_file.setdefault(site.path, []).append(site)
    order = sorted(by_file, key=lambda p: (min(_priority(s) for s in by_file[p]), p))
    for path in order:
        sites = sorted(by_file[path], key=lambda s: (_priority(s), s.raw.line, s.raw.col))
        misses = sum(s.has_miss for s in sites)
        tail = f", {misses} with misses" if misses else ""
        out.write(f"\n{path}  ({_count(len(sites), 'site')}{tail})\n")
        for site in sites:
            _write_site(site, u, out)
    _write_summary(result, out, hidden_notes)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def site_json(site: Site) -> dict[str, Any]:
    """One site as a JSON object (the ``sites`` items of ``--json``)."""
    r, a = site.raw, site.answer
    return {
        "path": site.path,
        "line": r.line,
        "column": r.col + 1,
        "end_line": r.end_line,
        "function": r.function,
        "form": r.form,
        "check": r.text,
        "subject": r.subject,
        "classes": list(r.classes),
        "excluded": list(r.excluded),
        "negated": r.negated,
        "exact": r.exact,
        "branch_classes": list(site.branch_classes),
        "answer": None
        if a is None
        else {
            "trait": a.trait,
            "value": a.value,
            "match": a.match,
            "similarity": a.similarity,
            "expression": a.expression,
            "value_classes": list(a.value_classes),
            "other_value_classes": list(a.other_value_classes),
            "varies": list(a.varies),
        },
        "missing": list(site.missing),
        "excluded_by_flow": list(site.excluded_by_flow),
        "skipped_subclasses": list(site.skipped_subclasses),
        "unknown": list(site.unknown),
        "other_classes": list(r.others),
        "kinds": list(r.kinds),
        "verdict": site.verdict,
        "confidence": site.confidence,
        "reason": site.reason,
        "wrapper_not_unwrapped": site.wrapper_not_unwrapped,
        "no_representative": list(site.no_representative),
        "rule": _rule_of(site)[0],
    }


def _errors_json(errors: Iterable[FileError]) -> list[dict[str, str]]:
    return [{"path": e.path, "error": e.error} for e in errors]


def render_json(result: AuditResult) -> dict[str, Any]:
    """The whole audit as one JSON object."""
    from kvspec_traits import __version__

    u = result.universe
    return {
        "tool": TOOL_NAME,
        "version": __version__,
        "vllm": {"version": u.vllm_version, "path": u.vllm_path},
        "extensions": list(u.extensions),
        "summary": summary(result),
        "sites": [site_json(s) for s in result.sites],
        "errors": _errors_json(result.errors),
    }


def _artifact(path: str) -> dict[str, str]:
    # Relative paths resolve against the checkout (%SRCROOT%); others become file URIs.
    if Path(path).is_absolute():
        return {"uri": Path(path).as_uri()}
    return {"uri": path, "uriBaseId": "%SRCROOT%"}


def render_sarif(result: AuditResult) -> dict[str, Any]:
    """SARIF 2.1.0 for code-scanning annotations: one result per site, under its most
    severe rule; unreadable files as tool execution notifications."""
    from kvspec_traits import __version__

    results = []
    for site in result.sites:
        rule_id, level = _rule_of(site)
        results.append(
            {
                "ruleId": rule_id,
                "ruleIndex": _RULE_INDEX[rule_id],
                "level": level,
                "message": {"text": _message(site)},
                "locations": [
                    {
                        "physicalLocation": {
                            "artifactLocation": _artifact(site.path),
                            "region": {
                                "startLine": site.raw.line,
                                "startColumn": site.raw.col + 1,
                                "endLine": site.raw.end_line,
                            },
                        },
                        "logicalLocations": [{"fullyQualifiedName": site.raw.function}],
                    }
                ],
                "properties": {
                    "missing": list(site.missing),
                    "verdict": site.verdict,
                    "confidence": site.confidence,
                    "trait": None if site.answer is None else site.answer.trait,
                },
            }
        )
    notifications = [
        {
            "level": "error",
            "message": {"text": f"could not scan: {e.error}"},
            "locations": [{"physicalLocation": {"artifactLocation": _artifact(e.path)}}],
        }
        for e in result.errors
    ]
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": TOOL_NAME,
                        "version": __version__,
                        "rules": [
                            {
                                "id": rule_id,
                                "name": name,
                                "shortDescription": {"text": text},
                                "help": {"text": "See docs/audit.md of kvspec-traits."},
                            }
                            for rule_id, name, text in RULES
                        ],
                    }
                },
                "invocations": [
                    {
                        "executionSuccessful": not result.errors,
                        "toolExecutionNotifications": notifications,
                    }
                ],
                "results": results,
            }
        ],
    }
