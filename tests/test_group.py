"""UniformTypeKVCacheSpecs: per-member traits and a group answer, or a named disagreement."""

from __future__ import annotations

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import GroupTraits, MixedGroupTraitsError, TokenScope, TPLayout, traits_of


def _mla(tokens_per_state: int = 1) -> kvi.MLAAttentionSpec:
    return kvi.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=576,
        dtype=torch.bfloat16,
        tokens_per_state=tokens_per_state,
    )


def test_group_of_equal_mla_layers_answers_for_the_group() -> None:
    group = kvi.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs={"l0": _mla(), "l1": _mla()})
    t = traits_of(group)
    assert isinstance(t, GroupTraits)
    assert list(t.members) == ["l0", "l1"]
    # each layer: 64 * 576 * 2 B = 73728; the group page is both side by side
    assert (t.is_mla, t.tp_layout, t.token_scope, t.page_size_bytes, t.per_token_bytes) == (
        True,
        TPLayout.REPLICATED,
        TokenScope.FULL,
        2 * 73728,
        2 * 1152,
    )
    assert t.page_size_bytes == group.page_size_bytes
    assert [c.name for c in t.components] == ["l0/latent", "l1/latent"]


def test_members_that_disagree_raise_for_that_trait_only() -> None:
    # Same class, different compression: vLLM groups them (uniform type) but a per-state
    # question has no single answer.
    group = kvi.UniformTypeKVCacheSpecs(
        block_size=64, kv_cache_specs={"dense": _mla(1), "compressed": _mla(4)}
    )
    t = traits_of(group)
    assert t.is_mla is True  # they agree here
    # 64 * 1152 + 16 states * 1152 = 73728 + 18432
    assert t.page_size_bytes == 92160
    with pytest.raises(MixedGroupTraitsError, match="tokens_per_state") as info:
        _ = t.tokens_per_state
    assert info.value.values == {"dense": 1, "compressed": 4}
    with pytest.raises(MixedGroupTraitsError) as again:
        _ = t.tokens_per_state
    assert again.value is not info.value  # a fresh error each time, not a growing traceback
    # per-token bytes add up exactly: 1152 + 1152 / 4
    assert t.per_token_bytes == 1152 + 288


def test_vllm_builds_the_group_through_its_own_constructor() -> None:
    specs: dict[str, kvi.KVCacheSpec] = {
        f"layers.{i}": kvi.FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
        )
        for i in range(3)
    }
    group = kvi.UniformTypeKVCacheSpecs.from_specs(specs)
    assert group is not None
    t = traits_of(group)
    # 3 layers * 16 tokens * 2 heads * 128 * 2 B
    assert (t.page_size_bytes, t.tp_layout) == (3 * 8192, TPLayout.HEAD_SHARDED)


def test_an_empty_group_is_refused_with_a_named_error() -> None:
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={})
    with pytest.raises(ValueError, match="no member layers"):
        traits_of(group)


def test_per_layer_and_representative_traits_of_a_group_and_of_a_plain_spec() -> None:
    from kvspec_traits import representative_traits, traits_for_layer

    group = kvi.UniformTypeKVCacheSpecs(
        block_size=64, kv_cache_specs={"dense": _mla(1), "compressed": _mla(4)}
    )
    t = traits_of(group)
    assert traits_for_layer(t, "compressed").tokens_per_state == 4
    assert representative_traits(t).tokens_per_state == 1  # the first member, as vLLM
    with pytest.raises(KeyError, match="'other' is not a member"):
        traits_for_layer(t, "other")
    plain = traits_of(_mla(4))
    assert traits_for_layer(plain, "any layer") is plain
    assert representative_traits(plain) is plain
