"""Which audit sites are rewritten, where each one sits in the source, and what replaces it.

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

from kvspec_traits.audit import Site, Universe
from kvspec_traits.audit._questions import KIND_TRAITS, question_named

__all__ = ["REWRITTEN_FORMS", "Edit", "Skip", "Span", "keep_context", "plan_site"]

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

_REPRESENTATIVE: Final = "get_representative_spec_type"

_REWRITTEN_VERDICTS: Final = frozenset({"ok", "miss"})


@dataclass(frozen=True, slots=True)
class Span:
    """Start and end (exclusive) of an expression: 1-based lines, 0-based character
    columns (LibCST's positions, parentheses excluded)."""

    line: int
    col: int
    end_line: int
    end_col: int


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
    return subject.partition("(")[0].endswith(_REPRESENTATIVE)


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


def _char_col(lines: list[str], line: int, byte_col: int) -> int:
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))


def _span(node: ast.expr, lines: list[str]) -> Span:
    end_line = node.end_lineno or node.lineno
    return Span(
        node.lineno,
        _char_col(lines, node.lineno, node.col_offset),
        end_line,
        _char_col(lines, end_line, node.end_col_offset or 0),
    )


def _source_of(node: ast.expr, lines: list[str]) -> str:
    span = _span(node, lines)
    if span.line == span.end_line:
        return lines[span.line - 1][span.col : span.end_col]
    parts = [
        lines[span.line - 1][span.col :],
        *lines[span.line : span.end_line - 1],
        lines[span.end_line - 1][: span.end_col],
    ]
    return "\n".join(parts)


class SourceIndex:
    """One module's syntax tree with parent links and checks found by position."""

    def __init__(self, text: str) -> None:
        self.tree = ast.parse(text)
        self.lines = text.splitlines()
        self.parents: dict[int, ast.AST] = {}
        self.at: dict[tuple[int, int], list[ast.expr]] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[id(child)] = node
            if isinstance(node, ast.Call | ast.Compare):
                self.at.setdefault((node.lineno, node.col_offset), []).append(node)

    def parent(self, node: ast.AST) -> ast.AST | None:
        return self.parents.get(id(node))


def _subject(check: ast.expr) -> ast.expr | None:
    # The instance a check asks about: isinstance(x, C), not ..., type(x) is C, and the
    # x of type(x).__mro__ anywhere inside an MRO walk.
    while isinstance(check, ast.UnaryOp) and isinstance(check.op, ast.Not):
        check = check.operand
    for node in ast.walk(check):
        if isinstance(node, ast.Attribute) and node.attr == "__mro__":
            inner = _subject(ast.Compare(left=node.value, ops=[ast.Is()], comparators=[]))
            return inner if inner is not None else node.value
    if isinstance(check, ast.Call) and check.args:
        first = check.args[0]
        if isinstance(first, ast.Call) and _representative_call(first):
            return first.args[0]
        return first
    if isinstance(check, ast.Compare):
        for side in (check.left, *check.comparators):
            if isinstance(side, ast.Call) and _representative_call(side):
                return side.args[0]
            if (
                isinstance(side, ast.Call)
                and isinstance(side.func, ast.Name)
                and side.func.id == "type"
                and len(side.args) == 1
            ):
                return side.args[0]
            if isinstance(side, ast.Attribute) and side.attr == "__class__":
                return side.value
    return None


def _representative_call(node: ast.expr) -> bool:
    # get_representative_spec_type(x), however it is imported
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name == _REPRESENTATIVE


def _mro_any(node: ast.expr, index: SourceIndex) -> ast.expr | None:
    # `any(<node> for c in type(x).__mro__)`: the any() call a name walk stands for.
    gen = index.parent(node)
    call = index.parent(gen) if isinstance(gen, ast.GeneratorExp) else None
    if (
        isinstance(gen, ast.GeneratorExp)
        and isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "any"
        and gen.elt is node
        and len(gen.generators) == 1
        and isinstance(gen.generators[0].iter, ast.Attribute)
        and gen.generators[0].iter.attr == "__mro__"
    ):
        return call
    return None


def _locate(site: Site, index: SourceIndex) -> tuple[list[ast.expr], bool] | None:
    # The expressions the audit read as this site: ([one], False) or (members, True).
    raw = site.raw
    for node in index.at.get((raw.line, raw.col), []):
        current: ast.expr = node
        while True:
            if ast.unparse(current) == raw.text:
                walk = _mro_any(current, index) if raw.form == "mro-walk" else None
                return [walk if walk is not None else current], False
            parent = index.parent(current)
            if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not):
                current = parent
                continue
            break
        parent = index.parent(current)
        if isinstance(parent, ast.BoolOp):
            joiner = " or " if isinstance(parent.op, ast.Or) else " and "
            parts = raw.text.split(joiner)
            start = next((i for i, v in enumerate(parent.values) if v is current), None)
            if start is None:
                continue
            members = [v for v in parent.values[start:] if ast.unparse(v) in parts]
            if joiner.join(ast.unparse(m) for m in members) == raw.text:
                return members, True
    return None


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
    have = frozenset(n for n in concrete if u.values(answer.trait, n) == {answer.value})
    varies = frozenset(n for n in concrete if len(u.values(answer.trait, n)) > 1)
    new = concrete - have if negated else have
    differ = (old ^ new) - varies - set(site.missing)
    kinds = frozenset(k for n in branch for k in _kind(u, n, answer.trait))
    own = {n for n in differ if _kind(u, n, answer.trait) & kinds}
    return tuple(sorted(differ - own)), tuple(sorted(own))


def plan_site(site: Site, index: SourceIndex, universe: Universe) -> Edit | Skip:
    """The edit that rewrites ``site`` into its traits question, or why it is left."""
    why = _why_not(site)
    if why is not None:
        return _skip(site, why)
    answer = site.answer
    if answer is None:  # _why_not returned a reason already
        return _skip(site, "no trait question")
    found = _locate(site, index)
    if found is None:
        return _skip(site, "the check could not be found again in the source")
    members, chain = found
    # a spec-kind site's subject is the spec the audit resolved (a kind variable's spec
    # is no part of the check as written)
    subject = _subject(members[0]) if site.raw.form != "spec-kind" else None
    if subject is None and site.raw.form != "spec-kind":
        return _skip(site, "no instance expression in the check")
    question = question_named(answer.trait)
    # The audit wrote answer.expression on raw.subject; pick the polarity it used.
    raw_subject = site.raw.subject or "spec"
    if site.raw.form == "issubclass":
        raw_subject = f"<a {raw_subject} instance>"
    negated = next(
        (
            n
            for n in (False, True)
            if question.expression(raw_subject, answer.value, negated=n) == answer.expression
        ),
        None,
    )
    if negated is None:
        return _skip(site, f"unexpected answer expression {answer.expression!r}")
    if subject is None:
        written = site.raw.subject
    else:
        written = _source_of(subject, index.lines)  # the subject as the source spells it
        if "\n" in written:
            written = ast.unparse(subject)
    after = question.expression(written, answer.value, negated=negated)
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
        spans=tuple(_span(m, index.lines) for m in members),
        chain=chain,
        differs_on=other_kind,
    )


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
