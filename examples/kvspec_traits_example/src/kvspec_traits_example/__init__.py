"""An example third-party extension: an out-of-tree spec class and its kvspec-traits adapter.

``ScaledLatentSpec`` is what an out-of-tree attention backend might add: an MLA latent
stored as int8 with one float32 scale per token. Its page math differs from its parent
``MLAAttentionSpec``, so kvspec-traits refuses to answer for it with the parent's adapter;
this package supplies the adapter and publishes it in the ``kvspec_traits.adapters``
entry-point group (see ``pyproject.toml``), so every registry picks it up.
``representative_specs()`` gives ``kvspec-traits audit`` real instances to learn the class's
traits from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from kvspec_traits.extend import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    LayoutTraits,
    Registry,
    attention_traits,
    register_adapter,
)

__all__ = [
    "SCALE_BYTES",
    "ScaledLatentSpec",
    "adapt_scaled_latent",
    "register",
    "representative_specs",
]

SCALE_BYTES = 4  # one float32 scale per token


@dataclass(frozen=True, kw_only=True)
class ScaledLatentSpec(MLAAttentionSpec):
    """An int8 MLA latent of ``head_size`` values plus a float32 scale per token."""

    @property
    def state_content_size_bytes(self) -> int:
        return self.head_size * self.dtype.itemsize + SCALE_BYTES


def adapt_scaled_latent(spec: ScaledLatentSpec) -> LayoutTraits:
    """Traits from the spec's fields: each cell is the int8 latent then its float32 scale;
    one latent slot, replicated like any MLA cache (the built-in attention math)."""
    return attention_traits(
        spec, cell=(("latent", spec.head_size, spec.dtype), ("scale", 1, "float32"))
    )


def register(registry: Registry) -> None:
    """Entry point of the ``kvspec_traits.adapters`` group: called once per registry."""
    # The fields the adapter reads are the attention fields (head_size, dtype, ...); the
    # rest of MLAAttentionSpec's fields it knows do not change a page. Without reads= it
    # would declare none, and every spec of the class would be refused.
    register_adapter(
        ScaledLatentSpec,
        adapt_scaled_latent,
        registry=registry,
        reads=ATTENTION_READS,
        ignores=ATTENTION_IGNORES,
    )


def representative_specs() -> list[ScaledLatentSpec]:
    """Real instances of this package's spec classes, for ``kvspec-traits audit``'s class
    sets (the optional hook next to the entry point): a DeepSeek-sized latent."""
    return [
        ScaledLatentSpec(
            block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.int8
        )
    ]
