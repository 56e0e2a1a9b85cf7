"""Issue 23's wrong-answer kinds, each read by its reasoning (tests/fixtures/audit/issue23,
hand verdicts in tests/fixtures/audit/hand_checked.json), and issue 25 item 4's spec-kind
forms. Every test here fails on the audit before issue 23."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvspec_traits.audit import AuditResult, Site, audit_paths, load_universe

FIXTURES = Path(__file__).parent / "fixtures" / "audit"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> AuditResult:
    # vLLM's classes alone (the hand verdicts are of vLLM's classes)
    universe = load_universe(cache_dir=tmp_path_factory.mktemp("cache"), extensions=False)
    return audit_paths([FIXTURES / "issue23"], universe, display_root=FIXTURES)


def _at(result: AuditResult, path: str, line: int) -> Site:
    (site,) = [s for s in result.sites if s.path == path and s.raw.line == line]
    return site


def test_a_vendor_subclass_does_not_hide_a_missing_vllm_class(result: AuditResult) -> None:
    """Failure mode: `isinstance(spec, (MLAAttentionSpec, VendorMLASpec))`, in code that
    also defines two windowed-latent subclasses, read as "no single trait" (the vendor
    classes diluted the is_mla set below a majority), so the left-out
    SlidingWindowMLASpec went unreported. Judged on vLLM's classes plus VendorMLASpec's
    base (MLAAttentionSpec): is_mla's {MLA, HiddenState, SlidingWindowMLA}, near, miss."""
    site = _at(result, "issue23/vendor/user.py", 10)
    assert (site.verdict, site.missing) == ("miss", ("SlidingWindowMLASpec",))
    assert "bases of VendorMLASpec (MLAAttentionSpec)" in site.reason
    # the vendor's own windowed latent stands for SlidingWindowMLASpec: exact, no miss
    other = _at(result, "issue23/vendor/user.py", 15)
    assert (other.verdict, other.answer and other.answer.match) == ("ok", "exact")


def test_a_plain_vllm_check_is_not_diluted_by_vendor_classes(result: AuditResult) -> None:
    """Failure mode: with the vendor's windowed latents in the class tree, a plain
    `isinstance(spec, MLAAttentionSpec)` (3 of 6 is_mla classes) got no trait at all."""
    site = _at(result, "issue23/kinds.py", 59)
    assert (site.verdict, site.missing) == ("miss", ("SlidingWindowMLASpec",))


def test_spec_kind_comparisons_are_judged_by_the_enum(result: AuditResult) -> None:
    """Failure mode: `get_kv_cache_spec_kind(spec) == KVCacheSpecKind.SLIDING_WINDOW_MLA`
    was a miss of SlidingWindowSpec; the enum gives that class its own kind."""
    site = _at(result, "issue23/kinds.py", 50)
    assert (site.verdict, site.missing) == ("ok", ())
    assert "SlidingWindowSpec has the kind SLIDING_WINDOW (the enum's definition)" in site.reason


def test_module_level_kind_sets_and_kind_variables(result: AuditResult) -> None:
    """Failure mode (issue 25 item 4): `kind in _PAGED_KINDS` was no site at all, and a
    kind variable's suggestion read `traits_of(kind)`, which raises (a kind is no spec)."""
    paged = _at(result, "issue23/kinds.py", 25)
    assert paged.raw.form == "spec-kind" and paged.raw.subject == "spec"
    assert paged.raw.kinds == ("FULL_ATTENTION", "SLIDING_WINDOW", "CHUNKED_LOCAL_ATTENTION")
    held = _at(result, "issue23/kinds.py", 37)  # `k` comes from a list of kinds
    assert held.raw.subject == "<the spec whose kind is k>"
    assert all(
        "traits_of(k)" not in (s.answer.expression if s.answer else "") for s in result.sites
    )


def test_flags_computed_earlier_carry_the_flow(result: AuditResult) -> None:
    """Failure mode: `windowed = isinstance(spec, SlidingWindowMLASpec)`, `if windowed:
    return`, then `isinstance(spec, MLAAttentionSpec)` was a miss of SlidingWindowMLASpec:
    the exit tested a flag, not a class check on the same subject."""
    for line, flag_line in ((44, 42), (53, 51)):  # a class flag, a kind flag
        site = _at(result, "issue23/kinds.py", line)
        assert (site.verdict, site.excluded_by_flow) == ("ok", ("SlidingWindowMLASpec",))
        assert f"early exit (through a flag) at line {flag_line}" in site.reason


def test_test_assertions_and_spec_definitions_are_what_they_are(result: AuditResult) -> None:
    """Failure mode: `assert observed["type"] == "FullAttentionSpec"` in a test, and an
    exact type in the module that defines the class (merge logic), were exact-type
    warnings."""
    asserted = _at(result, "issue23/kinds.py", 65)
    assert asserted.verdict == "ok" and asserted.reason.startswith("a test's assertion")
    merge = _at(result, "issue23/specdefs.py", 14)
    assert merge.verdict == "ok" and "the module that defines it" in merge.reason
