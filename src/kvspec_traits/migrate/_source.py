"""Where an audit site sits in a module's source: the syntax tree with parent links, the
expression the audit read as one check (the call, the ``not`` around it, or the members of
an ``and``/``or`` chain), its subject as the source spells it, and its span in LibCST's
terms (:class:`Span`)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from kvspec_traits.audit import Site

__all__ = [
    "REPRESENTATIVE",
    "SourceIndex",
    "Span",
    "bound_more_than_once",
    "handled_nearby",
    "locate",
    "source_of",
    "span_of",
    "subject_of",
]

REPRESENTATIVE: Final = "get_representative_spec_type"


@dataclass(frozen=True, slots=True)
class Span:
    """Start and end (exclusive) of an expression: 1-based lines, 0-based character
    columns (LibCST's positions, parentheses excluded)."""

    line: int
    col: int
    end_line: int
    end_col: int


def char_col(lines: list[str], line: int, byte_col: int) -> int:
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))


def span_of(node: ast.expr, lines: list[str]) -> Span:
    end_line = node.end_lineno or node.lineno
    return Span(
        node.lineno,
        char_col(lines, node.lineno, node.col_offset),
        end_line,
        char_col(lines, end_line, node.end_col_offset or 0),
    )


def source_of(node: ast.expr, lines: list[str]) -> str:
    span = span_of(node, lines)
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

    def function_of(self, node: ast.AST) -> ast.AST | None:
        """The innermost function (or lambda) ``node`` is in; None at module level."""
        scope = self.parent(node)
        while scope is not None and not isinstance(
            scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        ):
            scope = self.parent(scope)
        return scope


def handled_nearby(check: ast.expr, index: SourceIndex, classes: Iterable[str]) -> dict[str, int]:
    """Those of ``classes`` that the function ``check`` is in names elsewhere (a reference
    ``X`` or ``mod.X`` outside the check), each with the line of its first mention:
    evidence that a spec of that class reaches the check."""
    scope = index.function_of(check)
    wanted = set(classes)
    if scope is None or not wanted:
        return {}
    inside = {id(n) for n in ast.walk(check)}
    found: dict[str, int] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Name | ast.Attribute) and id(node) not in inside:
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in wanted:
                found[name] = min(found.get(name, node.lineno), node.lineno)
    return found


def subject_of(check: ast.expr) -> ast.expr | None:
    # The instance a check asks about: isinstance(x, C), not ..., type(x) is C, and the
    # x of type(x).__mro__ anywhere inside an MRO walk.
    while isinstance(check, ast.UnaryOp) and isinstance(check.op, ast.Not):
        check = check.operand
    for node in ast.walk(check):
        if isinstance(node, ast.Attribute) and node.attr == "__mro__":
            inner = subject_of(ast.Compare(left=node.value, ops=[ast.Is()], comparators=[]))
            return inner if inner is not None else node.value
    if isinstance(check, ast.Call) and check.args:
        first = check.args[0]
        if isinstance(first, ast.Call) and representative_call(first):
            return first.args[0]
        return first
    if isinstance(check, ast.Compare):
        for side in (check.left, *check.comparators):
            if isinstance(side, ast.Call) and representative_call(side):
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


def representative_call(node: ast.expr) -> bool:
    # get_representative_spec_type(x), however it is imported
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name == REPRESENTATIVE


def mro_any(node: ast.expr, index: SourceIndex) -> ast.expr | None:
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


def locate(site: Site, index: SourceIndex) -> tuple[list[ast.expr], bool] | None:
    # The expressions the audit read as this site: ([one], False) or (members, True).
    raw = site.raw
    for node in index.at.get((raw.line, raw.col), []):
        current: ast.expr = node
        while True:
            if ast.unparse(current) == raw.text:
                walk = mro_any(current, index) if raw.form == "mro-walk" else None
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


def bound_more_than_once(check: ast.expr, index: SourceIndex) -> str:
    # The class operand's name when it is bound by two or more statements of the function
    # the check is in (`supported = (A, B)`, then `supported += (C,)` on one path): the
    # audit reads their union, which the check tests only on some paths. "" otherwise.
    subject = subject_of(check)
    names = (
        {n.id for n in ast.walk(check) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        - {n.id for n in ast.walk(subject) if isinstance(n, ast.Name)}
        if subject
        else set()
    )
    scope = index.function_of(check)
    if scope is None:
        return ""
    counts: dict[str, int] = {}
    for node in ast.walk(scope):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and target.id in names:
                counts[target.id] = counts.get(target.id, 0) + 1
    return next((n for n, c in sorted(counts.items()) if c > 1), "")
