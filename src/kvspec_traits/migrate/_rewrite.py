"""Apply planned edits to one module with LibCST: only the planned expressions change, so
formatting and comments everywhere else survive; the imports the new expressions need are
added once (``from kvspec_traits import traits_of``, plus ``TokenScope``/``TPLayout``/
``representative_traits`` when an expression names them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from kvspec_traits.migrate._plan import Edit
from kvspec_traits.migrate._source import Span

__all__ = ["rewrite_module"]

_IMPORTED: Final = ("representative_traits", "traits_of", "TokenScope", "TPLayout")
_DROPPED: Final = "__kvspec_traits_dropped__"
# A comparison or `not x` needs parentheses as an operand of these.
_TIGHT_PARENTS: Final = (
    cst.Comparison,
    cst.BinaryOperation,
    cst.Attribute,
    cst.Subscript,
    cst.Await,
)


def _key(pos: CodeRange) -> Span:
    return Span(pos.start.line, pos.start.column, pos.end.line, pos.end.column)


def _dropped(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == _DROPPED


class _Swap(cst.CSTTransformer):
    # Parents come from the walk itself (``_path``): LibCST's ParentNodeProvider walks the
    # whole module once more for the same answer.
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, edits: Sequence[Edit]) -> None:
        super().__init__()
        self._path: list[cst.CSTNode] = []
        self.replace: dict[Span, str] = {}
        self.drop: set[Span] = set()
        for edit in edits:
            if edit.parts:
                self.replace.update(zip(edit.spans, edit.parts, strict=True))
                continue
            self.replace[edit.spans[0]] = edit.after
            self.drop.update(edit.spans[1:])
        self.done: set[Span] = set()

    def on_visit(self, node: cst.CSTNode) -> bool:
        self._path.append(node)
        return super().on_visit(node)

    def on_leave(
        self, original_node: cst.CSTNodeT, updated_node: cst.CSTNodeT
    ) -> cst.CSTNodeT | cst.RemovalSentinel | cst.FlattenSentinel[cst.CSTNodeT]:
        try:
            return super().on_leave(original_node, updated_node)
        finally:
            self._path.pop()

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        return self._swap(original_node, updated_node)

    def leave_Comparison(
        self, original_node: cst.Comparison, updated_node: cst.Comparison
    ) -> cst.BaseExpression:
        return self._swap(original_node, updated_node)

    def leave_UnaryOperation(
        self, original_node: cst.UnaryOperation, updated_node: cst.UnaryOperation
    ) -> cst.BaseExpression:
        return self._swap(original_node, updated_node)

    def leave_BooleanOperation(
        self, original_node: cst.BooleanOperation, updated_node: cst.BooleanOperation
    ) -> cst.BaseExpression:
        return self._collapse(updated_node)

    def _swap(
        self, original_node: cst.BaseExpression, updated_node: cst.BaseExpression
    ) -> cst.BaseExpression:
        pos = self.get_metadata(PositionProvider, original_node, None)
        if pos is None:
            return updated_node
        span = _key(pos)
        if span in self.drop and span not in self.done:
            self.done.add(span)
            return cst.Name(_DROPPED)
        text = self.replace.get(span)
        if text is None or span in self.done:
            return updated_node
        self.done.add(span)
        new = cst.parse_expression(text)
        if updated_node.lpar:
            return new.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)
        # The node itself is last on the path until it is left.
        parent = self._path[-2] if len(self._path) > 1 else None
        tight = isinstance(parent, _TIGHT_PARENTS) or (
            isinstance(parent, cst.UnaryOperation)
            and (not isinstance(parent.operator, cst.Not) or isinstance(new, cst.BooleanOperation))
        )
        if tight:
            return new.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return new

    @staticmethod
    def _collapse(node: cst.BooleanOperation) -> cst.BaseExpression:
        # `A or <dropped>` -> A (the chain's later members went into its first).
        kept: cst.BaseExpression | None = None
        if _dropped(node.right):
            kept = node.left
        elif _dropped(node.left):
            kept = node.right
        if kept is None:
            return node
        if node.lpar and not kept.lpar:
            return kept.with_changes(lpar=node.lpar, rpar=node.rpar)
        return kept


def rewrite_module(code: str, edits: Sequence[Edit]) -> tuple[str, tuple[Edit, ...]]:
    """The module's code with ``edits`` applied, and the edits that were applied (an
    edit whose spans LibCST does not find is left out)."""
    if not edits:
        return code, ()
    module = cst.parse_module(code)
    # Just parsed and not shared: no defensive deep copy (it cost a third of a run).
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    swap = _Swap(edits)
    changed = wrapper.visit(swap)
    applied = tuple(e for e in edits if all(s in swap.done for s in e.spans))
    if len(applied) != len(edits):
        # Partially found chains would change meaning: redo with only complete edits.
        if not applied:
            return code, ()
        return rewrite_module(code, applied)
    text = "\n".join(e.after for e in applied)
    names = [n for n in _IMPORTED if n == "traits_of" or f"{n}." in text or f"{n}(" in text]
    return add_imports(changed, "kvspec_traits", names).code, applied


def add_imports(module: cst.Module, source: str, names: Sequence[str]) -> cst.Module:
    """``module`` with ``from <source> import <names>`` where LibCST's AddImportsVisitor
    puts it: merged into the leading import block's ``from <source> import``, or after that
    block. The visitor walks the whole module twice, but it considers only the imports
    before the first other statement (LibCST 1.x's ``_GatherTopImportsBeforeStatements``,
    and its ``leave_ImportFrom`` leaves every other import alone), so it runs here on the
    leading imports and the first statement after them alone: the same module, at a
    fraction of the cost."""
    context = CodemodContext()
    for name in names:
        AddImportsVisitor.add_needed_import(context, source, name)
    body = list(module.body)
    end = 0
    for index, statement in enumerate(body):
        is_import = isinstance(statement, cst.SimpleStatementLine) and isinstance(
            statement.body[0], (cst.Import, cst.ImportFrom)
        )
        docstring = (
            index == 0
            and isinstance(statement, cst.SimpleStatementLine)
            and isinstance(statement.body[0], (cst.Expr, cst.Assign))
        )
        if not (is_import or docstring):
            end = index + 1
            break
    else:
        end = len(body)
    head = AddImportsVisitor(context).transform_module(module.with_changes(body=body[:end]))
    return module.with_changes(body=[*head.body, *body[end:]])
