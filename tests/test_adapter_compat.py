"""Adapters keep working (issue 49 item 2): an adapter written against kvspec-traits 0.1.0
builds its ``LayoutTraits`` with exactly the keywords 0.1.0 ships
(``tests/fixtures/compat/layout-traits-0.1.0.json``, frozen at the release), and
``traits_of`` and the connector's layout facts still accept it. A field added after 0.1.0
needs a default that keeps such an adapter's answer right, or a documented breaking
change (docs/extending.md, "Compatibility"; CHANGELOG.md).

Failure mode: ``holds_hidden_states`` was added as a required keyword, so a vendor
adapter that built its traits by hand raised ``TypeError: LayoutTraits() missing keyword
argument(s): holds_hidden_states`` at its first ``traits_of``, and the connector refused
every class it adapts.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvspec_traits import PageComponent, TokenScope, TPLayout
from kvspec_traits.extend import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    LayoutTraits,
    Registry,
    register_adapter,
)
from kvspec_traits.vllm_connector._facts import GroupKind, layout_facts

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "compat" / "layout-traits-0.1.0.json"
RELEASED: dict[str, Any] = json.loads(FIXTURE.read_text())


@dataclasses.dataclass(frozen=True, kw_only=True)
class VendorFullSpec(FullAttentionSpec):
    """A vendor's spec class: laid out as its parent, answered by its own adapter."""


def _released_kwargs(*, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fixture's example keywords as Python values (enums by name, components as
    ``PageComponent``), less ``leave_out``."""
    kwargs = dict(RELEASED["example"]["kwargs"])
    kwargs["tp_layout"] = TPLayout[kwargs["tp_layout"]]
    kwargs["token_scope"] = TokenScope[kwargs["token_scope"]]
    kwargs["components"] = tuple(
        PageComponent(**{**c, "shape": tuple(c["shape"])}) for c in kwargs["components"]
    )
    return {k: v for k, v in kwargs.items() if k not in leave_out}


def _spec() -> VendorFullSpec:
    # The fixture's example: 16 tokens * 2 heads * (K 64 + V 64) * 2 B (float16) = 8192 B a
    # page, 512 B a token, 256 B a state (one head slot's K and V of one token).
    return VendorFullSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)


def _registry_with(kwargs: dict[str, Any]) -> Registry:
    registry = Registry().copy()

    @register_adapter(
        VendorFullSpec,
        registry=registry,
        reads=ATTENTION_READS,
        ignores=ATTENTION_IGNORES,
    )
    def adapt(spec: VendorFullSpec) -> LayoutTraits:
        return LayoutTraits(**kwargs)

    return registry


def test_the_released_field_set_is_kept_and_every_later_field_has_a_default() -> None:
    for cls in (LayoutTraits, PageComponent):
        now = {f.name: f for f in dataclasses.fields(cls)}
        released = RELEASED[cls.__name__]
        assert set(released) <= set(now), f"{cls.__name__} lost {set(released) - set(now)}"
        later = sorted(
            name
            for name, f in now.items()
            if name not in released
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        assert later == [], f"{cls.__name__}: fields added after 0.1.0 without a default"
    # The two added before 0.1.0 that an adapter written earlier does not pass.
    for name, default in RELEASED["added_with_a_default_before_0.1.0"].items():
        field = {f.name: f for f in dataclasses.fields(LayoutTraits)}[name]
        assert field.default == default, name


def test_an_adapter_with_exactly_the_released_keywords_is_accepted() -> None:
    kwargs = _released_kwargs()
    assert sorted(kwargs) == sorted(RELEASED["LayoutTraits"])
    registry = _registry_with(kwargs)
    spec = _spec()
    traits = registry.traits_of(spec)  # resolved, result-checked, verified against vLLM's math
    assert traits.page_size_bytes == 8192 and traits.per_token_bytes == 512
    assert traits.spec_name == "VendorFullSpec"
    # The connector's layout facts, from the same registry: one head-sharded token group.
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["model.layers.0.attn"], kv_cache_spec=spec)],
    )
    facts = layout_facts(config, registry)
    assert facts.group_kinds == (GroupKind.PAGED,)
    assert facts.transfer_block_size == 16 and not facts.mla and not facts.has_state
    assert facts.layer_traits["model.layers.0.attn"] is traits


def test_an_adapter_written_before_holds_hidden_states_still_answers() -> None:
    """The issue's adapter: written against the extension API before
    ``holds_hidden_states`` and ``grouped`` existed, it passes neither; its traits say
    False for both (its pages hold K/V, and one layer's traits are never a group's)."""
    registry = _registry_with(_released_kwargs(leave_out=("holds_hidden_states", "grouped")))
    traits = registry.traits_of(_spec())
    assert traits.holds_hidden_states is False and traits.grouped is False
    assert traits.is_mla is False and traits.tp_layout is TPLayout.HEAD_SHARDED


def test_a_required_trait_left_out_is_still_named() -> None:
    with pytest.raises(TypeError, match=r"missing keyword argument\(s\): is_mla"):
        LayoutTraits(**_released_kwargs(leave_out=("is_mla",)))
