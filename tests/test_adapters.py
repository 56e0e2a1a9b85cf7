"""Every spec class resolves; each family's traits, hand-computed from vLLM's formulas.

vLLM's page formula (AttentionSpec): page = num_heads * num_states * C, with
num_states = block_size // tokens_per_state and C = state_content_bytes, or
(head_size + head_size_v) * itemsize when not packed; padded up to a multiple of
``alignment`` for the DeepSeek MLA specs. MambaSpec: page = sum(prod(shape) * itemsize).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import (
    KVLayoutTraits,
    MixedGroupTraitsError,
    TokenScope,
    TPLayout,
    UnsupportedSpecError,
    trait_names,
    traits_of,
)
from kvspec_traits.catalog import refused_specs, representative_specs, spec_classes

CATALOG = {e.label: e.spec for e in representative_specs()}


def test_every_spec_class_of_the_installed_vllm_is_covered() -> None:
    classes = spec_classes()
    # 0.32 and 0.33 both have KVCacheSpec and 16 subclasses.
    assert len(classes) == 17
    answered = {type(e.spec) for e in representative_specs()}
    refused = {type(e.spec) for e in refused_specs()}
    assert set(classes) == answered | refused
    for entry in representative_specs():
        traits_of(entry.spec)  # verified against the spec's own math, or raises
    for entry in refused_specs():
        with pytest.raises(UnsupportedSpecError) as info:
            traits_of(entry.spec)
        assert info.value.spec_type is type(entry.spec)


def _check(t: KVLayoutTraits, **expected: object) -> None:
    actual = {name: getattr(t, name) for name in expected}
    assert actual == expected


def test_llama_gqa() -> None:
    t = traits_of(CATALOG["Llama-3 8B GQA"])
    # 8 KV heads * (128 K + 128 V) * 2 B = 4096 B/token; 16 tokens -> 65536 B
    _check(
        t,
        is_mla=False,
        tp_layout=TPLayout.HEAD_SHARDED,
        tp_shards=None,
        token_scope=TokenScope.FULL,
        window_tokens=None,
        num_head_slots=8,
        tokens_per_state=1,
        states_per_block=16,
        state_bytes=512,
        per_token_bytes=4096,
        unpadded_page_size_bytes=65536,
        page_size_bytes=65536,
        dtype="bfloat16",
        kv_quant_mode="NONE",
        transferable=True,
        prefix_cacheable=True,
        uses_slot_mapping=True,
    )
    assert [(c.name, c.shape, c.nbytes) for c in t.components] == [
        ("k", (8, 16, 128), 8 * 16 * 128 * 2),
        ("v", (8, 16, 128), 8 * 16 * 128 * 2),
    ]


def test_llama_fp8_kv_halves_the_page() -> None:
    t = traits_of(CATALOG["Llama-3 8B GQA, fp8 KV"])
    # 8 * (128 + 128) * 1 B = 2048 B/token
    _check(
        t,
        per_token_bytes=2048,
        page_size_bytes=32768,
        dtype="float8_e4m3fn",
        kv_quant_mode="FP8_PER_TENSOR",
    )


def test_deepseek_v3_mla_fp8_ds_mla_is_656_bytes_per_token_and_replicated() -> None:
    t = traits_of(CATALOG["DeepSeek-V3 MLA fp8_ds_mla"])
    # state_content_bytes=656 packs 512 NoPE fp8 + 4 scales * 4 B + 64 RoPE * 2 B; 64 tokens
    _check(
        t,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        tp_shards=1,
        per_token_bytes=656,
        page_size_bytes=64 * 656,
        num_head_slots=1,
        dtype="uint8",
        kv_quant_mode="FP8_PER_TENSOR",
    )
    assert [(c.name, c.dtype, c.nbytes) for c in t.components] == [("packed", "uint8", 41984)]


def test_deepseek_v3_mla_bf16_is_not_sized_as_mha() -> None:
    # The Mooncake-store bug: MLA sized as K + V. One 576-wide latent * 2 B = 1152 B/token.
    t = traits_of(CATALOG["DeepSeek-V3 MLA bf16"])
    _check(t, is_mla=True, per_token_bytes=1152, page_size_bytes=64 * 1152)
    assert [c.name for c in t.components] == ["latent"]


def test_deepseek_v32_indexer() -> None:
    t = traits_of(CATALOG["DeepSeek-V3.2 indexer"])
    # head_dim 128 + 128 // 128 * 4 scale bytes = 132 uint8 per token
    _check(
        t,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        per_token_bytes=132,
        page_size_bytes=64 * 132,
        token_scope=TokenScope.FULL,
    )


def test_deepseek_v4_compressed_mla_pads_to_576_and_counts_fractional_tokens() -> None:
    t = traits_of(CATALOG["DeepSeek-V4 compressed MLA (ratio 4)"])
    # 64 tokens / 4 per state = 16 states * 584 B = 9344 B; ceil(9344 / 576) * 576 = 17 * 576
    _check(
        t,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        tokens_per_state=4,
        states_per_block=16,
        state_bytes=584,
        unpadded_page_size_bytes=9344,
        page_size_bytes=9792,
        per_token_bytes=146,
    )


def test_deepseek_v4_per_token_bytes_is_exact_when_a_state_covers_128_tokens() -> None:
    spec = kvi.MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        tokens_per_state=128,
        cache_dtype_str="fp8_ds_mla",
        state_content_bytes=584,
        alignment=576,
        model_version="deepseek_v4",
    )
    t = traits_of(spec)
    # 584 B per state / 128 tokens = 73/16 B per token; 2 states = 1168 -> 3 * 576 = 1728
    _check(
        t,
        per_token_bytes=Fraction(73, 16),
        states_per_block=2,
        unpadded_page_size_bytes=1168,
        page_size_bytes=1728,
    )


def test_deepseek_v4_swa_mla_compressor_is_mla_and_replicated() -> None:
    # The founding regression: SlidingWindowMLASpec is a SlidingWindowSpec, not an
    # MLAAttentionSpec; NIXL registered it head-sharded. Its fields say one latent
    # (head_size_v == 0) and max_tp_shards == 1.
    t = traits_of(CATALOG["DeepSeek-V4 SWA-MLA compressor state"])
    # 4 tokens * 2048 fp32 = 32768 B, already a multiple of the 512 B alignment
    _check(
        t,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        tp_shards=1,
        token_scope=TokenScope.SLIDING_WINDOW,
        window_tokens=8,
        block_size=4,
        per_token_bytes=8192,
        page_size_bytes=32768,
    )


def test_deepseek_v4_sparse_swa_cache() -> None:
    t = traits_of(CATALOG["DeepSeek-V4 sparse SWA cache"])
    # 64 * 584 = 37376; ceil(37376 / 576) = 65 -> 37440
    _check(
        t,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        window_tokens=128,
        unpadded_page_size_bytes=37376,
        page_size_bytes=37440,
        per_token_bytes=584,
    )


def test_ring_buffer() -> None:
    t = traits_of(CATALOG["DeepSeek-V4.1 compressor ring"])
    # one 1024-wide fp32 key row per token, no V: 4096 B; ring of 8 rows = 32768 B
    _check(
        t,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        token_scope=TokenScope.RING,
        window_tokens=8,
        page_size_bytes=32768,
        per_token_bytes=4096,
        prefix_cacheable=False,
        uses_slot_mapping=False,
        transferable=True,
    )


def test_gpt_oss_sliding_window_and_llama4_chunked() -> None:
    sw = traits_of(CATALOG["gpt-oss sliding window"])
    # 8 * (64 + 64) * 2 B = 2048 B/token
    _check(
        sw,
        is_mla=False,
        tp_layout=TPLayout.HEAD_SHARDED,
        token_scope=TokenScope.SLIDING_WINDOW,
        window_tokens=128,
        per_token_bytes=2048,
    )
    ch = traits_of(CATALOG["Llama-4 chunked local"])
    _check(ch, token_scope=TokenScope.CHUNKED, window_tokens=8192, per_token_bytes=4096)


def test_full_attention_with_a_kernel_window_still_keeps_every_token() -> None:
    spec = kvi.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=256
    )
    _check(traits_of(spec), token_scope=TokenScope.FULL, window_tokens=None)


def test_bounded_head_sharding_reports_its_shard_count() -> None:
    spec = kvi.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, max_tp_shards=4
    )
    _check(traits_of(spec), tp_layout=TPLayout.HEAD_SHARDED, tp_shards=4)
    one = kvi.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, max_tp_shards=1
    )
    # max_tp_shards == 1: every rank beyond the first holds a replica
    _check(traits_of(one), tp_layout=TPLayout.REPLICATED, tp_shards=1, is_mla=False)


def test_mamba_gdn_state_and_replicated_conv_state() -> None:
    gdn = traits_of(CATALOG["Qwen3.5 GDN state"])
    # conv 3 * 8192 * 2 B = 49152; SSM 32 * 128 * 128 * 4 B = 2097152
    _check(
        gdn,
        is_mla=False,
        tp_layout=TPLayout.STATE_SHARDED,
        tp_shards=None,
        token_scope=TokenScope.RECURRENT_STATE,
        tokens_per_state=None,
        per_token_bytes=None,
        states_per_block=1,
        page_size_bytes=49152 + 2097152,
        dtype=None,
    )
    assert [(c.name, c.shape, c.dtype, c.nbytes) for c in gdn.components] == [
        ("state0", (3, 8192), "bfloat16", 49152),
        ("state1", (32, 128, 128), "float32", 2097152),
    ]
    ple = traits_of(CATALOG["replicated PLE conv state"])
    # 3 * 2048 * 2 B
    _check(ple, tp_layout=TPLayout.REPLICATED, tp_shards=1, page_size_bytes=12288, dtype="bfloat16")


def test_mamba_padding_is_kept_apart_from_content() -> None:
    spec = kvi.MambaSpec(
        block_size=64, shapes=((4, 100),), dtypes=(torch.float32,), page_size_padded=4096
    )
    # 4 * 100 * 4 B = 1600 B of state in a 4096 B page
    _check(traits_of(spec), unpadded_page_size_bytes=1600, page_size_bytes=4096)


def test_cross_attention_encoder_only_and_hidden_states() -> None:
    cross = traits_of(CATALOG["Whisper cross-attention"])
    # 20 * (64 + 64) * 2 B = 5120 B/token
    _check(cross, token_scope=TokenScope.ENCODER, per_token_bytes=5120, transferable=False)
    enc = traits_of(CATALOG["BERT encoder-only"])
    _check(enc, token_scope=TokenScope.NONE, transferable=False)
    hidden = traits_of(CATALOG["extract_hidden_states"])
    # 3 slots * 4096 * 2 B, no V
    _check(hidden, is_mla=True, tp_layout=TPLayout.REPLICATED, per_token_bytes=24576)


def test_pooled_cross_attention_has_fractional_tokens_per_state() -> None:
    spec = kvi.CrossAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float16,
        tokens_per_state=Fraction(1, 2),
    )
    t = traits_of(spec)
    # two states per token: 32 states; 2 * (64 + 64) * 2 B = 512 B per state, 1024 per token
    _check(t, states_per_block=32, per_token_bytes=1024, page_size_bytes=32 * 512)


def test_rswa_sink_and_bare_attention() -> None:
    _check(
        traits_of(CATALOG["R-SWA (reference sliding window)"]),
        token_scope=TokenScope.PROMPT_AND_WINDOW,
        window_tokens=1024,
    )
    _check(traits_of(CATALOG["static sink attention"]), token_scope=TokenScope.FULL)
    _check(
        traits_of(CATALOG["bare AttentionSpec"]),
        token_scope=TokenScope.FULL,
        per_token_bytes=4 * 128 * 2,
    )


def test_hisparse_pages_are_never_transferred() -> None:
    for label, scope in (
        ("HiSparse hot cache", TokenScope.SPARSE_HOT),
        ("HiSparse resident pages", TokenScope.SPARSE_RESIDENT),
    ):
        t = traits_of(CATALOG[label])
        # an opaque copy of a 64-token fp8_ds_mla page: 64 * 656 B
        _check(
            t,
            token_scope=scope,
            transferable=False,
            page_size_bytes=41984,
            per_token_bytes=656,
            prefix_cacheable=False,
        )


# The kind traits (issue 20), hand-derived per class from vLLM's class tree and managers
# (v1/core/single_type_kv_cache_manager.py, register_all_kvcache_specs):
# - attention_page: the class has AttentionSpec's K/V fields (every AttentionSpec subclass);
# - token_paged: neither MambaSpec's one state per request nor the ring's one page;
# - keeps_prompt: FullAttentionManager or a subclass keeps every prompt block (full, MLA,
#   hidden-state, sink; RSWAManager evicts generated tokens only), not a bare AttentionSpec
#   (no manager is registered for it);
# - grouped: UniformTypeKVCacheSpecs only.
_KINDS: dict[str, tuple[bool, bool, bool]] = {
    "AttentionSpec": (True, True, False),
    "FullAttentionSpec": (True, True, True),
    "MLAAttentionSpec": (True, True, True),
    "HiddenStateCacheSpec": (True, True, True),
    "SinkFullAttentionSpec": (True, True, True),
    "RSWASpec": (True, True, True),
    "SlidingWindowSpec": (True, True, False),
    "SlidingWindowMLASpec": (True, True, False),
    "ChunkedLocalAttentionSpec": (True, True, False),
    "CircularBufferSpec": (True, False, False),
    "CrossAttentionSpec": (True, True, False),
    "EncoderOnlyAttentionSpec": (True, True, False),
    "MambaSpec": (False, False, False),
    "HiSparseHotSpec": (False, True, False),
    "HiSparseResidentSpec": (False, True, False),
    "UniformTypeKVCacheSpecs": (True, True, True),  # the catalog's group of MLA layers
}


def test_the_kind_traits_of_every_catalog_spec() -> None:
    for label, spec in CATALOG.items():
        t = traits_of(spec)
        name = type(spec).__name__
        assert (t.attention_page, t.token_paged, t.keeps_prompt) == _KINDS[name], label
        assert t.grouped is (name == "UniformTypeKVCacheSpecs"), label


def _hidden_or_latent(cls: type[kvi.MLAAttentionSpec]) -> kvi.MLAAttentionSpec:
    return cls(block_size=16, num_kv_heads=3, head_size=4096, dtype=torch.bfloat16)


def test_only_hidden_state_pages_hold_hidden_states() -> None:
    """vLLM's HiddenStateCacheSpec is a marker subclass of MLAAttentionSpec: every layout
    trait equals an MLA page's of the same fields, and only holds_hidden_states (what
    ExampleHiddenStatesConnector finds its group by) tells them apart."""
    for label, spec in CATALOG.items():
        held = traits_of(spec).holds_hidden_states
        assert held is isinstance(spec, kvi.HiddenStateCacheSpec), label
    hidden = traits_of(_hidden_or_latent(kvi.HiddenStateCacheSpec))
    latent = traits_of(_hidden_or_latent(kvi.MLAAttentionSpec))
    assert hidden.holds_hidden_states and not latent.holds_hidden_states
    others = [n for n in trait_names() if n not in ("spec_name", "holds_hidden_states")]
    assert {n: getattr(hidden, n) for n in others} == {n: getattr(latent, n) for n in others}
    # A group of hidden-state layers holds them (a check on the class asked the wrapper and
    # missed it); a group mixing them with MLA layers has no single answer.
    members: dict[str, kvi.KVCacheSpec] = {
        f"l{i}": _hidden_or_latent(kvi.HiddenStateCacheSpec) for i in range(2)
    }
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=members)
    assert traits_of(group).holds_hidden_states
    mixed: dict[str, kvi.KVCacheSpec] = {
        "h": _hidden_or_latent(kvi.HiddenStateCacheSpec),
        "m": _hidden_or_latent(kvi.MLAAttentionSpec),
    }
    mixed_traits = traits_of(kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=mixed))
    assert mixed_traits.is_mla  # the traits both members share are answered
    with pytest.raises(MixedGroupTraitsError, match="holds_hidden_states"):
        _ = mixed_traits.holds_hidden_states
