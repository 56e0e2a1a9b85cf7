"""Fail-closed: a spec class the library does not know gets an error, never a parent's answer.

Each synthetic class here is a real subclass of a real vLLM spec class.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import TokenScope, TPLayout, TraitsMismatchError, UnsupportedSpecError, traits_of
from kvspec_traits.extend import LayoutTraits, Registry
from tests import fresh


@dataclass(frozen=True, kw_only=True)
class NewCompressedMLASpec(kvi.SlidingWindowSpec):
    """A future compressed MLA cache that keeps SlidingWindowSpec's fields but stores one
    latent per token: its own page math drops V without setting head_size_v = 0."""

    @property
    def state_content_size_bytes(self) -> int:
        return self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class DoubleBufferedStateSpec(kvi.MambaSpec):
    """A new recurrent-state spec keeping two copies of every state tensor per block."""

    @property
    def page_size_bytes(self) -> int:
        return 2 * super().page_size_bytes


@dataclass(frozen=True, kw_only=True)
class DirectSpec(kvi.KVCacheSpec):
    """A direct KVCacheSpec subclass with a page of its own."""

    page: int = 4096

    @property
    def page_size_bytes(self) -> int:
        return self.page


@dataclass(frozen=True, kw_only=True)
class TaggedFullSpec(kvi.FullAttentionSpec):
    """A subclass that only adds metadata: laid out exactly like its parent."""

    tag: str = "draft"


@dataclass(frozen=True, kw_only=True)
class LatentWindowSpec(kvi.SlidingWindowSpec):
    """A new sliding-window MLA class that says 'no V' through vLLM's own field."""

    head_size_v: int = 0


def _compressed() -> NewCompressedMLASpec:
    return NewCompressedMLASpec(
        block_size=64, num_kv_heads=1, head_size=512, dtype=torch.bfloat16, sliding_window=128
    )


def test_mla_page_under_a_non_mla_parent_is_refused() -> None:
    spec = _compressed()
    # Its own page: 64 * 512 * 2 = 65536; the SlidingWindowSpec adapter would say
    # 64 * (512 + 512) * 2 = 131072 and call it head-sharded.
    assert spec.page_size_bytes == 65536
    with pytest.raises(
        UnsupportedSpecError, match=r"NewCompressedMLASpec.*SlidingWindowSpec"
    ) as info:
        traits_of(spec)
    err = info.value
    assert err.spec_type is NewCompressedMLASpec
    assert "register_adapter(NewCompressedMLASpec)" in str(err)
    assert "page_size_bytes=131072" in str(err) and "65536" in str(err)


def test_new_state_spec_is_refused() -> None:
    spec = DoubleBufferedStateSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(UnsupportedSpecError, match="DoubleBufferedStateSpec") as info:
        traits_of(spec)
    assert info.value.spec_type is DoubleBufferedStateSpec


def test_direct_subclass_of_the_abstract_base_is_refused() -> None:
    with pytest.raises(UnsupportedSpecError, match="abstract") as info:
        traits_of(DirectSpec(block_size=16))
    assert info.value.spec_type is DirectSpec


def test_the_abstract_base_itself_is_refused() -> None:
    """vLLM 0.34's ``test_canonical_mapping.py::test_fail_closed_cases`` asks for the
    canonical mapping of a bare ``KVCacheSpec(block_size=4)``: upstream's
    ``isinstance(spec, AttentionSpec)`` is False and the mapping is ``None`` (the opaque
    per-rank fallback). The base class has no layout fields, so ``traits_of`` refuses it
    by name, and the migrated line raises where upstream returned ``None`` (the
    ``[[migrated]]`` difference in expected_differences.toml this proves)."""
    with pytest.raises(UnsupportedSpecError, match="abstract") as info:
        traits_of(kvi.KVCacheSpec(block_size=4))
    assert info.value.spec_type is kvi.KVCacheSpec


@pytest.mark.parametrize("obj", [object(), 42, "FullAttentionSpec"])
def test_objects_that_are_not_specs_are_refused(obj: object) -> None:
    with pytest.raises(UnsupportedSpecError, match="is it a vLLM KV cache spec") as info:
        traits_of(obj)  # type: ignore[arg-type]
    assert info.value.spec_type is type(obj)


def test_a_faithful_subclass_is_served_by_its_parent() -> None:
    spec = TaggedFullSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16)
    t = traits_of(spec)
    # 4 * (64 + 64) * 2 B = 1024 B/token
    assert (t.spec_name, t.per_token_bytes, t.tp_layout) == (
        "TaggedFullSpec",
        1024,
        TPLayout.HEAD_SHARDED,
    )


def test_a_new_latent_window_class_comes_out_mla_and_replicated_not_head_sharded() -> None:
    spec = LatentWindowSpec(
        block_size=64, num_kv_heads=1, head_size=512, dtype=torch.bfloat16, sliding_window=128
    )
    t = traits_of(spec)
    assert (t.is_mla, t.tp_layout, t.token_scope, t.page_size_bytes) == (
        True,
        TPLayout.REPLICATED,
        TokenScope.SLIDING_WINDOW,
        64 * 512 * 2,
    )


def test_an_adapter_that_contradicts_its_own_spec_raises_traits_mismatch() -> None:
    registry = Registry().copy(name="wrong adapter")
    full = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    right = registry.traits_of(full)
    assert isinstance(right, LayoutTraits)

    def sized_as_mla(spec: kvi.FullAttentionSpec) -> LayoutTraits:
        # the Mooncake bug in reverse: forgets V
        half = right.unpadded_page_size_bytes // 2
        return replace(right, components=(), unpadded_page_size_bytes=half, page_size_bytes=half)

    declared = registry.registrations()[kvi.FullAttentionSpec]  # keeps its fields' accounting
    registry.register(
        kvi.FullAttentionSpec,
        sized_as_mla,
        replace=True,
        reads=declared.reads,
        ignores=declared.ignores,
    )
    with pytest.raises(TraitsMismatchError, match="page_size_bytes") as info:
        registry.traits_of(full)
    err = info.value
    # 16 * 2 * (64 + 64) * 2 B = 8192; the adapter said half
    assert (err.field, err.traits_value, err.spec_value, err.spec) == (
        "page_size_bytes",
        4096,
        8192,
        full,
    )


# A vLLM release without one of the classes the built-ins name: simulated by removing two
# real classes from the real module before the adapters load (in a fresh interpreter, so
# this process's vLLM is untouched).
_WITHOUT_CLASSES = r"""
import torch
from vllm.v1 import kv_cache_interface as kvi

rswa, hot = kvi.RSWASpec, kvi.HiSparseHotSpec
del kvi.RSWASpec, kvi.HiSparseHotSpec

from kvspec_traits import UnsupportedSpecError, traits_of
from kvspec_traits.extend import Registry
from kvspec_traits._vllm_adapters import ABSENT, BUILTINS, REGISTERED

assert ABSENT == ("RSWASpec", "HiSparseHotSpec"), ABSENT
assert "RSWASpec" not in REGISTERED and "FullAttentionSpec" in REGISTERED
assert rswa not in BUILTINS.adapters() and hot not in BUILTINS.adapters()
assert kvi.FullAttentionSpec in Registry().adapters()
full = kvi.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
assert traits_of(full).page_size_bytes == 65536  # 16 * 8 * (128 + 128) * 2 B
# The class the adapters no longer know is refused, not served by FullAttentionSpec's
# adapter: rswa_window has no default and no adapter accounts for it.
spec = rswa(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, rswa_window=64)
try:
    traits_of(spec)
except UnsupportedSpecError as err:
    assert "rswa_window" in str(err), err
else:
    raise SystemExit("an RSWASpec was answered without an adapter of its own")
print("ok")
"""


def test_a_spec_class_missing_from_vllm_only_loses_its_adapter() -> None:
    import sys

    from kvspec_traits._vllm_adapters import ABSENT, REGISTERED

    assert ABSENT == ()  # every supported series has every class the built-ins name
    # KVCacheSpec, 5 keep-every-token classes, RSWA, chunked, 2 sliding, ring, encoder-only,
    # cross, Mamba, 2 HiSparse, the group: 17 names registered on 0.32, 0.33 and 0.34.
    assert len(REGISTERED) == 17
    done = fresh.run([sys.executable, "-c", _WITHOUT_CLASSES], timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-2000:]
