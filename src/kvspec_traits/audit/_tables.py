"""Class-keyed tables: a dict literal keyed by spec classes is an exact type check only
through the code that looks it up, so the audit reads how the scanned code does that.

``TABLE[type(spec)]`` raises ``KeyError`` for a class that is no key (subclasses of a key
included): a loud refusal, like a check that guards a ``raise``. ``TABLE.get(type(spec))``,
``type(spec) in TABLE`` and a subscript inside ``try: ... except KeyError`` fall back
silently for such a class: that is what an exact-type warning is for. A table the scanned
code never looks up by type is read elsewhere (a registration into another package's
table, a patched copy of one): the lookup that decides is not in the scan.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from typing import Final

from kvspec_traits.audit._names import NameResolver, last_name

__all__ = [
    "LOOKUP_HINT",
    "RAISES",
    "SILENT",
    "lookup_of",
    "table_name",
    "table_reason",
    "type_lookups",
]

RAISES: Final = "raises"
SILENT: Final = "silent"
_CATCHES_KEY_ERROR: Final = frozenset({"KeyError", "LookupError", "Exception", "BaseException"})
_MERGES: Final = frozenset({"update", "setdefault"})
LOOKUP_HINT: Final = re.compile(
    rb"\[\s*type\(|get\(\s*type\(|type\([^()]*\)\s+(not\s+)?in\b|__class__\s*[\]),]"
)
"""Text without which a module looks no table up by type (it is not walked for lookups)."""


def table_name(node: ast.Dict, region: ast.AST) -> str:
    """The name the dict literal ``node`` is bound to in its statement ``region``: an
    assignment target, a keyword argument (``Config(blocks_per_group={...})``), or the
    table an ``.update({...})`` merges it into; ``""`` when it is bound to no name."""
    if isinstance(region, ast.Assign | ast.AnnAssign | ast.AugAssign) and region.value is node:
        targets = region.targets if isinstance(region, ast.Assign) else [region.target]
        return next((n for n in map(last_name, targets) if n), "")
    for sub in ast.walk(region):
        if isinstance(sub, ast.keyword) and sub.value is node and sub.arg:
            return sub.arg
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr in _MERGES
            and any(a is node for a in sub.args)
        ):
            return last_name(sub.func.value)
    return ""


def _is_type_of(node: ast.expr, r: NameResolver) -> bool:
    if isinstance(node, ast.Call) and r.is_builtin(node.func, "type") and len(node.args) == 1:
        return True
    return isinstance(node, ast.Attribute) and node.attr == "__class__"


def _catches_key_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(last_name(t) in _CATCHES_KEY_ERROR for t in types)


def _walk(node: ast.AST, guarded: bool) -> Iterator[tuple[ast.AST, bool]]:
    # Every node with whether a `try` around it catches KeyError (iterative: deep trees).
    stack = [(node, guarded)]
    while stack:
        current, inside = stack.pop()
        yield current, inside
        if isinstance(current, ast.Try | ast.TryStar):
            catches = inside or any(_catches_key_error(h) for h in current.handlers)
            stack.extend((s, catches) for s in current.body)
            rest = [*current.handlers, *current.orelse, *current.finalbody]
            stack.extend((s, inside) for s in rest)
        else:
            stack.extend((child, inside) for child in ast.iter_child_nodes(current))


def type_lookups(tree: ast.Module, r: NameResolver) -> dict[str, set[str]]:
    """Names of tables the module looks up by an exact type, each with how: ``RAISES``
    (``T[type(x)]``) or ``SILENT`` (``T.get(type(x))``, ``type(x) in T``, a subscript
    under ``except KeyError``). The name is the table's last component (``cfg.T[...]``
    is ``T``)."""
    found: dict[str, set[str]] = {}
    for node, guarded in _walk(tree, False):
        name, how = "", RAISES
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and _is_type_of(node.slice, r)
        ):
            name, how = last_name(node.value), SILENT if guarded else RAISES
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and _is_type_of(node.args[0], r)
        ):
            name, how = last_name(node.func.value), SILENT
        elif (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and _is_type_of(node.left, r)
        ):
            name, how = last_name(node.comparators[0]), SILENT
        if name:
            found.setdefault(name, set()).add(how)
    return found


def table_reason(table: str, lookup: str, skipped: tuple[str, ...]) -> str:
    """Why a class-keyed table whose lookup is not silent is a note, not a warning."""
    names = ", ".join(skipped)
    if lookup == RAISES:
        return (
            f"a table looked up as {table}[type(x)]: a class that is no key, subclasses "
            f"included ({names}), raises KeyError, loudly, not mishandled"
        )
    return (
        f"a table the scanned code never looks up by type ({table or 'bound to no name'}): "
        f"the code that reads it, outside the scan, decides what a class that is no key "
        f"({names}) gets"
    )


def lookup_of(table: str, lookups: dict[str, set[str]]) -> str:
    """How the scan looks ``table`` up by type: ``SILENT`` if any lookup is silent, else
    ``RAISES`` if any raises, else ``""`` (never looked up by type in the scan)."""
    how = lookups.get(table, set()) if table else set()
    return SILENT if SILENT in how else RAISES if RAISES in how else ""
