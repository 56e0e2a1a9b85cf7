"""Finding the sites in one module: the walk over its tree, and what the code around each
check says (guards, exits, refusals, unwrapping), recorded as :class:`RawSite`.
"""

from __future__ import annotations

import ast
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Final

from kvspec_traits.audit._checks import Check, CheckReader
from kvspec_traits.audit._flow import (
    Constraint,
    TraitGuard,
    contains,
    exits,
    flow_context,
    iterables_around,
    raises,
    refused_through_flag,
    test_checks,
)
from kvspec_traits.audit._names import NameResolver, all_statements, blocks, dedup, last_name
from kvspec_traits.audit._tables import table_name

__all__ = ["RawSite", "SiteFinder"]

_TRAIT_ATTRIBUTES: Final = frozenset({"prefix_cacheable"})
"""Spec attributes that are also trait questions: ``if not s.prefix_cacheable:
continue`` excludes the classes whose answer is False."""
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
    ``subclass_safe`` a class-keyed dict looked up along ``type(x).__mro__``; ``table`` the
    name such a dict is bound to and ``lookup`` how the scanned code looks that name up by
    type (see :mod:`~kvspec_traits.audit._tables`); ``others`` the names in the class
    operand that are no spec class the audit knows (a class defined outside the scan);
    ``built`` the bases of the classes the check and the code around it name of which the
    scanned code builds an instance anywhere (a call of the class, or of a method on it):
    where it builds none of a vLLM class whose vendor subclass the code names, a miss of
    it is latent.
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
    table: str = ""
    lookup: str = ""
    built: tuple[str, ...] = ()


def _position(node: ast.AST) -> int:
    return getattr(node, "lineno", 0) * 100_000 + getattr(node, "col_offset", 0)


class SiteFinder(CheckReader):
    """Walks one module's tree and records every check on spec classes as a site."""

    def __init__(
        self,
        resolver: NameResolver,
        *,
        groups: frozenset[str],
        group_attributes: frozenset[str],
        source: bytes | None = None,
    ) -> None:
        super().__init__(resolver)
        self.groups = groups
        self.group_attributes = group_attributes
        self.source_lines = source.split(b"\n") if source is not None else None
        self.sites: list[RawSite] = []
        self.consumed: set[int] = set()
        self.scope: ast.AST | None = None  # the function, class or module being walked
        self.top: ast.AST | None = None  # the outermost function (or method) around it
        self.stmt: ast.AST | None = None  # the innermost statement around the node
        self.tree: ast.Module | None = None
        self._exits: dict[int, tuple[tuple[str, tuple[str, ...], int, str], ...]] = {}
        self._refused: tuple[str, ...] | None = None

    def run(self, tree: ast.Module, lines: Sequence[int] | None = None) -> list[RawSite]:
        """Visit the tree; with ``lines``, only the nodes that span one of those lines."""
        self.tree = tree
        if self.source_lines is None or any(b"__mro__" in line for line in self.source_lines):
            self.find_mro_walks(tree)
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
        groups: dict[tuple[str, str, bool], list[tuple[Check, bool]]] = {}
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
                classes, negated = dedup(n for c in negatives for n in c.classes), True
            elif len(positives) == 1 and form in ("isinstance", "issubclass"):
                classes = positives[0].classes
                excluded = dedup(n for c in negatives for n in c.classes)
                negated = False
            else:
                continue
            checks = [c for c, _ in members]
            joiner = " or " if is_or else " and "
            merged = Check(
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
            safe = any(last_name(t) in self.mro_dicts for t in targets)
            check = Check(node, "class-dict", "", written, written, dedup(keys), False, not safe)
            self._emit(check, func, region, subclass_safe=safe)
            self.sites[-1] = replace(self.sites[-1], table=table_name(node, region))

    def _visit_match(self, node: ast.Match, func: str) -> None:
        subject = ast.unparse(node.subject)
        for case in node.cases:
            classes = dedup(self._pattern_classes(case.pattern))
            if classes:
                written = ast.unparse(case.pattern)
                self._emit(
                    Check(
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
            for block in blocks(self.scope):
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
        for block in blocks(self.scope):
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
            for stmt in all_statements(body if isinstance(body, list) else []):
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
                for stmt in all_statements(self.tree.body):
                    if isinstance(stmt, ast.If) and raises(stmt.body):
                        for use in test_checks(stmt.test, self.check_of):
                            if use.triggers:
                                found.extend(use.check.classes)
            self._refused = dedup(found)
        return self._refused

    def _context(self, check: Check, region: ast.AST) -> tuple[str, ...]:
        flags: list[str] = []
        stmt = self.stmt
        if isinstance(stmt, ast.Assert) or check.asserted:
            flags.append("assert")
        if isinstance(stmt, ast.If) and contains(stmt.test, check.node):
            if raises(stmt.body):
                flags.append("validation")
            tail: ast.If = stmt
            while len(tail.orelse) == 1 and isinstance(tail.orelse[0], ast.If):
                tail = tail.orelse[0]
            if tail is not stmt and raises(tail.orelse):
                flags.append("chain-raises")
        elif isinstance(stmt, ast.Assign) and self.top and refused_through_flag(self.top, stmt):
            flags.append("validation")  # a flag that a later `if not flag: raise` tests
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
            and last_name(e)[:1].isupper()
        )

    def _emit(
        self,
        check: Check,
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
        check.subject = self.site_subject(check, self.top, self.stmt)
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
            exited = dedup(
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
