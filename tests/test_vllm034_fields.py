"""The fields vLLM 0.34 added to spec classes, each set away from its default on every
class that has it, with traits hand-computed from vLLM 0.34's formulas.

- ``AttentionSpec.kv_head_major_slots`` groups the head slots by KV head (``H2ND``). It
  leaves ``page_size_bytes`` unchanged and moves bytes: ``kv_head_contiguous`` says so.
- ``MambaSpec.state_alignment`` starts every state at a multiple of that many bytes:
  ``state_content_size_bytes = sum(round_up(prod(shape) * itemsize, alignment))``.
- ``SlidingWindowMLASpec.non_causal_multi_token_decode`` is scheduling only.

On 0.32 and 0.33 the same tests check that these fields do not exist there (so nothing
is left unaccounted and the built-ins' declarations of them are inert).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import vllm
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import InvalidSpecError, PageComponent, TokenScope, TPLayout, traits_of
from kvspec_traits.extend import LayoutTraits, default_registry

V034 = vllm.__version__.startswith("0.34")
NVFP4 = kvi.KVQuantMode.NVFP4
# Per head slot and state: nvfp4 packs 128 values in 64 B plus 8 B of fp8 block scales
# (vLLM's nvfp4_kv_cache_full_dim(128) = 72 uint8 elements); K and V are separate slots.
CELL = 72

# class -> (extra kwargs, token scope, window, MLA)
ATTENTION: dict[type[kvi.AttentionSpec], tuple[dict[str, Any], TokenScope, int | None, bool]] = {
    kvi.AttentionSpec: ({}, TokenScope.FULL, None, False),
    kvi.FullAttentionSpec: ({}, TokenScope.FULL, None, False),
    kvi.MLAAttentionSpec: ({}, TokenScope.FULL, None, True),
    kvi.HiddenStateCacheSpec: ({}, TokenScope.FULL, None, True),
    kvi.SinkFullAttentionSpec: ({"sink_len": 4}, TokenScope.FULL, None, False),
    kvi.RSWASpec: ({"rswa_window": 1024}, TokenScope.PROMPT_AND_WINDOW, 1024, False),
    kvi.ChunkedLocalAttentionSpec: (
        {"attention_chunk_size": 8192},
        TokenScope.CHUNKED,
        8192,
        False,
    ),
    kvi.SlidingWindowSpec: ({"sliding_window": 128}, TokenScope.SLIDING_WINDOW, 128, False),
    kvi.SlidingWindowMLASpec: ({"sliding_window": 128}, TokenScope.SLIDING_WINDOW, 128, True),
    kvi.CircularBufferSpec: ({}, TokenScope.RING, 16, False),
    kvi.EncoderOnlyAttentionSpec: ({}, TokenScope.NONE, None, False),
    kvi.CrossAttentionSpec: ({}, TokenScope.ENCODER, None, False),
}


def _field_names(cls: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _nvfp4_page(cls: type[kvi.AttentionSpec], **kw: Any) -> kvi.AttentionSpec:
    # As FlashInfer's / MiniMax-M3's customize_spec publish an NVFP4 page: 8 KV heads,
    # 16 slots (K and V of each head), packed cells.
    extra, *_ = ATTENTION[cls]
    return cls(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.uint8,
        kv_quant_mode=NVFP4,
        num_head_slots=16,
        state_content_bytes=CELL,
        **extra,
        **kw,
    )


def test_the_new_fields_exist_exactly_on_0_34() -> None:
    assert ("kv_head_major_slots" in _field_names(kvi.AttentionSpec)) is V034
    assert ("state_alignment" in _field_names(kvi.MambaSpec)) is V034
    assert ("non_causal_multi_token_decode" in _field_names(kvi.SlidingWindowMLASpec)) is V034
    # whatever the series, no field of any class is left unaccounted
    for cls in [*ATTENTION, kvi.MambaSpec]:
        assert default_registry.unaccounted_fields(cls) == (), cls


@pytest.mark.parametrize("cls", list(ATTENTION), ids=lambda c: c.__name__)
def test_kv_head_major_slots_moves_bytes_without_changing_the_page(
    cls: type[kvi.AttentionSpec],
) -> None:
    if not V034:
        with pytest.raises(TypeError, match="kv_head_major_slots"):
            _nvfp4_page(cls, kv_head_major_slots=True)
        return
    _, scope, window, mla = ATTENTION[cls]
    slot_major = _nvfp4_page(cls)
    head_major = _nvfp4_page(cls, kv_head_major_slots=True)
    # 16 slots * 16 states * 72 B, both ways: vLLM's page size cannot tell them apart
    assert slot_major.page_size_bytes == head_major.page_size_bytes == 16 * 16 * CELL
    before, after = traits_of(slot_major), traits_of(head_major)
    assert isinstance(before, LayoutTraits) and isinstance(after, LayoutTraits)
    assert after == LayoutTraits(
        spec_name=cls.__qualname__,
        is_mla=mla,
        tp_layout=TPLayout.REPLICATED if mla else TPLayout.HEAD_SHARDED,
        tp_shards=1 if mla else None,
        token_scope=scope,
        window_tokens=window,
        block_size=16,
        num_head_slots=16,
        kv_head_contiguous=True,
        tokens_per_state=1,
        states_per_block=16,
        state_bytes=CELL,
        unpadded_page_size_bytes=16 * 16 * CELL,
        page_size_bytes=16 * 16 * CELL,
        per_token_bytes=16 * CELL,
        dtype="uint8",
        kv_quant_mode="NVFP4",
        components=(
            PageComponent(name="packed", shape=(16, 16, CELL), dtype="uint8", nbytes=18432),
        ),
        prefix_cacheable=cls is not kvi.CircularBufferSpec,
        uses_slot_mapping=cls is not kvi.CircularBufferSpec,
        transferable=scope not in (TokenScope.NONE, TokenScope.ENCODER),
        attention_page=True,
        token_paged=scope is not TokenScope.RING,
        # every prompt block kept: FullAttentionSpec and its subclasses (R-SWA too)
        keeps_prompt=issubclass(cls, kvi.FullAttentionSpec),
        # the marker class of extracted hidden states, and no other
        holds_hidden_states=cls is kvi.HiddenStateCacheSpec,
        grouped=False,
    )
    # the slot-major page differs in that trait alone: a head's K and V slots are 8 apart
    assert dataclasses.replace(after, kv_head_contiguous=False) == before


def test_kv_head_major_slots_with_slots_that_cannot_be_grouped_is_refused() -> None:
    # The field is typed by the installed vLLM (0.32): passed by name through a dict.
    kwargs: dict[str, Any] = {
        "block_size": 16,
        "num_kv_heads": 8,
        "head_size": 128,
        "dtype": torch.uint8,
        "num_head_slots": 12,
        "state_content_bytes": CELL,
        "kv_head_major_slots": True,
    }
    if not V034:
        with pytest.raises(TypeError, match="kv_head_major_slots"):
            kvi.FullAttentionSpec(**kwargs)
        return
    spec = kvi.FullAttentionSpec(**kwargs)
    with pytest.raises(InvalidSpecError, match=r"kv_head_major_slots=True.*12.*8 KV heads"):
        traits_of(spec)
    not_a_bool: dict[str, Any] = {"num_head_slots": 16, "kv_head_major_slots": "yes"}
    with pytest.raises(InvalidSpecError, match="must be a bool"):
        traits_of(dataclasses.replace(spec, **not_a_bool))


@pytest.mark.parametrize(
    ("alignment", "padded", "parts", "page"),
    [
        # conv (3, 5) bf16 = 30 B, SSM (4, 4) fp32 = 64 B
        (1, None, [("state0", 30), ("state1", 64)], 94),
        # 30 B rounded up to 32: 2 B of padding before the SSM state at byte 32
        (16, None, [("state0", 30), ("pad0", 2), ("state1", 64)], 96),
        (64, None, [("state0", 30), ("pad0", 34), ("state1", 64)], 128),
        (16, 128, [("state0", 30), ("pad0", 2), ("state1", 64)], 128),
    ],
)
def test_state_alignment_places_each_state_on_its_boundary(
    alignment: int, padded: int | None, parts: list[tuple[str, int]], page: int
) -> None:
    kwargs: dict[str, Any] = {
        "block_size": 16,
        "shapes": ((3, 5), (4, 4)),
        "dtypes": (torch.bfloat16, torch.float32),
        "page_size_padded": padded,
    }
    kwargs["state_alignment"] = alignment
    if not V034:
        with pytest.raises(TypeError, match="state_alignment"):
            kvi.MambaSpec(**kwargs)
        return
    spec = kvi.MambaSpec(**kwargs)
    content = sum(n for _, n in parts)
    assert (spec.real_page_size_bytes, spec.page_size_bytes) == (content, page)
    t = traits_of(spec)
    assert [(c.name, c.nbytes) for c in t.components] == parts
    assert (t.unpadded_page_size_bytes, t.page_size_bytes, t.state_bytes) == (
        content,
        page,
        content,
    )
    assert t.token_scope is TokenScope.RECURRENT_STATE and t.dtype is None  # bf16 + fp32


def test_non_causal_multi_token_decode_changes_no_trait() -> None:
    base = kvi.SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=128
    )
    new: dict[str, Any] = {"non_causal_multi_token_decode": True}
    if not V034:
        with pytest.raises(TypeError, match="non_causal_multi_token_decode"):
            dataclasses.replace(base, **new)
        return
    drafted = dataclasses.replace(base, **new)
    assert drafted != base
    t = traits_of(drafted)
    # 64 tokens * 576 * 2 B, one latent, replicated
    assert (t.page_size_bytes, t.is_mla, t.token_scope) == (73728, True, TokenScope.SLIDING_WINDOW)
    assert t == traits_of(base)


def test_the_order_of_head_slots_is_a_fingerprint_difference() -> None:
    # Two peers whose pages agree in size and differ in the order of their head slots
    # must not pair up: the NIXL fingerprint carries kv_head_contiguous (and a page that
    # does not keep a head's slots together is never split by heads).
    from kvspec_traits.extend import Registry
    from kvspec_traits.transfer import HandshakeMismatchError, check_handshake, plan_regions

    registry = Registry().copy()
    if V034:
        head_major = _nvfp4_page(kvi.FullAttentionSpec, kv_head_major_slots=True)
    else:
        # Before 0.34 no field says it: an adapter of our own stands for one that does.
        builtin = registry.adapters()[kvi.FullAttentionSpec]

        def grouped(spec: kvi.FullAttentionSpec) -> LayoutTraits:
            traits = builtin(spec)
            assert isinstance(traits, LayoutTraits)
            return dataclasses.replace(traits, kv_head_contiguous=spec.head_size == 128)

        declared = registry.registrations()[kvi.FullAttentionSpec]
        registry.register(
            kvi.FullAttentionSpec,
            grouped,
            replace=True,
            reads=declared.reads,
            ignores=declared.ignores,
        )
        head_major = _nvfp4_page(kvi.FullAttentionSpec)
    slot_major = _nvfp4_page(kvi.FullAttentionSpec)
    if not V034:
        slot_major = dataclasses.replace(slot_major, head_size=64, state_content_bytes=CELL)

    def plan(spec: kvi.AttentionSpec) -> Any:
        cache = torch.zeros((4, 16, 16, CELL), dtype=torch.uint8)  # [B, H, N, C]
        return plan_regions({"l0": cache}, specs={"l0": spec}, num_blocks=4, registry=registry)

    a, b = plan(head_major), plan(slot_major)
    assert [r.block_len for r in a.regions] == [r.block_len for r in b.regions] == [16 * 16 * CELL]
    assert [r.head_major for r in a.regions] == [True]
    assert [r.head_major for r in b.regions] == [False]  # a head's slots are 8 apart
    assert a.fingerprint().digest != b.fingerprint().digest
    with pytest.raises(HandshakeMismatchError, match="kv_head_contiguous: local=True remote=False"):
        check_handshake(a, b.fingerprint())
