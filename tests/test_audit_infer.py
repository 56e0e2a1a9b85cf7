"""The matching rule on a small hand-built class universe (no vLLM needed).

The universe mirrors the shapes that matter in vLLM: an MLA-like family split across two
branches of the hierarchy, a ring and a HiSparse-like page of other page kinds with the
same ``is_mla`` value, a state class whose ``tp_layout`` varies, and a group wrapper.
"""

from __future__ import annotations

from dataclasses import replace

from kvspec_traits.audit import ClassInfo, RawSite, Universe, infer
from kvspec_traits.audit._questions import QUESTIONS

T, F = "True", "False"
# class: (mro, {question: value or set of values}); kind = (transferable, uses_slot_mapping)
_TABLE: dict[str, tuple[tuple[str, ...], dict[str, str | set[str]]]] = {
    "Attn": (
        ("Attn", "Base"),
        dict(
            is_mla=F, token_scope="TokenScope.FULL", tp_layout="TPLayout.HEAD_SHARDED", windowed=F
        ),
    ),
    "Full": (
        ("Full", "Attn", "Base"),
        dict(
            is_mla=F, token_scope="TokenScope.FULL", tp_layout="TPLayout.HEAD_SHARDED", windowed=F
        ),
    ),
    "Latent": (
        ("Latent", "Full", "Attn", "Base"),
        dict(is_mla=T, token_scope="TokenScope.FULL", tp_layout="TPLayout.REPLICATED", windowed=F),
    ),
    "LatentChild": (
        ("LatentChild", "Latent", "Full", "Attn", "Base"),
        dict(is_mla=T, token_scope="TokenScope.FULL", tp_layout="TPLayout.REPLICATED", windowed=F),
    ),
    "Win": (
        ("Win", "Attn", "Base"),
        dict(
            is_mla=F,
            token_scope="TokenScope.SLIDING_WINDOW",
            tp_layout="TPLayout.HEAD_SHARDED",
            windowed=T,
        ),
    ),
    "WinLatent": (
        ("WinLatent", "Win", "Attn", "Base"),
        dict(
            is_mla=T,
            token_scope="TokenScope.SLIDING_WINDOW",
            tp_layout="TPLayout.REPLICATED",
            windowed=T,
        ),
    ),
    "Sink": (
        ("Sink", "Full", "Attn", "Base"),
        dict(
            is_mla=F, token_scope="TokenScope.FULL", tp_layout="TPLayout.HEAD_SHARDED", windowed=F
        ),
    ),
    "Chunk": (
        ("Chunk", "Attn", "Base"),
        dict(
            is_mla=F,
            token_scope="TokenScope.CHUNKED",
            tp_layout="TPLayout.HEAD_SHARDED",
            windowed=T,
        ),
    ),
    "Ring": (
        ("Ring", "Attn", "Base"),
        dict(
            is_mla=T,
            token_scope="TokenScope.RING",
            tp_layout="TPLayout.REPLICATED",
            windowed=T,
            uses_slot_mapping=F,
            prefix_cacheable=F,
        ),
    ),
    "Hot": (
        ("Hot", "Base"),
        dict(
            is_mla=T,
            token_scope="TokenScope.SPARSE_HOT",
            tp_layout="TPLayout.REPLICATED",
            windowed=F,
            transferable=F,
            uses_slot_mapping=F,
            prefix_cacheable=F,
        ),
    ),
    "State": (
        ("State", "Base"),
        dict(
            is_mla=F,
            token_scope="TokenScope.RECURRENT_STATE",
            tp_layout={"TPLayout.REPLICATED", "TPLayout.STATE_SHARDED"},
            windowed=F,
        ),
    ),
}
_DEFAULTS = dict(
    transferable=T,
    uses_slot_mapping=T,
    prefix_cacheable=T,
    attention_page=T,
    token_paged=T,
    keeps_prompt=F,
    holds_hidden_states=F,
    grouped=F,
)
# (issue 20's kind traits, by the same rules as vLLM's classes: Hot and State have no
# attention page, Ring and State are not token-paged, Full and its subclasses keep the prompt)
for _name, _values in (
    ("Hot", dict(attention_page=F)),
    ("State", dict(attention_page=F, token_paged=F)),
    ("Ring", dict(token_paged=F)),
    *((n, dict(keeps_prompt=T)) for n in ("Full", "Latent", "LatentChild", "Sink")),
):
    _TABLE[_name][1].update(_values)


def _universe() -> Universe:
    classes = {
        name: ClassInfo(name=name, module="fake", mro=mro, representatives=1)
        for name, (mro, _) in _TABLE.items()
    }
    classes["Base"] = ClassInfo(name="Base", module="fake", mro=("Base",), representatives=0)
    classes["Group"] = ClassInfo(
        name="Group", module="fake", mro=("Group", "Base"), representatives=1, group=True
    )
    answers: dict[str, dict[str, frozenset[str]]] = {q.name: {} for q in QUESTIONS}
    for name, (_, values) in _TABLE.items():
        for q in QUESTIONS:
            value = values.get(q.name, _DEFAULTS.get(q.name))
            assert value is not None, (name, q.name)
            answers[q.name][name] = frozenset({value} if isinstance(value, str) else value)
    return Universe(
        vllm_version="test",
        vllm_path="",
        classes=classes,
        answers=answers,
        group_attributes=frozenset({"members"}),
    )


U = _universe()


def _site(
    *classes: str,
    form: str = "isinstance",
    negated: bool = False,
    exact: bool = False,
    unwraps: bool | None = None,
) -> RawSite:
    return RawSite(
        line=1,
        col=0,
        end_line=1,
        function="f",
        form=form,
        subject="spec",
        text="...",
        written="...",
        classes=classes,
        negated=negated,
        exact=exact,
        unwraps=unwraps,
    )


def test_isinstance_takes_subclasses_and_misses_same_kind_classes_only() -> None:
    site = infer(_site("Latent"), U)
    assert site.branch_classes == ("Latent", "LatentChild")
    assert site.answer is not None
    assert (site.answer.trait, site.answer.value, site.answer.match) == ("is_mla", T, "near")
    # Ring (no slot mapping) and Hot (never transferred) are MLA too, but of another
    # page kind: not reported as missed.
    assert site.answer.value_classes == ("Latent", "LatentChild", "WinLatent")
    assert site.missing == ("WinLatent",)


def test_the_whole_same_kind_value_set_is_an_exact_match() -> None:
    site = infer(_site("Latent", "WinLatent"), U)
    assert site.answer is not None
    assert (site.answer.trait, site.answer.match, site.missing) == ("is_mla", "exact", ())


def test_covering_half_or_less_is_no_near_match_and_reports_no_miss() -> None:
    # WinLatent alone covers 1 of the 3 MLA classes of its kind, 1 of the 3 windowed ones
    # and 1 of the 2 sliding-window ones: none is more than half, none similar enough.
    site = infer(_site("WinLatent"), U)
    assert (site.answer, site.missing) == (None, ())


def test_a_class_whose_representatives_disagree_is_left_out_of_that_trait() -> None:
    site = infer(_site("State"), U)
    assert site.answer is not None
    assert (site.answer.trait, site.answer.value, site.answer.match) == (
        "token_scope",
        "TokenScope.RECURRENT_STATE",
        "exact",
    )
    mla = infer(_site("Latent", "WinLatent"), U).answer
    assert mla is not None
    # tp_layout REPLICATED fits as exactly as is_mla once State is left out, but State
    # varies on it: the trait every class answers the same way wins.
    assert (mla.trait, mla.varies) == ("is_mla", ())


def test_a_value_most_classes_have_is_never_the_answer() -> None:
    # Every Attn subclass is transferable with a slot mapping, like most classes: that is
    # the common case, not a question.
    # Without the rule, `transferable = True` would be a near match missing State.
    # Only a question marked common (attention_page, issue 20) is asked in the common
    # case, and only as the exact set: every attention class, Hot and State left out.
    site = infer(_site("Attn"), U)
    assert site.answer is not None and site.missing == ()
    assert (site.answer.trait, site.answer.value, site.answer.match) == (
        "attention_page",
        "True",
        "exact",
    )


def test_exact_type_checks_skip_subclasses_and_count_them_as_missed() -> None:
    site = infer(_site("Latent", form="type-compare", exact=True), U)
    assert site.branch_classes == ("Latent",)
    assert site.skipped_subclasses == ("LatentChild",)
    assert site.missing == ("LatentChild", "WinLatent")


def test_group_wrapper_checks_ask_grouped_and_report_not_unwrapping() -> None:
    kept = infer(_site("Group", unwraps=True), U)
    dropped = infer(_site("Group", unwraps=False), U)
    # a check on the group wrapper alone asks `grouped` (issue 20), True for it alone
    for site in (kept, dropped):
        assert site.answer is not None
        assert (site.answer.trait, site.answer.match) == ("grouped", "exact")
        assert site.answer.expression == "traits_of(spec).grouped"
    assert (kept.wrapper_not_unwrapped, dropped.wrapper_not_unwrapped) == (False, True)


def test_a_class_without_representatives_is_reported_as_such() -> None:
    site = infer(_site("Base", form="type-compare", exact=True), U)
    assert site.no_representative == ("Base",)
    assert site.branch_classes == ()


def test_negated_site_renders_the_negated_expression() -> None:
    site = infer(_site("Latent", "WinLatent", negated=True), U)
    assert site.answer is not None
    assert site.answer.expression == "not traits_of(spec).is_mla"


def test_universe_round_trips_through_json() -> None:
    assert Universe.from_json(U.to_json()) == U


def test_a_set_of_one_enum_traits_values_is_an_exact_answer_when_nothing_else_fits() -> None:
    # Win, WinLatent and State: no single trait value names them (windowed takes Chunk
    # and leaves State), but the scopes SLIDING_WINDOW and RECURRENT_STATE name exactly
    # them among the classes of their page kind.
    site = infer(_site("Win", "State"), U)
    assert site.answer is not None and site.missing == () and site.verdict == "ok"
    assert (site.answer.trait, site.answer.match) == ("token_scope", "exact")
    assert site.answer.expression == (
        "traits_of(spec).token_scope in (TokenScope.SLIDING_WINDOW, TokenScope.RECURRENT_STATE)"
    )
    negated = infer(_site("Win", "State", negated=True), U).answer
    assert negated is not None and " not in (" in negated.expression


def test_a_set_of_scopes_that_also_takes_an_untested_class_is_no_answer() -> None:
    # vLLM 0.34's MoRIIO set (FullAttentionSpec, SlidingWindowSpec, MambaSpec): Full,
    # Win and State here. Attn, the bare base, has the FULL scope too and the tuple
    # rejects it, so no set of scopes is exact: the closest single trait stays.
    site = infer(_site("Full", "Win", "State"), U)
    assert site.answer is None or site.answer.match == "closest"


def test_a_and_not_b_is_asked_as_two_traits_when_both_are_exact() -> None:
    # `isinstance(s, Win) and not isinstance(s, WinLatent)`: Win's classes are exactly
    # the SLIDING_WINDOW scope; among them WinLatent's are exactly is_mla.
    site = infer(replace(_site("Win"), excluded=("WinLatent",)), U)
    assert site.answer is not None and site.verdict == "ok" and site.missing == ()
    assert site.answer.unless == ("is_mla", "True")
    assert site.answer.expression == (
        "traits_of(spec).token_scope is TokenScope.SLIDING_WINDOW and not traits_of(spec).is_mla"
    )
    # negated (`not (A and not B)`) it is not asked so: no such reading is written
    flipped = infer(replace(_site("Win", negated=True), excluded=("WinLatent",)), U)
    assert flipped.answer is None or flipped.answer.unless == ()
