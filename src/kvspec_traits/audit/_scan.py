"""Find, in one module's syntax tree, every place that asks a KV cache spec for its class.

Works on names only: a reference is a spec class when, after following the module's
imports, aliases and module-level class tuples, its last component is the name of a spec
class of the installed vLLM (``known``). Nothing here imports vLLM or compares classes.
"""

from __future__ import annotations

import ast
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from kvspec_traits.audit._flow import (
    Constraint,
    TraitGuard,
    exits,
    flow_context,
    iterables_around,
    raises,
    test_checks,
)

__all__ = [
    "FORMS",
    "ClassDefinition",
    "ModuleScan",
    "RawSite",
    "module_class_sets",
    "relevant_lines",
    "scan_module",
]

FORMS: Final = (
    "isinstance",
    "issubclass",
    "type-compare",
    "representative-type",
    "class-dict",
    "match-class",
    "type-name",
    "mro-walk",
    "spec-kind",
    "class-compare",
)
"""Site forms: ``isinstance``/``issubclass`` calls (and ``or``-chains of them on one
subject), ``type(x) is``/``==``/``in`` comparisons, the same on
``get_representative_spec_type(x)``, dict literals keyed by spec classes, ``case``
class patterns, a class read elsewhere compared by identity (``spec_type is
MambaSpec``), comparisons with class-name strings (``type(x).__name__ ==
"MambaSpec"``), walks over ``type(x).__mro__`` (by class or by name) and comparisons with
``KVCacheSpecKind`` members."""

_KIND_ENUM: Final = "KVCacheSpecKind"
_KIND_FUNCTION: Final = "get_kv_cache_spec_kind"
KIND_TOKENS: Final = (_KIND_ENUM.encode(), _KIND_FUNCTION.encode())
"""Names that make a file and a line worth scanning for spec-kind comparisons."""
_TRAIT_ATTRIBUTES: Final = frozenset({"prefix_cacheable"})
"""Spec attributes that are also trait questions: ``if not s.prefix_cacheable:
continue`` excludes the classes whose answer is False."""

_REPRESENTATIVE: Final = "get_representative_spec_type"
_UNION: Final = frozenset({"Union"})
_WRAPPING_CALLS: Final = frozenset({"tuple", "frozenset", "set", "list"})
_EXACT_OPS: Final = (ast.Is, ast.IsNot, ast.Eq, ast.NotEq, ast.In, ast.NotIn)
_NEGATIVE_OPS: Final = (ast.IsNot, ast.NotEq, ast.NotIn)
_EXITS: Final = (ast.Return, ast.Raise, ast.Continue, ast.Break)
_SUBCLASS_WORDS: Final = ("subclass",)


@dataclass(frozen=True, slots=True, kw_only=True)
class RawSite:
    """One class check as written: where, on what, against which spec classes.

    ``text`` is the check as written (normalised by ``ast.unparse``), ``written`` its
    class operand; ``classes`` are spec class names in source order; ``exact`` is true
    when the check matches the class itself and not its subclasses; ``excluded`` are
    classes an ``and not isinstance(...)`` on the same subject takes out again;
    ``unwraps`` says whether the guarded code uses anything only a group class has
    (``None`` when no group class is tested).

    The rest is what the surrounding code says: ``constraints`` and ``trait_guards``
    on the subject where the check runs (earlier ``elif`` branches, early exits,
    asserts); ``exited_on`` classes an exit elsewhere in the same top-level function
    handles explicitly (``if isinstance(s, X): return False``); ``refused`` classes a
    ``raise`` in the module is guarded by; ``context`` flags (``assert``: the check is
    asserted; ``validation``: it guards a ``raise``; ``chain-raises``: its if/elif chain
    ends in ``else: raise``; ``subclass-comment``: a comment just above speaks of
    subclasses); ``kinds`` the ``KVCacheSpecKind`` members a spec-kind site compares with;
    ``subclass_safe`` a class-keyed dict looked up along ``type(x).__mro__``; ``others``
    the names in the class operand that are no spec class the audit knows (a class defined
    outside the scanned code, tested next to spec classes).
    """

    line: int
    col: int
    end_line: int
    function: str
    form: str
    subject: str
    text: str
    written: str
    classes: tuple[str, ...]
    negated: bool
    exact: bool
    unwraps: bool | None
    excluded: tuple[str, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    trait_guards: tuple[TraitGuard, ...] = ()
    exited_on: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    context: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    subclass_safe: bool = False
    others: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ClassDefinition:
    """A class the scanned code defines on a spec class: its spec-class bases (as
    resolved names) and whether its body declares fields of its own (annotated
    assignments), which may change its traits."""

    name: str
    module: str
    line: int
    bases: tuple[str, ...]
    adds_fields: bool


# A name's binding: a dotted reference ("vllm.v1.kv_cache_interface.MambaSpec"), a set
# of spec class names (a module-level tuple), or something else that shadows it.
_Ref = str
_ClassSet = tuple[str, ...]


class _Other:
    """A module-level name bound to something that is not a class reference."""


_OTHER: Final = _Other()
_Binding = _Ref | _ClassSet | _Other


class _Resolver:
    def __init__(
        self,
        tree: ast.Module,
        *,
        module: str,
        is_package: bool,
        known: frozenset[str],
        exports: Mapping[str, Mapping[str, tuple[str, ...]]],
    ) -> None:
        self.known = known
        self.exports = exports
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.bindings: dict[str, _Binding] = {}
        self.class_sets: dict[str, tuple[str, ...]] = {}
        # Imports anywhere (vLLM imports spec classes inside functions too): an alias is
        # rarely reused for something else within one module.
        for node in _all_statements(tree.body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.bindings[alias.asname] = alias.name
                    else:
                        head = alias.name.partition(".")[0]
                        self.bindings.setdefault(head, head)
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                for alias in node.names:
                    if alias.name == "*":
                        continue
                    ref = f"{base}.{alias.name}" if base else alias.name
                    self.bindings[alias.asname or alias.name] = ref
        self._imports: dict[str, str] = {
            k: v for k, v in self.bindings.items() if isinstance(v, str)
        }
        self._tree = tree
        self._bind_module_level()

    def _bind_module_level(self) -> None:
        for stmt in _module_level(self._tree.body):
            self._bind_assignment(stmt)

    def import_refs(self) -> list[str]:
        """The dotted references this module's imports bind."""
        return list(self._imports.values())

    def use_exports(self, exports: Mapping[str, Mapping[str, tuple[str, ...]]]) -> None:
        """Resolve imported names against other modules' class sets from now on."""
        self.exports = exports
        self.bindings = {}
        self.bindings.update(self._imports)
        self.class_sets = {}
        self._bind_module_level()

    def tokens(self) -> set[bytes]:
        """Names whose occurrence in the source can start a check on spec classes."""
        names = set(self.known) | set(self.class_sets)
        for sets in self.exports.values():
            names.update(sets)  # `mod.LATENT` through a module alias
        for name, bound in self.bindings.items():
            if isinstance(bound, str) and self._ref_classes(bound):
                names.add(name)
        return {n.encode() for n in names} | set(KIND_TOKENS)

    def kind_member(self, node: ast.expr) -> str | None:
        """The member name when ``node`` is ``KVCacheSpecKind.X`` (through imports)."""
        if not isinstance(node, ast.Attribute):
            return None
        ref = self.dotted(node.value)
        if ref is not None and ref.rpartition(".")[2] == _KIND_ENUM:
            return node.attr
        return None

    def kind_members(self, node: ast.expr) -> tuple[str, ...]:
        """Members a kind expression (one, or a tuple/list/set of them) names."""
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            found = [self.kind_member(e) for e in node.elts]
            return tuple(m for m in found if m is not None) if all(found) else ()
        member = self.kind_member(node)
        return (member,) if member else ()

    def name_strings(self, node: ast.expr) -> tuple[str, ...]:
        """Spec class names a string constant (or a tuple/list/set of them) spells;
        empty unless every string names a spec class."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return (node.value,) if node.value in self.known else ()
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and node.elts:
            names = [
                e.value
                for e in node.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
            if len(names) == len(node.elts) and all(n in self.known for n in names):
                return tuple(names)
        return ()

    def _absolute(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        parts = self.package.split(".") if self.package else []
        if level > 1:
            parts = parts[: len(parts) - (level - 1)] if level - 1 <= len(parts) else []
        base = ".".join(parts)
        if module:
            return f"{base}.{module}" if base else module
        return base

    def _bind_assignment(self, stmt: ast.stmt) -> None:
        targets: list[ast.expr]
        value: ast.expr | None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign):
            targets, value = [stmt.target], stmt.value
        else:
            return
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            found = self.classes_of(value) if value is not None else ()
            if found:
                self.bindings[target.id] = found
                self.class_sets[target.id] = found
            else:
                self.bindings[target.id] = _OTHER
                self.class_sets.pop(target.id, None)

    def dotted(self, node: ast.expr) -> str | None:
        """The dotted reference an expression names, following imports; ``None`` when it
        is not a plain name or attribute chain, or names a class set."""
        if isinstance(node, ast.Name):
            bound = self.bindings.get(node.id)
            if bound is None:
                return node.id
            return bound if isinstance(bound, str) else None
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base is not None else None
        return None

    def _ref_classes(self, ref: str) -> tuple[str, ...]:
        module, _, name = ref.rpartition(".")
        exported = self.exports.get(module, {}).get(name)
        if exported is not None:
            return exported
        return (name,) if name in self.known else ()

    def classes_of(self, node: ast.expr) -> tuple[str, ...]:
        """Spec class names a class expression stands for (empty: none)."""
        if isinstance(node, ast.Name):
            bound = self.bindings.get(node.id)
            if isinstance(bound, tuple):
                return bound
            if isinstance(bound, _Other):
                return ()
            return self._ref_classes(bound if bound is not None else node.id)
        if isinstance(node, ast.Attribute):
            ref = self.dotted(node)
            if ref is not None:
                return self._ref_classes(ref)
            return (node.attr,) if node.attr in self.known else ()
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return _dedup(c for elt in node.elts for c in self.classes_of(elt))
        if isinstance(node, ast.Starred):
            return self.classes_of(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr | ast.Add):
            return _dedup((*self.classes_of(node.left), *self.classes_of(node.right)))
        if isinstance(node, ast.Subscript):
            ref = self.dotted(node.value)
            if ref is not None and ref.rpartition(".")[2] in _UNION:
                return self.classes_of(node.slice)
            return ()
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
            ref = self.dotted(node.func)
            if ref in _WRAPPING_CALLS:
                return self.classes_of(node.args[0])
        return ()

    def is_builtin(self, node: ast.expr, name: str) -> bool:
        return isinstance(node, ast.Name) and node.id == name and node.id not in self.bindings


def _dedup(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _all_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    # Every statement at any depth, without visiting expressions (the bulk of a tree).
    stack = list(reversed(body))
    while stack:
        stmt = stack.pop()
        yield stmt
        nested: list[ast.stmt] = []
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if isinstance(block, list):
                nested.extend(b for b in block if isinstance(b, ast.stmt))
        for handler in getattr(stmt, "handlers", ()):
            nested.extend(handler.body)
        for case in getattr(stmt, "cases", ()):
            nested.extend(case.body)
        stack.extend(reversed(nested))


def relevant_lines(source: bytes, tokens: Iterable[bytes]) -> list[int] | None:
    """Sorted line numbers on which any token occurs (``None``: cannot tell, visit all).

    Lines are counted on ``\n``; a file with bare ``\r`` line ends is not pruned."""
    if b"\r" in source.replace(b"\r\n", b""):
        return None
    hits: list[int] = []
    for token in tokens:
        pos = source.find(token)
        while pos != -1:
            hits.append(pos)
            pos = source.find(token, pos + len(token))
    hits.sort()
    lines: list[int] = []
    line, last = 1, 0
    for pos in hits:
        line += source.count(b"\n", last, pos)
        last = pos
        if not lines or lines[-1] != line:
            lines.append(line)
    return lines


def _blocks(node: ast.AST) -> Iterator[list[ast.stmt]]:
    # Every statement list below `node` (bodies, else branches, handlers, cases).
    stack = [node]
    while stack:
        current = stack.pop()
        lists: list[list[ast.stmt]] = []
        for name in ("body", "orelse", "finalbody"):
            block = getattr(current, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                lists.append(block)
        lists += [h.body for h in getattr(current, "handlers", ())]
        lists += [c.body for c in getattr(current, "cases", ())]
        for block in lists:
            yield block
            stack.extend(block)


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    # Module-level statements, including those under `if TYPE_CHECKING:` and `try:`.
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _module_level(stmt.body)
            yield from _module_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from _module_level(block)
            for handler in stmt.handlers:
                yield from _module_level(handler.body)


class ModuleScan:
    """One parsed module: its class sets (for other modules) and its sites.

    ``source`` (the file's bytes) lets the walk skip statements and expressions on whose
    lines no spec class name, alias or class-set name occurs; without it every node is
    visited.
    """

    def __init__(
        self,
        tree: ast.Module,
        *,
        module: str = "",
        is_package: bool = False,
        known: frozenset[str],
        source: bytes | None = None,
    ) -> None:
        self.tree = tree
        self.source = source
        self.resolver = _Resolver(
            tree, module=module, is_package=is_package, known=known, exports={}
        )

    def class_definitions(self) -> list[ClassDefinition]:
        """Classes this module defines on spec classes (an out-of-tree
        ``XMLAAttentionSpec(MLAAttentionSpec)``), in definition order."""
        found: list[ClassDefinition] = []
        for stmt in _all_statements(self.tree.body):
            if not isinstance(stmt, ast.ClassDef):
                continue
            bases = _dedup(c for b in stmt.bases for c in self.resolver.classes_of(b))
            if not bases:
                continue
            adds = any(
                isinstance(b, ast.AnnAssign)
                and isinstance(b.target, ast.Name)
                and not _is_classvar(b.annotation)
                for b in stmt.body
            )
            found.append(
                ClassDefinition(
                    name=stmt.name,
                    module=self.resolver.module,
                    line=stmt.lineno,
                    bases=bases,
                    adds_fields=adds,
                )
            )
        return found

    def imported_modules(self) -> frozenset[str]:
        """Modules this one imports from or imports (candidates for defining class sets
        it uses)."""
        found: set[str] = set()
        for ref in self.resolver.import_refs():
            found.add(ref)
            found.add(ref.rpartition(".")[0])
        return frozenset(found)

    @property
    def class_sets(self) -> dict[str, tuple[str, ...]]:
        """Module-level names bound to spec class sets (``_MLA = (MLAAttentionSpec, ...)``),
        which other modules may import."""
        return dict(self.resolver.class_sets)

    def sites(
        self,
        *,
        groups: frozenset[str] = frozenset(),
        group_attributes: frozenset[str] = frozenset(),
        exports: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
    ) -> list[RawSite]:
        """Every class check against spec classes, in line order."""
        if exports:
            self.resolver.use_exports(exports)
        lines = None
        if self.source is not None:
            lines = relevant_lines(self.source, self.resolver.tokens())
        finder = _Finder(
            self.resolver, groups=groups, group_attributes=group_attributes, source=self.source
        )
        return finder.run(self.tree, lines)


def _is_classvar(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation)
    return text.startswith(("ClassVar", "typing.ClassVar"))


def module_class_sets(
    tree: ast.Module, *, module: str = "", is_package: bool = False, known: frozenset[str]
) -> dict[str, tuple[str, ...]]:
    """Module-level names bound to spec class sets, which other modules may import."""
    return ModuleScan(tree, module=module, is_package=is_package, known=known).class_sets


@dataclass(slots=True)
class _Check:
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


def _position(node: ast.AST) -> int:
    return getattr(node, "lineno", 0) * 100_000 + getattr(node, "col_offset", 0)


def _contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(sub is node for sub in ast.walk(tree))


def _name_of(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else ""


def _last_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


class _Finder:
    def __init__(
        self,
        resolver: _Resolver,
        *,
        groups: frozenset[str],
        group_attributes: frozenset[str],
        source: bytes | None = None,
    ) -> None:
        self.r = resolver
        self.groups = groups
        self.group_attributes = group_attributes
        self.source_lines = source.split(b"\n") if source is not None else None
        self.sites: list[RawSite] = []
        self.consumed: set[int] = set()
        self.scope: ast.AST | None = None  # the function, class or module being walked
        self.top: ast.AST | None = None  # the outermost function (or method) around it
        self.stmt: ast.AST | None = None  # the innermost statement around the node
        self.tree: ast.Module | None = None
        # loop variables bound by `for c in type(x).__mro__` (or a comprehension): name ->
        # the subject x; names of dicts looked up with such a variable.
        self.mro_vars: dict[str, str] = {}
        self.mro_dicts: set[str] = set()
        self._exits: dict[int, tuple[tuple[str, tuple[str, ...], int, str], ...]] = {}
        self._refused: tuple[str, ...] | None = None

    def _find_mro_walks(self, tree: ast.Module) -> None:
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
                    self.mro_vars[target.id] = self._mro_subject(it.value)
        if not self.mro_vars:
            return
        for node in ast.walk(tree):
            # D[c], D.get(c), c in D with c a walk variable: D is looked up along the MRO
            if isinstance(node, ast.Subscript) and _name_of(node.slice) in self.mro_vars:
                self.mro_dicts.add(_last_name(node.value))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and _name_of(node.args[0]) in self.mro_vars
            ):
                self.mro_dicts.add(_last_name(node.func.value))
            elif (
                isinstance(node, ast.Compare)
                and len(node.ops) == 1
                and isinstance(node.ops[0], ast.In | ast.NotIn)
                and _name_of(node.left) in self.mro_vars
            ):
                self.mro_dicts.add(_last_name(node.comparators[0]))
        self.mro_dicts.discard("")

    def _mro_subject(self, node: ast.expr) -> str:
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

    # -- recognising one check ------------------------------------------------------------

    def check_of(self, node: ast.expr, negated: bool = False) -> _Check | None:
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

    def _call_check(self, node: ast.Call, negated: bool) -> _Check | None:
        for form in ("isinstance", "issubclass"):
            if self.r.is_builtin(node.func, form) and len(node.args) == 2:
                classes = self.r.classes_of(node.args[1])
                if not classes:
                    return None
                return _Check(
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
                return _Check(
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
            var = _name_of(node.value)
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
                return "mro-walk", self._mro_subject(gen.iter.value)
        if isinstance(node, ast.Constant):
            return None
        return "type-name", ast.unparse(node)

    def _special_check(
        self, node: ast.expr, left: ast.expr, op: ast.cmpop, right: ast.expr, negated: bool
    ) -> _Check | None:
        # Class-name strings, KVCacheSpecKind members, `C in type(x).__mro__`.
        is_in = isinstance(op, ast.In | ast.NotIn)
        neg = negated != isinstance(op, _NEGATIVE_OPS)
        pairs = [(left, right)] if is_in else [(left, right), (right, left)]
        for other, const in pairs:
            kinds = self.r.kind_members(const)
            if kinds:
                subject = ast.unparse(other)
                if isinstance(other, ast.Call) and len(other.args) == 1:
                    ref = self.r.dotted(other.func)
                    if ref is not None and ref.rpartition(".")[2] == _KIND_FUNCTION:
                        subject = ast.unparse(other.args[0])
                return _Check(
                    node,
                    "spec-kind",
                    subject,
                    ast.unparse(node),
                    ast.unparse(const),
                    (),
                    neg,
                    exact=True,
                    kinds=kinds,
                )
        if is_in and isinstance(right, ast.Attribute) and right.attr == "__mro__":
            classes = self.r.classes_of(left)
            if classes:
                return _Check(
                    node,
                    "mro-walk",
                    self._mro_subject(right.value),
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
            return _Check(
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
    ) -> _Check | None:
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
            return _Check(
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
                return _Check(
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

    # -- the walk -------------------------------------------------------------------------

    def run(self, tree: ast.Module, lines: Sequence[int] | None = None) -> list[RawSite]:
        """Visit the tree; with ``lines``, only the nodes that span one of those lines."""
        self.tree = tree
        if self.source_lines is None or any(b"__mro__" in line for line in self.source_lines):
            self._find_mro_walks(tree)
        Entry = tuple[ast.AST, str, ast.AST, ast.AST, ast.AST, ast.AST]
        stack: list[Entry] = [(tree, "<module>", tree, tree, tree, tree)]
        while stack:
            node, func, region, scope, stmt, top = stack.pop()
            if lines is not None and isinstance(node, ast.stmt | ast.expr):
                i = bisect_left(lines, node.lineno)
                if i == len(lines) or lines[i] > (node.end_lineno or node.lineno):
                    continue  # no name that could make a check appears in this node
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if func == "<module>" or (
                    isinstance(top, ast.ClassDef)
                    and not isinstance(node, ast.ClassDef)
                    and top is scope
                ):
                    top = node  # a method's top is the method, not its class
                func = node.name if func == "<module>" else f"{func}.{node.name}"
                scope = node
            if isinstance(node, ast.stmt | ast.IfExp):
                region = node
            if isinstance(node, ast.stmt):
                stmt = node
            self.scope, self.stmt, self.top = scope, stmt, top
            self._visit(node, func, region)
            children = list(ast.iter_child_nodes(node))
            if isinstance(node, ast.Match):
                children = [node.subject, *(s for c in node.cases for s in c.body)]
                for case in node.cases:
                    if case.guard is not None:
                        children.append(case.guard)
            stack.extend((child, func, region, scope, stmt, top) for child in reversed(children))
        self.sites.sort(key=lambda s: (s.line, s.col))
        return self.sites

    def _visit(self, node: ast.AST, func: str, region: ast.AST) -> None:
        if id(node) in self.consumed:
            return
        if isinstance(node, ast.BoolOp):
            self._visit_boolop(node, func, region)
        elif isinstance(node, ast.Call | ast.Compare):
            check = self.check_of(node)
            if check is not None:
                self._emit(check, func, region)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            check = self.check_of(node)
            if check is not None:
                self._emit(check, func, region)
                self._consume(node)
        elif isinstance(node, ast.Dict):
            self._visit_dict(node, func, region)
        elif isinstance(node, ast.Match):
            self._visit_match(node, func)

    def _consume(self, node: ast.AST) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call | ast.Compare | ast.UnaryOp):
                self.consumed.add(id(sub))

    def _visit_boolop(self, node: ast.BoolOp, func: str, region: ast.AST) -> None:
        # Checks on one subject joined by `and`/`or` ask one question: one site.
        # `a or b` is `not (not a and not b)`, so both reduce to an `and` of checks with a
        # polarity each: no positive check -> the union of the negated ones, negated;
        # one positive `isinstance` -> its classes minus the negated ones'.
        is_or = isinstance(node.op, ast.Or)
        groups: dict[tuple[str, str, bool], list[tuple[_Check, bool]]] = {}
        for value in node.values:
            check = self.check_of(value)
            if check is None:
                continue
            positive = check.negated == is_or  # its polarity inside the `and` form
            key = (check.form, check.subject, check.exact)
            groups.setdefault(key, []).append((check, positive))
        for (form, subject, exact), members in groups.items():
            if len(members) < 2:
                continue
            positives = [c for c, positive in members if positive]
            negatives = [c for c, positive in members if not positive]
            excluded: tuple[str, ...] = ()
            if not positives:
                classes, negated = _dedup(n for c in negatives for n in c.classes), True
            elif len(positives) == 1 and form in ("isinstance", "issubclass"):
                classes = positives[0].classes
                excluded = _dedup(n for c in negatives for n in c.classes)
                negated = False
            else:
                continue
            checks = [c for c, _ in members]
            joiner = " or " if is_or else " and "
            merged = _Check(
                checks[0].node,
                form,
                subject,
                joiner.join(c.text for c in checks),
                joiner.join(c.written for c in checks),
                classes,
                negated != is_or,
                exact,
                excluded,
            )
            self._emit(merged, func, region, end=checks[-1].node)
            for value in node.values:
                check = self.check_of(value)
                if check is not None and any(check.node is c.node for c in checks):
                    self._consume(value)

    def _visit_dict(self, node: ast.Dict, func: str, region: ast.AST) -> None:
        keys: list[str] = []
        for key in node.keys:
            if isinstance(key, ast.Name | ast.Attribute):
                found = self.r.classes_of(key)
                if len(found) == 1:
                    keys.append(found[0])
        if keys:
            written = "{" + ", ".join(f"{k}: ..." for k in keys) + "}"
            # A dict bound to a name that is looked up along type(x).__mro__ answers for
            # subclasses too (vLLM's own spec registry does this).
            targets: list[ast.expr] = []
            if isinstance(region, ast.Assign):
                targets = region.targets
            elif isinstance(region, ast.AnnAssign):
                targets = [region.target]
            safe = any(_last_name(t) in self.mro_dicts for t in targets)
            self._emit(
                _Check(node, "class-dict", "", written, written, _dedup(keys), False, not safe),
                func,
                region,
                subclass_safe=safe,
            )

    def _visit_match(self, node: ast.Match, func: str) -> None:
        subject = ast.unparse(node.subject)
        for case in node.cases:
            classes = _dedup(self._pattern_classes(case.pattern))
            if classes:
                written = ast.unparse(case.pattern)
                self._emit(
                    _Check(
                        case.pattern,
                        "match-class",
                        subject,
                        f"case {written}",
                        written,
                        classes,
                        False,
                        False,
                    ),
                    func,
                    case,
                )

    def _pattern_classes(self, pattern: ast.pattern) -> Iterator[str]:
        if isinstance(pattern, ast.MatchClass):
            yield from self.r.classes_of(pattern.cls)
        elif isinstance(pattern, ast.MatchOr):
            for sub in pattern.patterns:
                yield from self._pattern_classes(sub)
        elif isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
            yield from self._pattern_classes(pattern.pattern)

    def _guarded(self, region: ast.AST, negated: bool) -> list[ast.AST]:
        # The code a check guards: its statement (an `if` with both branches); after
        # `if not isinstance(x, Wrapper): return/raise/continue`, also the rest of the block.
        nodes = [region]
        if isinstance(region, ast.Assert) and not negated and self.scope is not None:
            # `assert isinstance(x, Wrapper)` then reading x.kv_cache_specs: an unwrap
            for block in _blocks(self.scope):
                for i, stmt in enumerate(block):
                    if stmt is region:
                        return nodes + list(block[i + 1 :])
            return nodes
        if not (
            negated
            and isinstance(region, ast.If)
            and region.body
            and isinstance(region.body[-1], _EXITS)
            and self.scope is not None
        ):
            return nodes
        for block in _blocks(self.scope):
            for i, stmt in enumerate(block):
                if stmt is region:
                    return nodes + list(block[i + 1 :])
        return nodes

    def _exit_checks(self, top: ast.AST) -> tuple[tuple[str, tuple[str, ...], int, str], ...]:
        # (subject, classes, position) of every check an exit in `top` is taken on when
        # it holds: `if isinstance(s, X): return False` handles X explicitly.
        cached = self._exits.get(id(top))
        if cached is None:
            found: list[tuple[str, tuple[str, ...], int, str]] = []
            body = getattr(top, "body", [])
            for stmt in _all_statements(body if isinstance(body, list) else []):
                if isinstance(stmt, ast.If) and exits(stmt.body):
                    for use in test_checks(stmt.test, self.check_of):
                        if use.triggers:
                            found.append(
                                (
                                    use.check.subject,
                                    use.check.classes,
                                    _position(use.check.node),
                                    use.over,
                                )
                            )
            cached = self._exits[id(top)] = tuple(found)
        return cached

    def _refusals(self) -> tuple[str, ...]:
        # Classes a `raise` anywhere in the module is guarded by (a domain limit the code
        # states: `if any(isinstance(s, MLAAttentionSpec) and ...): raise ...`).
        if self._refused is None:
            found: list[str] = []
            if self.tree is not None:
                for stmt in _all_statements(self.tree.body):
                    if isinstance(stmt, ast.If) and raises(stmt.body):
                        for use in test_checks(stmt.test, self.check_of):
                            if use.triggers:
                                found.extend(use.check.classes)
            self._refused = _dedup(found)
        return self._refused

    def _context(self, check: _Check, region: ast.AST) -> tuple[str, ...]:
        flags: list[str] = []
        stmt = self.stmt
        if isinstance(stmt, ast.Assert) or check.asserted:
            flags.append("assert")
        if isinstance(stmt, ast.If) and _contains(stmt.test, check.node):
            if raises(stmt.body):
                flags.append("validation")
            tail: ast.If = stmt
            while len(tail.orelse) == 1 and isinstance(tail.orelse[0], ast.If):
                tail = tail.orelse[0]
            if tail is not stmt and raises(tail.orelse):
                flags.append("chain-raises")
        line = getattr(check.node, "lineno", 0)
        first = getattr(stmt, "lineno", line)
        if self.source_lines is not None and line:
            above = self.source_lines[max(0, first - 4) : line]
            if any(
                b"#" in text and any(w.encode() in text.lower() for w in _SUBCLASS_WORDS)
                for text in above
            ):
                flags.append("subclass-comment")
        return tuple(flags)

    def _others(self, node: ast.AST) -> tuple[str, ...]:
        # `isinstance(s, (MLAAttentionSpec, XMLASpec))` with XMLASpec imported from code the
        # audit does not see: say so rather than read the tuple as if it were not there.
        operand: ast.expr | None = None
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            operand = node.args[1]
        elif isinstance(node, ast.Compare) and node.comparators:
            operand = node.comparators[0]
        if not isinstance(operand, ast.Tuple | ast.List | ast.Set):
            return ()
        return tuple(
            ast.unparse(e)
            for e in operand.elts
            if isinstance(e, ast.Name | ast.Attribute)
            and not self.r.classes_of(e)
            and not self.r.is_builtin(e, "type")
            and _last_name(e)[:1].isupper()
        )

    def _emit(
        self,
        check: _Check,
        func: str,
        region: ast.AST,
        *,
        end: ast.AST | None = None,
        subclass_safe: bool = False,
    ) -> None:
        unwraps: bool | None = None
        if self.groups.intersection(check.classes):
            unwraps = any(
                isinstance(n, ast.Attribute) and n.attr in self.group_attributes
                for guarded in self._guarded(region, check.negated)
                for n in ast.walk(guarded)
            )
        constraints: tuple[Constraint, ...] = ()
        guards: tuple[TraitGuard, ...] = ()
        exited: tuple[str, ...] = ()
        if self.scope is not None and self.stmt is not None and check.subject:
            constraints, guards = flow_context(
                self.scope,
                self.stmt,
                check.subject,
                self.check_of,
                own=check.node,
                trait_attributes=_TRAIT_ATTRIBUTES,
            )
        if self.top is not None and self.top is not self.tree:
            own = _position(check.node)
            site_over = iterables_around(self.stmt, check.node) if self.stmt else set()
            exited = _dedup(
                c
                for subject, classes, where, over in self._exit_checks(self.top)
                for c in classes
                if subject == check.subject and where != own and (not over or over in site_over)
            )
        node = check.node
        last = end if end is not None else node
        line: int = getattr(node, "lineno", 0)
        end_line: int = getattr(last, "end_lineno", None) or line
        others = self._others(check.node)
        self.sites.append(
            RawSite(
                line=line,
                col=getattr(node, "col_offset", 0),
                end_line=end_line,
                function=func,
                form=check.form,
                subject=check.subject,
                text=check.text,
                written=check.written,
                classes=check.classes,
                negated=check.negated,
                exact=check.exact,
                unwraps=unwraps,
                excluded=check.excluded,
                constraints=constraints,
                trait_guards=guards,
                exited_on=exited,
                refused=self._refusals(),
                context=self._context(check, region),
                kinds=check.kinds,
                subclass_safe=subclass_safe,
                others=others,
            )
        )
        self._consume(node)


def scan_module(
    tree: ast.Module,
    *,
    module: str = "",
    is_package: bool = False,
    known: frozenset[str],
    groups: frozenset[str] = frozenset(),
    group_attributes: frozenset[str] = frozenset(),
    exports: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
    source: bytes | None = None,
) -> list[RawSite]:
    """Every class check against spec classes in ``tree``, in line order.

    ``module`` is the module's dotted name (for relative imports and ``exports``, the
    class sets other modules define); ``groups`` are group wrapper classes and
    ``group_attributes`` the attributes that unwrap them; ``source`` enables skipping lines
    that cannot hold a check.
    """
    return ModuleScan(tree, module=module, is_package=is_package, known=known, source=source).sites(
        groups=groups, group_attributes=group_attributes, exports=exports
    )
