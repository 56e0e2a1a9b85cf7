"""The in-repo third-party extension (examples/kvspec_traits_example): a custom spec the
built-ins refuse, answered once its adapter arrives through the entry-point group."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from kvspec_traits_example import ScaledLatentSpec, adapt_scaled_latent

from kvspec_traits import TPLayout, UnsupportedSpecError, traits_of
from kvspec_traits.extend import ENTRY_POINT_GROUP, Registry


def _spec() -> ScaledLatentSpec:
    return ScaledLatentSpec(
        block_size=16, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.int8
    )


def test_the_extension_is_published_in_the_entry_point_group() -> None:
    names = {ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert "kvspec_traits_example:register" in names


def test_without_the_extension_the_parent_adapter_refuses() -> None:
    registry = Registry(entry_points=False)
    with pytest.raises(UnsupportedSpecError, match="MLAAttentionSpec") as info:
        registry.traits_of(_spec())
    assert info.value.spec_type is ScaledLatentSpec


def test_the_default_registry_loads_it_and_verifies_it() -> None:
    t = traits_of(_spec())
    # 16 tokens * (512 int8 + 4 B scale) = 8256 B, one replicated latent
    assert (t.page_size_bytes, t.per_token_bytes, t.is_mla, t.tp_layout) == (
        8256,
        516,
        True,
        TPLayout.REPLICATED,
    )
    assert [(c.name, c.nbytes) for c in t.components] == [("latent", 8192), ("scale", 64)]
    assert Registry().adapters()[ScaledLatentSpec] is adapt_scaled_latent
