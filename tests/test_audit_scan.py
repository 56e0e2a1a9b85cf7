"""The scanner on its own: name resolution, line pruning, module names (no class sets)."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from kvspec_traits.audit import scan_module
from kvspec_traits.audit._files import module_name
from kvspec_traits.audit._scan import relevant_lines
from kvspec_traits.audit._universe import installed_vllm_dir

KNOWN = frozenset(
    {
        "KVCacheSpec",
        "MambaSpec",
        "MLAAttentionSpec",
        "SlidingWindowMLASpec",
        "UniformTypeKVCacheSpecs",
    }
)
FIXTURES = Path(__file__).parent / "fixtures" / "audit"


def _sites(
    source: str,
    *,
    module: str = "",
    exports: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
) -> list[tuple[int, str, str, tuple[str, ...], bool]]:
    found = scan_module(
        ast.parse(source), module=module, known=KNOWN, exports=exports, source=source.encode()
    )
    return [(s.line, s.form, s.subject, s.classes, s.negated) for s in found]


def test_union_subscript_wrapping_calls_and_starred_tuples() -> None:
    src = (
        "import typing\n"
        "from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec as M\n"
        "BASE = (M,)\n"
        "ALL = frozenset({*BASE, MambaSpec})\n"
        "def f(s):\n"
        "    a = isinstance(s, typing.Union[M, MambaSpec])\n"
        "    b = type(s) in ALL\n"
        "    c = MambaSpec is type(s)\n"
        "    return a, b, c\n"
    )
    assert _sites(src) == [
        (6, "isinstance", "s", ("MLAAttentionSpec", "MambaSpec"), False),
        (7, "type-compare", "s", ("MLAAttentionSpec", "MambaSpec"), False),
        (8, "type-compare", "s", ("MambaSpec",), False),
    ]


def test_relative_imports_resolve_against_the_package() -> None:
    src = (
        "from ..sets import LATENT\n"
        "from . import sets as local\n"
        "def f(s):\n"
        "    return isinstance(s, LATENT) or isinstance(s, local.STATE)\n"
    )
    exports = {
        "pkg.sets": {"LATENT": ("MLAAttentionSpec",)},
        "pkg.sub.sets": {"STATE": ("MambaSpec",)},
    }
    found = _sites(src, module="pkg.sub.user", exports=exports)
    assert found == [(4, "isinstance", "s", ("MLAAttentionSpec", "MambaSpec"), False)]
    # Through a module alias alone, on a line naming no spec class or imported set.
    src = "from . import sets as local\ndef f(s):\n    return isinstance(s, local.STATE)\n"
    found = _sites(src, module="pkg.sub.user", exports=exports)
    assert found == [(3, "isinstance", "s", ("MambaSpec",), False)]


def test_double_negation_and_or_chains_on_different_subjects() -> None:
    src = (
        "from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec\n"
        "def f(a, b):\n"
        "    x = not not isinstance(a, MambaSpec)\n"
        "    y = isinstance(a, MambaSpec) or isinstance(b, MLAAttentionSpec)\n"
        "    return x, y\n"
    )
    assert _sites(src) == [
        (3, "isinstance", "a", ("MambaSpec",), False),
        (4, "isinstance", "a", ("MambaSpec",), False),
        (4, "isinstance", "b", ("MLAAttentionSpec",), False),
    ]


def test_match_patterns_with_capture_and_guards() -> None:
    src = (
        "from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowMLASpec\n"
        "def f(spec):\n"
        "    match spec:\n"
        "        case MambaSpec(block_size=16) as m if isinstance(m, SlidingWindowMLASpec):\n"
        "            return 1\n"
        "        case [SlidingWindowMLASpec()]:\n"
        "            return 2\n"
    )
    # The class pattern nested in a sequence pattern does not test `spec` itself.
    assert _sites(src) == [
        (4, "match-class", "spec", ("MambaSpec",), False),
        (4, "isinstance", "m", ("SlidingWindowMLASpec",), False),
    ]


def test_module_level_rebinding_shadows_a_spec_name() -> None:
    src = (
        "from vllm.v1.kv_cache_interface import MambaSpec\n"
        "MambaSpec = None\n"
        "def f(s):\n"
        "    return isinstance(s, MambaSpec)\n"
    )
    assert _sites(src) == []


def test_wrapper_check_unwraps_when_the_branch_reads_a_member_field() -> None:
    src = (
        "from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs as U\n"
        "def f(s):\n"
        "    inner = s.kv_cache_specs if isinstance(s, U) else {'x': s}\n"
        "    if isinstance(s, U):\n"
        "        return s.page_size_bytes\n"
        "    return inner\n"
    )
    found = scan_module(
        ast.parse(src),
        known=KNOWN,
        groups=frozenset({"UniformTypeKVCacheSpecs"}),
        group_attributes=frozenset({"kv_cache_specs", "first_spec"}),
    )
    assert [(s.line, s.unwraps) for s in found] == [(3, True), (4, False)]


def test_code_after_a_negated_early_exit_wrapper_check_is_guarded_by_it() -> None:
    src = (
        "from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs as U\n"
        "def members(s):\n"
        "    if not isinstance(s, U):\n"
        "        raise ValueError(s)\n"
        "    return s.kv_cache_specs\n"
        "def first(s):\n"
        "    for g in s:\n"
        "        if not isinstance(g, U):\n"
        "            continue\n"
        "        g = g.first_spec\n"
        "def positive(s):\n"
        "    if isinstance(s, U):\n"
        "        return s.page_size_bytes\n"
        "    return s.kv_cache_specs\n"
    )
    found = scan_module(
        ast.parse(src),
        known=KNOWN,
        groups=frozenset({"UniformTypeKVCacheSpecs"}),
        group_attributes=frozenset({"kv_cache_specs", "first_spec"}),
    )
    # After `if isinstance(s, U): return`, the rest runs for non-groups only: not counted.
    assert [(s.function, s.unwraps) for s in found] == [
        ("members", True),
        ("first", True),
        ("positive", False),
    ]


def test_relevant_lines_finds_every_token_occurrence() -> None:
    src = b"a = 1\nx = MambaSpec\n\ny = (M,\n  MambaSpec)\n"
    assert relevant_lines(src, [b"MambaSpec", b"M"]) == [2, 4, 5]
    assert relevant_lines(b"a = 1\rb = MambaSpec\r", [b"MambaSpec"]) is None


def _vllm_files() -> list[Path]:
    root = installed_vllm_dir()
    assert root is not None
    return sorted((root / "distributed" / "kv_transfer").rglob("*.py"))


@pytest.mark.parametrize("group", ["fixtures", "vllm kv_transfer"])
def test_line_pruning_finds_exactly_what_a_full_walk_finds(group: str) -> None:
    files = sorted(FIXTURES.rglob("*.py")) if group == "fixtures" else _vllm_files()
    known = KNOWN | {
        "FullAttentionSpec",
        "AttentionSpec",
        "SlidingWindowSpec",
        "CircularBufferSpec",
        "HiddenStateCacheSpec",
        "ChunkedLocalAttentionSpec",
    }
    total = 0
    for path in files:
        data = path.read_bytes()
        tree = ast.parse(data)
        module, is_package = module_name(path)
        pruned = scan_module(tree, module=module, is_package=is_package, known=known, source=data)
        full = scan_module(tree, module=module, is_package=is_package, known=known)
        # only the source has comments: the "subclass-comment" flag needs it
        pruned = [
            replace(s, context=tuple(c for c in s.context if c != "subclass-comment"))
            for s in pruned
        ]
        assert pruned == full, path
        total += len(full)
    assert total > (20 if group == "fixtures" else 80)


def test_module_names_follow_init_files(tmp_path: Path) -> None:
    pkg = tmp_path / "top" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "top" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("")
    (tmp_path / "loose.py").write_text("")
    cache: dict[Path, str] = {}
    assert module_name(pkg / "mod.py", cache) == ("top.sub.mod", False)
    assert module_name(pkg / "__init__.py", cache) == ("top.sub", True)
    assert module_name(tmp_path / "loose.py", cache) == ("loose", False)


def test_name_strings_are_sites_only_when_compared_with_a_class_name() -> None:
    src = (
        "def f(spec, group, registry):\n"
        "    a = type(spec).__name__ == 'MambaSpec'\n"
        "    b = group['spec_type'] not in ('MambaSpec', 'MLAAttentionSpec')\n"
        "    c = 'MambaSpec' in registry\n"
        "    d = group['spec_type'] in 'MambaSpec'\n"
        "    e = 'MambaSpec' in [k.__name__ for k in type(spec).__mro__]\n"
        "    f = group['spec_type'] == 'NotASpec'\n"
        "    return a, b, c, d, e, f\n"
    )
    assert _sites(src) == [
        (2, "type-name", "spec", ("MambaSpec",), False),
        (3, "type-name", "group['spec_type']", ("MambaSpec", "MLAAttentionSpec"), True),
        (6, "mro-walk", "spec", ("MambaSpec",), False),
    ]
