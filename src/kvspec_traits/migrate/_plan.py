"""Which audit sites are rewritten, and what replaces each (where it sits in the source is
:mod:`kvspec_traits.migrate._source`'s).

Works on the standard syntax tree, like the audit: a site's position (line, column of its
first check) is found again, the expression the audit read as one check is recovered (the
call, the ``not`` around it, or the members of an ``and``/``or`` chain) and the traits
expression is written with the subject exactly as the source spells it. The LibCST pass
(:mod:`kvspec_traits.migrate._rewrite`) then swaps those spans and nothing else.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from itertools import product
from typing import Final

from kvspec_traits.audit import Answer, Site, Universe
from kvspec_traits.audit._questions import KIND_TRAITS, answer_values, ask, question_named
from kvspec_traits.migrate._source import (
    REPRESENTATIVE,
    SourceIndex,
    Span,
    bound_more_than_once,
    handled_nearby,
    locate,
    source_of,
    span_of,
    subject_of,
)

__all__ = ["REWRITTEN_FORMS", "Edit", "Skip", "keep_context", "plan_site"]

REWRITTEN_FORMS: Final = frozenset(
    {"isinstance", "type-compare", "spec-kind", "mro-walk", "representative-type"}
)
"""Forms asked of an instance: ``isinstance(x, C)``, ``type(x) is C``, vLLM's kind of a
spec in reach (``get_kv_cache_spec_kind(spec) == KVCacheSpecKind.MAMBA``, or a kind
variable computed from one earlier in the function), walks over ``type(x).__mro__``
(``C in type(x).__mro__``, ``"C" in [c.__name__ for c in type(x).__mro__]``,
``any(c.__name__ == "C" for c in type(x).__mro__)``), and the class of a group's first
member, ``get_representative_spec_type(x) is C`` (and ``issubclass`` of it), asked as
``representative_traits(traits_of(x))``. The others ask a class held elsewhere
(``issubclass(spec_type, C)``, ``spec_type is C``), a stored name or a table, which a
trait of an instance does not answer as written."""

_REWRITTEN_VERDICTS: Final = frozenset({"ok", "miss"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Edit:
    """One site rewritten: ``spans`` are the expressions replaced (one, or the members of
    an ``and``/``or`` chain, the first taking ``after`` and the rest dropped)."""

    path: str
    line: int
    before: str
    after: str
    trait: str
    value: str
    match: str
    verdict: str
    fixes_miss: bool
    missing: tuple[str, ...]
    spans: tuple[Span, ...]
    chain: bool
    differs_on: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()
    """When set, one replacement per span (``A and not B`` asked as two traits keeps its
    two operands, and the lines they are on); else the first span takes ``after``."""

    def as_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "line": self.line,
            "before": self.before,
            "after": self.after,
            "trait": self.trait,
            "value": self.value,
            "match": self.match,
            "verdict": self.verdict,
            "fixes_miss": self.fixes_miss,
            "missing": list(self.missing),
            "differs_on": list(self.differs_on),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Skip:
    """One site left alone, and why."""

    path: str
    line: int
    text: str
    verdict: str
    reason: str
    match: str = ""
    """The audit's answer match (``exact``, ``near``, ``closest``; empty: no answer)."""

    def as_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "line": self.line,
            "text": self.text,
            "verdict": self.verdict,
            "match": self.match,
            "reason": self.reason,
        }


def _skip(site: Site, reason: str) -> Skip:
    return Skip(
        path=site.path,
        line=site.raw.line,
        text=site.raw.text,
        verdict=site.verdict,
        reason=reason,
        match=site.answer.match if site.answer else "",
    )


def _of_representative(subject: str) -> bool:
    # issubclass(get_representative_spec_type(x), C): the class of x's first member.
    return subject.partition("(")[0].endswith(REPRESENTATIVE)


def _why_not(site: Site) -> str | None:
    # None: the site is rewritten; else the reason it is left.
    raw, answer = site.raw, site.answer
    grouped = answer is not None and answer.trait == "grouped"
    if raw.form not in REWRITTEN_FORMS and not (
        raw.form == "issubclass" and _of_representative(raw.subject)
    ):
        what = {
            "issubclass": "asks a class held elsewhere, not an instance (where the class "
            "is computed from a spec, ask representative_traits(traits_of(spec)))",
            "class-compare": "compares a class read elsewhere, not an instance",
        }
        return f"{raw.form}: {what.get(raw.form, 'no instance expression to rewrite')}"
    if raw.form == "spec-kind" and raw.subject.startswith("<"):
        return "spec-kind: the kind is not computed from a spec in reach (no spec to ask)"
    if "assert" in raw.context and raw.text.startswith("self."):
        return "a test assertion (assertIsInstance), not a branch"
    if raw.unwraps and not grouped:
        return "tests the group wrapper and reads its members (an unwrap)"
    if answer is None:
        return f"no trait question: {site.reason}"
    if site.verdict not in _REWRITTEN_VERDICTS and not (
        grouped and site.verdict == "group-wrapper"
    ):
        return f"{site.verdict}: {site.reason}"
    if answer.match == "exact":
        return None
    if answer.match == "near" and site.verdict == "miss":
        return None
    return (
        f"{answer.match} match only ({answer.expression}): {site.reason}; no exact trait question"
    )


def _kind(u: Universe, name: str, trait: str) -> frozenset[tuple[str, ...]]:
    # The page kinds of a class, as the audit scopes a comparison (_match._candidates).
    values = [sorted(u.values(t, name)) for t in KIND_TRAITS if t != trait]
    return frozenset(product(*values))


def _differs_on(site: Site, u: Universe, negated: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    # Concrete classes, other than the ones the site misses, for which the traits query
    # answers otherwise than the check as written, split into classes of another page
    # kind (which the audit leaves out of the comparison, docs/audit.md, and the code
    # reaches on paths of their own) and classes of the branch's own kind (the query
    # would change what the branch does). Classes whose representatives disagree on the
    # trait are not counted.
    answer = site.answer
    if answer is None:
        return (), ()
    concrete = u.concrete
    branch = frozenset(site.branch_classes)
    old = concrete - branch if site.raw.negated else branch
    values = answer_values(answer.value)
    # (one value, or a set of an enum's values: a class has one of them)
    have = frozenset(
        n
        for n in concrete
        if len(u.values(answer.trait, n)) == 1 and u.values(answer.trait, n) <= values
    )
    asked = (answer.trait, *answer.unless[:1])
    varies = frozenset(n for n in concrete if any(len(u.values(t, n)) > 1 for t in asked))
    if answer.unless:
        trait, value = answer.unless
        have -= {n for n in concrete if u.values(trait, n) == {value}}
    new = concrete - have if negated else have
    differ = (old ^ new) - varies - set(site.missing)
    kinds = frozenset(k for n in branch for k in _kind(u, n, answer.trait))
    own = {n for n in differ if _kind(u, n, answer.trait) & kinds}
    return tuple(sorted(differ - own)), tuple(sorted(own))


@dataclass(frozen=True, slots=True)
class _Found:
    """A site found again in the source: its check's nodes (one, or a chain's members),
    whether it is a chain, and its subject (None for a spec-kind site)."""

    members: list[ast.expr]
    chain: bool
    subject: ast.expr | None


def _find(site: Site, index: SourceIndex) -> _Found | Skip:
    # The site in the source, or why it is left as written.
    why = _why_not(site)
    if why is not None:
        return _skip(site, why)
    if site.answer is None:  # _why_not returned a reason already
        return _skip(site, "no trait question")
    found = locate(site, index)
    if found is None:
        return _skip(site, "the check could not be found again in the source")
    members, chain = found
    # a spec-kind site's subject is the spec the audit resolved (a kind variable's spec
    # is no part of the check as written)
    subject = subject_of(members[0]) if site.raw.form != "spec-kind" else None
    if subject is None and site.raw.form != "spec-kind":
        return _skip(site, "no instance expression in the check")
    bound = bound_more_than_once(members[0], index)
    if bound:
        return _skip(
            site,
            f"its classes are the name {bound!r}, bound more than once in the function: "
            f"which classes it holds depends on the path taken",
        )
    return _Found(members=members, chain=chain, subject=subject)


def _asked(answer: Answer, subject: str, negated: bool) -> str:
    return ask(answer.trait, answer.value, subject, negated=negated, unless=answer.unless)


def _polarity(site: Site, answer: Answer) -> bool | None:
    # The audit wrote answer.expression on raw.subject; the polarity it used (None: neither).
    raw_subject = site.raw.subject or "spec"
    if site.raw.form == "issubclass":
        raw_subject = f"<a {raw_subject} instance>"
    return next(
        (
            n
            for n in ((False,) if answer.unless else (False, True))
            if _asked(answer, raw_subject, n) == answer.expression
        ),
        None,
    )


def _written(site: Site, subject: ast.expr | None, index: SourceIndex) -> str:
    # The subject as the source spells it (on one line).
    if subject is None:
        return site.raw.subject
    written = source_of(subject, index.lines)
    return ast.unparse(subject) if "\n" in written else written


def _guarded(
    site: Site,
    universe: Universe,
    query: tuple[str, str, bool],
    reaches: dict[str, int],
    other_kind: tuple[str, ...],
) -> tuple[str, tuple[str, ...]] | Skip:
    # Another page kind is compared apart only while it takes paths of its own; a
    # function that names the class handles it here, so the check sees it too: the
    # query also asks the page kind the branch's classes share, or is not written.
    after, written, negated = query
    answer = site.answer
    guard = _kind_guard(universe, site.branch_classes, tuple(reaches))
    if answer is None or guard is None or answer.unless:
        named = ", ".join(f"{c} (line {line})" for c, line in sorted(reaches.items()))
        return _skip(
            site,
            f"{after} would answer otherwise for {named}, which this function also "
            f"handles: such a spec reaches the check",
        )
    trait, value = guard
    kind = question_named(trait).expression(written, value, negated=False)
    positive = _asked(answer, written, False)
    after = f"not ({positive} and {kind})" if negated else f"{positive} and {kind}"
    return after, tuple(c for c in other_kind if c not in reaches)


def plan_site(site: Site, index: SourceIndex, universe: Universe) -> Edit | Skip:
    """The edit that rewrites ``site`` into its traits question, or why it is left."""
    found = _find(site, index)
    if isinstance(found, Skip):
        return found
    answer = site.answer
    if answer is None:  # _find returned a reason already
        return _skip(site, "no trait question")
    negated = _polarity(site, answer)
    if negated is None:
        return _skip(site, f"unexpected answer expression {answer.expression!r}")
    written = _written(site, found.subject, index)
    after = _asked(answer, written, negated)
    if site.raw.form in ("representative-type", "issubclass"):
        # the class of the group's first member: that member's traits (as vLLM's helper)
        after = after.replace(
            f"traits_of({written})", f"representative_traits(traits_of({written}))", 1
        )
    other_kind, own_kind = _differs_on(site, universe, negated)
    if own_kind:
        return _skip(
            site,
            f"{after} would answer otherwise for {', '.join(own_kind)}, "
            f"of the branch's own page kind",
        )
    reaches = handled_nearby(found.members[0], index, other_kind)
    if reaches:
        guarded = _guarded(site, universe, (after, written, negated), reaches, other_kind)
        if isinstance(guarded, Skip):
            return guarded
        after, other_kind = guarded
    members = found.members
    return Edit(
        path=site.path,
        line=site.raw.line,
        before=site.raw.text,
        after=after,
        trait=answer.trait,
        value=answer.value,
        match=answer.match,
        verdict=site.verdict,
        fixes_miss=site.verdict == "miss",
        missing=site.missing,
        spans=tuple(span_of(m, index.lines) for m in members),
        chain=found.chain,
        differs_on=other_kind,
        parts=_parts(answer.unless, written, after, len(members) if found.chain else 1),
    )


def _kind_guard(
    u: Universe, branch: tuple[str, ...], differ: tuple[str, ...]
) -> tuple[str, str] | None:
    # A page-kind trait whose value every branch class has and no differing class has:
    # asked with the query, it answers False for those classes, as the check does.
    for trait in KIND_TRAITS:
        values = {v for n in branch for v in u.values(trait, n)}
        if len(values) == 1:
            (value,) = values
            if all(value not in u.values(trait, n) for n in differ):
                return trait, value
    return None


def _parts(unless: tuple[str, ...], subject: str, after: str, members: int) -> tuple[str, ...]:
    # `A and not B` written as two operands: each becomes its own trait question.
    if not unless or members != 2:
        return ()
    trait, value = unless
    second = ask(trait, value, subject, negated=True)
    first = after.removesuffix(f" and {second}")
    return (first, second) if first != after else ()


def _rests_on(left: Site, other: Site) -> bool:
    # Whether `left`'s verdict uses `other` as context: an if/elif/exit/assert test on
    # the same subject at other's line, or an explicit exit in the same function that
    # handles classes left's check misses (what makes `type(s) is C` deliberate).
    raw, oth = left.raw, other.raw
    if oth.subject != raw.subject or oth is raw:
        return False
    if any(c.line in range(oth.line, oth.end_line + 1) for c in raw.constraints):
        return True
    return oth.function == raw.function and bool(set(oth.classes) & set(raw.exited_on))


def keep_context(planned: list[tuple[Site, Edit | Skip]]) -> list[Edit | Skip]:
    """Leave the checks that a site left alone rests on.

    A site with a trait answer that is left (deliberate, near, possible miss) was judged
    with the class checks around it; rewriting those into traits queries would hide them
    from the audit, and a second run would judge (and rewrite) the site otherwise. So such
    checks stay, which keeps the migration idempotent and the deliberate site deliberate.
    """
    out = [p for _, p in planned]
    changed = True
    while changed:
        changed = False
        left = [
            site
            for (site, _), p in zip(planned, out, strict=True)
            if isinstance(p, Skip)
            and site.answer is not None
            and site.answer.match in ("exact", "near")
        ]
        for i, ((site, _), p) in enumerate(zip(planned, out, strict=True)):
            if not isinstance(p, Edit):
                continue
            holder = next((s for s in left if _rests_on(s, site)), None)
            if holder is not None:
                out[i] = _skip(
                    site,
                    f"kept: the verdict on line {holder.raw.line} "
                    f"({holder.verdict}) rests on this check",
                )
                changed = True
    return out
