"""Static typing contract, checked by mypy (the suite runs mypy over tests/).

The ``assert_type`` lines fail mypy if the decorator erased the adapter's type; each
``# type: ignore[code]`` line is a case mypy must reject (``warn_unused_ignores`` turns an
accepted one into an error). The runtime test makes the same calls for real.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, assert_type

import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import GroupTraits, KVLayoutTraits, traits_of
from kvspec_traits.extend import LayoutTraits, Registry, register_adapter


def _registry() -> Registry:
    return Registry(builtins=False, entry_points=False, name="typing")


def adapt_mamba(spec: kvi.MambaSpec) -> LayoutTraits:
    raise NotImplementedError


def adapt_full(spec: kvi.FullAttentionSpec) -> LayoutTraits:
    raise NotImplementedError


def adapt_any_attention(spec: kvi.AttentionSpec) -> LayoutTraits:
    raise NotImplementedError


if TYPE_CHECKING:
    r = _registry()
    # The decorator returns the adapter with its own parameter and return types.
    assert_type(
        register_adapter(kvi.MambaSpec, registry=r)(adapt_mamba),
        Callable[[kvi.MambaSpec], LayoutTraits],
    )
    assert_type(
        register_adapter(kvi.MambaSpec, adapt_mamba, registry=r),
        Callable[[kvi.MambaSpec], LayoutTraits],
    )
    # An adapter for a base class may serve a subclass (parameters are contravariant).
    register_adapter(kvi.SlidingWindowMLASpec, adapt_any_attention, registry=r)
    # The protocol's members are read-only and typed.
    t = traits_of(
        kvi.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    )
    assert_type(t, KVLayoutTraits)
    assert_type(t.is_mla, bool)
    assert_type(t.tp_shards, int | None)

    # Rejected: an adapter whose parameter does not accept the registered class.
    register_adapter(kvi.MambaSpec, adapt_full, registry=r)  # type: ignore[arg-type]
    register_adapter(kvi.MambaSpec, registry=r)(adapt_full)  # type: ignore[arg-type]
    # Rejected: registering for something that is not a spec class.
    register_adapter(int, adapt_full, registry=r)  # type: ignore[type-var, arg-type]
    # Rejected: traits are read-only.
    t.is_mla = True  # type: ignore[misc]
    # Rejected: the value type and the group type both satisfy the protocol; a plain
    # object does not.
    ok1: KVLayoutTraits = LayoutTraits.__new__(LayoutTraits)
    ok2: KVLayoutTraits = GroupTraits.__new__(GroupTraits)
    bad: KVLayoutTraits = object()  # type: ignore[assignment]


def test_the_decorator_returns_the_function_unchanged() -> None:
    r = _registry()
    assert register_adapter(kvi.MambaSpec, registry=r)(adapt_mamba) is adapt_mamba
    assert register_adapter(kvi.FullAttentionSpec, adapt_full, registry=r) is adapt_full
    assert r.adapters() == {kvi.MambaSpec: adapt_mamba, kvi.FullAttentionSpec: adapt_full}
