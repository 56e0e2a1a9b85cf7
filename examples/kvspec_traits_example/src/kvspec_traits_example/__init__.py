"""An example third-party extension: an out-of-tree spec class and its kvspec-traits adapter.

``ScaledLatentSpec`` is what an out-of-tree attention backend might add: an MLA latent
stored as int8 with one float32 scale per token. Its page math differs from its parent
``MLAAttentionSpec``, so kvspec-traits refuses to answer for it with the parent's adapter;
this package supplies the adapter and publishes it in the ``kvspec_traits.adapters``
entry-point group (see ``pyproject.toml``), so every registry picks it up.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import MLAAttentionSpec

from kvspec_traits import (
    LayoutTraits,
    PageComponent,
    Registry,
    TokenScope,
    TPLayout,
    register_adapter,
)

__all__ = ["SCALE_BYTES", "ScaledLatentSpec", "adapt_scaled_latent", "register"]

SCALE_BYTES = 4  # one float32 scale per token


@dataclass(frozen=True, kw_only=True)
class ScaledLatentSpec(MLAAttentionSpec):
    """An int8 MLA latent of ``head_size`` values plus a float32 scale per token."""

    @property
    def state_content_size_bytes(self) -> int:
        return self.head_size * self.dtype.itemsize + SCALE_BYTES


def adapt_scaled_latent(spec: ScaledLatentSpec) -> LayoutTraits:
    """Traits from the spec's fields: one latent slot, replicated like any MLA cache."""
    states = spec.block_size // int(spec.tokens_per_state)
    cell = spec.head_size * spec.dtype.itemsize + SCALE_BYTES
    content = spec.num_heads * states * cell
    return LayoutTraits(
        spec_name=type(spec).__qualname__,
        is_mla=True,
        tp_layout=TPLayout.REPLICATED,
        tp_shards=1,
        token_scope=TokenScope.FULL,
        window_tokens=None,
        block_size=spec.block_size,
        num_head_slots=spec.num_heads,
        kv_head_contiguous=True,
        tokens_per_state=spec.tokens_per_state,
        states_per_block=states,
        state_bytes=cell,
        unpadded_page_size_bytes=content,
        page_size_bytes=spec.page_size_bytes,
        per_token_bytes=spec.num_heads * cell,
        dtype=str(spec.dtype).removeprefix("torch."),
        kv_quant_mode=spec.kv_quant_mode.name,
        components=(
            PageComponent(name="latent", shape=(spec.num_heads, states, spec.head_size),
                          dtype=str(spec.dtype).removeprefix("torch."),
                          nbytes=spec.num_heads * states * spec.head_size * spec.dtype.itemsize),
            PageComponent(name="scale", shape=(spec.num_heads, states, 1), dtype="float32",
                          nbytes=spec.num_heads * states * SCALE_BYTES),
        ),
        prefix_cacheable=spec.prefix_cacheable,
        uses_slot_mapping=spec.uses_slot_mapping,
        transferable=True,
    )


def register(registry: Registry) -> None:
    """Entry point of the ``kvspec_traits.adapters`` group: called once per registry."""
    register_adapter(ScaledLatentSpec, adapt_scaled_latent, registry=registry)
