"""Find, in one module's syntax tree, every place that asks a KV cache spec for its class.

Works on names only: a reference is a spec class when, after following the module's
imports, aliases and module-level class tuples, its last component is the name of a spec
class of the installed vLLM (``known``). Nothing here imports vLLM or compares classes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from kvspec_traits.audit._names import KIND_TOKENS, NameResolver, all_statements, dedup
from kvspec_traits.audit._sites import RawSite, SiteFinder
from kvspec_traits.audit._tables import LOOKUP_HINT, type_lookups

__all__ = [
    "FORMS",
    "KIND_TOKENS",
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
        self.resolver = NameResolver(
            tree, module=module, is_package=is_package, known=known, exports={}
        )

    def class_definitions(self) -> list[ClassDefinition]:
        """Classes this module defines on spec classes (an out-of-tree
        ``XMLAAttentionSpec(MLAAttentionSpec)``), in definition order."""
        found: list[ClassDefinition] = []
        for stmt in all_statements(self.tree.body):
            if not isinstance(stmt, ast.ClassDef):
                continue
            bases = dedup(c for b in stmt.bases for c in self.resolver.classes_of(b))
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

    def built_classes(self) -> frozenset[str]:
        """Spec classes this module builds an instance of: a call of the class
        (``SlidingWindowMLASpec(...)``) or of a method on it (``X.merge(specs)``)."""
        if self.source is not None:
            # Most modules only test classes: the walk is for those that may call one.
            names = self.resolver.tokens().difference(KIND_TOKENS)
            if not any(n + b"(" in self.source or n + b"." in self.source for n in names):
                return frozenset()
        found: set[str] = set()
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name | ast.Attribute):
                found.update(self.resolver.classes_of(func))
            if isinstance(func, ast.Attribute):
                found.update(self.resolver.classes_of(func.value))
        return frozenset(found)

    def imported_modules(self) -> frozenset[str]:
        """Modules this one imports from or imports (candidates for defining class sets
        it uses)."""
        found: set[str] = set()
        for ref in self.resolver.import_refs():
            found.add(ref)
            found.add(ref.rpartition(".")[0])
        return frozenset(found)

    def type_lookups(self) -> dict[str, set[str]]:
        """Tables this module looks up by an exact type, and how (see
        :func:`~kvspec_traits.audit._tables.type_lookups`)."""
        if self.source is not None and not LOOKUP_HINT.search(self.source):
            return {}
        return type_lookups(self.tree, self.resolver)

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
        finder = SiteFinder(
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
