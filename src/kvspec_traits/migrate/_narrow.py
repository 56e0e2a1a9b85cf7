"""Keep the narrowing a rewritten class check gave a type checker.

``isinstance(spec, SlidingWindowSpec)`` tells mypy that ``spec`` is a ``SlidingWindowSpec``
where the check held, so the code after it reads ``spec.sliding_window``; the traits query
that replaces it (``traits_of(spec).token_scope is TokenScope.SLIDING_WINDOW``) tells it
nothing, and every such read becomes an ``attr-defined`` finding. Where the check held, the
query holds for exactly the class the check named (the audit's exact match), so the
rewrite says so to the type checker with ``typing.cast`` to that class, and only where a
read needs it:

- the regions where the check narrowed: the later operands of its ``and`` chain (of an
  ``or`` chain when negated), the ``if``/conditional expression's branch it guards, the
  element of a comprehension it filters, and the rest of the block after
  ``if not <check>: return`` (or ``continue``, ``raise``, ``break``) or ``assert <check>``;
- in them, the uses of the same subject (a name or a chain of attributes, not rebound in
  between) that read an attribute the spec base class lacks, that pass the spec to a call,
  or that are the comprehension's element itself;
- one ``spec = cast(C, spec)`` at the start of a block region that has two or more such
  uses of a name; otherwise the use itself becomes ``cast(C, spec)``.

Checks whose query answers True for more than the classes named (a miss fixed, another
page kind) get no cast: it would claim a class the spec may not have. ``cast`` is imported
from ``typing`` once per file.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import libcst as cst

from kvspec_traits.migrate._hoist import dotted_name, parent_map
from kvspec_traits.migrate._plan import Edit
from kvspec_traits.migrate._rewrite import add_imports

__all__ = ["narrow_casts"]

# Calls that take any object: a spec passed to them needs no narrowing.
_ANY_OBJECT: Final = frozenset(
    {
        *("traits_of", "representative_traits", "len", "isinstance", "type", "id", "print"),
        *("repr", "str", "hash", "getattr", "hasattr", "setattr"),
    }
)
_EXITS: Final = (cst.Return, cst.Raise, cst.Continue, cst.Break)
_COMPREHENSIONS: Final = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)


@dataclass(frozen=True)
class _Guard:
    cls: str
    """The class expression to cast to (``A`` or ``A | B``), as the check wrote it."""
    positive: bool


def _guard(edit: Edit) -> _Guard | None:
    """The class a rewritten check narrowed to and whether it held when True, or None when
    the check named no class of an instance or its query answers True for more."""
    if edit.parts or edit.fixes_miss or edit.differs_on:
        return None
    try:
        node = ast.parse(edit.before, mode="eval").body
    except SyntaxError:
        return None
    positive = True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        positive, node = False, node.operand
    operands = node.values if isinstance(node, ast.BoolOp) else [node]
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        # `not isinstance(s, A) and not isinstance(s, B)`: negated as a whole.
        if not positive or not all(
            isinstance(o, ast.UnaryOp) and isinstance(o.op, ast.Not) for o in operands
        ):
            return None
        positive, operands = False, [o.operand for o in operands if isinstance(o, ast.UnaryOp)]
    classes: list[str] = []
    for operand in operands:
        found = _classes(operand)
        if found is None:
            return None
        negated, names = found
        if negated:
            if len(operands) > 1:
                return None
            positive = not positive
        classes.extend(n for n in names if n not in classes)
    return _Guard(" | ".join(classes), positive) if classes else None


def _first_part(edit: Edit) -> _Guard | None:
    """``isinstance(s, A) and not isinstance(s, B)`` asked as two traits (``parts``): the
    first part narrows to ``A`` for the operands after it, as the check did."""
    if not edit.parts or edit.fixes_miss:
        return None
    try:
        node = ast.parse(edit.before, mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And)):
        return None
    found = _classes(node.values[0])
    if found is None or found[0]:
        return None
    return _Guard(" | ".join(found[1]), True)


def _classes(node: ast.expr) -> tuple[bool, list[str]] | None:
    """``isinstance(x, C)``/``(A, B)`` or ``type(x) is [not] C``: (negated, classes)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and len(node.args) == 2
    ):
        arg = node.args[1]
        members = arg.elts if isinstance(arg, ast.Tuple) else [arg]
        if all(isinstance(m, (ast.Name, ast.Attribute)) for m in members):
            return False, [ast.unparse(m) for m in members]
        return None
    if (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], (ast.Is, ast.IsNot))
        and isinstance(node.left, ast.Call)
        and isinstance(node.left.func, ast.Name)
        and node.left.func.id == "type"
        and isinstance(node.comparators[0], (ast.Name, ast.Attribute))
    ):
        return isinstance(node.ops[0], ast.IsNot), [ast.unparse(node.comparators[0])]
    return None


def _flat(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _bare(node: cst.CSTNode) -> cst.CSTNode:
    if isinstance(node, cst.BaseExpression) and (node.lpar or node.rpar):
        return node.with_changes(lpar=[], rpar=[])
    return node


class _Find(cst.CSTVisitor):
    def __init__(self) -> None:
        self.calls: list[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        if isinstance(node.func, cst.Name) and node.func.value == "traits_of":
            self.calls.append(node)


@dataclass
class _Region:
    nodes: list[cst.CSTNode]
    """Expressions, or statements of one block (then ``block`` and ``index`` say where)."""
    block: cst.BaseSuite | cst.Module | None = None
    index: int = 0


class _Narrow:
    def __init__(
        self,
        module: cst.Module,
        parents: dict[cst.CSTNode, cst.CSTNode],
        base_attributes: frozenset[str] | None,
    ) -> None:
        self.module = module
        self.parents = parents
        self.base = base_attributes
        self.inline: dict[int, str] = {}
        self.rebind: dict[int, list[tuple[int, str, str]]] = {}

    def code(self, node: cst.CSTNode) -> str:
        return _flat(self.module.code_for_node(_bare(node)))

    # -- where a query narrowed -----------------------------------------------------------

    def regions(self, query: cst.BaseExpression, positive: bool) -> list[_Region]:
        out: list[_Region] = []
        joiner = cst.And if positive else cst.Or
        cur: cst.CSTNode = query
        parent = self.parents.get(cur)
        while isinstance(parent, cst.BooleanOperation) and isinstance(parent.operator, joiner):
            if cur is parent.left:
                out.append(_Region([parent.right]))
            cur, parent = parent, self.parents.get(parent)
        if isinstance(parent, cst.If) and cur is parent.test:
            if positive:
                out.append(self._suite(parent.body))
            else:
                if isinstance(parent.orelse, cst.Else):
                    out.append(self._suite(parent.orelse.body))
                if _exits(parent.body):
                    out.extend(self._after(parent))
        elif isinstance(parent, cst.IfExp) and cur is parent.test:
            out.append(_Region([parent.body if positive else parent.orelse]))
        elif isinstance(parent, cst.CompIf) and cur is parent.test and positive:
            comp = self._comprehension(parent)
            if comp is not None:
                elements = [comp.value] if isinstance(comp, cst.DictComp) else [comp.elt]
                out.append(_Region(list(elements)))
        elif isinstance(parent, cst.Assert) and cur is parent.test and positive:
            out.extend(self._after(parent))
        return out

    def _comprehension(
        self, node: cst.CSTNode
    ) -> cst.ListComp | cst.SetComp | cst.GeneratorExp | cst.DictComp | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)):
                return node
            if not isinstance(node, (cst.CompFor, cst.CompIf)):
                return None
        return None

    @staticmethod
    def _suite(suite: cst.BaseSuite) -> _Region:
        body: list[cst.CSTNode] = (
            list(suite.body) if isinstance(suite, cst.IndentedBlock) else [suite]
        )
        return _Region(body, block=suite if isinstance(suite, cst.IndentedBlock) else None)

    def _after(self, node: cst.If | cst.Assert) -> list[_Region]:
        """The statements after ``node`` in its block (an ``elif`` has none of its own)."""
        statement = node if isinstance(node, cst.If) else self.parents.get(node)
        block = self.parents.get(statement) if statement is not None else None
        if not isinstance(block, (cst.IndentedBlock, cst.Module)):
            return []
        body: list[cst.CSTNode] = list(block.body)
        index = next(i for i, s in enumerate(body) if s is statement)
        return [_Region(body[index + 1 :], block=block, index=index + 1)]

    # -- the uses that need the class -----------------------------------------------------

    def uses(self, region: _Region, subject: str) -> list[cst.CSTNode]:
        base = subject.split(".", 1)[0]
        found: list[cst.CSTNode] = []
        for node in region.nodes:
            binds = _binding(node, base)
            if binds == "other":
                break
            if region.block is None and self.code(node) == subject:
                found.append(node)  # the comprehension's element, or a branch, itself
                continue
            value = _assigned(node) if binds == "assign" else None
            found.extend(self._needing(value or node, subject, base))
            if binds == "assign":
                break
        return found

    def _needing(self, root: cst.CSTNode, subject: str, base: str) -> Iterable[cst.CSTNode]:
        stack = [root]
        while stack:
            node = stack.pop()
            if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                continue
            if isinstance(node, _COMPREHENSIONS) and _binding(node, base) != "none":
                continue
            if isinstance(node, (cst.Name, cst.Attribute)) and self.code(node) == subject:
                if self._needs(node):
                    yield node
                continue
            stack.extend(reversed(node.children))

    def _needs(self, node: cst.CSTNode) -> bool:
        parent = self.parents.get(node)
        if isinstance(parent, cst.Attribute) and parent.value is node:
            return self.base is None or parent.attr.value not in self.base
        if isinstance(parent, cst.Arg) and parent.value is node:
            call = self.parents.get(parent)
            if isinstance(call, cst.Call):
                name = call.func.value if isinstance(call.func, cst.Name) else None
                return name not in _ANY_OBJECT
        return False

    def plan(self, query: cst.BaseExpression, subject: str, guard: _Guard) -> None:
        for region in self.regions(query, guard.positive):
            uses = self.uses(region, subject)
            if not uses:
                continue
            if region.block is not None and "." not in subject and len(uses) > 1:
                for use in uses:
                    self.inline.pop(id(use), None)
                rebinds = self.rebind.setdefault(id(region.block), [])
                if (region.index, subject, guard.cls) not in rebinds:
                    rebinds.append((region.index, subject, guard.cls))
                continue
            for use in uses:
                self.inline[id(use)] = guard.cls


def _exits(suite: cst.BaseSuite) -> bool:
    body = suite.body if isinstance(suite, cst.IndentedBlock) else [suite]
    last = body[-1] if body else None
    return isinstance(last, cst.SimpleStatementLine) and isinstance(last.body[-1], _EXITS)


def _binding(node: cst.CSTNode, name: str) -> str:
    """How a statement binds ``name``: ``none``, ``assign`` (a plain assignment, whose value
    is read first) or ``other`` (a loop, ``with``, ``del``, a walrus, nested comprehension
    targets)."""
    from kvspec_traits.migrate._hoist import _binds

    if not _binds([node], name):
        return "none"
    value = _assigned(node)
    if value is not None and not _binds([value], name):
        return "assign"
    return "other"


def _assigned(node: cst.CSTNode) -> cst.BaseExpression | None:
    """The value of a statement line that is one plain assignment."""
    if isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1:
        line = node.body[0]
        if isinstance(line, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
            return line.value
    return None


class _Apply(cst.CSTTransformer):
    def __init__(self, narrow: _Narrow) -> None:
        super().__init__()
        self.narrow = narrow

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        return self._cast(original_node, updated_node)

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.BaseExpression:
        return self._cast(original_node, updated_node)

    def _cast(
        self, original_node: cst.BaseExpression, updated_node: cst.BaseExpression
    ) -> cst.BaseExpression:
        cls = self.narrow.inline.get(id(original_node))
        if cls is None:
            return updated_node
        return cst.Call(
            func=cst.Name("cast"),
            args=[
                cst.Arg(
                    cst.parse_expression(cls),
                    comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
                ),
                cst.Arg(updated_node.with_changes(lpar=[], rpar=[])),
            ],
            lpar=updated_node.lpar,
            rpar=updated_node.rpar,
        )

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        return updated_node.with_changes(body=self._rebind(original_node, updated_node.body))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._rebind(original_node, updated_node.body))

    def _rebind(
        self, original_node: cst.CSTNode, body: Sequence[cst.BaseStatement]
    ) -> list[cst.BaseStatement]:
        out = list(body)
        for index, subject, cls in sorted(
            self.narrow.rebind.get(id(original_node), ()), reverse=True
        ):
            out.insert(index, cst.parse_statement(f"{subject} = cast({cls}, {subject})\n"))
        return out


def _imports_cast_elsewhere(module: cst.Module) -> bool:
    for statement in module.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                source = small.module.value if isinstance(small.module, cst.Name) else None
                if source != "typing" and any(
                    cst.ensure_type(a.asname.name if a.asname else a.name, cst.Name).value == "cast"
                    for a in small.names
                    if isinstance(a.asname.name if a.asname else a.name, cst.Name)
                ):
                    return True
    return False


def _guards_of(edits: Sequence[Edit]) -> dict[str, set[_Guard]]:
    # Each written query (and an `and` chain's first part) with the casts it keeps.
    guards: dict[str, set[_Guard]] = {}
    for edit in edits:
        first = _first_part(edit)
        if first is not None:
            guards.setdefault(_flat(edit.parts[0]), set()).add(first)
        guard = _guard(edit)
        if guard is not None:
            guards.setdefault(_flat(edit.after), set()).add(guard)
        else:
            # A query written for a check that gets no cast makes its text ambiguous.
            guards.setdefault(_flat(edit.after), set()).add(_Guard("", True))
    return guards


def _query_around(
    call: cst.Call,
    parents: dict[cst.CSTNode, cst.CSTNode],
    narrow: _Narrow,
    guards: dict[str, set[_Guard]],
) -> tuple[cst.BaseExpression, set[_Guard]] | None:
    # The outermost written query over a `traits_of(...)` call (`not q` over `q`).
    node: cst.CSTNode = call
    match: tuple[cst.BaseExpression, set[_Guard]] | None = None
    for _ in range(4):
        node = parents.get(node, node)
        if not isinstance(node, (cst.Attribute, cst.Comparison, cst.UnaryOperation)):
            break
        found = guards.get(narrow.code(node))
        if found is not None:
            match = (node, found)
    return match


def narrow_casts(
    code: str, edits: Sequence[Edit], base_attributes: frozenset[str] | None
) -> tuple[str, int]:
    """``code`` (rewritten by ``edits``) with the casts that keep the narrowing the checks
    gave, and how many were written. ``base_attributes``: what every spec has (vLLM's
    ``KVCacheSpec``), read without a cast; None casts every attribute read."""
    guards = _guards_of(edits)
    if not any(g.cls for gs in guards.values() for g in gs):
        return code, 0
    module = cst.parse_module(code)
    if _imports_cast_elsewhere(module):
        return code, 0
    parents = parent_map(module)
    find = _Find()
    module.visit(find)
    narrow = _Narrow(module, parents, base_attributes)
    for call in find.calls:
        subject = dotted_name(call.args[0].value) if len(call.args) == 1 else None
        if subject is None:
            continue
        match = _query_around(call, parents, narrow, guards)
        if match is not None and len(match[1]) == 1:
            (guard,) = match[1]
            if guard.cls:
                narrow.plan(match[0], subject, guard)
    count = len(narrow.inline) + sum(len(v) for v in narrow.rebind.values())
    if not count:
        return code, 0
    changed = module.visit(_Apply(narrow))
    return add_imports(changed, "typing", ["cast"]).code, count
