"""``migrate`` keeps the narrowing a rewritten class check gave a type checker (issue 35,
item 4: no new mypy finding in the patched files). ``isinstance(spec, SlidingWindowSpec)``
tells mypy what ``spec`` is where the check held; the traits query that replaces it does
not, so ``spec.sliding_window`` after it became an ``attr-defined`` finding (59 on vLLM
0.34's patched kv_transfer). The rewrite adds ``typing.cast`` to the class the check named,
only where a read needs it.

Each case is a function over a small spec hierarchy shaped like vLLM's (a base with
``block_size``, subclasses with their own fields, a group wrapper) and a ``traits_of``
stand-in: mypy (as vLLM configures it: ``check_untyped_defs``) passes the original, fails
the rewritten text without the casts (so the check can fail) and passes it with them, and
the casts change no answer (each function runs on every spec before and after)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvspec_traits.migrate import Edit
from kvspec_traits.migrate._narrow import narrow_casts

PRELUDE = """\
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import cast


class TokenScope(enum.Enum):
    FULL = 1
    SLIDING_WINDOW = 2
    RECURRENT_STATE = 3


@dataclass(frozen=True)
class Traits:
    token_scope: TokenScope
    attention_page: bool
    grouped: bool


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int
    extra: int = 0


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    mode: str


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    spec: KVCacheSpec


def traits_of(spec: KVCacheSpec) -> Traits:
    return Traits(
        token_scope=TokenScope.SLIDING_WINDOW
        if isinstance(spec, SlidingWindowSpec)
        else TokenScope.RECURRENT_STATE
        if isinstance(spec, MambaSpec)
        else TokenScope.FULL,
        attention_page=isinstance(spec, AttentionSpec),
        grouped=isinstance(spec, UniformTypeKVCacheSpecs),
    )


"""
# The spec base's attributes: read after a check without a cast.
BASE = frozenset({"block_size", "page_size_bytes"})

SW = "traits_of({s}).token_scope is TokenScope.SLIDING_WINDOW"
MAMBA = "traits_of({s}).token_scope is TokenScope.RECURRENT_STATE"
ATTN = "traits_of({s}).attention_page"
GROUP = "traits_of({s}).grouped"

# name: (original function, [(check, query, subject)])
CASES: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "an if body reading two fields: one cast of the name": (
        """
        def f(spec: KVCacheSpec) -> int:
            if isinstance(spec, SlidingWindowSpec):
                return spec.sliding_window + spec.extra + spec.block_size
            return 0
        """,
        [("isinstance(spec, SlidingWindowSpec)", SW, "spec")],
    ),
    "an and chain": (
        """
        def f(spec: KVCacheSpec) -> bool:
            return isinstance(spec, MambaSpec) and spec.mode == "align"
        """,
        [("isinstance(spec, MambaSpec)", MAMBA, "spec")],
    ),
    "a negated check in an or chain, then the rest of the block": (
        """
        def f(spec: KVCacheSpec) -> int:
            if not isinstance(spec, AttentionSpec) or spec.num_kv_heads > 4:
                return -1
            heads = spec.num_kv_heads
            return heads * spec.num_kv_heads
        """,
        [("not isinstance(spec, AttentionSpec)", "not " + ATTN, "spec")],
    ),
    "a group unwrap, rebinding the name": (
        """
        def f(spec: KVCacheSpec) -> int:
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = next(iter(spec.kv_cache_specs.values()))
            return spec.block_size
        """,
        [("isinstance(spec, UniformTypeKVCacheSpecs)", GROUP, "spec")],
    ),
    "a comprehension's element and a conditional expression": (
        """
        def f(groups: list[Group]) -> list[int]:
            modes = [g.spec for g in groups if isinstance(g.spec, MambaSpec)]
            windows = [
                g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else 0
                for g in groups
            ]
            return [len(m.mode) for m in modes] + windows
        """,
        [
            ("isinstance(g.spec, MambaSpec)", MAMBA, "g.spec"),
            ("isinstance(g.spec, SlidingWindowSpec)", SW, "g.spec"),
        ],
    ),
    "a spec passed on, as replace() and a typed function take it": (
        """
        def widen(spec: SlidingWindowSpec) -> int:
            return spec.sliding_window

        def f(spec: KVCacheSpec) -> int:
            if isinstance(spec, SlidingWindowSpec) and spec.extra:
                return widen(replace(spec, sliding_window=spec.sliding_window + 1))
            return len(str(spec))
        """,
        [("isinstance(spec, SlidingWindowSpec)", SW, "spec")],
    ),
}

SPECS: list[Any] = []


def _specs(ns: dict[str, Any]) -> list[Any]:
    sw = ns["SlidingWindowSpec"](block_size=16, num_kv_heads=2, sliding_window=128, extra=3)
    full = ns["AttentionSpec"](block_size=16, num_kv_heads=8)
    mamba = ns["MambaSpec"](block_size=16, mode="align")
    group = ns["UniformTypeKVCacheSpecs"](block_size=16, kv_cache_specs={"a": sw})
    return [sw, full, mamba, group]


def _rewrite(original: str, checks: list[tuple[str, str, str]]) -> tuple[str, list[Edit]]:
    text, edits = original, []
    for check, query, subject in checks:
        after = query.format(s=subject)
        text = text.replace(check, after)
        edits.append(
            Edit(
                path="case.py",
                line=1,
                before=check,
                after=after,
                trait="",
                value="",
                match="exact",
                verdict="ok",
                fixes_miss=False,
                missing=(),
                spans=(),
                chain=False,
            )
        )
    return text, edits


def _mypy(tmp: Path, name: str, code: str) -> list[str]:
    """mypy as vLLM's pyproject configures it (check_untyped_defs), its errors."""
    path = tmp / f"{name}.py"
    path.write_text(code)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "",
            "--check-untyped-defs",
            "--ignore-missing-imports",
            "--no-error-summary",
            "--cache-dir",
            str(tmp / ".mypy"),
            str(path),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp,
    )
    return [line for line in run.stdout.splitlines() if ": error:" in line]


def _answers(code: str) -> list[object]:
    ns: dict[str, Any] = {}
    exec(compile(code, "<case>", "exec"), ns)
    specs = _specs(ns)
    out: list[object] = []
    for spec in specs:
        arg = [ns["Group"](spec=s) for s in specs] if "groups" in code else spec
        out.append(ns["f"](arg))
    return out


def test_the_casts_keep_mypy_quiet_and_every_answer(tmp_path: Path) -> None:
    originals, rewritten, narrowed = [], [], []
    for original, checks in CASES.values():
        body = textwrap.dedent(original)
        text, edits = _rewrite(body, checks)
        cast_text, count = narrow_casts(PRELUDE + text, edits, BASE)
        assert count >= 1, text
        originals.append(body)
        rewritten.append(text)
        narrowed.append(cast_text.removeprefix(PRELUDE))
        # every answer unchanged: the original, the rewrite and the narrowed rewrite
        assert _answers(PRELUDE + body) == _answers(PRELUDE + text) == _answers(cast_text)
    # one module per side, each case's `f` renamed apart
    sides = {}
    for side, texts in (("release", originals), ("rewritten", rewritten), ("narrowed", narrowed)):
        renamed = [
            t.replace("def f(", f"def f{i}(")
            .replace("def widen(", f"def widen{i}(")
            .replace("return widen(", f"return widen{i}(")
            for i, t in enumerate(texts)
        ]
        sides[side] = _mypy(tmp_path, side, PRELUDE + "\n\n".join(renamed))
    assert sides["release"] == [], sides["release"]
    # the gate can fail: the rewrite without the casts loses the narrowing
    assert len(sides["rewritten"]) >= len(CASES), sides["rewritten"]
    assert any("has no attribute" in e for e in sides["rewritten"])
    assert sides["narrowed"] == [], sides["narrowed"]


def test_one_cast_per_need_and_none_for_what_every_spec_has() -> None:
    original, checks = CASES["an if body reading two fields: one cast of the name"]
    text, edits = _rewrite(textwrap.dedent(original), checks)
    out, count = narrow_casts(text, edits, BASE)
    assert count == 1
    assert "spec = cast(SlidingWindowSpec, spec)\n" in out
    assert "from typing import cast" in out
    # a single read is cast where it is; block_size (the base's) is not
    original, checks = CASES["an and chain"]
    text, edits = _rewrite(textwrap.dedent(original), checks)
    out, _ = narrow_casts(text, edits, BASE)
    assert 'and cast(MambaSpec, spec).mode == "align"' in out
    original, checks = CASES["a group unwrap, rebinding the name"]
    text, edits = _rewrite(textwrap.dedent(original), checks)
    out, count = narrow_casts(text, edits, BASE)
    assert count == 1
    assert "cast(UniformTypeKVCacheSpecs, spec).kv_cache_specs" in out
    # after the rebinding the name holds a member: its block_size is not cast
    assert "return spec.block_size" in out


def test_a_check_asked_as_two_traits_narrows_to_its_first_class() -> None:
    """``isinstance(s, A) and not isinstance(s, B) and s.x`` (vLLM 0.32/0.33's offloading
    gate) is rewritten as two traits (``parts``); the operands after it read ``A``'s
    fields, so they are cast to ``A``."""
    code = textwrap.dedent(
        """
        def f(spec: KVCacheSpec) -> bool:
            return (
                traits_of(spec).attention_page
                and not traits_of(spec).grouped
                and spec.num_kv_heads > 1
            )
        """
    )
    before = "isinstance(spec, AttentionSpec) and not isinstance(spec, UniformTypeKVCacheSpecs)"
    (edit,) = _rewrite("", [(before, ATTN, "spec")])[1]
    import dataclasses

    edit = dataclasses.replace(
        edit,
        after=ATTN.format(s="spec") + " and not " + GROUP.format(s="spec"),
        parts=(ATTN.format(s="spec"), "not " + GROUP.format(s="spec")),
    )
    out, count = narrow_casts(code, [edit], BASE)
    assert count == 1
    assert "and cast(AttentionSpec, spec).num_kv_heads > 1" in out


@pytest.mark.parametrize(
    ("fixes_miss", "differs_on"), [(True, ()), (False, ("CircularBufferSpec",))]
)
def test_no_cast_where_the_query_takes_more_than_the_class(
    fixes_miss: bool, differs_on: tuple[str, ...]
) -> None:
    """A query that also says True for a class the check left out (a miss fixed, another
    page kind) would make the cast claim a class the spec may not have: none is written."""
    original, checks = CASES["an and chain"]
    text, edits = _rewrite(textwrap.dedent(original), checks)
    import dataclasses

    edits = [dataclasses.replace(e, fixes_miss=fixes_miss, differs_on=differs_on) for e in edits]
    assert narrow_casts(text, edits, BASE) == (text, 0)
