"""The library's own rule, checked with its own audit: outside the adapters, no module of
kvspec-traits branches on a vLLM spec class (isinstance, type(...) is, class-keyed dicts,
match patterns, through aliases and class tuples). This is the one test of that rule: the
connector, the NIXL shim and the audit are all under src/kvspec_traits."""

from __future__ import annotations

from pathlib import Path

from kvspec_traits.audit import audit_paths, load_universe

SRC = Path(__file__).resolve().parents[1] / "src" / "kvspec_traits"
# The one place allowed to name spec classes: the built-in adapters' package.
ADAPTERS = "*/kvspec_traits/_vllm_adapters/*"


def test_only_the_adapters_branch_on_spec_classes() -> None:
    universe = load_universe()
    result = audit_paths([SRC], universe, exclude=[ADAPTERS], display_root=SRC)
    assert result.errors == ()
    assert result.files_seen > 20  # the whole package was walked, not an empty folder
    assert [f"{s.path}:{s.raw.line}" for s in result.sites] == []


def test_the_exception_is_exactly_the_adapters_package() -> None:
    # The pattern must exclude every module of the adapters package and nothing else: the
    # adapters themselves do branch on classes they name (the control for the pattern).
    universe = load_universe()
    adapters = SRC / "_vllm_adapters"
    inside = audit_paths([adapters], universe, display_root=SRC)
    assert inside.files_seen == len(list(adapters.glob("*.py")))
    excluded = audit_paths([SRC], universe, exclude=[ADAPTERS], display_root=SRC)
    everything = audit_paths([SRC], universe, display_root=SRC)
    assert everything.files_seen - excluded.files_seen == inside.files_seen


def test_the_same_audit_finds_the_branches_in_vllms_nixl_worker() -> None:
    # The control: the call above, on the code this library replaces, finds branches; if it
    # found none there either, the test above would prove nothing.
    import vllm

    nixl = Path(vllm.__file__).parent / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    result = audit_paths([nixl / "nixl" / "base_worker.py"], load_universe())
    lines = {s.raw.line for s in result.sites}
    assert len(lines) >= 5
