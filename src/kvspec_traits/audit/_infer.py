"""Which trait question a class check stands for, and which classes it leaves out.

The rule (docs/audit.md, "How a branch is matched to a trait") in short: expand the tested
classes as the check does (``isinstance`` takes subclasses, ``type(x) is`` does not);
compare that set with, for every trait question and value, the classes whose
representatives all give that value, among the classes of the branch's own page kind.
An equal set is an *exact* match; a proper subset that covers more than half of the value's
classes is a *near* match, and the rest are the classes the branch misses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import product
from typing import Final, Literal

from kvspec_traits.audit._questions import KIND_TRAITS, QUESTIONS, Question
from kvspec_traits.audit._scan import RawSite
from kvspec_traits.audit._universe import Universe

__all__ = ["Answer", "Site", "infer"]

MIN_SIMILARITY: Final = 0.6
"""Below this Jaccard similarity no trait is named ("no single trait"). A value that more
than half of all classes have (``transferable``, ``not is_mla``) is never named either:
a branch on the common case is read through the exceptions it singles out."""

Match = Literal["exact", "near", "closest"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """The trait question a branch most likely asks.

    ``value`` is the label of the tested value (``"True"``, ``"TokenScope.RING"``);
    ``value_classes`` the classes of the branch's kind with that value; ``similarity``
    the Jaccard similarity of the two sets; ``other_value_classes`` tested classes whose
    value differs (only for ``closest``); ``varies`` classes left out of the comparison
    because their representatives disagree on this trait.
    """

    trait: str
    value: str
    match: Match
    similarity: float
    expression: str
    value_classes: tuple[str, ...]
    other_value_classes: tuple[str, ...]
    varies: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """One class check with its verdict.

    ``branch_classes``: the concrete classes the check accepts. ``missing``: classes with
    the answer's value that it does not accept. ``skipped_subclasses``: for exact checks,
    subclasses of a tested class that the check rejects. ``wrapper_not_unwrapped``: the
    check tests a group wrapper and the guarded code never reads its members.
    ``no_representative``: tested classes the class sets know nothing about.
    """

    path: str
    raw: RawSite
    branch_classes: tuple[str, ...]
    answer: Answer | None
    missing: tuple[str, ...]
    skipped_subclasses: tuple[str, ...]
    wrapper_not_unwrapped: bool
    no_representative: tuple[str, ...]

    @property
    def has_miss(self) -> bool:
        """Whether the branch leaves out a class it most likely means (what
        ``--fail-on-miss`` fails on)."""
        return bool(self.missing)


def _kinds(u: Universe, name: str, traits: tuple[str, ...]) -> set[tuple[str, ...]]:
    return set(product(*(sorted(u.values(t, name)) for t in traits)))


@dataclass(frozen=True, slots=True)
class _Candidate:
    question: Question
    value: str
    exact: bool
    near: bool
    similarity: float
    overall_similarity: float
    value_classes: frozenset[str]
    varies: frozenset[str]
    other: frozenset[str]

    def rank(self, priority: int) -> tuple[bool, bool, float, float, int, int]:
        return (self.exact, self.near, self.similarity, self.overall_similarity,
                -len(self.varies), -priority)


def _have(u: Universe, question: str, value: str, among: Iterable[str]) -> frozenset[str]:
    return frozenset(n for n in among if u.values(question, n) == {value})


def _candidates(u: Universe, branch: frozenset[str]) -> Iterable[tuple[int, _Candidate]]:
    for priority, q in enumerate(QUESTIONS):
        everywhere = u.concrete - {n for n in u.concrete if len(u.values(q.name, n)) > 1}
        kind_traits = tuple(t for t in KIND_TRAITS if t != q.name)
        branch_kinds: set[tuple[str, ...]] = set()
        for name in branch:
            branch_kinds |= _kinds(u, name, kind_traits)
        scope = {n for n in u.concrete if _kinds(u, n, kind_traits) & branch_kinds}
        varies = frozenset(n for n in scope if len(u.values(q.name, n)) > 1)
        tested = branch - varies
        if not tested:
            continue
        labels = sorted({v for n in scope - varies for v in u.values(q.name, n)})
        for value in labels:
            overall = _have(u, q.name, value, everywhere)
            if 2 * len(overall) > len(everywhere):
                continue  # the common case is no question: see MIN_SIMILARITY's docs
            have = _have(u, q.name, value, scope - varies)
            inter, union = tested & have, tested | have
            other, miss = tested - have, have - tested
            yield priority, _Candidate(
                question=q, value=value, exact=not other and not miss,
                near=not other and len(inter) > len(miss),
                similarity=len(inter) / len(union),
                overall_similarity=len(tested & overall) / len(tested | overall),
                value_classes=have, varies=varies, other=other)


def infer(raw: RawSite, u: Universe, *, path: str = "") -> Site:
    """The verdict on one class check against the class sets ``u``."""
    groups = u.group_names
    tested = [c for c in raw.classes if c not in groups]
    expanded = u.subclasses(tested) - u.subclasses(raw.excluded)
    as_written = frozenset(c for c in tested if c in u.concrete) if raw.exact else expanded
    no_rep = tuple(c for c in tested if c in u.classes
                   and (c not in u.concrete if raw.exact else not u.subclasses([c])))
    skipped = tuple(sorted(expanded - as_written)) if raw.exact else ()
    wrapper = raw.unwraps is False

    best: tuple[int, _Candidate] | None = None
    # A dict keyed by classes holds one branch per key, not one question for all keys.
    if expanded and raw.form != "class-dict":
        for priority, cand in _candidates(u, expanded):
            if best is None or cand.rank(priority) > best[1].rank(best[0]):
                best = priority, cand
    answer: Answer | None = None
    missing: tuple[str, ...] = ()
    if best is not None and best[1].similarity >= MIN_SIMILARITY:
        cand = best[1]
        match: Match = "exact" if cand.exact else "near" if cand.near else "closest"
        subject = raw.subject or "spec"
        if raw.form == "issubclass":
            subject = f"<a {subject} instance>"  # traits describe instances, not classes
        answer = Answer(
            trait=cand.question.name, value=cand.value, match=match,
            similarity=round(cand.similarity, 3),
            expression=cand.question.expression(subject, cand.value, negated=raw.negated),
            value_classes=tuple(sorted(cand.value_classes)),
            other_value_classes=tuple(sorted(cand.other)),
            varies=tuple(sorted(cand.varies)))
        if match != "closest":
            missing = tuple(sorted(cand.value_classes - as_written - cand.varies))
    return Site(path=path, raw=raw, branch_classes=tuple(sorted(as_written)), answer=answer,
                missing=missing, skipped_subclasses=skipped, wrapper_not_unwrapped=wrapper,
                no_representative=no_rep)
