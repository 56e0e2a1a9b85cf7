"""Which trait question and value a branch's tested classes stand for
(:func:`best_candidate`), among the classes of the branch's own page kind; ``_infer``
turns the best candidate into an answer and a verdict."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import product
from typing import Final

from kvspec_traits.audit._questions import (
    KIND_TRAITS,
    QUESTIONS,
    VALUE_SEPARATOR,
    Question,
    joined_values,
)
from kvspec_traits.audit._universe import Universe

__all__ = [
    "MIN_SIMILARITY",
    "Candidate",
    "best_candidate",
    "exact_values",
    "relative_candidate",
    "value_set_candidate",
]

MIN_SIMILARITY: Final = 0.6
"""Below this Jaccard similarity no trait is named ("no single trait"). A value that more
than half of all classes have (``transferable``, ``not is_mla``) is never named either:
a branch on the common case is read through the exceptions it singles out."""


def _kinds(u: Universe, name: str, traits: tuple[str, ...]) -> set[tuple[str, ...]]:
    return set(product(*(sorted(u.values(t, name)) for t in traits)))


@dataclass(frozen=True, slots=True)
class Candidate:
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
        return (
            self.exact,
            self.near,
            self.similarity,
            self.overall_similarity,
            -len(self.varies),
            -priority,
        )


def _have(u: Universe, question: str, value: str, among: Iterable[str]) -> frozenset[str]:
    return frozenset(n for n in among if u.values(question, n) == {value})


def _scope(u: Universe, q: Question, branch: frozenset[str]) -> tuple[set[str], frozenset[str]]:
    # The concrete classes of the branch's page kinds, and those of them whose
    # representatives disagree on q (left out of every comparison).
    kind_traits = tuple(t for t in KIND_TRAITS if t != q.name)
    branch_kinds: set[tuple[str, ...]] = set()
    for name in branch:
        branch_kinds |= _kinds(u, name, kind_traits)
    scope = {n for n in u.concrete if _kinds(u, n, kind_traits) & branch_kinds}
    return scope, frozenset(n for n in scope if len(u.values(q.name, n)) > 1)


def _candidates(u: Universe, branch: frozenset[str]) -> Iterable[tuple[int, Candidate]]:
    for priority, q in enumerate(QUESTIONS):
        everywhere = u.concrete - {n for n in u.concrete if len(u.values(q.name, n)) > 1}
        scope, varies = _scope(u, q, branch)
        tested = branch - varies
        if not tested:
            continue
        labels = sorted({v for n in scope - varies for v in u.values(q.name, n)})
        for value in labels:
            overall = _have(u, q.name, value, everywhere)
            common = 2 * len(overall) > len(everywhere)
            if common and not q.common:
                continue  # the common case is no question: see MIN_SIMILARITY's docs
            have = _have(u, q.name, value, scope - varies)
            inter, union = tested & have, tested | have
            other, miss = tested - have, have - tested
            if common and (other or miss or overall - tested):
                # A common value is asked only as the exact set of every kind: within
                # one kind, traits_of(spec).attention_page would also take the others'.
                continue
            yield (
                priority,
                Candidate(
                    question=q,
                    value=value,
                    exact=not other and not miss,
                    near=not other and len(inter) > len(miss),
                    similarity=len(inter) / len(union),
                    overall_similarity=len(tested & overall) / len(tested | overall),
                    value_classes=have,
                    varies=varies,
                    other=other,
                ),
            )


def best_candidate(u: Universe, branch: frozenset[str]) -> Candidate | None:
    best: tuple[int, Candidate] | None = None
    for priority, cand in _candidates(u, branch):
        if best is None or cand.rank(priority) > best[1].rank(best[0]):
            best = priority, cand
    if best is None or best[1].similarity < MIN_SIMILARITY:
        return None
    return best[1]


def exact_values(u: Universe, q: Question, branch: frozenset[str]) -> Candidate | None:
    """``q``'s values of the branch's classes, when the classes of the branch's page kinds
    that have one of them are exactly the branch: ``isinstance(spec, (FullAttentionSpec,
    MambaSpec))`` is ``token_scope in (FULL, PROMPT_AND_WINDOW, RECURRENT_STATE)``. Only an
    enum trait is asked so; None when the values name other classes too (or none)."""
    if q.booleans:
        return None
    scope, varies = _scope(u, q, branch)
    tested = branch - varies
    if not tested:
        return None
    values = frozenset(v for n in tested for v in u.values(q.name, n))
    have = frozenset(n for n in scope - varies if u.values(q.name, n) <= values)
    if have != tested:
        return None
    everywhere = frozenset(
        n for n in u.concrete if len(u.values(q.name, n)) == 1 and u.values(q.name, n) <= values
    )
    return Candidate(
        question=q,
        value=joined_values(values),
        exact=True,
        near=False,
        similarity=1.0,
        overall_similarity=len(tested & everywhere) / len(tested | everywhere),
        value_classes=have,
        varies=varies,
        other=frozenset(),
    )


def value_set_candidate(u: Universe, branch: frozenset[str]) -> Candidate | None:
    """A set of one enum trait's values that names the branch's classes exactly (see
    :func:`exact_values`), asked only where no single value does: the first such trait in
    :data:`QUESTIONS` order. Never a near match, so never a miss of its own."""
    for q in QUESTIONS:
        found = exact_values(u, q, branch)
        if found is not None and VALUE_SEPARATOR in found.value:
            return found
    return None


def relative_candidate(
    u: Universe, accepted: frozenset[str], taken_out: frozenset[str]
) -> tuple[Candidate, Question, str] | None:
    """``isinstance(s, A) and not isinstance(s, B)`` as two traits: A's classes
    (``accepted``) are exactly one trait's value (or values), and among them B's
    (``taken_out``) are exactly another trait's value: ``SlidingWindowSpec and not
    SlidingWindowMLASpec`` is ``token_scope is SLIDING_WINDOW and not is_mla``. Returns
    A's candidate, B's question and value; None unless both match exactly."""
    inside = accepted & taken_out
    if not inside or inside == accepted:
        return None
    whole = best_candidate(u, accepted)
    if whole is None or not whole.exact:
        whole = value_set_candidate(u, accepted)
    if whole is None or whole.varies & accepted:
        return None
    for q in QUESTIONS:
        if q.name == whole.question.name or any(len(u.values(q.name, n)) > 1 for n in accepted):
            continue
        for value in sorted({v for n in inside for v in u.values(q.name, n)}):
            if frozenset(n for n in accepted if u.values(q.name, n) == {value}) == inside:
                return whole, q, value
    return None
