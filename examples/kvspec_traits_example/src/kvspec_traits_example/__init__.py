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

from kvspec_traits import LayoutTraits, Registry, register_adapter
from kvspec_traits.helpers import attention_traits

__all__ = ["SCALE_BYTES", "ScaledLatentSpec", "adapt_scaled_latent", "register"]

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
    return attention_traits(spec, cell=(("latent", spec.head_size, spec.dtype),
                                        ("scale", 1, "float32")))


def register(registry: Registry) -> None:
    """Entry point of the ``kvspec_traits.adapters`` group: called once per registry."""
    register_adapter(ScaledLatentSpec, adapt_scaled_latent, registry=registry)
