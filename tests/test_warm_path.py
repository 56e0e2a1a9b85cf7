"""The warm path (pure Python: the wheel is py3-none-any): a hit returns the cached answer
without resolving, a miss resolves, errors pass through unchained; a traits object whose
class can be falsy is served warm like any other."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import KVLayoutTraits, UnsupportedSpecError, traits_of
from kvspec_traits._caches import Answers
from kvspec_traits.extend import LayoutTraits, Registry


def test_hit_returns_the_cached_answer_and_a_miss_resolves() -> None:
    registry = Registry().copy()
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    calls: list[object] = []

    def resolve(s: kvi.KVCacheSpec) -> KVLayoutTraits:
        calls.append(s)
        return registry.traits_of(s)

    answers = Answers()
    warm = answers.warm_path(resolve)
    first = warm(spec)
    assert calls == [spec]
    answers.by_id[id(spec)] = first
    assert warm(spec) is first
    assert calls == [spec]  # served from the dict, resolve not called again
    # 16 * 2 * (64 + 64) * 2 B
    assert first.page_size_bytes == 8192


def test_errors_pass_through_unchained_and_wrong_calls_are_type_errors() -> None:
    def resolve(s: object) -> KVLayoutTraits:
        raise LookupError(f"no traits for {s!r}")

    warm = Answers().warm_path(resolve)
    with pytest.raises(LookupError, match="no traits for 7") as raised:
        warm(7)  # type: ignore[arg-type]
    # Raised outside the cache miss's except block: no "during handling of KeyError".
    assert raised.value.__context__ is None
    with pytest.raises(TypeError):
        warm()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        warm(1, 2)  # type: ignore[call-arg, arg-type]


def test_the_default_warm_path_refuses_a_non_spec_by_name() -> None:
    with pytest.raises(UnsupportedSpecError, match="traits_of takes a spec instance") as err:
        traits_of(object())  # type: ignore[arg-type]
    assert err.value.__context__ is None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _SizedTraits(LayoutTraits):
    """A third party's traits class with a length: its instances are falsy."""

    def __len__(self) -> int:
        return 0


def _sized(traits: KVLayoutTraits) -> _SizedTraits:
    assert isinstance(traits, LayoutTraits)
    return _SizedTraits(**{f.name: getattr(traits, f.name) for f in dataclasses.fields(traits)})


def test_a_registry_answers_a_falsy_traits_object_warm() -> None:
    """Failure mode: a warm path that tells kinds of entries apart by truth (the dict
    version design did) would never serve a falsy traits object warm."""
    registry = Registry().copy()
    builtin = registry.adapters()[kvi.FullAttentionSpec]
    declared = registry.registrations()[kvi.FullAttentionSpec]

    calls: list[object] = []

    def adapt(spec: kvi.FullAttentionSpec) -> KVLayoutTraits:
        calls.append(spec)
        return _sized(builtin(spec))

    registry.register(
        kvi.FullAttentionSpec,
        adapt,
        replace=True,
        reads=declared.reads,
        ignores=declared.ignores,
    )
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    first = registry.traits_of(spec)
    assert isinstance(first, _SizedTraits) and first.page_size_bytes == 8192
    assert not first and registry._answers.by_id[id(spec)] is first
    for _ in range(3):
        assert registry.traits_of(spec) is first
    assert calls == [spec]
