"""Recognising one class check: whether an expression asks a spec for its class, and how.

``isinstance``/``issubclass`` calls, ``type(x) is C`` and friends, class-name strings,
``KVCacheSpecKind`` members and walks over ``type(x).__mro__``; names are resolved by
:class:`~kvspec_traits.audit._names.NameResolver`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Final

from kvspec_traits.audit._flow import kind_source
from kvspec_traits.audit._names import (
    KIND_FUNCTION,
    NameResolver,
    last_name,
    name_of,
)

__all__ = ["Check", "CheckReader"]

_REPRESENTATIVE: Final = "get_representative_spec_type"
_EXACT_OPS: Final = (ast.Is, ast.IsNot, ast.Eq, ast.NotEq, ast.In, ast.NotIn)
_NEGATIVE_OPS: Final = (ast.IsNot, ast.NotEq, ast.NotIn)


@dataclass(slots=True)
class Check:
    node: ast.AST
    form: str
    subject: str
    text: str
    written: str
    classes: tuple[str, ...]
    negated: bool
    exact: bool
    excluded: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    asserted: bool = False
    kind_value: bool = False  # a spec-kind check on a kind as held (not on the call)


class CheckReader:
    """Reads single checks in one module (and the MRO walks that make a check)."""

    def __init__(self, resolver: NameResolver) -> None:
        self.r = resolver
        # loop variables bound by `for c in type(x).__mro__` (or a comprehension): name ->
        # the subject x; names of dicts looked up with such a variable.
        self.mro_vars: dict[str, str] = {}
        self.mro_dicts: set[str] = set()

    def find_mro_walks(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            pairs: list[tuple[ast.expr, ast.expr]] = []
            if isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                pairs.append((node.target, node.iter))
            for target, it in pairs:
                if (
                    isinstance(target, ast.Name)
                    and isinstance(it, ast.Attribute)
                    and it.attr == "__mro__"
                ):
                    self.mro_vars[target.id] = self.mro_subject(it.value)
        if not self.mro_vars:
            return
        for node in ast.walk(tree):
            # D[c], D.get(c), c in D with c a walk variable: D is looked up along the MRO
            if isinstance(node, ast.Subscript) and name_of(node.slice) in self.mro_vars:
                self.mro_dicts.add(last_name(node.value))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and name_of(node.args[0]) in self.mro_vars
            ):
                self.mro_dicts.add(last_name(node.func.value))
            elif (
                isinstance(node, ast.Compare)
                and len(node.ops) == 1
                and isinstance(node.ops[0], ast.In | ast.NotIn)
                and name_of(node.left) in self.mro_vars
            ):
                self.mro_dicts.add(last_name(node.comparators[0]))
        self.mro_dicts.discard("")

    def mro_subject(self, node: ast.expr) -> str:
        # `type(x).__mro__` / `x.__class__.__mro__` walk x's classes; `t.__mro__` walks t.
        if (
            isinstance(node, ast.Call)
            and self.r.is_builtin(node.func, "type")
            and len(node.args) == 1
        ):
            return ast.unparse(node.args[0])
        if isinstance(node, ast.Attribute) and node.attr == "__class__":
            return ast.unparse(node.value)
        return ast.unparse(node)

    def site_subject(self, check: Check, scope: ast.AST | None, region: ast.AST | None) -> str:
        """The subject a site reports: for a spec-kind check on a kind variable, the spec
        it was computed from (``kind = get_kv_cache_spec_kind(spec)`` earlier), else
        ``<the spec whose kind is kind>``: a kind is no spec, ``traits_of(kind)`` would
        raise."""
        subject = check.subject
        if not check.kind_value or scope is None or region is None:
            return subject
        if not subject.isidentifier():
            return f"<the spec whose kind is {subject}>"
        spec = kind_source(scope, region, subject, self._is_kind_call)
        return spec if spec is not None else f"<the spec whose kind is {subject}>"

    def _is_kind_call(self, func: ast.expr) -> bool:
        ref = self.r.dotted(func)
        return ref is not None and ref.rpartition(".")[2] == KIND_FUNCTION

    # -- recognising one check ------------------------------------------------------------

    def check_of(self, node: ast.expr, negated: bool = False) -> Check | None:
        """The class check ``node`` is (through any number of ``not``), or ``None``."""
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            inner = self.check_of(node.operand, not negated)
            if inner is not None:
                inner.text = f"not {inner.text}"
            return inner
        if isinstance(node, ast.Call):
            return self._call_check(node, negated)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            return self._compare_check(node, node.left, node.ops[0], node.comparators[0], negated)
        return None

    def _call_check(self, node: ast.Call, negated: bool) -> Check | None:
        for form in ("isinstance", "issubclass"):
            if self.r.is_builtin(node.func, form) and len(node.args) == 2:
                classes = self.r.classes_of(node.args[1])
                if not classes:
                    return None
                return Check(
                    node,
                    form,
                    ast.unparse(node.args[0]),
                    ast.unparse(node),
                    ast.unparse(node.args[1]),
                    classes,
                    negated,
                    exact=False,
                )
        # unittest's self.assertIsInstance(x, C) / assertNotIsInstance: an asserted check
        if (
            isinstance(node.func, ast.Attribute)
            and len(node.args) >= 2
            and node.func.attr in ("assertIsInstance", "assertNotIsInstance")
        ):
            classes = self.r.classes_of(node.args[1])
            if classes:
                return Check(
                    node,
                    "isinstance",
                    ast.unparse(node.args[0]),
                    ast.unparse(node),
                    ast.unparse(node.args[1]),
                    classes,
                    negated != (node.func.attr == "assertNotIsInstance"),
                    exact=False,
                    asserted=True,
                )
        return None

    def _type_side(self, node: ast.expr) -> tuple[str, str] | None:
        # (form, subject) when `node` reads an object's exact class.
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
            if self.r.is_builtin(node.func, "type"):
                return "type-compare", ast.unparse(node.args[0])
            ref = self.r.dotted(node.func)
            if ref is not None and ref.rpartition(".")[2] == _REPRESENTATIVE:
                return "representative-type", ast.unparse(node.args[0])
        if isinstance(node, ast.Attribute) and node.attr == "__class__":
            return "type-compare", ast.unparse(node.value)
        return None

    def _name_side(self, node: ast.expr) -> tuple[str, str] | None:
        # (form, subject) when `node` reads a class's name: `type(x).__name__`,
        # `x.__class__.__name__`, `c.__name__` with c walking an MRO, or any other
        # expression compared with spec class names (a name stored earlier).
        if isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__"):
            var = name_of(node.value)
            if var in self.mro_vars:
                return "mro-walk", self.mro_vars[var]
            found = self._type_side(node.value)
            if found is not None:
                return "type-name", found[1]
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
            gen = node.generators[0] if len(node.generators) == 1 else None
            if (
                gen is not None
                and isinstance(gen.iter, ast.Attribute)
                and gen.iter.attr == "__mro__"
            ):
                return "mro-walk", self.mro_subject(gen.iter.value)
        if isinstance(node, ast.Constant):
            return None
        return "type-name", ast.unparse(node)

    def _special_check(
        self, node: ast.expr, left: ast.expr, op: ast.cmpop, right: ast.expr, negated: bool
    ) -> Check | None:
        # Class-name strings, KVCacheSpecKind members, `C in type(x).__mro__`.
        is_in = isinstance(op, ast.In | ast.NotIn)
        neg = negated != isinstance(op, _NEGATIVE_OPS)
        pairs = [(left, right)] if is_in else [(left, right), (right, left)]
        for other, const in pairs:
            kinds = self.r.kind_members(const)
            if kinds:
                subject, held = ast.unparse(other), True
                if (
                    isinstance(other, ast.Call)
                    and len(other.args) == 1
                    and self._is_kind_call(other.func)
                ):
                    subject, held = ast.unparse(other.args[0]), False
                return Check(
                    node,
                    "spec-kind",
                    subject,
                    ast.unparse(node),
                    ast.unparse(const),
                    (),
                    neg,
                    exact=True,
                    kinds=kinds,
                    kind_value=held,
                )
        if is_in and isinstance(right, ast.Attribute) and right.attr == "__mro__":
            classes = self.r.classes_of(left)
            if classes:
                return Check(
                    node,
                    "mro-walk",
                    self.mro_subject(right.value),
                    ast.unparse(node),
                    ast.unparse(left),
                    classes,
                    neg,
                    exact=False,
                )
        # `names in <mro names>` has the strings on the left; otherwise on the right
        string_pairs = [(right, left)] if is_in else [(left, right), (right, left)]
        if is_in:
            string_pairs.append((left, right))
        for other, const in string_pairs:
            names = self.r.name_strings(const)
            if not names:
                continue
            if is_in and const is right and isinstance(const, ast.Constant):
                continue  # `x in "MambaSpec"` is a substring test
            side = self._name_side(other)
            if side is None or (is_in and const is left and side[0] != "mro-walk"):
                continue  # `"MambaSpec" in registry` asks about a table, not an object
            form, subject = side
            return Check(
                node,
                form,
                subject,
                ast.unparse(node),
                ast.unparse(const),
                names,
                neg,
                exact=form != "mro-walk",
            )
        return None

    def _compare_check(
        self, node: ast.expr, left: ast.expr, op: ast.cmpop, right: ast.expr, negated: bool
    ) -> Check | None:
        if not isinstance(op, _EXACT_OPS):
            return None
        special = self._special_check(node, left, op, right, negated)
        if special is not None:
            return special
        sides = [(left, right)]
        if not isinstance(op, ast.In | ast.NotIn):
            sides.append((right, left))
        for type_expr, class_expr in sides:
            found = self._type_side(type_expr)
            if found is None:
                continue
            classes = self.r.classes_of(class_expr)
            if not classes:
                continue
            form, subject = found
            return Check(
                node,
                form,
                subject,
                ast.unparse(node),
                ast.unparse(class_expr),
                classes,
                negated != isinstance(op, _NEGATIVE_OPS),
                exact=True,
            )
        # A class compared by identity or membership: `spec_type is CircularBufferSpec`,
        # `base in (A, B)` where the other side holds a class read elsewhere.
        for other, class_expr in sides:
            if isinstance(other, ast.Constant) or self.r.classes_of(other):
                continue
            classes = self.r.classes_of(class_expr)
            if classes:
                return Check(
                    node,
                    "class-compare",
                    ast.unparse(other),
                    ast.unparse(node),
                    ast.unparse(class_expr),
                    classes,
                    negated != isinstance(op, _NEGATIVE_OPS),
                    exact=True,
                )
        return None
