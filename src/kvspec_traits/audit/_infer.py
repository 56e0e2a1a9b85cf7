"""Which trait question a class check stands for, and which classes it leaves out.

The rule (docs/audit.md, "How a branch is matched to a trait") in short: expand the tested
classes as the check does (``isinstance`` takes subclasses, ``type(x) is`` does not);
compare that set with, for every trait question and value, the classes whose
representatives all give that value, among the classes of the branch's own page kind.
An equal set is an *exact* match; a proper subset that covers more than half of the value's
classes is a *near* match, and the rest are the classes the branch misses.
"""

from __future__ import annotations

from dataclasses import replace

from kvspec_traits.audit._around import blocked_classes, flow_reason, of_kinds
from kvspec_traits.audit._match import (
    Candidate,
    best_candidate,
    relative_candidate,
    value_set_candidate,
)
from kvspec_traits.audit._questions import QUESTIONS, VALUE_SEPARATOR, ask
from kvspec_traits.audit._readings import defines, in_test, judged_on_vllm
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


# Over the size bounds (docs/architecture.md, "Size"): one verdict over every reading of a
# class check, 45 branches; to be split along its questions (issue 37).
def infer(raw: RawSite, u: Universe, *, path: str = "") -> Site:  # noqa: C901, PLR0915
    """The verdict on one class check against the class sets ``u``."""
    mixed = judged_on_vllm(raw, u, path, infer)
    if mixed is not None:
        return mixed
    tested = _tested(raw, u)
    exact = raw.exact and not raw.subclass_safe
    expanded = (
        frozenset(tested) & u.concrete
        if raw.kinds
        else u.subclasses(tested) - u.subclasses(raw.excluded)
    )
    as_written = frozenset(c for c in tested if c in u.concrete) if exact else expanded
    no_rep = tuple(
        c
        for c in tested
        if c in u.classes
        and c not in u.unknown
        and (c not in u.concrete if exact else not u.subclasses([c]))
    )
    unknown = tuple(c for c in raw.classes if c in u.unknown)
    skipped: tuple[str, ...] = ()
    if exact and not raw.kinds:
        # out-of-tree subclasses (even of unknown traits) are skipped all the same
        below = {
            n for n in u.out_of_tree - set(tested) if any(t in u.classes[n].mro[1:] for t in tested)
        }
        skipped = tuple(sorted((expanded - as_written) | below))
    wrapper = raw.unwraps is False
    blocked = blocked_classes(raw, u)

    answer: Answer | None = None
    missing: frozenset[str] = frozenset()
    negative = False
    # A dict keyed by classes holds one branch per key, not one question for all keys.
    cand = best_candidate(u, expanded) if expanded and raw.form != "class-dict" else None
    if (
        (cand is None or not (cand.exact or cand.near))
        and expanded
        and not (exact or raw.excluded or raw.form == "class-dict")
    ):
        # no single value is asked: several values of one enum trait may be, exactly
        cand = value_set_candidate(u, expanded) or cand
    if cand is not None:
        answer = _answer(cand, raw, negated=raw.negated)
        if answer.match != "closest":
            missing = cand.value_classes - as_written - cand.varies
    elif not tested:
        answer = _group_answer(raw, u)
    if raw.excluded and (answer is None or answer.match != "exact"):
        # `A and not B`: the question is B's, negated; what B's question covers but B
        # does not take out of A gets through.
        taken_out = u.subclasses(raw.excluded)
        neg = best_candidate(u, taken_out)
        neg_missing = (
            (neg.value_classes - taken_out - neg.varies) & u.subclasses(tested)
            if neg is not None
            else frozenset()
        )
        rel = None
        if (
            (answer is None or answer.match == "closest")
            and not (neg is not None and (neg.exact or (neg.near and neg_missing)))
            and not (raw.negated or exact or raw.form == "class-dict")
        ):
            # No question names the classes left, and B's question alone names no miss:
            # A's trait, less B's trait within A, may name them exactly.
            rel = relative_candidate(u, u.subclasses(tested), taken_out)
        if rel is not None:
            whole, other, value = rel
            unless = (other.name, value)
            answer = replace(
                _answer(whole, raw, negated=False),
                unless=unless,
                expression=ask(
                    whole.question.name, whole.value, _subject_of(raw), negated=False, unless=unless
                ),
            )
            missing = frozenset()
        elif neg is not None and (neg.exact or neg.near):
            answer = _answer(neg, raw, negated=not raw.negated)
            missing = neg_missing
            negative = True
    if not negative:
        # `A and not B`: B's classes are taken out on purpose, never missed
        missing -= u.subclasses(raw.excluded)
    excluded_by_flow = missing & blocked
    missing -= blocked
    # An out-of-tree subclass of a missed class, tested here or handled by the code
    # around it, covers it: that platform makes its own subclass's instances.
    around = {*raw.classes, *raw.exited_on, *(n for c in raw.constraints for n in c.classes)}
    # (the class it replaces: its own first base)
    replaced = {u.classes[c].mro[1] for c in around if c in u.out_of_tree}
    covered = missing & replaced
    missing -= covered
    # A spec-kind check asks the enum's question: a class vLLM gives a kind of its own
    # (SlidingWindowMLASpec: SLIDING_WINDOW_MLA, not MLA_ATTENTION) is set apart by the
    # enum's definition, not left out by this check.
    by_enum = sorted(missing) if raw.kinds else []
    missing -= set(by_enum)

    verdict: Verdict = "ok"
    confidence: Confidence = "high"
    if raw.unwraps:
        reason = "tests the group wrapper and reads its members (an unwrap)"
    elif answer and answer.unless:
        reason = "asks exactly one trait's classes, less those of another trait's value"
    elif answer and answer.match == "exact" and VALUE_SEPARATOR in answer.value:
        reason = "asks exactly the classes of several values of one trait"
    elif answer and answer.match == "exact":
        reason = "asks exactly one trait's classes"
    elif answer and answer.match == "closest":
        reason = "closest to one trait, but also accepts classes of another value"
    else:
        reason = "no single trait: a class-identity check"
    exited = u.subclasses(raw.exited_on)
    owner = raw.function.partition(".")[0]
    here = [c for c in tested if c in u.classes and defines(path, u.classes[c].module)]
    if exact and in_test(path, raw.function):
        # a test builds its own specs: an exact class there is what it expects of them
        where = "a test's assertion on" if "assert" in raw.context else "a check in a test on"
        reason = f"{where} an exact class: what the test expects of the specs it built, no branch"
    elif exact and (owner in u.classes or (here and len(here) == len(tested))):
        where = f"{owner}'s own code" if owner in u.classes else "the module that defines it"
        reason = (
            f"an exact type in {where} (the spec definitions: merge and registry logic): "
            f"the class's own contract, not a branch of code that uses specs"
        )
    elif raw.form == "class-dict" and raw.subclass_safe:
        reason = "a table looked up along type(x).__mro__: subclasses find their base's entry"
    elif unknown and not expanded:
        verdict, confidence = "unknown-class", "high"
        reason = (
            f"names {', '.join(unknown)}, defined in the scanned code with fields of "
            f"its own: its traits are unknown (register an adapter for it)"
        )
    elif missing:
        names = ", ".join(sorted(missing))
        if negative:
            verdict, confidence = "miss", "high"
            reason = (
                f"asks {answer.expression if answer else 'a negative question'} but "
                f"lets {names} through"
            )
        elif missing <= exited:
            verdict, confidence = "deliberate", "medium"
            reason = f"{names} handled by an explicit exit elsewhere in this function"
        elif "subclass-comment" in raw.context and exact:
            verdict, confidence = "deliberate", "medium"
            reason = "exact type check with a comment about subclasses just above"
        elif "assert" in raw.context:
            verdict, confidence = "possible-miss", "low"
            reason = f"an assertion: {names} would fail loudly, not be mishandled"
        elif "validation" in raw.context:
            verdict, confidence = "possible-miss", "low"
            reason = f"guards a raise: {names} would be refused loudly"
        elif "chain-raises" in raw.context:
            verdict, confidence = "possible-miss", "low"
            reason = f"its if/elif chain ends in raise: {names} takes a later branch or is refused"
        elif set(raw.refused) & set(tested):
            verdict, confidence = "possible-miss", "low"
            reason = (
                f"this package refuses some "
                f"{', '.join(sorted(set(raw.refused) & set(tested)))} specs with a "
                f"raise: a domain limit the code states"
            )
        else:
            verdict = "miss"
            confidence = "high" if answer and answer.similarity >= 0.5 else "medium"
            reason = (
                f"asks {answer.trait if answer else '?'} = "
                f"{answer.value if answer else '?'} but leaves out {names}"
            )
            if unknown:
                confidence = "medium"
                reason += f"; also names {', '.join(unknown)} (unknown traits)"
            if raw.others:
                confidence = "medium"
                reason += (
                    f"; also tests {', '.join(raw.others)}, no spec class the audit "
                    f"knows (defined outside the scanned code?)"
                )
    elif skipped and not (set(skipped) - exited):
        verdict, confidence = "deliberate", "medium"
        reason = "exact type check; the subclasses it skips are handled by an explicit exit"
    elif skipped and "subclass-comment" in raw.context:
        verdict, confidence = "deliberate", "medium"
        reason = "exact type check with a comment about subclasses just above"
    elif skipped and (refusal := _refuses_skipped(raw)):
        verdict, confidence = "possible-miss", "low"
        reason = f"{refusal}: the subclasses it skips ({', '.join(skipped)}) are refused loudly"
    elif skipped and raw.form == "class-dict" and raw.lookup != SILENT:
        # a table is an exact check through its lookup: only a silent one mishandles
        verdict, confidence = "possible-miss", "low"
        reason = table_reason(raw.table, raw.lookup, skipped)
    elif skipped and raw.form == "class-compare":
        verdict, confidence = "exact-type", "low"
        reason = (
            f"a class read elsewhere (a registry answer, a stored type) compared by "
            f"identity: whether subclasses ({', '.join(skipped)}) can reach it depends "
            f"on where it comes from"
        )
    elif skipped:
        verdict, confidence = "exact-type", "medium"
        reason = f"exact type check skips subclasses {', '.join(skipped)}"
        if raw.form == "class-dict":
            reason += f"; {raw.table} is looked up by type with a fallback (.get, in, except)"
    elif wrapper:
        verdict, confidence = "group-wrapper", "low"
        reason = (
            "tests the group wrapper and reads none of its members; its own "
            "properties (page_size_bytes sums the members) may be what it means"
        )
    elif excluded_by_flow:
        reason = (
            f"{', '.join(sorted(excluded_by_flow))} cannot get here (excluded by "
            f"{flow_reason(raw, u, excluded_by_flow)})"
        )
    elif covered:
        reason = f"{', '.join(sorted(covered))} covered by an out-of-tree subclass the code names"
    elif by_enum:
        reason = (
            f"asks KVCacheSpecKind {', '.join(raw.kinds)}; "
            + ", ".join(
                f"{m} has the kind {'/'.join(sorted(u.kinds.get(m, ()))) or 'UNKNOWN'}"
                for m in by_enum
            )
            + " (the enum's definition)"
        )
    if unknown and verdict == "ok":
        reason += f"; names {', '.join(unknown)} (unknown traits: adds fields)"
    if no_rep and verdict == "ok":
        reason += (
            f"; {', '.join(no_rep)} has no representative: its traits are unknown to the audit"
        )
    if raw.others and verdict != "miss":
        reason += f"; also tests {', '.join(raw.others)}, no spec class the audit knows"
    return Site(
        path=path,
        raw=raw,
        branch_classes=tuple(sorted(as_written)),
        answer=answer,
        missing=tuple(sorted(missing)),
        skipped_subclasses=skipped,
        wrapper_not_unwrapped=wrapper,
        no_representative=no_rep,
        verdict=verdict,
        confidence=confidence,
        reason=reason,
        excluded_by_flow=tuple(sorted(excluded_by_flow)),
        unknown=unknown,
    )
