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

__all__ = ["FORMS", "ModuleScan", "RawSite", "module_class_sets", "relevant_lines", "scan_module"]

FORMS: Final = (
    "isinstance",
    "issubclass",
    "type-compare",
    "representative-type",
    "class-dict",
    "match-class",
)
"""Site forms: ``isinstance``/``issubclass`` calls (and ``or``-chains of them on one
subject), ``type(x) is``/``==``/``in`` comparisons, the same on
``get_representative_spec_type(x)``, dict literals keyed by spec classes, and ``case``
class patterns."""

_REPRESENTATIVE: Final = "get_representative_spec_type"
_UNION: Final = frozenset({"Union"})
_WRAPPING_CALLS: Final = frozenset({"tuple", "frozenset", "set", "list"})
_EXACT_OPS: Final = (ast.Is, ast.IsNot, ast.Eq, ast.NotEq, ast.In, ast.NotIn)
_NEGATIVE_OPS: Final = (ast.IsNot, ast.NotEq, ast.NotIn)
_EXITS: Final = (ast.Return, ast.Raise, ast.Continue, ast.Break)


@dataclass(frozen=True, slots=True, kw_only=True)
class RawSite:
    """One class check as written: where, on what, against which spec classes.

    ``text`` is the check as written (normalised by ``ast.unparse``), ``written`` its
    class operand; ``classes`` are spec class names in source order; ``exact`` is true
    when the check matches the class itself and not its subclasses; ``excluded`` are
    classes an ``and not isinstance(...)`` on the same subject takes out again;
    ``unwraps`` says whether the guarded code uses anything only a group class has
    (``None`` when no group class is tested).
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


# A name's binding: a dotted reference ("vllm.v1.kv_cache_interface.MambaSpec"), a set
# of spec class names (a module-level tuple), or something else that shadows it.
_Ref = str
_ClassSet = tuple[str, ...]


class _Other:
    """A module-level name bound to something that is not a class reference."""


_OTHER: Final = _Other()
_Binding = _Ref | _ClassSet | _Other


class _Resolver:
    def __init__(self, tree: ast.Module, *, module: str, is_package: bool,
                 known: frozenset[str],
                 exports: Mapping[str, Mapping[str, tuple[str, ...]]]) -> None:
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
        self._imports: dict[str, str] = {k: v for k, v in self.bindings.items()
                                          if isinstance(v, str)}
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
        return {n.encode() for n in names}

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

    def __init__(self, tree: ast.Module, *, module: str = "", is_package: bool = False,
                 known: frozenset[str], source: bytes | None = None) -> None:
        self.tree = tree
        self.source = source
        self.resolver = _Resolver(tree, module=module, is_package=is_package, known=known,
                                  exports={})

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

    def sites(self, *, groups: frozenset[str] = frozenset(),
              group_attributes: frozenset[str] = frozenset(),
              exports: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
              ) -> list[RawSite]:
        """Every class check against spec classes, in line order."""
        if exports:
            self.resolver.use_exports(exports)
        lines = None
        if self.source is not None:
            lines = relevant_lines(self.source, self.resolver.tokens())
        finder = _Finder(self.resolver, groups=groups, group_attributes=group_attributes)
        return finder.run(self.tree, lines)


def module_class_sets(tree: ast.Module, *, module: str = "", is_package: bool = False,
                      known: frozenset[str]) -> dict[str, tuple[str, ...]]:
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


class _Finder:
    def __init__(self, resolver: _Resolver, *, groups: frozenset[str],
                 group_attributes: frozenset[str]) -> None:
        self.r = resolver
        self.groups = groups
        self.group_attributes = group_attributes
        self.sites: list[RawSite] = []
        self.consumed: set[int] = set()
        self.scope: ast.AST | None = None  # the function, class or module being walked

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
            return self._compare_check(node, node.left, node.ops[0], node.comparators[0],
                                       negated)
        return None

    def _call_check(self, node: ast.Call, negated: bool) -> _Check | None:
        for form in ("isinstance", "issubclass"):
            if self.r.is_builtin(node.func, form) and len(node.args) == 2:
                classes = self.r.classes_of(node.args[1])
                if not classes:
                    return None
                return _Check(node, form, ast.unparse(node.args[0]), ast.unparse(node),
                              ast.unparse(node.args[1]), classes, negated, exact=False)
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

    def _compare_check(self, node: ast.expr, left: ast.expr, op: ast.cmpop, right: ast.expr,
                       negated: bool) -> _Check | None:
        if not isinstance(op, _EXACT_OPS):
            return None
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
            return _Check(node, form, subject, ast.unparse(node), ast.unparse(class_expr),
                          classes, negated != isinstance(op, _NEGATIVE_OPS), exact=True)
        return None

    # -- the walk -------------------------------------------------------------------------

    def run(self, tree: ast.Module, lines: Sequence[int] | None = None) -> list[RawSite]:
        """Visit the tree; with ``lines``, only the nodes that span one of those lines."""
        stack: list[tuple[ast.AST, str, ast.AST, ast.AST]] = [(tree, "<module>", tree, tree)]
        while stack:
            node, func, region, scope = stack.pop()
            if lines is not None and isinstance(node, ast.stmt | ast.expr):
                i = bisect_left(lines, node.lineno)
                if i == len(lines) or lines[i] > (node.end_lineno or node.lineno):
                    continue  # no name that could make a check appears in this node
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                func = node.name if func == "<module>" else f"{func}.{node.name}"
                scope = node
            if isinstance(node, ast.stmt | ast.IfExp):
                region = node
            self.scope = scope
            self._visit(node, func, region)
            children = list(ast.iter_child_nodes(node))
            if isinstance(node, ast.Match):
                children = [node.subject, *(s for c in node.cases for s in c.body)]
                for case in node.cases:
                    if case.guard is not None:
                        children.append(case.guard)
            stack.extend((child, func, region, scope) for child in reversed(children))
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
            merged = _Check(checks[0].node, form, subject, joiner.join(c.text for c in checks),
                            joiner.join(c.written for c in checks), classes,
                            negated != is_or, exact, excluded)
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
            self._emit(_Check(node, "class-dict", "", written, written, _dedup(keys), False,
                              True), func, region)

    def _visit_match(self, node: ast.Match, func: str) -> None:
        subject = ast.unparse(node.subject)
        for case in node.cases:
            classes = _dedup(self._pattern_classes(case.pattern))
            if classes:
                written = ast.unparse(case.pattern)
                self._emit(_Check(case.pattern, "match-class", subject, f"case {written}",
                                  written, classes, False, False), func, case)

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
        if not (negated and isinstance(region, ast.If) and region.body
                and isinstance(region.body[-1], _EXITS) and self.scope is not None):
            return nodes
        for block in _blocks(self.scope):
            for i, stmt in enumerate(block):
                if stmt is region:
                    return nodes + list(block[i + 1:])
        return nodes

    def _emit(self, check: _Check, func: str, region: ast.AST, *,
              end: ast.AST | None = None) -> None:
        unwraps: bool | None = None
        if self.groups.intersection(check.classes):
            unwraps = any(isinstance(n, ast.Attribute) and n.attr in self.group_attributes
                          for guarded in self._guarded(region, check.negated)
                          for n in ast.walk(guarded))
        node = check.node
        last = end if end is not None else node
        line: int = getattr(node, "lineno", 0)
        end_line: int = getattr(last, "end_lineno", None) or line
        self.sites.append(RawSite(
            line=line, col=getattr(node, "col_offset", 0), end_line=end_line,
            function=func, form=check.form, subject=check.subject, text=check.text,
            written=check.written,
            classes=check.classes,
            negated=check.negated,
            exact=check.exact, unwraps=unwraps, excluded=check.excluded))
        self._consume(node)


def scan_module(tree: ast.Module, *, module: str = "", is_package: bool = False,
                known: frozenset[str], groups: frozenset[str] = frozenset(),
                group_attributes: frozenset[str] = frozenset(),
                exports: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
                source: bytes | None = None) -> list[RawSite]:
    """Every class check against spec classes in ``tree``, in line order.

    ``module`` is the module's dotted name (for relative imports and ``exports``, the
    class sets other modules define); ``groups`` are group wrapper classes and
    ``group_attributes`` the attributes that unwrap them; ``source`` enables skipping lines
    that cannot hold a check.
    """
    return ModuleScan(tree, module=module, is_package=is_package, known=known,
                      source=source).sites(groups=groups, group_attributes=group_attributes,
                                           exports=exports)
