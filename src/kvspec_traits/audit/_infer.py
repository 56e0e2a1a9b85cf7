"""Which trait question a class check stands for, and which classes it leaves out.

The rule (docs/audit.md, "How a branch is matched to a trait") in short: expand the tested
classes as the check does (``isinstance`` takes subclasses, ``type(x) is`` does not);
compare that set with, for every trait question and value, the classes whose
representatives all give that value, among the classes of the branch's own page kind.
An equal set is an *exact* match; a proper subset that covers more than half of the value's
classes is a *near* match, and the rest are the classes the branch misses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvspec_traits.audit._around import blocked_classes, flow_reason, of_kinds
from kvspec_traits.audit._match import (
    Candidate,
    best_candidate,
    relative_candidate,
    value_set_candidate,
)
from kvspec_traits.audit._questions import QUESTIONS, VALUE_SEPARATOR, ask
from kvspec_traits.audit._readings import defines, in_test, judged_on_vllm, latent
from kvspec_traits.audit._scan import RawSite
from kvspec_traits.audit._site import CONFIDENCES, Answer, Confidence, Match, Site, Verdict
from kvspec_traits.audit._tables import SILENT, table_reason
from kvspec_traits.audit._universe import Universe

__all__ = ["CONFIDENCES", "Answer", "Confidence", "Site", "Verdict", "infer"]


def _subject_of(raw: RawSite) -> str:
    subject = raw.subject or "spec"
    if raw.form == "issubclass":
        subject = f"<a {subject} instance>"  # traits describe instances, not classes
    return subject


def _answer(cand: Candidate, raw: RawSite, *, negated: bool) -> Answer:
    match: Match = "exact" if cand.exact else "near" if cand.near else "closest"
    subject = _subject_of(raw)
    return Answer(
        trait=cand.question.name,
        value=cand.value,
        match=match,
        similarity=round(cand.similarity, 3),
        expression=cand.question.expression(subject, cand.value, negated=negated),
        value_classes=tuple(sorted(cand.value_classes)),
        other_value_classes=tuple(sorted(cand.other)),
        varies=tuple(sorted(cand.varies)),
    )


def _group_answer(raw: RawSite, u: Universe) -> Answer | None:
    # A check on vLLM's group wrapper alone asks whether a spec is a group of layers:
    # the `grouped` trait, True for the group classes and no other.
    groups = tuple(c for c in raw.classes if c in u.group_names)
    if not groups or len(groups) != len(raw.classes) or raw.excluded or raw.form == "class-dict":
        return None
    q = next(q for q in QUESTIONS if q.name == "grouped")
    subject = raw.subject or "spec"
    if raw.form == "issubclass":
        subject = f"<a {subject} instance>"
    return Answer(
        trait=q.name,
        value="True",
        match="exact",
        similarity=1.0,
        expression=q.expression(subject, "True", negated=raw.negated),
        value_classes=tuple(sorted(groups)),
        other_value_classes=(),
        varies=(),
    )


def _tested(raw: RawSite, u: Universe) -> list[str]:
    if raw.kinds:  # vLLM's own mapping from classes to kinds
        return sorted(of_kinds(u, raw.kinds))
    return [c for c in raw.classes if c not in u.group_names]


def _refuses_skipped(raw: RawSite) -> str:
    # An exact check whose failing classes reach a raise: `if type(s) not in (A, B): raise`,
    # `assert type(s) is A`, an if/elif chain ending in `else: raise` (a skipped subclass
    # fails every branch). `if type(s) is A: raise` refuses A, not the subclasses it skips.
    if "validation" in raw.context and raw.negated:
        return "guards a raise"
    if "assert" in raw.context and not raw.negated:
        return "an assertion"
    return "its if/elif chain ends in raise" if "chain-raises" in raw.context else ""


@dataclass(frozen=True, slots=True)
class _Classes:
    """What a check tests: its classes as the check takes them and as written."""

    tested: tuple[str, ...]
    exact: bool
    expanded: frozenset[str]  # the concrete classes it accepts (subclasses included)
    as_written: frozenset[str]  # an exact check: only the tested classes themselves
    no_rep: tuple[str, ...]
    unknown: tuple[str, ...]
    skipped: tuple[str, ...]  # subclasses an exact check rejects


def _skipped(raw: RawSite, u: Universe, c: _Classes) -> tuple[str, ...]:
    if not c.exact or raw.kinds:
        return ()
    # out-of-tree subclasses (even of unknown traits) are skipped all the same
    below = {
        n for n in u.out_of_tree - set(c.tested) if any(t in u.classes[n].mro[1:] for t in c.tested)
    }
    return tuple(sorted((c.expanded - c.as_written) | below))


def _classes(raw: RawSite, u: Universe) -> _Classes:
    tested = tuple(_tested(raw, u))
    exact = raw.exact and not raw.subclass_safe
    expanded = (
        frozenset(tested) & u.concrete
        if raw.kinds
        else u.subclasses(tested) - u.subclasses(raw.excluded)
    )
    no_rep = tuple(
        c
        for c in tested
        if c in u.classes
        and c not in u.unknown
        and (c not in u.concrete if exact else not u.subclasses([c]))
    )
    c = _Classes(
        tested=tested,
        exact=exact,
        expanded=expanded,
        as_written=frozenset(c for c in tested if c in u.concrete) if exact else expanded,
        no_rep=no_rep,
        unknown=tuple(c for c in raw.classes if c in u.unknown),
        skipped=(),
    )
    return replace(c, skipped=_skipped(raw, u, c))


@dataclass(frozen=True, slots=True)
class _Question:
    """The trait question read from a check, and the classes of its value it leaves out."""

    answer: Answer | None
    missing: frozenset[str]
    negative: bool = False  # `A and not B` read as B's question, negated


def _positive(raw: RawSite, u: Universe, c: _Classes) -> _Question:
    # The question the tested classes ask as they are.
    # A dict keyed by classes holds one branch per key, not one question for all keys.
    cand = best_candidate(u, c.expanded) if c.expanded and raw.form != "class-dict" else None
    if (
        (cand is None or not (cand.exact or cand.near))
        and c.expanded
        and not (c.exact or raw.excluded or raw.form == "class-dict")
    ):
        # no single value is asked: several values of one enum trait may be, exactly
        cand = value_set_candidate(u, c.expanded) or cand
    if cand is not None:
        answer = _answer(cand, raw, negated=raw.negated)
        if answer.match == "closest":
            return _Question(answer, frozenset())
        return _Question(answer, cand.value_classes - c.as_written - cand.varies)
    return _Question(_group_answer(raw, u) if not c.tested else None, frozenset())


def _less_excluded(raw: RawSite, u: Universe, c: _Classes, q: _Question) -> _Question:
    # `A and not B`: the question is B's, negated; what B's question covers but B
    # does not take out of A gets through.
    taken_out = u.subclasses(raw.excluded)
    neg = best_candidate(u, taken_out)
    neg_missing = (
        (neg.value_classes - taken_out - neg.varies) & u.subclasses(c.tested)
        if neg is not None
        else frozenset()
    )
    if (
        (q.answer is None or q.answer.match == "closest")
        and not (neg is not None and (neg.exact or (neg.near and neg_missing)))
        and not (raw.negated or c.exact or raw.form == "class-dict")
    ):
        # No question names the classes left, and B's question alone names no miss:
        # A's trait, less B's trait within A, may name them exactly.
        rel = relative_candidate(u, u.subclasses(c.tested), taken_out)
        if rel is not None:
            whole, other, value = rel
            unless = (other.name, value)
            expression = ask(
                whole.question.name, whole.value, _subject_of(raw), negated=False, unless=unless
            )
            answer = replace(
                _answer(whole, raw, negated=False), unless=unless, expression=expression
            )
            return _Question(answer, frozenset())
    if neg is not None and (neg.exact or neg.near):
        return _Question(_answer(neg, raw, negated=not raw.negated), neg_missing, negative=True)
    return q


def _question(raw: RawSite, u: Universe, c: _Classes) -> _Question:
    q = _positive(raw, u, c)
    if raw.excluded and (q.answer is None or q.answer.match != "exact"):
        return _less_excluded(raw, u, c, q)
    return q


@dataclass(frozen=True, slots=True)
class _Apart:
    """The classes of the answer's value the check leaves out (``missing``), less those
    the code around it or the question's own definition sets apart, each named."""

    missing: frozenset[str]
    excluded_by_flow: frozenset[str]
    by_enum: tuple[str, ...]


def _set_apart(raw: RawSite, u: Universe, q: _Question) -> _Apart:
    missing = q.missing
    if not q.negative:
        # `A and not B`: B's classes are taken out on purpose, never missed
        missing -= u.subclasses(raw.excluded)
    blocked = blocked_classes(raw, u)
    excluded_by_flow = missing & blocked
    missing -= blocked
    # A spec-kind check asks the enum's question: a class vLLM gives a kind of its own
    # (SlidingWindowMLASpec: SLIDING_WINDOW_MLA, not MLA_ATTENTION) is set apart by the
    # enum's definition, not left out by this check.
    by_enum = tuple(sorted(missing)) if raw.kinds else ()
    return _Apart(missing - set(by_enum), excluded_by_flow, by_enum)


_Judged = tuple[Verdict, Confidence, str]


def _placed(raw: RawSite, u: Universe, c: _Classes, path: str) -> str | None:
    # Where a check stands can make it no branch at all: a test's own expectation, a
    # class's own contract, a table looked up along the MRO.
    owner = raw.function.partition(".")[0]
    here = [t for t in c.tested if t in u.classes and defines(path, u.classes[t].module)]
    if c.exact and in_test(path, raw.function):
        # a test builds its own specs: an exact class there is what it expects of them
        where = "a test's assertion on" if "assert" in raw.context else "a check in a test on"
        return f"{where} an exact class: what the test expects of the specs it built, no branch"
    if c.exact and (owner in u.classes or (here and len(here) == len(c.tested))):
        where = f"{owner}'s own code" if owner in u.classes else "the module that defines it"
        return (
            f"an exact type in {where} (the spec definitions: merge and registry logic): "
            f"the class's own contract, not a branch of code that uses specs"
        )
    if raw.form == "class-dict" and raw.subclass_safe:
        return "a table looked up along type(x).__mro__: subclasses find their base's entry"
    return None


def _loud(raw: RawSite, c: _Classes, names: str) -> str | None:
    # A miss whose classes would be refused or fail loudly, not mishandled.
    if "assert" in raw.context:
        return f"an assertion: {names} would fail loudly, not be mishandled"
    if "validation" in raw.context:
        return f"guards a raise: {names} would be refused loudly"
    if "chain-raises" in raw.context:
        return f"its if/elif chain ends in raise: {names} takes a later branch or is refused"
    if refused := set(raw.refused) & set(c.tested):
        return (
            f"this package refuses some {', '.join(sorted(refused))} specs with a "
            f"raise: a domain limit the code states"
        )
    return None


def _plain_miss(raw: RawSite, c: _Classes, answer: Answer | None, names: str) -> _Judged:
    confidence: Confidence = "high" if answer and answer.similarity >= 0.5 else "medium"
    reason = (
        f"asks {answer.trait if answer else '?'} = "
        f"{answer.value if answer else '?'} but leaves out {names}"
    )
    if c.unknown:
        confidence = "medium"
        reason += f"; also names {', '.join(c.unknown)} (unknown traits)"
    if raw.others:
        confidence = "medium"
        reason += (
            f"; also tests {', '.join(raw.others)}, no spec class the audit "
            f"knows (defined outside the scanned code?)"
        )
    return "miss", confidence, reason


def _miss(
    raw: RawSite, c: _Classes, q: _Question, missing: frozenset[str], exited: frozenset[str]
) -> _Judged:
    names = ", ".join(sorted(missing))
    if q.negative:
        asked = q.answer.expression if q.answer else "a negative question"
        return "miss", "high", f"asks {asked} but lets {names} through"
    if missing <= exited:
        return (
            "deliberate",
            "medium",
            f"{names} handled by an explicit exit elsewhere in this function",
        )
    if "subclass-comment" in raw.context and c.exact:
        return "deliberate", "medium", "exact type check with a comment about subclasses just above"
    if (loud := _loud(raw, c, names)) is not None:
        return "possible-miss", "low", loud
    return _plain_miss(raw, c, q.answer, names)


def _skips(raw: RawSite, skipped: tuple[str, ...], exited: frozenset[str]) -> _Judged:
    # An exact check that rejects subclasses of a tested class.
    listed = ", ".join(skipped)
    if not set(skipped) - exited:
        return (
            "deliberate",
            "medium",
            "exact type check; the subclasses it skips are handled by an explicit exit",
        )
    if "subclass-comment" in raw.context:
        return "deliberate", "medium", "exact type check with a comment about subclasses just above"
    if refusal := _refuses_skipped(raw):
        return (
            "possible-miss",
            "low",
            f"{refusal}: the subclasses it skips ({listed}) are refused loudly",
        )
    if raw.form == "class-dict" and raw.lookup != SILENT:
        # a table is an exact check through its lookup: only a silent one mishandles
        return "possible-miss", "low", table_reason(raw.table, raw.lookup, skipped)
    if raw.form == "class-compare":
        return (
            "exact-type",
            "low",
            f"a class read elsewhere (a registry answer, a stored type) compared by "
            f"identity: whether subclasses ({listed}) can reach it depends "
            f"on where it comes from",
        )
    reason = f"exact type check skips subclasses {listed}"
    if raw.form == "class-dict":
        reason += f"; {raw.table} is looked up by type with a fallback (.get, in, except)"
    return "exact-type", "medium", reason


def _ok_reason(raw: RawSite, answer: Answer | None) -> str:
    if raw.unwraps:
        return "tests the group wrapper and reads its members (an unwrap)"
    if answer and answer.unless:
        return "asks exactly one trait's classes, less those of another trait's value"
    if answer and answer.match == "exact" and VALUE_SEPARATOR in answer.value:
        return "asks exactly the classes of several values of one trait"
    if answer and answer.match == "exact":
        return "asks exactly one trait's classes"
    if answer and answer.match == "closest":
        return "closest to one trait, but also accepts classes of another value"
    return "no single trait: a class-identity check"


def _set_apart_reason(raw: RawSite, u: Universe, apart: _Apart) -> str | None:
    # An `ok` whose left-out classes the code around it or the enum sets apart.
    if apart.excluded_by_flow:
        return (
            f"{', '.join(sorted(apart.excluded_by_flow))} cannot get here (excluded by "
            f"{flow_reason(raw, u, apart.excluded_by_flow)})"
        )
    if apart.by_enum:
        return (
            f"asks KVCacheSpecKind {', '.join(raw.kinds)}; "
            + ", ".join(
                f"{m} has the kind {'/'.join(sorted(u.kinds.get(m, ()))) or 'UNKNOWN'}"
                for m in apart.by_enum
            )
            + " (the enum's definition)"
        )
    return None


def _judge(
    raw: RawSite, u: Universe, c: _Classes, q: _Question, apart: _Apart, path: str
) -> _Judged:
    exited = u.subclasses(raw.exited_on)
    if (placed := _placed(raw, u, c, path)) is not None:
        return "ok", "high", placed
    if c.unknown and not c.expanded:
        return (
            "unknown-class",
            "high",
            f"names {', '.join(c.unknown)}, defined in the scanned code with fields of "
            f"its own: its traits are unknown (register an adapter for it)",
        )
    if apart.missing:
        return _miss(raw, c, q, apart.missing, exited)
    if c.skipped:
        return _skips(raw, c.skipped, exited)
    if raw.unwraps is False:
        return (
            "group-wrapper",
            "low",
            "tests the group wrapper and reads none of its members; its own "
            "properties (page_size_bytes sums the members) may be what it means",
        )
    return "ok", "high", _set_apart_reason(raw, u, apart) or _ok_reason(raw, q.answer)


def _notes(raw: RawSite, c: _Classes, verdict: Verdict) -> str:
    # What the verdict leaves unsaid: tested classes whose traits the audit cannot tell.
    notes = ""
    if c.unknown and verdict == "ok":
        notes += f"; names {', '.join(c.unknown)} (unknown traits: adds fields)"
    if c.no_rep and verdict == "ok":
        notes += (
            f"; {', '.join(c.no_rep)} has no representative: its traits are unknown to the audit"
        )
    if raw.others and verdict != "miss":
        notes += f"; also tests {', '.join(raw.others)}, no spec class the audit knows"
    return notes


def infer(raw: RawSite, u: Universe, *, path: str = "") -> Site:
    """The verdict on one class check against the class sets ``u``."""
    mixed = judged_on_vllm(raw, u, path, infer)
    if mixed is not None:
        return mixed
    c = _classes(raw, u)
    q = _question(raw, u, c)
    apart = _set_apart(raw, u, q)
    verdict, confidence, reason = _judge(raw, u, c, q, apart, path)
    site = Site(
        path=path,
        raw=raw,
        branch_classes=tuple(sorted(c.as_written)),
        answer=q.answer,
        missing=tuple(sorted(apart.missing)),
        skipped_subclasses=c.skipped,
        wrapper_not_unwrapped=raw.unwraps is False,
        no_representative=c.no_rep,
        verdict=verdict,
        confidence=confidence,
        reason=reason + _notes(raw, c, verdict),
        excluded_by_flow=tuple(sorted(apart.excluded_by_flow)),
        unknown=c.unknown,
    )
    return latent(site, raw, u)
