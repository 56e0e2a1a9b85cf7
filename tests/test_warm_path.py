"""The warm path (pure Python: the wheel is py3-none-any): a hit returns the cached answer
without resolving, a miss resolves, errors pass through unchained; a falsy entry is always a
Watched, so a traits object whose class can be falsy is cached behind an always-valid one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import KVLayoutTraits, UnsupportedSpecError, traits_of
from kvspec_traits._caches import Watched, warm_entry, warm_path
from kvspec_traits.extend import LayoutTraits, Registry


def test_hit_returns_the_cached_answer_and_a_miss_resolves() -> None:
    registry = Registry().copy()
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    calls: list[object] = []

    def resolve(s: kvi.KVCacheSpec) -> KVLayoutTraits:
        calls.append(s)
        return registry.traits_of(s)

    by_id: dict[int, KVLayoutTraits | Watched] = {}
    warm = warm_path(by_id, resolve)
    first = warm(spec)
    assert calls == [spec]
    by_id[id(spec)] = first
    assert warm(spec) is first
    assert calls == [spec]  # served from the dict, resolve not called again
    # 16 * 2 * (64 + 64) * 2 B
    assert first.page_size_bytes == 8192


def test_errors_pass_through_unchained_and_wrong_calls_are_type_errors() -> None:
    def resolve(s: object) -> KVLayoutTraits:
        raise LookupError(f"no traits for {s!r}")

    warm = warm_path({}, resolve)
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


def test_a_falsy_traits_object_is_cached_behind_an_always_valid_watched() -> None:
    """Failure mode (guarded here): the warm path tells a group's Watched (an empty dict)
    from traits by truth, so a falsy traits object stored as itself would be read as a
    Watched (AttributeError) or never served warm."""
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    built = Registry().copy().traits_of(spec)
    assert built and warm_entry(built) is built  # built-in traits are stored as themselves
    sized = _sized(built)
    assert not sized
    entry = warm_entry(sized)
    assert isinstance(entry, Watched) and not entry and entry.traits is sized
    calls: list[object] = []

    def resolve(s: kvi.KVCacheSpec) -> KVLayoutTraits:
        calls.append(s)
        return sized

    warm = warm_path({id(spec): entry}, resolve)
    for _ in range(3):
        assert warm(spec) is sized
    assert calls == []


def test_a_registry_answers_a_falsy_traits_object_warm() -> None:
    registry = Registry().copy()
    builtin = registry.adapters()[kvi.FullAttentionSpec]
    declared = registry.registrations()[kvi.FullAttentionSpec]

    def adapt(spec: kvi.FullAttentionSpec) -> KVLayoutTraits:
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
    assert isinstance(registry._by_id[id(spec)], Watched)
    assert registry.traits_of(spec) is first
