"""A subclass without an adapter of its own that overrides a member its parent's answer
depends on is refused, naming the members, even when its byte math agrees; a pure marker
subclass is still answered as its parent.

Each override below returns exactly what the parent computes, so the byte-math check
cannot see it: only the member accounting can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import KVLayoutTraits, TokenScope, UnsupportedSpecError, traits_of
from kvspec_traits.extend import ATTENTION_IGNORES, ATTENTION_READS, Registry, default_registry


@dataclass(frozen=True, kw_only=True)
class SamePageSpec(kvi.FullAttentionSpec):
    @property
    def page_size_bytes(self) -> int:
        return super().page_size_bytes


@dataclass(frozen=True, kw_only=True)
class SameRealPageSpec(kvi.FullAttentionSpec):
    @property
    def real_page_size_bytes(self) -> int:
        return super().real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class SameCellSpec(kvi.FullAttentionSpec):
    @property
    def state_content_size_bytes(self) -> int:
        return super().state_content_size_bytes


@dataclass(frozen=True, kw_only=True)
class SameHeadsSpec(kvi.FullAttentionSpec):
    @property
    def num_heads(self) -> int:  # read by the attention adapter (ATTENTION_READS)
        return super().num_heads


@dataclass(frozen=True, kw_only=True)
class WindowedFullSpec(kvi.FullAttentionSpec):
    """Keeps only a window: its manager-facing members say so, its bytes do not."""

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return 8 * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        return 8


@dataclass(frozen=True, kw_only=True)
class MergedSpec(kvi.FullAttentionSpec):
    @classmethod
    def merge(cls, specs: list[Any]) -> Any:
        return specs[0]


@dataclass(frozen=True, kw_only=True)
class RetainingWindowSpec(kvi.SlidingWindowSpec):
    @property
    def num_retained_tokens(self) -> int:  # vLLM >= 0.33 defines it; overriding counts
        return 4 * self.sliding_window


@dataclass(frozen=True, kw_only=True)
class MarkerSpec(kvi.FullAttentionSpec):
    """Only a name: laid out exactly like its parent."""


@dataclass(frozen=True, kw_only=True)
class DescribedSpec(kvi.FullAttentionSpec):
    """Adds a method nothing layout-related reads."""

    def describe(self) -> str:
        return f"{self.num_kv_heads} heads"


class PlainSubclass(kvi.FullAttentionSpec):
    """Not even a dataclass of its own."""


def _kwargs() -> dict[str, Any]:
    return {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}


@pytest.mark.parametrize(
    ("cls", "members"),
    [
        (SamePageSpec, ("page_size_bytes",)),
        (SameRealPageSpec, ("real_page_size_bytes",)),
        (SameCellSpec, ("state_content_size_bytes",)),
        (SameHeadsSpec, ("num_heads",)),
        (WindowedFullSpec, ("max_memory_usage_bytes", "max_num_blocks_per_req")),
        (MergedSpec, ("merge",)),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_overriding_a_member_the_answer_depends_on_is_refused(
    cls: type[kvi.FullAttentionSpec], members: tuple[str, ...]
) -> None:
    spec = cls(**_kwargs())
    # the byte math agrees with the parent's: 16 * 8 * 256 * 2 B
    assert spec.page_size_bytes == 65536
    with pytest.raises(
        UnsupportedSpecError,
        match=rf"{cls.__name__}.*it overrides "
        rf"{', '.join(members)}.*FullAttentionSpec",
    ) as info:
        traits_of(spec)
    assert (info.value.spec_type, info.value.members) == (cls, members)
    assert default_registry.overridden_members(cls) == members


def test_a_window_member_of_a_windowed_class_is_refused() -> None:
    spec = RetainingWindowSpec(**_kwargs(), sliding_window=128)
    with pytest.raises(UnsupportedSpecError, match="num_retained_tokens") as info:
        traits_of(spec)
    assert info.value.members == ("num_retained_tokens",)


def test_a_member_the_parents_adapter_declares_it_reads_counts_too() -> None:
    registry = Registry().copy()
    builtin = registry.adapters()[kvi.FullAttentionSpec]

    @dataclass(frozen=True, kw_only=True)
    class ScoredSpec(kvi.FullAttentionSpec):
        def score(self) -> int:
            return 1

    @dataclass(frozen=True, kw_only=True)
    class RescoredSpec(ScoredSpec):
        def score(self) -> int:
            return 2

    def adapt(spec: ScoredSpec) -> KVLayoutTraits:
        return builtin(spec)

    registry.register(
        ScoredSpec, adapt, reads=(*ATTENTION_READS, "score"), ignores=ATTENTION_IGNORES
    )
    assert registry.traits_of(ScoredSpec(**_kwargs())).page_size_bytes == 65536
    assert registry.overridden_members(RescoredSpec) == ("score",)
    with pytest.raises(UnsupportedSpecError, match="it overrides score") as info:
        registry.traits_of(RescoredSpec(**_kwargs()))
    assert info.value.members == ("score",)


@pytest.mark.parametrize(
    "cls", [MarkerSpec, DescribedSpec, PlainSubclass], ids=lambda c: c.__name__
)
def test_a_marker_subclass_is_still_answered_as_its_parent(
    cls: type[kvi.FullAttentionSpec],
) -> None:
    t = traits_of(cls(**_kwargs()))
    assert (t.spec_name, t.page_size_bytes, t.token_scope) == (
        cls.__qualname__,
        65536,
        TokenScope.FULL,
    )
    assert default_registry.overridden_members(cls) == ()


def test_a_class_with_its_own_adapter_may_override_anything() -> None:
    registry = Registry().copy()
    builtin = registry.adapters()[kvi.FullAttentionSpec]

    def adapt(spec: WindowedFullSpec) -> KVLayoutTraits:
        return builtin(spec)

    registry.register(WindowedFullSpec, adapt, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES)
    assert registry.overridden_members(WindowedFullSpec) == ()
    assert registry.traits_of(WindowedFullSpec(**_kwargs())).page_size_bytes == 65536
