"""Property tests: for valid parameters of every spec class, traits agree with vLLM's own
byte math (page_size_bytes, the unpadded page, num_heads, state size) and with vLLM's own
logical page shape ``compute_layer_kv_cache_shape_bytes`` (B, H, N, C)."""

from __future__ import annotations

from fractions import Fraction
from math import prod
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import TPLayout, traits_of

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.uint8,
    torch.int8,
    torch.float8_e4m3fn,
]

# class -> extra keyword arguments it requires
ATTENTION_CLASSES: dict[type[kvi.AttentionSpec], st.SearchStrategy[dict[str, Any]]] = {
    kvi.AttentionSpec: st.just({}),
    kvi.FullAttentionSpec: st.fixed_dictionaries(
        {}, optional={"sliding_window": st.integers(1, 4096)}
    ),
    kvi.MLAAttentionSpec: st.fixed_dictionaries(
        {}, optional={"alignment": st.sampled_from([512, 576])}
    ),
    kvi.HiddenStateCacheSpec: st.just({}),
    kvi.SinkFullAttentionSpec: st.fixed_dictionaries({"sink_len": st.integers(1, 64)}),
    kvi.RSWASpec: st.fixed_dictionaries({"rswa_window": st.integers(1, 4096)}),
    kvi.ChunkedLocalAttentionSpec: st.fixed_dictionaries(
        {"attention_chunk_size": st.integers(1, 8192)}
    ),
    kvi.SlidingWindowSpec: st.fixed_dictionaries({"sliding_window": st.integers(1, 4096)}),
    kvi.SlidingWindowMLASpec: st.fixed_dictionaries(
        {"sliding_window": st.integers(1, 4096)},
        optional={"alignment": st.sampled_from([512, 576])},
    ),
    kvi.CircularBufferSpec: st.just({}),
    kvi.EncoderOnlyAttentionSpec: st.just({}),
    kvi.CrossAttentionSpec: st.just({}),
}
TOKENS_PER_STATE: list[int | Fraction] = [1, 2, 4, 128, Fraction(1, 2), Fraction(1, 4)]


@st.composite
def attention_specs(draw: st.DrawFn, cls: type[kvi.AttentionSpec]) -> kvi.AttentionSpec:
    block_size = draw(st.sampled_from([1, 4, 16, 64, 128, 256]))
    tps = draw(st.sampled_from([t for t in TOKENS_PER_STATE if t <= block_size]))
    kwargs: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": draw(st.integers(1, 64)),
        "head_size": draw(st.integers(1, 1024)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "tokens_per_state": tps,
        "max_tp_shards": draw(st.none() | st.integers(1, 8)),
        "num_head_slots": draw(st.none() | st.integers(1, 64)),
        "state_content_bytes": draw(st.none() | st.integers(1, 4096)),
        **draw(ATTENTION_CLASSES[cls]),
    }
    if draw(st.booleans()) and not issubclass(cls, kvi.MLAAttentionSpec | kvi.SlidingWindowMLASpec):
        kwargs["head_size_v"] = draw(st.integers(0, 1024))
    spec = cls(**kwargs)
    if "alignment" not in kwargs and draw(st.booleans()):
        # padding as a backend publishes it: at least the content
        spec = cls(
            **kwargs, page_size_padded=spec.unpadded_page_size_bytes + draw(st.integers(0, 4096))
        )
    return spec


def _shape_bytes(spec: kvi.KVCacheSpec) -> int:
    return prod(kvi.compute_layer_kv_cache_shape_bytes(spec, 1))


@pytest.mark.parametrize("cls", list(ATTENTION_CLASSES), ids=lambda c: c.__name__)
def test_attention_traits_match_vllm_byte_math(cls: type[kvi.AttentionSpec]) -> None:
    @SETTINGS
    @given(attention_specs(cls))
    def check(spec: kvi.AttentionSpec) -> None:
        t = traits_of(spec)
        assert t.page_size_bytes == spec.page_size_bytes
        assert t.unpadded_page_size_bytes == spec.unpadded_page_size_bytes == _shape_bytes(spec)
        assert (t.num_head_slots, t.states_per_block, t.state_bytes) == (
            spec.num_heads,
            spec.num_states,
            spec.state_content_size_bytes,
        )
        assert sum(c.nbytes for c in t.components) == t.unpadded_page_size_bytes
        # content per token times tokens per state is one state of every head slot
        assert t.per_token_bytes is not None and t.tokens_per_state is not None
        assert t.per_token_bytes * t.tokens_per_state == t.num_head_slots * t.state_bytes
        assert t.is_mla == (spec.head_size_v == 0)
        replicated = spec.max_tp_shards == 1 or spec.head_size_v == 0
        assert (t.tp_layout is TPLayout.REPLICATED) == replicated
        assert t.tp_shards == (1 if replicated else spec.max_tp_shards)
        # An independent oracle: upstream NIXL's fixed class list, which registers these
        # classes TP-replicated. The traits must agree without any class list.
        if isinstance(spec, kvi.MLAAttentionSpec | kvi.SlidingWindowMLASpec):
            assert t.is_mla
            assert t.tp_layout is TPLayout.REPLICATED

    check()


@st.composite
def mamba_specs(draw: st.DrawFn) -> kvi.MambaSpec:
    n = draw(st.integers(1, 3))
    shapes = tuple(
        tuple(draw(st.lists(st.integers(1, 64), min_size=1, max_size=3))) for _ in range(n)
    )
    dtypes = tuple(draw(st.sampled_from(DTYPES)) for _ in range(n))
    content = sum(prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True))
    padded = draw(st.none() | st.integers(content, content + 8192))
    return kvi.MambaSpec(
        block_size=draw(st.sampled_from([16, 1024])),
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=padded,
        tp_replicated=draw(st.booleans()),
    )


@SETTINGS
@given(mamba_specs())
def test_mamba_traits_match_vllm_byte_math(spec: kvi.MambaSpec) -> None:
    t = traits_of(spec)
    assert t.page_size_bytes == spec.page_size_bytes
    assert t.unpadded_page_size_bytes == spec.real_page_size_bytes == _shape_bytes(spec)
    assert [c.shape for c in t.components] == [tuple(s) for s in spec.shapes]
    assert t.tp_layout is (TPLayout.REPLICATED if spec.tp_replicated else TPLayout.STATE_SHARDED)
    assert t.per_token_bytes is None and t.tokens_per_state is None


@SETTINGS
@given(st.integers(1, 1 << 20), st.sampled_from([16, 64, 256]), st.integers(1, 64))
def test_hisparse_traits_match_vllm_page(page: int, block: int, per_request: int) -> None:
    for spec in (
        kvi.HiSparseHotSpec(block_size=block, page_size=page, blocks_per_request=per_request),
        kvi.HiSparseResidentSpec(block_size=block, page_size=page),
    ):
        t = traits_of(spec)
        assert t.page_size_bytes == spec.page_size_bytes == page
        assert t.per_token_bytes == Fraction(page, block)
        assert not t.transferable


@SETTINGS
@given(st.lists(attention_specs(kvi.FullAttentionSpec), min_size=1, max_size=4))
def test_group_page_is_the_sum_of_member_pages(drawn: list[kvi.FullAttentionSpec]) -> None:
    # vLLM groups only layers of one block size (UniformTypeKVCacheSpecs.is_uniform_type)
    members = [m for m in drawn if m.block_size == drawn[0].block_size]
    group = kvi.UniformTypeKVCacheSpecs(
        block_size=members[0].block_size,
        kv_cache_specs={f"layer{i}": m for i, m in enumerate(members)},
    )
    t = traits_of(group)
    assert t.page_size_bytes == group.page_size_bytes == sum(m.page_size_bytes for m in members)
