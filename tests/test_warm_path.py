"""The warm path: the C one (built by the set-up) and the pure-Python fallback behave alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import KVLayoutTraits, Registry, traits_of
from kvspec_traits._registry import _warm_path
from kvspec_traits._warm import WarmCache


def test_the_c_warm_path_was_built_and_serves_the_default_registry() -> None:
    # The set-up compiles src/kvspec_traits/_warm.c; CI proves it on a clean clone.
    assert type(traits_of) is WarmCache


@pytest.mark.parametrize("pure_python", [False, True], ids=["c", "python"])
def test_hit_returns_the_cached_answer_and_a_miss_resolves(pure_python: bool) -> None:
    registry = Registry().copy()
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                 dtype=torch.float16)
    calls: list[object] = []

    def resolve(s: kvi.KVCacheSpec) -> KVLayoutTraits:
        calls.append(s)
        return registry.traits_of(s)

    by_id: dict[int, KVLayoutTraits] = {}
    warm: Callable[[kvi.KVCacheSpec], KVLayoutTraits] = _warm_path(
        by_id, resolve, pure_python=pure_python)
    first = warm(spec)
    assert calls == [spec]
    by_id[id(spec)] = first
    assert warm(spec) is first
    assert calls == [spec]  # served from the dict, resolve not called again
    # 16 * 2 * (64 + 64) * 2 B
    assert first.page_size_bytes == 8192


def test_the_c_warm_path_refuses_wrong_calls_and_propagates_errors() -> None:
    def resolve(s: object) -> KVLayoutTraits:
        raise LookupError(f"no traits for {s!r}")

    warm = _warm_path({}, resolve, pure_python=False)
    with pytest.raises(TypeError, match="exactly one spec"):
        warm()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="exactly one spec"):
        warm(1, 2)  # type: ignore[call-arg, arg-type]
    with pytest.raises(LookupError, match="no traits for 7"):
        warm(7)  # type: ignore[arg-type]
