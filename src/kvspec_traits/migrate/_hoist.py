"""One ``traits_of`` per spec per function: after the rewrite, a function that asks
``traits_of(x)`` more than once for the same ``x`` (a name or an attribute of one) asks it
once, in a local named after it (``spec_traits = traits_of(spec)``), placed just before the
statement that asked first, in the innermost block holding every use.

It is done only where the answer cannot change and no path asks earlier than the code did:

- the first use is evaluated whenever its statement runs (an ``if`` or ``while`` test, an
  assignment's value, an expression statement, a ``return``; never under ``and``/``or``, a
  conditional expression, a comprehension, a lambda or an ``assert``, which ``python -O``
  removes): ``traits_of`` refuses an unknown spec, and a hoisted call must refuse exactly
  where the original did;
- nothing between that statement and the last use binds the name the subject starts from
  (an assignment, a ``for`` or ``with`` target, a walrus, ``del``), and no use sits where a
  comprehension or lambda binds it;
- the local's name is free in the function.

Elsewhere the calls stay as written (``hoist_traits`` says how many subjects it left).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import libcst as cst

__all__ = ["hoist_traits"]

_BLOCKS: Final = (cst.IndentedBlock, cst.Module)
# Expression parents under which a child is not always evaluated when its statement runs.
_CONDITIONAL: Final = (
    cst.BooleanOperation,
    cst.IfExp,
    cst.Lambda,
    cst.ListComp,
    cst.SetComp,
    cst.DictComp,
    cst.GeneratorExp,
)
_UNCONDITIONAL_STATEMENTS: Final = (
    cst.If,
    cst.While,
    cst.Assign,
    cst.AnnAssign,
    cst.AugAssign,
    cst.Expr,
    cst.Return,
)


def _subject(call: cst.Call) -> str | None:
    """The code of ``traits_of``'s argument when it is a name or a chain of attributes."""
    if not (isinstance(call.func, cst.Name) and call.func.value == "traits_of"):
        return None
    if len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star:
        return None
    return dotted_name(call.args[0].value)


def dotted_name(node: cst.BaseExpression) -> str | None:
    """The code of ``node`` when it is a name or a chain of attributes (``a.b.c``)."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return None
    parts.append(node.value)
    return ".".join(reversed(parts))


_CHILD_FIELDS: dict[type[cst.CSTNode], tuple[str, ...]] = {}


def parent_map(module: cst.Module) -> dict[cst.CSTNode, cst.CSTNode]:
    """Every node of ``module`` mapped to its parent: what LibCST's ``ParentNodeProvider``
    answers (tests/test_migrate_parents.py compares the two on real trees), read off the
    nodes' dataclass fields instead of a visit, which rebuilds every node on its way and
    cost most of a migrate run."""
    parents: dict[cst.CSTNode, cst.CSTNode] = {}
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        kind = type(node)
        names = _CHILD_FIELDS.get(kind)
        if names is None:
            names = _CHILD_FIELDS[kind] = tuple(f.name for f in dataclasses.fields(node))
        for name in names:
            value = getattr(node, name)
            if isinstance(value, cst.CSTNode):
                parents[value] = node
                stack.append(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, cst.CSTNode):
                        parents[item] = node
                        stack.append(item)
    return parents


def _local_name(subject: str) -> str:
    return f"{subject.rsplit('.', 1)[-1]}_traits"


@dataclass
class _Function:
    node: cst.FunctionDef
    uses: dict[tuple[str, int], list[cst.Call]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)


class _Collect(cst.CSTVisitor):
    """Each function's ``traits_of`` calls by subject, and every name it mentions."""

    def __init__(self) -> None:
        self.stack: list[_Function] = []
        self.functions: list[_Function] = []
        self.calls: list[tuple[_Function, str, cst.Call]] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.stack.append(_Function(node))

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.append(self.stack.pop())

    def visit_Name(self, node: cst.Name) -> None:
        if self.stack:
            self.stack[-1].names.add(node.value)

    def visit_Call(self, node: cst.Call) -> None:
        subject = _subject(node)
        if subject is not None and self.stack:
            self.calls.append((self.stack[-1], subject, node))


class _Binds(cst.CSTVisitor):
    """Whether a statement (nested functions and classes aside) binds ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.found = False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def _target(self, target: cst.BaseExpression | None) -> None:
        if target is None:
            return
        for node in _walk(target):
            if isinstance(node, cst.Name) and node.value == self.name:
                self.found = True

    def visit_Assign(self, node: cst.Assign) -> bool:
        # `spec = cast(C, spec)` (migrate's narrowing, _narrow) keeps the same spec.
        value = node.value
        same = (
            len(node.targets) == 1
            and isinstance(node.targets[0].target, cst.Name)
            and isinstance(value, cst.Call)
            and isinstance(value.func, cst.Name)
            and value.func.value == "cast"
            and len(value.args) == 2
            and isinstance(value.args[1].value, cst.Name)
            and value.args[1].value.value == node.targets[0].target.value
        )
        return not same

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._target(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._target(node.target)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._target(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self._target(node.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._target(node.target)

    def visit_Del(self, node: cst.Del) -> None:
        self._target(node.target)

    def visit_Lambda(self, node: cst.Lambda) -> None:
        for param in node.params.params:
            self._target(param.name)


def _walk(node: cst.CSTNode) -> list[cst.CSTNode]:
    out = [node]
    for child in node.children:
        out.extend(_walk(child))
    return out


def _binds_target(target: cst.BaseExpression, name: str) -> bool:
    return any(isinstance(n, cst.Name) and n.value == name for n in _walk(target))


def _binds(statements: Sequence[cst.CSTNode], name: str) -> bool:
    visitor = _Binds(name)
    for statement in statements:
        statement.visit(visitor)
    return visitor.found


@dataclass(frozen=True)
class _Hoist:
    block: cst.IndentedBlock
    index: int
    subject: str
    local: str
    calls: tuple[cst.Call, ...]


class _Plan:
    def __init__(self, parents: dict[cst.CSTNode, cst.CSTNode]) -> None:
        self.parents = parents

    def chain(self, node: cst.CSTNode) -> list[cst.CSTNode]:
        """``node`` and its ancestors, innermost first."""
        out = [node]
        while out[-1] in self.parents:
            out.append(self.parents[out[-1]])
        return out

    def scope(self, call: cst.Call, base: str, function: cst.FunctionDef) -> cst.CSTNode:
        """The innermost node around ``call`` that binds ``base`` for it: a comprehension,
        lambda or ``for`` loop, else the function."""
        for node in self.chain(call)[1:]:
            if node is function:
                break
            if isinstance(node, cst.For) and _binds_target(node.target, base):
                return node
            if isinstance(node, (cst.Lambda, *_CONDITIONAL[3:])) and _binds([node], base):
                return node
        return function

    def hoist(self, function: _Function, subject: str, calls: Sequence[cst.Call]) -> _Hoist | None:
        local = _local_name(subject)
        if local in function.names:
            return None
        base = subject.split(".", 1)[0]
        chains = [self.chain(call) for call in calls]
        # The innermost block of the function that holds every use.
        block: cst.IndentedBlock | None = None
        for node in chains[0]:
            if node is function.node:
                break
            if isinstance(node, cst.IndentedBlock) and all(node in c for c in chains):
                block = node
                break
        if block is None:
            return None
        # Each use's statement in that block.
        positions = []
        for chain in chains:
            statement = chain[chain.index(block) - 1]
            positions.append(block.body.index(statement))
        first, last = min(positions), max(positions)
        # The first use (in source order) within the first statement: always evaluated.
        first_calls = [c for c, p in zip(chains, positions, strict=True) if p == first]
        if not any(self._always(chain, block) for chain in first_calls):
            return None
        # No use where a comprehension or lambda of its own binds the base name, and no
        # binding of it between the first and the last use's statements.
        for chain in chains:
            for node in chain[1 : chain.index(block)]:
                if isinstance(node, (cst.Lambda, *_CONDITIONAL[3:])) and _binds([node], base):
                    return None
        # The last statement may bind it after its uses when they are all in its test.
        last_in_test = all(
            isinstance(block.body[last], cst.If) and self._in_test(chain, block.body[last])
            for chain, p in zip(chains, positions, strict=True)
            if p == last
        )
        statements = block.body[first : last if last_in_test and last > first else last + 1]
        if _binds(statements, base):
            return None
        return _Hoist(block, first, subject, local, tuple(calls))

    @staticmethod
    def _in_test(chain: list[cst.CSTNode], statement: cst.CSTNode) -> bool:
        index = chain.index(statement)
        return isinstance(statement, cst.If) and chain[index - 1] is statement.test

    def _always(self, chain: list[cst.CSTNode], block: cst.IndentedBlock) -> bool:
        """Whether the call at ``chain[0]`` runs whenever its statement in ``block`` runs."""
        upto = chain.index(block)
        for child, parent in itertools.pairwise(chain[:upto]):
            if isinstance(parent, _CONDITIONAL):
                # `a and b`: `a` always runs; `x if t else y`: `t` always runs.
                if isinstance(parent, cst.BooleanOperation) and child is parent.left:
                    continue
                if isinstance(parent, cst.IfExp) and child is parent.test:
                    continue
                return False
            if isinstance(parent, (cst.If, cst.While)):
                # An `elif` is an If in its parent's orelse: asked only when that failed.
                return child is parent.test and parent is chain[upto - 1]
            if isinstance(parent, cst.SimpleStatementLine):
                return True
            if isinstance(parent, cst.BaseSmallStatement):
                if not isinstance(parent, _UNCONDITIONAL_STATEMENTS):
                    return False
            elif isinstance(parent, cst.BaseCompoundStatement):
                return False
        return False


class _Apply(cst.CSTTransformer):
    def __init__(self, hoists: Sequence[_Hoist]) -> None:
        super().__init__()
        self.calls = {id(call): h.local for h in hoists for call in h.calls}
        self.inserts: dict[int, list[_Hoist]] = {}
        for h in hoists:
            self.inserts.setdefault(id(h.block), []).append(h)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        local = self.calls.get(id(original_node))
        if local is None:
            return updated_node
        return cst.Name(local, lpar=updated_node.lpar, rpar=updated_node.rpar)

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        hoists = self.inserts.get(id(original_node))
        if not hoists:
            return updated_node
        body = list(updated_node.body)
        for h in sorted(hoists, key=lambda h: (-h.index, h.local)):
            statement = cst.parse_statement(f"{h.local} = traits_of({h.subject})\n")
            leading = getattr(body[h.index], "leading_lines", ())
            # The new line takes the comments above the statement; the statement keeps none.
            if leading:
                statement = statement.with_changes(leading_lines=leading)
                body[h.index] = body[h.index].with_changes(leading_lines=())
            body.insert(h.index, statement)
        return updated_node.with_changes(body=body)


def hoist_traits(code: str) -> tuple[str, int]:
    """``code`` with one ``traits_of`` per subject per function where that is safe, and
    how many subjects asked more than once were left as written."""
    if "traits_of" not in code:
        return code, 0
    module = cst.parse_module(code)
    collect = _Collect()
    module.visit(collect)
    plan = _Plan(parent_map(module))
    # A subject is the same spec only where the same binding of its name holds: a
    # comprehension, lambda or ``for`` loop that binds the name makes a spec of its own.
    for function, subject, call in collect.calls:
        scope = plan.scope(call, subject.split(".", 1)[0], function.node)
        function.uses.setdefault((subject, id(scope)), []).append(call)
    hoists: list[_Hoist] = []
    left = 0
    for function in collect.functions:
        taken: set[str] = set()
        for (subject, _), calls in function.uses.items():
            if len(calls) < 2:
                continue
            hoist = plan.hoist(function, subject, calls)
            if hoist is None or hoist.local in taken:
                left += 1
                continue
            taken.add(hoist.local)
            hoists.append(hoist)
    if not hoists:
        return code, left
    return module.visit(_Apply(hoists)).code, left
