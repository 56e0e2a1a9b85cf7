"""Issue 23's wrong-answer kinds, each read by its reasoning (tests/fixtures/audit/issue23,
hand verdicts in tests/fixtures/audit/hand_checked.json), and issue 25 item 4's spec-kind
forms. Every test here fails on the audit before issue 23."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvspec_traits.audit import AuditResult, Site, Universe, audit_paths, load_universe

FIXTURES = Path(__file__).parent / "fixtures" / "audit"


@pytest.fixture(scope="module")
def universe(tmp_path_factory: pytest.TempPathFactory) -> Universe:
    # vLLM's classes alone (the hand verdicts are of vLLM's classes)
    return load_universe(cache_dir=tmp_path_factory.mktemp("cache"), extensions=False)


@pytest.fixture(scope="module")
def result(universe: Universe) -> AuditResult:
    return audit_paths([FIXTURES / "issue23"], universe, display_root=FIXTURES)


def _at(result: AuditResult, path: str, line: int) -> Site:
    (site,) = [s for s in result.sites if s.path == path and s.raw.line == line]
    return site


def test_a_vendor_subclass_does_not_hide_a_missing_vllm_class(result: AuditResult) -> None:
    """Failure mode: `isinstance(spec, (MLAAttentionSpec, VendorMLASpec))`, in code that
    also defines two windowed-latent subclasses, read as "no single trait" (the vendor
    classes diluted the is_mla set below a majority), so the left-out
    SlidingWindowMLASpec went unreported. Judged on the vLLM class it tests
    (MLAAttentionSpec): is_mla's {MLA, HiddenState, SlidingWindowMLA}, near, miss."""
    site = _at(result, "issue23/vendor/user.py", 10)
    assert (site.verdict, site.confidence) == ("miss", "high")
    assert site.missing == ("SlidingWindowMLASpec",)
    assert "VendorMLASpec counts for itself, not for its base MLAAttentionSpec" in site.reason
    # VendorMLASpec is no SlidingWindowMLASpec: the miss is not latent
    assert "latent" not in site.reason


def test_a_vendor_subclass_of_the_left_out_class_makes_the_miss_latent(
    result: AuditResult,
) -> None:
    """Issue 49 item 7: `isinstance(spec, (MLAAttentionSpec, VendorWindowMLASpec))` once
    read VendorWindowMLASpec as standing for its base SlidingWindowMLASpec ("ok", exact
    is_mla); a plain SlidingWindowMLASpec fails the check. A miss, latent: the fixtures
    build no SlidingWindowMLASpec, so high (similarity 0.83) goes down one step."""
    site = _at(result, "issue23/vendor/user.py", 15)
    assert (site.verdict, site.confidence) == ("miss", "medium")
    assert site.missing == ("SlidingWindowMLASpec",)
    assert site.answer is not None
    assert (site.answer.trait, site.answer.match) == ("is_mla", "near")
    assert site.reason.endswith(
        "; latent: the scanned code builds no instance of SlidingWindowMLASpec "
        "(the code names its subclass VendorWindowMLASpec) today"
    )


_PLATFORM = {
    "specs.py": (
        "from dataclasses import dataclass\n"
        "from vllm.v1.kv_cache_interface import SlidingWindowMLASpec\n"
        "@dataclass(frozen=True, kw_only=True)\n"
        "class PlatformWindowMLASpec(SlidingWindowMLASpec):\n"
        "    pass\n"
    ),
    "user.py": (
        "from vllm.v1.kv_cache_interface import MLAAttentionSpec\n"
        "from .specs import PlatformWindowMLASpec\n"
        "def in_tuple(spec):\n"
        "    return isinstance(spec, (MLAAttentionSpec, PlatformWindowMLASpec))\n"
        "def after_exit(spec):\n"
        "    if isinstance(spec, PlatformWindowMLASpec):\n"
        "        return 1\n"
        "    return 1 if isinstance(spec, MLAAttentionSpec) else 8\n"
    ),
}
_BUILDS_THE_BASE = (
    "from vllm.v1.kv_cache_interface import SlidingWindowMLASpec\n"
    "def window_spec(**fields):\n"
    "    return SlidingWindowMLASpec(**fields)\n"
)


@pytest.mark.parametrize(
    ("builds", "confidence"), [(False, "medium"), (True, "high")], ids=["latent", "built"]
)
@pytest.mark.parametrize("line", [4, 8], ids=["in-the-tuple", "after-an-exit"])
def test_a_latent_miss_is_lower_only_while_nothing_builds_the_class(
    universe: Universe, tmp_path: Path, builds: bool, confidence: str, line: int
) -> None:
    """A platform's windowed latent beside `MLAAttentionSpec`, in the check's tuple or in
    an exit before it: a plain SlidingWindowMLASpec passes neither, so the check misses it
    either way (never "ok" or "handled by an explicit exit"): high (near is_mla,
    similarity 0.83 >= 0.5) where the scanned code builds a SlidingWindowMLASpec, one step
    lower, medium, where it builds none (latent)."""
    pkg = tmp_path / "platform"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in _PLATFORM.items():
        (pkg / name).write_text(text)
    if builds:
        (pkg / "builder.py").write_text(_BUILDS_THE_BASE)
    got = audit_paths([pkg], universe, display_root=tmp_path)
    (site,) = [s for s in got.sites if s.path == "platform/user.py" and s.raw.line == line]
    assert (site.verdict, site.confidence, site.missing) == (
        "miss",
        confidence,
        ("SlidingWindowMLASpec",),
    )
    assert ("latent" in site.reason) is not builds


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
