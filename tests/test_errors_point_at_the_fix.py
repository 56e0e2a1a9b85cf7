"""Errors that say what to do instead (issue 40): each mistake a connector author made
while adopting kvspec-traits, and the call or flag its message now names.

On main: ``traits_of(group)`` asked "is it a vLLM KV cache spec?", ``traits_of(
MLAAttentionSpec)`` said "no adapter for builtins.type", a ``TraitsMismatchError``
named the field mid-sentence and cut the spec's repr at 300 characters (before
``tokens_per_state`` on vLLM 0.34), a spec that overrides ``page_size_bytes`` but
inherits ``unpadded_page_size_bytes`` was told its adapter was wrong, and
``audit --fail-on-misses`` got argparse's bare "unrecognized arguments".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import (
    NotASpecError,
    TraitsMismatchError,
    UnsupportedSpecError,
    traits_for_layer,
    traits_of,
)
from kvspec_traits._cli import main
from kvspec_traits._errors import _repr_through
from kvspec_traits.catalog import example_config
from kvspec_traits.extend import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    LayoutTraits,
    Registry,
    attention_traits,
    default_registry,
)

# -- traits_of given what a spec is mistaken for ----------------------------------------------


def test_a_cache_group_is_told_to_pass_its_spec_or_use_traits_for_layer() -> None:
    group = example_config("llama_gqa").kv_cache_groups[0]
    with pytest.raises(NotASpecError) as raised:
        traits_of(group)  # type: ignore[arg-type]
    message = str(raised.value)
    assert message.startswith("traits_of takes one KV cache spec instance, but was given a cache")
    assert "pass group.kv_cache_spec, or use traits_for_layer(" in message
    assert (raised.value.obj, raised.value.spec_type) == (group, kvi.KVCacheGroupSpec)
    # still what callers caught before: an UnsupportedSpecError, a TypeError
    assert isinstance(raised.value, UnsupportedSpecError) and isinstance(raised.value, TypeError)
    # and what it says works:
    spec_traits = traits_of(group.kv_cache_spec)
    assert traits_for_layer(spec_traits, group.layer_names[0]) is spec_traits


def test_a_spec_class_is_told_to_pass_an_instance() -> None:
    with pytest.raises(NotASpecError, match="pass an instance") as raised:
        traits_of(kvi.MLAAttentionSpec)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "the class vllm.v1.kv_cache_interface.MLAAttentionSpec itself" in message
    assert "traits_of(MLAAttentionSpec(block_size=..., ...))" in message
    assert "builtins.type" not in message


def test_a_whole_config_is_told_to_ask_per_group() -> None:
    with pytest.raises(NotASpecError, match=r"for group in config\.kv_cache_groups"):
        traits_of(example_config("jamba"))  # type: ignore[arg-type]


@pytest.mark.parametrize("obj", [object(), 42, "FullAttentionSpec"])
def test_other_objects_keep_the_general_refusal(obj: object) -> None:
    with pytest.raises(UnsupportedSpecError, match="is it a vLLM KV cache spec") as raised:
        traits_of(obj)  # type: ignore[arg-type]
    assert not isinstance(raised.value, NotASpecError)


# -- TraitsMismatchError: the field first, the repr not cut before it ---------------------------


def _replaced(spec_type: type[kvi.KVCacheSpec], adapter: object) -> Registry:
    registry = default_registry.copy(name="issue 40")
    declared = registry.registrations()[spec_type]
    registry.register(
        spec_type,
        adapter,  # type: ignore[arg-type]
        replace=True,
        reads=declared.reads,
        ignores=declared.ignores,
    )
    return registry


def test_a_mismatch_names_the_field_first_and_shows_it_in_the_spec() -> None:
    """An adapter saying 2 tokens per state where the spec stores 1 per token: the
    message starts with the trait, and the spec's repr runs at least through
    ``tokens_per_state=1`` (vLLM 0.34's FullAttentionSpec repr has it past character 300,
    where main cut)."""
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    right = traits_of(spec)
    assert isinstance(right, LayoutTraits)
    registry = _replaced(kvi.FullAttentionSpec, lambda s: replace(right, tokens_per_state=2))
    with pytest.raises(TraitsMismatchError) as raised:
        registry.traits_of(spec)
    err = raised.value
    assert (err.field, err.traits_value, err.spec_value) == ("tokens_per_state", 2, 1)
    assert str(err).startswith("tokens_per_state: adapter ")
    assert "tokens_per_state=1" in str(err).partition("(spec: ")[2]
    assert "The adapter is wrong for this spec" in str(err)
    assert (err.inherited_from, err.overridden) == (None, None)


def test_a_long_repr_is_cut_after_the_field_not_before() -> None:
    class Long:
        def __repr__(self) -> str:
            return "Long(" + ", ".join(f"f{i}={i}" for i in range(200)) + ")"

    text = _repr_through(Long(), "f150")
    assert text.endswith("f150=150...")
    assert len(_repr_through(Long(), "f3")) == 300 + len("...")  # early field: cut at 300
    assert _repr_through(Long(), "absent").endswith("...")


@dataclass(frozen=True, kw_only=True)
class ScaledPageSpec(kvi.FullAttentionSpec):
    """A full-attention page followed by ``scale_bytes`` of per-block scales: it overrides
    ``page_size_bytes`` and forgets ``unpadded_page_size_bytes``, which it inherits from
    ``AttentionSpec`` (K and V only)."""

    scale_bytes: int = 64

    @property
    def page_size_bytes(self) -> int:
        return super().page_size_bytes + self.scale_bytes


def _scaled_registry(page_from_spec: bool) -> Registry:
    registry = default_registry.copy(name="scaled")

    def adapt(spec: ScaledPageSpec) -> LayoutTraits:
        base = attention_traits(spec)
        if not page_from_spec:
            return base  # forgets the scales: K and V alone
        # the page's content: K and V, then the scales (what the author means)
        content = base.unpadded_page_size_bytes + spec.scale_bytes
        return replace(
            base, components=(), unpadded_page_size_bytes=content, page_size_bytes=content
        )

    registry.register(
        ScaledPageSpec,
        adapt,
        reads=(*ATTENTION_READS, "scale_bytes"),
        ignores=ATTENTION_IGNORES,
    )
    return registry


SCALED = ScaledPageSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
# 16 tokens * 2 heads * (64 K + 64 V) * 2 B = 8192 B of K and V, + 64 B of scales = 8256
KV, PAGE = 16 * 2 * (64 + 64) * 2, 16 * 2 * (64 + 64) * 2 + 64


def test_a_spec_inheriting_a_page_property_it_should_override_is_told_so() -> None:
    """The adapter agrees with the spec's own ``page_size_bytes`` (8256); the spec's
    inherited ``unpadded_page_size_bytes`` still says K and V alone (8192): the spec is
    at fault, and the message says which property to define where."""
    assert (SCALED.page_size_bytes, SCALED.unpadded_page_size_bytes) == (PAGE, KV)
    with pytest.raises(TraitsMismatchError) as raised:
        _scaled_registry(page_from_spec=True).traits_of(SCALED)
    err = raised.value
    assert (err.field, err.traits_value, err.spec_value) == ("unpadded_page_size_bytes", PAGE, KV)
    assert (err.inherited_from, err.overridden) == ("AttentionSpec", "page_size_bytes")
    message = str(err)
    assert message.startswith(
        "unpadded_page_size_bytes: ScaledPageSpec overrides page_size_bytes but inherits "
        "unpadded_page_size_bytes from AttentionSpec"
    )
    assert "The spec inherits a page property it should override" in message
    assert "define unpadded_page_size_bytes on ScaledPageSpec" in message
    assert "The adapter is wrong" not in message


def test_the_same_spec_with_a_wrong_adapter_is_still_the_adapters_fault() -> None:
    """The adapter forgets the scales: its page (8192) contradicts the page the spec
    itself overrides (8256), and nothing inherited is to blame."""
    with pytest.raises(TraitsMismatchError) as raised:
        _scaled_registry(page_from_spec=False).traits_of(SCALED)
    err = raised.value
    assert (err.field, err.traits_value, err.spec_value) == ("page_size_bytes", KV, PAGE)
    assert err.inherited_from is None
    assert "The adapter is wrong for this spec" in str(err)


# -- the command line suggests the closest flag -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["audit", "--fail-on-misses", "x.py"], "--fail-on-misses: did you mean --fail-on-miss?"),
        (["report", "--jsn"], "--jsn: did you mean --json?"),
        (["migrate", "--wirte", "x.py"], "--wirte: did you mean --write?"),
        (["audit", "--min-confidnce=high", "x.py"], "did you mean --min-confidence?"),
    ],
)
def test_an_unknown_flag_gets_the_closest_one(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and hint in err


def test_a_flag_like_no_other_gets_no_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["audit", "--zzzzzz", "x.py"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err
