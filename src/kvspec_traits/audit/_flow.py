"""What the code around a class check already decided about its subject.

A check in the second branch of ``if isinstance(s, A): ... elif isinstance(s, B): ...``
never sees ``A``; after ``if isinstance(s, A): return`` neither does the rest of the block;
after ``assert isinstance(s, A)`` or ``if not isinstance(s, A): raise`` only ``A`` gets
there. The scanner records these as *constraints* on the site's subject, and the
verdicts leave excluded classes out of what a branch can miss. Works on the syntax tree
only, like the scanner: a constraint is recognised when it tests the same subject,
written the same way.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Literal, Protocol

__all__ = [
    "Constraint",
    "TraitGuard",
    "Use",
    "bindings_before",
    "exits",
    "flow_context",
    "iterables_around",
    "kind_source",
    "path_to",
    "raises",
    "refused_through_flag",
    "test_checks",
]

_EXITS: Final = (ast.Return, ast.Raise, ast.Continue, ast.Break)

Mode = Literal["exclude", "require"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """``exclude``: instances of ``classes`` (only the classes themselves when ``exact``)
    cannot reach the site; ``require``: only instances of one of ``classes`` can.
    ``line`` is where the code says so, ``why`` how (``elif``, ``early exit``, ...)."""

    mode: Mode
    classes: tuple[str, ...]
    exact: bool
    line: int
    why: str


@dataclass(frozen=True, slots=True)
class TraitGuard:
    """An earlier ``if not s.prefix_cacheable: continue`` (attribute ``name`` of the
    subject): classes whose value for that attribute is ``excluded`` cannot reach the
    site."""

    name: str
    excluded: str
    line: int


class _CheckLike(Protocol):
    """What :func:`test_checks` needs of a recognised check (the scanner's ``_Check``)."""

    @property
    def node(self) -> ast.AST: ...
    @property
    def subject(self) -> str: ...
    @property
    def classes(self) -> tuple[str, ...]: ...
    @property
    def negated(self) -> bool: ...
    @property
    def exact(self) -> bool: ...
    @property
    def excluded(self) -> tuple[str, ...]: ...


CheckOf = Callable[[ast.expr], _CheckLike | None]


def exits(body: list[ast.stmt]) -> bool:
    """Whether a block always leaves (ends in ``return``/``raise``/``continue``/``break``)."""
    return bool(body) and isinstance(body[-1], _EXITS)


def raises(body: list[ast.stmt]) -> bool:
    """Whether a block ends in ``raise``."""
    return bool(body) and isinstance(body[-1], ast.Raise)


def _strip(expr: ast.expr) -> tuple[ast.expr, bool, str, bool, str]:
    # `not x` -> x, flipped; `any(<check> for v in it)`/`all(...)` -> the check inside.
    # Returns (inner, flipped outside the quantifier, quantifier, flipped inside, `it`).
    outer = inner = False
    quantifier = over = ""
    while True:
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            expr = expr.operand
            if quantifier:
                inner = not inner
            else:
                outer = not outer
            continue
        if (
            not quantifier
            and isinstance(expr, ast.Call)
            and isinstance(expr.func, ast.Name)
            and expr.func.id in ("any", "all")
            and len(expr.args) == 1
            and isinstance(expr.args[0], ast.GeneratorExp | ast.ListComp)
            and len(expr.args[0].generators) == 1
        ):
            quantifier, over = expr.func.id, ast.unparse(expr.args[0].generators[0].iter)
            expr = expr.args[0].elt
            continue
        return expr, outer, quantifier, inner, over


@dataclass(frozen=True, slots=True)
class Use:
    """One check inside a condition. ``outer``: the condition being true makes the
    quantified part (or, unquantified, the check) true; ``quantifier``: ``any``/``all``
    over a generator (else empty) whose iterable is ``over``; ``inner``: the quantified
    element is true exactly when the check matches (``isinstance`` true)."""

    check: _CheckLike
    outer: bool
    quantifier: str
    inner: bool
    over: str

    @property
    def triggers(self) -> bool:
        """Whether the condition being true goes with the check matching (leniently,
        for ``any``/``all`` too): ``if isinstance(s, X): return`` handles X."""
        return self.outer == self.inner

    def known(self, condition: bool) -> bool | None:
        """Whether each subject matches the check where the condition is ``condition``;
        ``None`` when that says nothing per subject."""
        value = self.outer == condition  # the quantified part's (or the check's) value
        if not self.quantifier:
            return value == self.inner
        if self.quantifier == "all":
            return self.inner if value else None
        return None if value else not self.inner


def test_checks(test: ast.expr, check_of: CheckOf) -> Iterator[Use]:
    """The checks a condition is made of (see :class:`Use`). ``and``/``or`` and ``not``
    are looked through; a lenient reading: ``if A and cond: return`` counts as excluding
    ``A`` (the author handled it there)."""
    stack: list[tuple[ast.expr, bool]] = [(test, True)]
    while stack:
        expr, positive = stack.pop()
        inner_expr, outer, quantifier, inner, over = _strip(expr)
        if outer:
            positive = not positive
        if isinstance(inner_expr, ast.BoolOp) and not quantifier:
            stack.extend((v, positive) for v in inner_expr.values)
            continue
        if isinstance(inner_expr, ast.BoolOp):  # any(A and B for ...): each conjunct
            for value in inner_expr.values:
                sub, _, _, flip, _ = _strip(value)
                check = check_of(sub)
                if check is not None:
                    yield Use(check, positive, quantifier, (not flip) != check.negated, over)
            continue
        check = check_of(inner_expr)
        if check is not None:
            if quantifier:
                yield Use(check, positive, quantifier, (not inner) != check.negated, over)
            else:
                yield Use(check, positive, "", not check.negated, over)


def path_to(scope: ast.AST, target: ast.stmt) -> list[tuple[ast.AST, str, list[ast.stmt], int]]:
    """From ``scope`` down to ``target``: each level is (statement holding the block,
    which block: ``body``/``orelse``/..., the block, index in it)."""
    stack: list[tuple[ast.AST, list[tuple[ast.AST, str, list[ast.stmt], int]]]] = [(scope, [])]
    while stack:
        node, trail = stack.pop()
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if not (isinstance(block, list) and block and isinstance(block[0], ast.stmt)):
                continue
            for i, stmt in enumerate(block):
                here = [*trail, (node, name, block, i)]
                if stmt is target:
                    return here
                if getattr(stmt, "end_lineno", 0) >= target.lineno >= stmt.lineno:
                    stack.append((stmt, here))
        for handler in getattr(node, "handlers", ()):
            for i, stmt in enumerate(handler.body):
                here = [*trail, (handler, "body", handler.body, i)]
                if stmt is target:
                    return here
                if getattr(stmt, "end_lineno", 0) >= target.lineno >= stmt.lineno:
                    stack.append((stmt, here))
    return []


def iterables_around(region: ast.AST, node: ast.AST) -> set[str]:
    """The iterables (as written) of the comprehensions in ``region`` that hold ``node``."""
    return {
        ast.unparse(g.iter)
        for n in ast.walk(region)
        if isinstance(n, ast.GeneratorExp | ast.ListComp | ast.SetComp | ast.DictComp)
        and contains(n, node)
        for g in n.generators
    }


def contains(tree: ast.AST, node: ast.AST) -> bool:
    """Whether ``node`` (by identity) is ``tree`` or inside it."""
    return any(sub is node for sub in ast.walk(tree))


def bindings_before(scope: ast.AST, region: ast.AST) -> dict[str, ast.expr]:
    """Names (and ``self.x`` attributes) bound exactly once in ``scope`` by a plain
    assignment before ``region``, with the expression bound: a flag computed earlier
    (``is_swa = isinstance(spec, SlidingWindowMLASpec)``, ``kind =
    get_kv_cache_spec_kind(spec)``) stands for that expression where it is tested."""
    counts: dict[str, int] = {}
    found: dict[str, ast.expr] = {}
    line = getattr(region, "lineno", 0)
    for node in ast.walk(scope):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.For | ast.NamedExpr):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name | ast.Attribute):
                key = ast.unparse(target)
                counts[key] = counts.get(key, 0) + 1
                if isinstance(node, ast.Assign) and len(targets) == 1 and node.lineno < line:
                    found[key] = node.value
    return {k: v for k, v in found.items() if counts[k] == 1}


class _Substitute(ast.NodeTransformer):
    def __init__(self, binds: dict[str, ast.expr]) -> None:
        self.binds = binds

    def visit_Name(self, node: ast.Name) -> ast.AST:
        bound = self.binds.get(node.id) if isinstance(node.ctx, ast.Load) else None
        return _copy(bound, node) if bound is not None else node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        bound = self.binds.get(ast.unparse(node)) if isinstance(node.ctx, ast.Load) else None
        return _copy(bound, node) if bound is not None else node


def _through_flags(test: ast.expr, binds: dict[str, ast.expr]) -> ast.expr:
    # The test with flags replaced by what they were computed from (two levels: a flag
    # computed from a kind variable computed from the spec).
    if not binds:
        return test
    names = {ast.unparse(n) for n in ast.walk(test) if isinstance(n, ast.Name | ast.Attribute)}
    if not names & binds.keys():
        return test
    out: ast.expr = test
    for _ in range(2):
        out = _Substitute(binds).visit(_copy(out, test))
    return out


def _copy(node: ast.expr, where: ast.AST) -> ast.expr:
    copied = copy.deepcopy(node)
    for sub in ast.walk(copied):  # positions of the tested line, for the reasons
        ast.copy_location(sub, where)
    return copied


def kind_source(
    scope: ast.AST, region: ast.AST, name: str, is_kind_call: Callable[[ast.expr], bool]
) -> str | None:
    """The spec a kind variable was computed from (``kind = get_kv_cache_spec_kind(spec)``
    earlier in ``scope``), as written; ``None`` when it cannot be told."""
    bound = bindings_before(scope, region).get(name)
    if isinstance(bound, ast.Call) and len(bound.args) == 1 and is_kind_call(bound.func):
        return ast.unparse(bound.args[0])
    return None


def _trait_guard(
    test: ast.expr, subject: str, attributes: frozenset[str], line: int
) -> TraitGuard | None:
    # `if not <subject>.prefix_cacheable: <exit>` -> the False value cannot get past.
    inner, flipped, quantifier, _, _ = _strip(test)
    if quantifier:
        return None
    if (
        isinstance(inner, ast.Attribute)
        and inner.attr in attributes
        and ast.unparse(inner.value) == subject
    ):
        # the exit runs when the attribute is (not flipped) true / (flipped) false
        return TraitGuard(name=inner.attr, excluded="False" if flipped else "True", line=line)
    return None


def _constraints(check: _CheckLike, matches: bool, line: int, why: str) -> list[Constraint]:
    # What a check known to match (or not) where the site runs says of the subject.
    # A spec-kind check speaks of the classes of its kinds (resolved by the verdict).
    kinds = getattr(check, "kinds", ())
    classes = tuple(f"kind:{k}" for k in kinds) if kinds else check.classes
    if matches:
        found = [Constraint("require", classes, check.exact, line, why)]
        if check.excluded:
            found.append(Constraint("exclude", check.excluded, False, line, why))
        return found
    if not check.excluded:
        return [Constraint("exclude", classes, check.exact, line, why)]
    return []


@dataclass(slots=True)
class _Around:
    """The constraints on one site's subject gathered from the code around it."""

    subject: str
    own: ast.AST
    check_of: CheckOf
    site_over: set[str]
    binds: dict[str, ast.expr]
    found: list[Constraint]

    def add(self, test: ast.expr, when_true: bool, why: str, line: int) -> None:
        flagged = _through_flags(test, self.binds)
        if flagged is not test:
            why = f"{why} (through a flag)"
        for use in test_checks(flagged, self.check_of):
            check = use.check
            if check.subject != self.subject or check.node is self.own:
                continue
            if use.quantifier and use.over not in self.site_over:
                continue
            matches = use.known(when_true)
            if matches is not None:
                self.found.extend(_constraints(check, matches, line, why))


def flow_context(
    scope: ast.AST,
    region: ast.AST,
    subject: str,
    check_of: CheckOf,
    *,
    own: ast.AST,
    trait_attributes: frozenset[str],
) -> tuple[tuple[Constraint, ...], tuple[TraitGuard, ...]]:
    """Constraints on ``subject`` that hold where ``region`` (the statement holding the
    check ``own``) runs: from enclosing ``if``/``elif`` tests, earlier early exits and
    asserts in every enclosing block."""
    if not isinstance(region, ast.stmt) or not subject:
        return (), ()
    guards: list[TraitGuard] = []
    # A check inside `any(... for v in it)` speaks of v only within that iteration: a
    # quantified constraint applies when the site iterates over the same `it`.
    around = _Around(
        subject=subject,
        own=own,
        check_of=check_of,
        site_over=iterables_around(region, own),
        binds=bindings_before(scope, region),
        found=[],
    )
    for holder, name, block, index in path_to(scope, region):
        if isinstance(holder, ast.If | ast.While) and name in ("body", "orelse"):
            around.add(
                holder.test, name == "body", "elif" if name == "orelse" else "if", holder.lineno
            )
        for stmt in block[:index]:
            if isinstance(stmt, ast.If) and exits(stmt.body):
                around.add(stmt.test, False, "early exit", stmt.lineno)
                guard = _trait_guard(stmt.test, subject, trait_attributes, stmt.lineno)
                if guard is not None:
                    guards.append(guard)
            elif isinstance(stmt, ast.Assert):
                around.add(stmt.test, True, "assert", stmt.lineno)
    return tuple(around.found), tuple(guards)


def refused_through_flag(scope: ast.AST, stmt: ast.stmt) -> bool:
    """Whether ``stmt`` binds a flag (a name assigned once in ``scope``) that a later
    ``if`` tests negated (``if ... and not flag: raise``) to guard a raise: the classes
    failing the check that computes the flag are refused loudly (issue 23's flags)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return False
    name = ast.unparse(stmt.targets[0])
    if name not in bindings_before(scope, ast.Pass(lineno=10**9)):
        return False
    return any(
        isinstance(node, ast.If)
        and node.lineno > stmt.lineno
        and raises(node.body)
        and any(
            isinstance(n, ast.UnaryOp)
            and isinstance(n.op, ast.Not)
            and ast.unparse(n.operand) == name
            for n in ast.walk(node.test)
        )
        for node in ast.walk(scope)
    )
