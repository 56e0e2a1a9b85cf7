"""The audit on the fixture files: every form, aliasing, and the seed's before/after lines.

Each fixture site is pinned with the trait it is read as and the classes it misses; a
change to the scanner or to the matching rule shows up here as a changed row.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvspec_traits.audit import AuditResult, Universe, audit_paths, load_universe

FIXTURES = Path(__file__).parent / "fixtures" / "audit"

# (file, line, function, form, classes tested, negated, (trait, value, match) or None,
#  missing, skipped subclasses, group wrapper not unwrapped)
Row = tuple[
    str,
    int,
    str,
    str,
    tuple[str, ...],
    bool,
    tuple[str, str, str] | None,
    tuple[str, ...],
    tuple[str, ...],
    bool,
]

MLA, SWMLA, HIDDEN = "MLAAttentionSpec", "SlidingWindowMLASpec", "HiddenStateCacheSpec"
RECURRENT = ("token_scope", "TokenScope.RECURRENT_STATE", "exact")
IS_MLA = ("is_mla", "True", "exact")
NEAR_MLA = ("is_mla", "True", "near")

EXPECTED: list[Row] = [
    ("aliases.py", 16, "aliased", "isinstance", (MLA,), False, NEAR_MLA, (SWMLA,), (), False),
    (
        "aliases.py",
        20,
        "module_attribute",
        "isinstance",
        ("MambaSpec",),
        False,
        RECURRENT,
        (),
        (),
        False,
    ),
    (
        "aliases.py",
        24,
        "module_alias_attribute",
        "isinstance",
        ("SlidingWindowSpec",),
        False,
        ("token_scope", "TokenScope.SLIDING_WINDOW", "exact"),
        (),
        (),
        False,
    ),
    ("aliases.py", 28, "module_tuple", "isinstance", (MLA, SWMLA), False, IS_MLA, (), (), False),
    (
        "aliases.py",
        32,
        "concatenated_tuple",
        "isinstance",
        ("MambaSpec", "CircularBufferSpec"),
        False,
        ("token_paged", "False", "exact"),
        (),
        (),
        False,
    ),
    (
        "aliases.py",
        47,
        "Worker.local_import",
        "isinstance",
        ("ChunkedLocalAttentionSpec",),
        False,
        ("token_scope", "TokenScope.CHUNKED", "exact"),
        (),
        (),
        False,
    ),
    (
        "forms.py",
        18,
        "tuple_check",
        "isinstance",
        ("SlidingWindowSpec", "MambaSpec"),
        False,
        # no single scope names both; the two scopes together name exactly their classes
        ("token_scope", "TokenScope.SLIDING_WINDOW, TokenScope.RECURRENT_STATE", "exact"),
        (),
        (),
        False,
    ),
    ("forms.py", 22, "union_check", "isinstance", (MLA, SWMLA), False, IS_MLA, (), (), False),
    ("forms.py", 26, "negated_check", "isinstance", ("MambaSpec",), True, RECURRENT, (), (), False),
    (
        "forms.py",
        30,
        "subclass_check",
        "issubclass",
        ("MambaSpec",),
        False,
        RECURRENT,
        (),
        (),
        False,
    ),
    ("forms.py", 35, "or_chain", "isinstance", (MLA, SWMLA), False, IS_MLA, (), (), False),
    ("forms.py", 39, "and_not_chain", "isinstance", (MLA, SWMLA), True, IS_MLA, (), (), False),
    (
        "forms.py",
        43,
        "type_is",
        "type-compare",
        ("FullAttentionSpec",),
        False,
        ("keeps_prompt", "True", "exact"),
        (HIDDEN, MLA, "RSWASpec", "SinkFullAttentionSpec"),
        (HIDDEN, MLA, "RSWASpec", "SinkFullAttentionSpec"),
        False,
    ),
    ("forms.py", 47, "type_is_not", "type-compare", ("MambaSpec",), True, RECURRENT, (), (), False),
    (
        "forms.py",
        51,
        "type_in",
        "type-compare",
        (MLA, SWMLA),
        False,
        IS_MLA,
        (HIDDEN,),
        (HIDDEN,),
        False,
    ),
    (
        "forms.py",
        55,
        "type_not_in",
        "type-compare",
        ("MambaSpec", "CircularBufferSpec"),
        True,
        ("token_paged", "False", "exact"),
        (),
        (),
        False,
    ),
    ("forms.py", 59, "type_eq", "type-compare", ("MambaSpec",), False, RECURRENT, (), (), False),
    (
        "forms.py",
        63,
        "representative_is",
        "representative-type",
        ("CircularBufferSpec",),
        False,
        ("token_scope", "TokenScope.RING", "exact"),
        (),
        (),
        False,
    ),
    (
        "forms.py",
        67,
        "representative_not_in",
        "representative-type",
        ("MambaSpec", "CircularBufferSpec"),
        True,
        ("token_paged", "False", "exact"),
        (),
        (),
        False,
    ),
    (
        "forms.py",
        70,
        "<module>",
        "class-dict",
        ("FullAttentionSpec", MLA, "MambaSpec"),
        False,
        None,
        (),
        (HIDDEN, "RSWASpec", "SinkFullAttentionSpec"),
        False,
    ),
    ("forms.py", 79, "match_class", "match-class", ("MambaSpec",), False, RECURRENT, (), (), False),
    ("forms.py", 81, "match_class", "match-class", (MLA, SWMLA), False, IS_MLA, (), (), False),
    # `A and not B` asks B's question negated (not is_mla); nothing of it gets through
    # here, since SlidingWindowMLASpec is no FullAttentionSpec (tests/test_audit_flow.py
    # has the AttentionSpec case that lets it through)
    (
        "forms.py",
        93,
        "full_but_not_mla",
        "isinstance",
        ("FullAttentionSpec",),
        False,
        NEAR_MLA,
        (),
        (),
        False,
    ),
    (
        "forms.py",
        97,
        "skip_unless_full_gqa",
        "isinstance",
        ("FullAttentionSpec",),
        True,
        NEAR_MLA,
        (),
        (),
        False,
    ),
    ("pkg/user.py", 7, "is_latent", "isinstance", (MLA,), False, NEAR_MLA, (SWMLA,), (), False),
    (
        "seed_after.py",
        7,
        "register_kv_caches",
        "isinstance",
        (MLA, SWMLA),
        False,
        IS_MLA,
        (),
        (),
        False,
    ),
    (
        "seed_before.py",
        7,
        "register_kv_caches",
        "isinstance",
        (MLA,),
        False,
        NEAR_MLA,
        (SWMLA,),
        (),
        False,
    ),
    (
        "wrapper.py",
        7,
        "layer_specs",
        "isinstance",
        ("UniformTypeKVCacheSpecs",),
        False,
        ("grouped", "True", "exact"),
        (),
        (),
        False,
    ),
    (
        "wrapper.py",
        13,
        "group_bytes",
        "isinstance",
        ("UniformTypeKVCacheSpecs",),
        False,
        ("grouped", "True", "exact"),
        (),
        (),
        True,
    ),
]


@pytest.fixture(scope="module")
def universe(tmp_path_factory: pytest.TempPathFactory) -> Universe:
    # vLLM's classes alone: the pinned sets do not depend on the installed extensions
    # (tests/test_audit_extensions.py covers those).
    return load_universe(cache_dir=tmp_path_factory.mktemp("audit-cache"), extensions=False)


@pytest.fixture(scope="module")
def result(universe: Universe) -> AuditResult:
    # flow.py, more_forms.py and oot/ are pinned in tests/test_audit_flow.py (oot/ adds
    # spec classes to the tree, which would change the exact checks' rows here)
    return audit_paths(
        [FIXTURES],
        universe,
        display_root=FIXTURES,
        exclude=["flow.py", "more_forms.py", "oot", "issue23"],
    )


def _row(site: object) -> Row:
    from kvspec_traits.audit import Site

    assert isinstance(site, Site)
    a = site.answer
    return (
        site.path,
        site.raw.line,
        site.raw.function,
        site.raw.form,
        site.raw.classes,
        site.raw.negated,
        None if a is None else (a.trait, a.value, a.match),
        site.missing,
        site.skipped_subclasses,
        site.wrapper_not_unwrapped,
    )


def test_every_fixture_site_is_found_with_its_verdict(result: AuditResult) -> None:
    assert [_row(s) for s in result.sites] == EXPECTED


def test_files_without_checks_are_read_but_give_no_site(result: AuditResult) -> None:
    # 9 .py files; pkg/__init__.py names no spec class so it is never parsed, and
    # no_sites.py is parsed but only annotates with spec classes.
    assert (result.files_seen, result.files_parsed, result.errors) == (9, 8, ())
    assert not [s for s in result.sites if s.path == "no_sites.py"]


def test_seed_before_line_misses_sliding_window_mla(result: AuditResult) -> None:
    (site,) = [s for s in result.sites if s.path == "seed_before.py"]
    assert site.raw.text == "isinstance(layer_spec, MLAAttentionSpec)"
    assert site.missing == ("SlidingWindowMLASpec",)
    assert site.answer is not None
    assert site.answer.expression == "traits_of(layer_spec).is_mla"
    assert site.has_miss


def test_seed_after_line_misses_nothing(result: AuditResult) -> None:
    (site,) = [s for s in result.sites if s.path == "seed_after.py"]
    assert site.raw.text == "isinstance(layer_spec, (MLAAttentionSpec, SlidingWindowMLASpec))"
    assert site.missing == ()
    assert site.answer is not None
    assert (site.answer.match, site.answer.value_classes) == (
        "exact",
        ("HiddenStateCacheSpec", "MLAAttentionSpec", "SlidingWindowMLASpec"),
    )
    assert not site.has_miss


def test_negated_sites_suggest_negated_expressions(result: AuditResult) -> None:
    by_function = {s.raw.function: s for s in result.sites}
    expressions = {
        name: by_function[name].answer.expression  # type: ignore[union-attr]
        for name in ("negated_check", "and_not_chain", "type_is_not", "subclass_check")
    }
    assert expressions == {
        "negated_check": "traits_of(spec).token_scope is not TokenScope.RECURRENT_STATE",
        "and_not_chain": "not traits_of(spec).is_mla",
        "type_is_not": "traits_of(spec).token_scope is not TokenScope.RECURRENT_STATE",
        "subclass_check": "traits_of(<a spec_type instance>).token_scope is "
        "TokenScope.RECURRENT_STATE",
    }


def test_closest_answers_name_the_classes_with_another_value(result: AuditResult) -> None:
    by_function = {s.raw.function: s for s in result.sites}
    answer = by_function["type_is"].answer
    assert answer is not None
    # FullAttentionSpec's classes were a closest match of token_scope FULL (RSWASpec is
    # PROMPT_AND_WINDOW); since issue 20 they are exactly keeps_prompt's
    assert (answer.trait, answer.match, answer.other_value_classes) == ("keeps_prompt", "exact", ())


def test_and_or_chains_take_negated_classes_out(result: AuditResult) -> None:
    # `A and not B` accepts A's subclasses without B's; `not A or B` is its negation.
    chains = [s for s in result.sites if s.raw.excluded]
    assert [(s.raw.function, s.raw.negated, s.raw.excluded, s.branch_classes) for s in chains] == [
        (
            "full_but_not_mla",
            False,
            ("MLAAttentionSpec",),
            ("FullAttentionSpec", "RSWASpec", "SinkFullAttentionSpec"),
        ),
        (
            "skip_unless_full_gqa",
            True,
            ("MLAAttentionSpec",),
            ("FullAttentionSpec", "RSWASpec", "SinkFullAttentionSpec"),
        ),
    ]
