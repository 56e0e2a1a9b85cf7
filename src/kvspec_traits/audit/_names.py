"""Name resolution for the audit: what a name in one module stands for.

A reference is a spec class when, after following the module's imports, aliases and
module-level class tuples, its last component is the name of a spec class of the installed
vLLM (``known``). Nothing here imports vLLM or compares classes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

__all__ = [
    "KIND_ENUM",
    "KIND_FUNCTION",
    "KIND_TOKENS",
    "NameResolver",
    "all_statements",
    "blocks",
    "dedup",
    "last_name",
    "module_level",
    "name_of",
]

KIND_ENUM: Final = "KVCacheSpecKind"
KIND_FUNCTION: Final = "get_kv_cache_spec_kind"
KIND_TOKENS: Final = (KIND_ENUM.encode(), KIND_FUNCTION.encode())
"""Names that make a file and a line worth scanning for spec-kind comparisons."""
_UNION: Final = frozenset({"Union"})
_WRAPPING_CALLS: Final = frozenset({"tuple", "frozenset", "set", "list"})

# A name's binding: a dotted reference ("vllm.v1.kv_cache_interface.MambaSpec"), a set
# of spec class names (a module-level tuple), or something else that shadows it.
_Ref = str
_ClassSet = tuple[str, ...]


class _Other:
    """A module-level name bound to something that is not a class reference."""


_OTHER: Final = _Other()
_Binding = _Ref | _ClassSet | _Other


class NameResolver:
    """What the names of one module stand for: spec classes, class sets, kind members."""

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
        # names bound to class sets inside functions (not exported)
        self.local_sets: dict[str, tuple[str, ...]] = {}
        # module-level names bound to a set of KVCacheSpecKind members
        # (`_SLIDING_KINDS = frozenset({KVCacheSpecKind.SLIDING_WINDOW, ...})`)
        self.kind_sets: dict[str, tuple[str, ...]] = {}
        # Imports anywhere (vLLM imports spec classes inside functions too): an alias is
        # rarely reused for something else within one module.
        for node in all_statements(tree.body):
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
        self._bindmodule_level()

    def _bindmodule_level(self) -> None:
        for stmt in module_level(self._tree.body):
            self._bind_assignment(stmt)
        self._bind_function_level()

    def _bind_function_level(self) -> None:
        """Class sets assigned inside functions (``supported = (FullAttentionSpec, ...)``
        then ``isinstance(spec, supported)``): a name no module-level statement binds,
        every assignment of which, in any function, is a set of spec classes. ``+=`` and
        ``|=`` add their classes (the set a check may test is their union). They resolve
        in this module only (no export)."""
        top = {id(s) for s in module_level(self._tree.body)}
        found: dict[str, list[str]] = {}
        ambiguous: set[str] = set()
        for stmt in all_statements(self._tree.body):
            if id(stmt) in top:
                continue
            target: ast.expr | None = None
            value: ast.expr | None = None
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value = stmt.targets[0], stmt.value
            elif isinstance(stmt, ast.AnnAssign) or (
                isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add | ast.BitOr)
            ):
                target, value = stmt.target, stmt.value
            elif isinstance(stmt, ast.Assign):
                ambiguous.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
            if not isinstance(target, ast.Name) or value is None:
                continue
            classes = self.classes_of(value)
            if classes:
                found.setdefault(target.id, []).extend(classes)
            else:
                ambiguous.add(target.id)
        for name, names in found.items():
            if name not in ambiguous and name not in self.bindings:
                self.bindings[name] = dedup(names)
                self.local_sets[name] = dedup(names)

    def import_refs(self) -> list[str]:
        """The dotted references this module's imports bind."""
        return list(self._imports.values())

    def use_exports(self, exports: Mapping[str, Mapping[str, tuple[str, ...]]]) -> None:
        """Resolve imported names against other modules' class sets from now on."""
        self.exports = exports
        self.bindings = {}
        self.bindings.update(self._imports)
        self.class_sets = {}
        self.local_sets = {}
        self._bindmodule_level()

    def tokens(self) -> set[bytes]:
        """Names whose occurrence in the source can start a check on spec classes."""
        names = set(self.known) | set(self.class_sets) | set(self.kind_sets)
        names.update(self.local_sets)
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
        if ref is not None and ref.rpartition(".")[2] == KIND_ENUM:
            return node.attr
        return None

    def kind_members(self, node: ast.expr) -> tuple[str, ...]:
        """Members a kind expression names: one, a tuple/list/set of them, such a
        collection wrapped in ``frozenset(...)``/``set(...)``/``tuple(...)``, or a
        module-level name bound to one of those."""
        if isinstance(node, ast.Name):
            found_set = self.kind_sets.get(node.id)
            if found_set is not None:
                return found_set
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            found = [self.kind_member(e) for e in node.elts]
            return tuple(m for m in found if m is not None) if all(found) else ()
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
            if self.dotted(node.func) in _WRAPPING_CALLS:
                return self.kind_members(node.args[0])
            return ()
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
            kinds = self.kind_members(value) if value is not None else ()
            if kinds and not isinstance(value, ast.Attribute):
                self.kind_sets[target.id] = kinds
            else:
                self.kind_sets.pop(target.id, None)
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

    def _named_classes(self, node: ast.Name | ast.Attribute) -> tuple[str, ...]:
        # A name or attribute chain: a class, a class set, or something else.
        if isinstance(node, ast.Name):
            bound = self.bindings.get(node.id)
            if isinstance(bound, tuple):
                return bound
            if isinstance(bound, _Other):
                return ()
            return self._ref_classes(bound if bound is not None else node.id)
        ref = self.dotted(node)
        if ref is not None:
            return self._ref_classes(ref)
        return (node.attr,) if node.attr in self.known else ()

    def _wrapped_classes(self, node: ast.Subscript | ast.Call) -> tuple[str, ...]:
        # `Union[A, B]` / `Optional[A]`, and a call that passes its one argument through.
        if isinstance(node, ast.Subscript):
            ref = self.dotted(node.value)
            if ref is not None and ref.rpartition(".")[2] in _UNION:
                return self.classes_of(node.slice)
            return ()
        if len(node.args) == 1 and not node.keywords and self.dotted(node.func) in _WRAPPING_CALLS:
            return self.classes_of(node.args[0])
        return ()

    def classes_of(self, node: ast.expr) -> tuple[str, ...]:
        """Spec class names a class expression stands for (empty: none)."""
        if isinstance(node, ast.Name | ast.Attribute):
            return self._named_classes(node)
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return dedup(c for elt in node.elts for c in self.classes_of(elt))
        if isinstance(node, ast.Starred):
            return self.classes_of(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr | ast.Add):
            return dedup((*self.classes_of(node.left), *self.classes_of(node.right)))
        if isinstance(node, ast.Subscript | ast.Call):
            return self._wrapped_classes(node)
        return ()

    def is_builtin(self, node: ast.expr, name: str) -> bool:
        return isinstance(node, ast.Name) and node.id == name and node.id not in self.bindings


def dedup(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def all_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
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


def blocks(node: ast.AST) -> Iterator[list[ast.stmt]]:
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


def module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    # Module-level statements, including those under `if TYPE_CHECKING:` and `try:`.
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from module_level(stmt.body)
            yield from module_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from module_level(block)
            for handler in stmt.handlers:
                yield from module_level(handler.body)


def name_of(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else ""


def last_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""
