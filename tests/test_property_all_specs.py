"""Every spec class of the installed vLLM, built with plausible and implausible field
values: ``traits_of`` returns traits that agree with every size the spec itself computes,
or raises a named refusal (``InvalidSpecError`` or ``UnsupportedSpecError``). Never a
bare error, never traits that disagree with the spec, never an adapter error.

The oracle is vLLM's own properties (``page_size_bytes``, ``real_page_size_bytes``,
``unpadded_page_size_bytes``, ``num_heads``, ``num_states``, ``state_content_size_bytes``)
and its logical page shape ``compute_layer_kv_cache_shape_bytes``, read here directly,
independently of the library's own check. Runs on every vLLM series of the suite.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from math import prod
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import (
    InvalidSpecError,
    KVLayoutTraits,
    UnsupportedSpecError,
    traits_of,
)
from kvspec_traits.catalog import spec_classes

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.uint8,
    torch.int8,
    torch.float8_e4m3fn,
]
BLOCKS = [1, 4, 16, 64, 128, 256]
NAMED = (InvalidSpecError, UnsupportedSpecError)

# A value no layout field should accept, whatever the field.
JUNK = st.sampled_from([None, 0, -1, -128, "128", 12.5, True, (), object()])


def _divisors(block: int) -> list[int | Fraction]:
    return [t for t in (1, 2, 4, 128) if block % t == 0] + [Fraction(1, 2), Fraction(1, 4)]


def _plausible(name: str, block: int) -> st.SearchStrategy[Any] | None:
    """A strategy of values a real model could give field ``name``; None: keep the default."""
    pos = st.integers(1, 64)
    table: dict[str, st.SearchStrategy[Any]] = {
        "num_kv_heads": pos,
        "head_size": st.integers(1, 1024),
        "head_size_v": st.none() | st.integers(0, 1024),
        "dtype": st.sampled_from(DTYPES),
        "kv_quant_mode": st.sampled_from(list(kvi.KVQuantMode)),
        "max_tp_shards": st.none() | st.integers(1, 8),
        "num_head_slots": st.none() | pos,
        "state_content_bytes": st.none() | st.integers(1, 4096),
        "tokens_per_state": st.sampled_from(_divisors(block)),
        "sliding_window": st.integers(1, 4096),
        "attention_chunk_size": st.integers(1, 8192),
        "rswa_window": st.integers(1, 4096),
        "sink_len": st.none() | pos,
        "extra_retained_tokens": st.integers(0, 8),
        "bounded_replay": st.booleans(),
        "kv_head_major_slots": st.booleans(),
        "non_causal": st.booleans(),
        "shapes": st.lists(
            st.lists(st.integers(1, 64), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3
        ).map(tuple),
        "num_heads": pos,
        "tp_replicated": st.booleans(),
        "state_alignment": st.sampled_from([1, 16, 64]),
        "page_size": st.integers(1, 1 << 20),
        "blocks_per_request": pos,
        "dcp_sharded": st.booleans(),
    }
    return table.get(name)


@st.composite
def specs(
    draw: st.DrawFn, cls: type[kvi.KVCacheSpec], *, junk: bool, depth: int = 0
) -> kvi.KVCacheSpec | None:
    """A spec of ``cls`` (None when vLLM's own constructor refuses the values)."""
    block = draw(st.sampled_from(BLOCKS))
    kwargs: dict[str, Any] = {"block_size": block}
    fields = [f for f in dataclasses.fields(cls) if f.init and f.name != "block_size"]
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        strategy = _plausible(f.name, block)
        if f.name == "dtypes":
            continue  # follows shapes
        if f.name == "kv_cache_specs":
            members = draw(
                st.lists(
                    specs(kvi.FullAttentionSpec, junk=False, depth=depth + 1),
                    min_size=1,
                    max_size=3,
                )
            )
            kwargs[f.name] = {
                f"layer{i}": dataclasses.replace(m, block_size=block)
                for i, m in enumerate(members)
                if m is not None
            }
            continue
        if strategy is not None and (required or draw(st.booleans())):
            kwargs[f.name] = draw(strategy)
        elif required:
            return None  # a required field this test has no values for
    if "shapes" in kwargs:
        kwargs["dtypes"] = tuple(draw(st.sampled_from(DTYPES)) for _ in kwargs["shapes"])
    if junk:
        # one or two fields (block_size included) set to something no layout has
        names = sorted(kwargs)
        for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True)):
            kwargs[name] = draw(JUNK | st.integers(-4096, 0))
    try:
        spec = cls(**kwargs)
    except Exception:  # vLLM's own __post_init__ refused them: nothing to resolve
        return None
    if not junk and draw(st.booleans()) and "page_size_padded" in {f.name for f in fields}:
        try:
            content = spec.real_page_size_bytes  # type: ignore[attr-defined]
            spec = dataclasses.replace(  # type: ignore[call-arg]
                spec, page_size_padded=content + draw(st.sampled_from([0, 64, 4096]))
            )
        except Exception:
            return None
    return spec


def _spec_says(spec: kvi.KVCacheSpec, name: str) -> Any:
    """The spec's own value of a property, or None when it has none (vLLM's base raises
    NotImplementedError for what a class does not define)."""
    try:
        return getattr(spec, name)
    except (AttributeError, NotImplementedError):
        return None


def _agrees(spec: kvi.KVCacheSpec, t: KVLayoutTraits) -> None:
    assert t.page_size_bytes == spec.page_size_bytes
    assert t.block_size == spec.block_size
    for prop in ("real_page_size_bytes", "unpadded_page_size_bytes"):
        want = _spec_says(spec, prop)
        if want is not None:
            assert t.unpadded_page_size_bytes == want, prop
    assert sum(c.nbytes for c in t.components) == t.unpadded_page_size_bytes
    assert t.unpadded_page_size_bytes <= t.page_size_bytes
    heads, states, cell = (
        _spec_says(spec, p) for p in ("num_heads", "num_states", "state_content_size_bytes")
    )
    if heads is not None and cell is not None:  # a group spec has neither
        assert (t.num_head_slots, t.states_per_block, t.state_bytes) == (heads, states, cell)
        # vLLM's logical page [B, H, N, C] of one block is the unpadded page
        assert prod(kvi.compute_layer_kv_cache_shape_bytes(spec, 1)) == t.unpadded_page_size_bytes
    members = getattr(spec, "kv_cache_specs", None)
    for one in [t] if members is None else [t.members[layer] for layer in members]:  # type: ignore[attr-defined]
        # content per token times tokens per state is one state of every head slot
        if one.per_token_bytes is not None and one.tokens_per_state is not None:
            assert (
                one.per_token_bytes * one.tokens_per_state == one.num_head_slots * one.state_bytes
            )


def _check(spec: kvi.KVCacheSpec | None) -> str:
    if spec is None:
        return "not built"
    error: Exception | None = None
    try:
        t = traits_of(spec)
    except NAMED as err:
        error = err
    if error is not None:
        # named, and naming what it is about (a group's refused member: that member)
        members = getattr(spec, "kv_cache_specs", None) or {}
        assert any(type(s).__qualname__ in str(error) for s in [spec, *members.values()])
        return type(error).__name__
    _agrees(spec, t)
    return "traits"


CLASSES = spec_classes()


def test_the_classes_are_every_spec_class_of_the_installed_vllm() -> None:
    assert len(CLASSES) == 17
    assert kvi.UniformTypeKVCacheSpecs in CLASSES and kvi.MambaSpec in CLASSES


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_plausible_values_give_traits_that_agree_with_the_spec(cls: type[kvi.KVCacheSpec]) -> None:
    outcomes: set[str] = set()

    @SETTINGS
    @given(specs(cls, junk=False))
    def check(spec: kvi.KVCacheSpec | None) -> None:
        outcomes.add(_check(spec))

    check()
    if cls is kvi.KVCacheSpec:
        assert outcomes == {"UnsupportedSpecError"}  # abstract: always refused
    else:
        assert "traits" in outcomes, outcomes  # real values are answered


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_implausible_values_give_agreeing_traits_or_a_named_error(
    cls: type[kvi.KVCacheSpec],
) -> None:
    outcomes: set[str] = set()

    @SETTINGS
    @given(specs(cls, junk=True))
    def check(spec: kvi.KVCacheSpec | None) -> None:
        outcomes.add(_check(spec))

    check()
    # the junk reached the library at least once (vLLM's constructors accept most of it)
    assert outcomes - {"not built"}, outcomes
