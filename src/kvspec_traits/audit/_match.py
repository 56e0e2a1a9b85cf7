"""Which trait question and value a branch's tested classes stand for
(:func:`best_candidate`), among the classes of the branch's own page kind; ``_infer``
turns the best candidate into an answer and a verdict."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import product
from typing import Final

from kvspec_traits.audit._questions import KIND_TRAITS, QUESTIONS, Question
from kvspec_traits.audit._universe import Universe

__all__ = ["MIN_SIMILARITY", "Candidate", "best_candidate"]

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


def _candidates(u: Universe, branch: frozenset[str]) -> Iterable[tuple[int, Candidate]]:
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
