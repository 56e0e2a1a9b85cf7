"""Which rewritten checks answer otherwise than the class check they replace, and for which
specs: every edit of a migration plan evaluated, as written and as rewritten, on the
catalog's real spec of every class and on a two-layer ``UniformTypeKVCacheSpecs`` of each
(the group wrapper vLLM's allocator builds). ``vllm_patch.py`` lists the result in the
patch header, so a reviewer sees each behaviour change with the specs it concerns
(issue 35: "every site whose traits answer differs from the class check for any spec of
the catalog ... is listed in the header with the specs it differs on").

It imports ``vllm.v1.kv_cache_interface`` of the vLLM on the path (the spec classes), and
nothing of the tree being patched. A repository tool, not part of the package.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

from kvspec_traits import TokenScope, TPLayout, representative_traits, traits_of
from kvspec_traits.catalog import representative_specs
from kvspec_traits.migrate._plan import Edit

__all__ = ["Change", "answers_that_change", "probe_changes"]


@dataclass(frozen=True)
class Change:
    """One rewritten check whose answer differs on some specs."""

    edit: Edit
    singles: tuple[str, ...]
    """Spec classes on which the query answers otherwise than the check."""
    groups: tuple[str, ...]
    """Member classes of a two-layer group on whose wrapper it answers otherwise."""

    def lines(self) -> list[str]:
        e = self.edit
        out = [f"{e.path}:{e.line}: {e.before} -> {e.after}"]
        if self.singles:
            why = "a miss fixed" if e.fixes_miss else "another page kind, same question"
            out.append(f"  differs on {', '.join(self.singles)} ({why})")
        if self.groups:
            out.append(
                f"  differs on a UniformTypeKVCacheSpecs of {', '.join(self.groups)}: "
                "the class check asked the wrapper, the query asks its members"
            )
        return out


def _representative_type(spec: object) -> type[Any]:
    # vLLM's get_representative_spec_type (nixl/utils.py): a group's first member's class.
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return type(next(iter(spec.kv_cache_specs.values())))
    return type(spec)


class _Subject(ast.NodeTransformer):
    """Replaces every occurrence of the edit's subject expression with ``__s``."""

    def __init__(self, subject: str) -> None:
        self.subject = subject

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and ast.unparse(node) == self.subject:
            return ast.copy_location(ast.Name("__s", ast.Load()), node)
        visited: ast.AST = super().visit(node)
        return visited


def _compiled(text: str, subject: str) -> CodeType:
    tree = _Subject(subject).visit(ast.parse(text.strip(), mode="eval"))
    if not isinstance(tree, ast.Expression):
        raise TypeError(tree)
    return compile(ast.fix_missing_locations(tree), "<edit>", "eval")


def _subject(after: str) -> str | None:
    """The subject a rewritten query asks: the argument of its ``traits_of(...)``."""
    for node in ast.walk(ast.parse(after.strip(), mode="eval")):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "traits_of":
            return ast.unparse(node.args[0])
    return None


def _answer(code: CodeType, env: dict[str, Any], spec: object) -> object:
    try:
        return eval(code, {**env, "__s": spec})
    except Exception as exc:  # a refusal is an answer too: name it
        return f"raises {type(exc).__name__}"


def _universe() -> tuple[dict[str, Any], Sequence[object], Sequence[object]]:
    """The names a check or query reads, the catalog's spec of every class (no group
    wrapper), and a two-layer group wrapper of each."""
    from vllm.v1 import kv_cache_interface as kvi

    env: dict[str, Any] = {
        **vars(kvi),
        "traits_of": traits_of,
        "representative_traits": representative_traits,
        "TokenScope": TokenScope,
        "TPLayout": TPLayout,
        "get_representative_spec_type": _representative_type,
    }
    singles = [
        e.spec
        for e in representative_specs()
        if not isinstance(e.spec, kvi.UniformTypeKVCacheSpecs)
    ]
    groups = [
        kvi.UniformTypeKVCacheSpecs(block_size=s.block_size, kv_cache_specs={"l0": s, "l1": s})
        for s in singles
    ]
    return env, singles, groups


def probe_changes(
    probes: tuple[tuple[str, str], ...],
) -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """Each (class check, traits query) pair over one spec ``spec`` (a hand edit's probes,
    hand_edits.py) that answers otherwise on some catalog spec or group wrapper:
    (check, query, spec classes, member classes of the wrappers)."""
    env, singles, groups = _universe()
    out = []
    for before_text, after_text in probes:
        before, after = _compiled(before_text, "spec"), _compiled(after_text, "spec")
        differ = sorted(
            {type(s).__name__ for s in singles if _answer(before, env, s) != _answer(after, env, s)}
        )
        on_groups = sorted(
            {
                type(member).__name__
                for group, member in zip(groups, singles, strict=True)
                if _answer(before, env, group) != _answer(after, env, group)
            }
        )
        if differ or on_groups:
            out.append((before_text, after_text, tuple(differ), tuple(on_groups)))
    return out


def answers_that_change(edits: list[Edit]) -> tuple[list[Change], int]:
    """The edits whose query answers otherwise on some catalog spec or group wrapper, and
    how many edits could not be evaluated alone (a kind variable computed earlier in the
    function: no spec in the expression)."""
    env, singles, groups = _universe()
    changes: list[Change] = []
    unevaluated = 0
    for edit in edits:
        subject = _subject(edit.after)
        if subject is None:
            unevaluated += 1
            continue
        before = _compiled(edit.before, subject)
        after = _compiled(edit.after, subject)
        try:
            eval(before, {**env, "__s": singles[0]})
        except NameError:
            unevaluated += 1
            continue
        except Exception:  # any other answer is evaluated per spec below
            pass
        differ = sorted(
            {type(s).__name__ for s in singles if _answer(before, env, s) != _answer(after, env, s)}
        )
        on_groups = sorted(
            {
                type(member).__name__
                for group, member in zip(groups, singles, strict=True)
                if _answer(before, env, group) != _answer(after, env, group)
            }
        )
        if differ or on_groups:
            changes.append(Change(edit, tuple(differ), tuple(on_groups)))
    return changes, unevaluated
