"""What the audit says about one class check: the trait question it most likely asks
(:class:`Answer`) and its verdict (:class:`Site`). ``_infer.infer`` returns a Site, and
each reading of a site (``_readings``) refines one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from kvspec_traits.audit._scan import RawSite

__all__ = ["CONFIDENCES", "Answer", "Confidence", "Match", "Site", "Verdict"]

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
    unless: tuple[str, ...] = ()
    """For ``A and not B`` read as two traits: B's trait and value, asked ``and not``
    after this answer's (see :func:`~kvspec_traits.audit._match.relative_candidate`)."""


Verdict = Literal[
    "miss", "possible-miss", "deliberate", "exact-type", "group-wrapper", "unknown-class", "ok"
]
Confidence = Literal["high", "medium", "low"]
CONFIDENCES: Final = ("low", "medium", "high")
"""In increasing order (``--min-confidence`` keeps a site at or above its level)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """One class check with its verdict.

    ``branch_classes``: the concrete classes the check accepts. ``missing``: classes with
    the answer's value that it does not accept (for a negative question, ``A and not
    B``: classes it lets through that the question leaves out), with classes the code
    around it already excluded taken out (``excluded_by_flow``). ``skipped_subclasses``:
    for exact checks, subclasses of a tested class that the check rejects.
    ``wrapper_not_unwrapped``: the check tests a group wrapper and the guarded code never
    reads its members. ``no_representative``: tested classes the class sets know nothing
    about. ``unknown``: tested classes the scanned code defines with fields of their own
    (their traits cannot be told). ``verdict`` sums it up, ``confidence`` says how sure
    it is, and ``reason`` says why in one line.
    """

    path: str
    raw: RawSite
    branch_classes: tuple[str, ...]
    answer: Answer | None
    missing: tuple[str, ...]
    skipped_subclasses: tuple[str, ...]
    wrapper_not_unwrapped: bool
    no_representative: tuple[str, ...]
    verdict: Verdict = "ok"
    confidence: Confidence = "high"
    reason: str = ""
    excluded_by_flow: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()

    @property
    def has_miss(self) -> bool:
        """Whether the branch leaves out a class it most likely means (what
        ``--fail-on-miss`` fails on): a ``miss`` verdict."""
        return self.verdict == "miss"

    def at_least(self, confidence: str) -> bool:
        """Whether this site's confidence is ``confidence`` or higher."""
        return CONFIDENCES.index(self.confidence) >= CONFIDENCES.index(confidence)
