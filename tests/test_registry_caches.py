"""The registry's caches: each bounded, none ever answering stale or for another spec, and
a warm group answered without re-reading its members' fields, yet afresh after any
mutation of its member dict (guarded by the identities of its members, nothing below the
language).

Page sizes are hand-computed from vLLM's attention formula, ``block_size * num_kv_heads *
(head_size + head_size_v) * itemsize``, and compared with the spec's own
``page_size_bytes`` too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

import kvspec_traits._registry as registry_module
import kvspec_traits._verify as verify_module
from kvspec_traits import GroupTraits, InvalidSpecError
from kvspec_traits._accounting import Accounting
from kvspec_traits._caches import MAX_CLASSES, MAX_SPECS, Answers, Members, Snapshot, member_guard
from kvspec_traits._loading import Loader
from kvspec_traits._result_check import snapshot
from kvspec_traits.extend import Registry


def _full(block_size: int = 16, heads: int = 8) -> kvi.FullAttentionSpec:
    return kvi.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=128, dtype=torch.bfloat16
    )


def _page(block_size: int = 16, heads: int = 8) -> int:
    return block_size * heads * (128 + 128) * 2  # bfloat16: 2 B


# -- bounds ---------------------------------------------------------------------------------


def test_a_thousand_dynamic_subclasses_stay_within_the_bounds_and_answer_right() -> None:
    """Failure mode: the per-class cache grew without limit with dynamically created
    subclasses (5,000 classes gave 5,000 entries, each keeping its class alive); here
    1,000 classes, four times the bound."""
    registry = Registry().copy()
    kept: list[tuple[type[kvi.FullAttentionSpec], int]] = []
    for i in range(1000):
        cls = type(f"Dynamic{i}", (kvi.FullAttentionSpec,), {})
        block_size = 16 * (1 + i % 8)
        spec = cls(block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        traits = registry.traits_of(spec)
        assert (traits.page_size_bytes, traits.block_size) == (_page(block_size), block_size)
        assert traits.page_size_bytes == spec.page_size_bytes
        if i < 3:
            kept.append((cls, block_size))
        del spec, cls, traits
    assert len(registry._accounting.plans) <= MAX_CLASSES < 1000
    answers = registry._answers
    for cache in (answers.alive, answers.by_id, answers.guarded, answers.by_value):
        assert len(cache) <= MAX_SPECS
    for fact in (verify_module._placeholder, verify_module._defined):
        info = fact.cache_info()
        assert info.maxsize is not None and info.currsize <= info.maxsize
    # The first classes' plans and answers were dropped: asked again, answered again.
    for cls, block_size in kept:
        assert cls not in registry._accounting.plans
        spec = cls(block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        assert registry.traits_of(spec).page_size_bytes == _page(block_size)


def test_a_full_spec_cache_starts_afresh_and_never_answers_for_a_reused_id() -> None:
    """Failure mode (guarded here): the per-spec cache, emptied by its bound, keeping an
    answer by id while releasing its spec (a new spec at the same address would get it),
    or keeping a group's guarded entry (answered from before a mutation).

    Each spec is dropped after its answer, so once the bound empties the cache, new specs
    reuse the ids of old ones with other block sizes: every answer must be its own."""
    registry = Registry().copy()
    members: dict[str, kvi.KVCacheSpec] = {"l0": _full()}
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=members)
    assert registry.traits_of(group).page_size_bytes == _page()
    assert id(group) in registry._answers.guarded
    for i in range(MAX_SPECS + 500):  # 8 values, each spec its own object and entry
        block_size = 16 * (1 + i % 8)
        spec = _full(block_size)
        assert registry.traits_of(spec).page_size_bytes == _page(block_size)
        del spec
        assert len(registry._answers.alive) <= MAX_SPECS
    assert id(group) not in registry._answers.guarded
    members["l1"] = _full(heads=4)
    assert registry.traits_of(group).page_size_bytes == _page() + _page(heads=4)
    assert group.page_size_bytes == _page() + _page(heads=4)


def test_the_registry_owns_its_parts_and_inherits_none() -> None:
    """Failure mode: the registry was two mixins over a shared state class (issue 37),
    which stubbed its parts' methods for mypy; one class cut across three files. Now it
    inherits nothing and owns each part as an object, none shared between registries."""
    assert Registry.__mro__ == (Registry, object)
    one = Registry(builtins=False, entry_points=False)
    two = Registry(builtins=False, entry_points=False)
    assert isinstance(one._accounting, Accounting)
    assert isinstance(one._loader, Loader)
    assert isinstance(one._answers, Answers)
    assert one._accounting is not two._accounting and one._answers is not two._answers
    one.register(kvi.FullAttentionSpec, lambda spec: registry_module.traits_of(spec))
    assert list(one.adapters()) == [kvi.FullAttentionSpec] and two.adapters() == {}


# -- groups on the warm path ------------------------------------------------------------------


def _counting_snapshot(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    calls: list[object] = []
    real: Callable[..., object] = snapshot

    def counted(spec: object, field_names: tuple[str, ...]) -> object:
        calls.append(spec)
        return real(spec, field_names)

    monkeypatch.setattr(registry_module, "_snapshot", counted)
    return calls


def test_a_warm_group_is_answered_without_reading_its_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Failure mode: every warm traits_of(group) snapshotted the group's 61 members and
    the types of all their fields (2.07 ms a call, ~35,000x an isinstance, issue 20).
    Now the identities of its members say it is unchanged (benchmarks/bench_traits.py
    times it)."""
    registry = Registry().copy()
    layers: dict[str, kvi.KVCacheSpec] = {f"model.layers.{i}.attn": _full() for i in range(61)}
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=layers)
    first = registry.traits_of(group)
    assert first.page_size_bytes == 61 * _page() == group.page_size_bytes
    calls = _counting_snapshot(monkeypatch)
    for _ in range(1000):
        assert registry.traits_of(group) is first
    assert calls == []
    # The same object written back changes nothing.
    layers["model.layers.0.attn"] = layers["model.layers.0.attn"]
    assert registry.traits_of(group) is first
    # An equal member in its place: compared once, then warm again with the same answer.
    layers["model.layers.0.attn"] = _full()
    assert registry.traits_of(group) is first
    assert registry.traits_of(group) is first
    assert calls == [group]


_F8, _F4 = _full(heads=8), _full(heads=4)


# (mutation, the members' head counts after it): every way a dict changes.
_MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], object], list[int]]] = [
    ("add", lambda d: d.__setitem__("l1", _F4), [8, 4]),
    ("replace, same size", lambda d: d.__setitem__("l1", _F8), [8, 8]),
    ("update", lambda d: d.update(l2=_F4), [8, 8, 4]),
    ("setdefault", lambda d: d.setdefault("l3", _F4), [8, 8, 4, 4]),
    ("pop", lambda d: d.pop("l2"), [8, 8, 4]),
    ("popitem", lambda d: d.popitem(), [8, 8]),
    ("del", lambda d: d.__delitem__("l1"), [8]),
    ("|=", lambda d: d.__ior__({"l9": _F4}), [8, 4]),
    ("replace, equal object", lambda d: d.__setitem__("l9", _full(heads=4)), [8, 4]),
    ("replace the first", lambda d: d.__setitem__("l0", _F4), [4, 4]),
]


def _guard_by(members: bool, monkeypatch: pytest.MonkeyPatch) -> type[Members | Snapshot]:
    """Make the registry guard groups by their members' identities (as it does), or by a
    snapshot of their fields (what it does for any other unhashable spec)."""
    if not members:
        monkeypatch.setattr(registry_module, "member_guard", lambda spec, names: None)
    return Members if members else Snapshot


@pytest.mark.parametrize("members", [True, False], ids=["members", "snapshot"])
def test_every_kind_of_group_mutation_is_answered_afresh(
    members: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failure mode (guarded here): a warm group answered from before its dict changed
    (vLLM's group spec is frozen, its dict is not), by either guard."""
    guard_type = _guard_by(members, monkeypatch)
    registry = Registry().copy()
    layers: dict[str, Any] = {"l0": _F8}
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=layers)
    assert registry.traits_of(group).page_size_bytes == _page()
    for what, mutate, heads in _MUTATIONS:
        mutate(layers)
        want = sum(_page(heads=h) for h in heads)
        for _ in range(2):  # the fresh answer, then the same from the warm path
            t = registry.traits_of(group)
            assert isinstance(t, GroupTraits)
            assert (t.page_size_bytes, list(t.members)) == (want, list(layers)), what
            assert t.page_size_bytes == group.page_size_bytes
        assert type(registry._answers.guarded[id(group)].guard) is guard_type
    layers.clear()
    with pytest.raises(InvalidSpecError, match="kv_cache_specs"):
        registry.traits_of(group)


def test_only_a_frozen_spec_whose_dicts_hold_hashable_values_is_guarded_by_members() -> None:
    """A dict's member identities show its own changes only: a spec whose fields may be
    rebound (not frozen), or whose dict holds a mutable value, is guarded by a snapshot."""

    @dataclasses.dataclass(frozen=True)
    class Pack:
        members: dict[str, Any]
        block_size: int = 16

    @dataclasses.dataclass(frozen=True)
    class Two:
        left: dict[str, Any]
        right: dict[str, Any]

    @dataclasses.dataclass
    class Loose:
        members: dict[str, Any]

    names = ("members", "block_size")
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"l0": _F8})
    assert member_guard(group, tuple(f.name for f in dataclasses.fields(group))) is not None
    assert member_guard(Pack({"a": _F8}), names) is not None
    assert member_guard(Pack({"a": [1]}), names) is None  # a list in it can change unseen
    assert member_guard(Loose({"a": _F8}), ("members",)) is None
    assert member_guard(Pack({"a": _F8}, block_size=[16]), names) is None  # type: ignore[arg-type]
    right = {"b": _F4}
    two = Two({"a": _F8}, right)
    guard = member_guard(two, ("left", "right"))
    assert guard is not None and guard.holds(two)
    right["b"] = _F8
    assert not guard.holds(two)  # the second dict is watched too


def test_the_guard_compares_members_by_identity_not_equality() -> None:
    """Failure mode (guarded here): a guard comparing members with ``==`` keeps a group's
    answer when a member is replaced by an equal spec, which may differ in a field's
    type (Python calls ``128 == 128.0``): that member is refused alone, so the group
    must be too. Put back, the same objects hold again."""
    layers: dict[str, Any] = {"l0": _F8}
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=layers)
    guard = member_guard(group, tuple(f.name for f in dataclasses.fields(group)))
    assert guard is not None and guard.holds(group)
    layers["l0"] = _full(heads=8)  # equal, another object
    assert layers["l0"] == _F8 and not guard.holds(group)
    layers["l0"] = _F8
    assert guard.holds(group)
    registry = Registry().copy()
    assert registry.traits_of(group).page_size_bytes == _page()
    float_heads = kvi.FullAttentionSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128.0,  # type: ignore[arg-type]
        dtype=torch.bfloat16,
    )
    assert float_heads == _F8
    layers["l0"] = float_heads
    with pytest.raises(InvalidSpecError, match=r"kv_cache_specs\['l0'\]\.head_size"):
        registry.traits_of(group)


@pytest.mark.parametrize("members", [True, False], ids=["members", "snapshot"])
def test_a_group_mutated_while_it_is_answered_is_answered_again(
    members: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failure mode (issue 20 item 5, found by this test): a group mutated after its
    snapshot but before its adapter read the members was cached with the new members'
    answer under the old snapshot; the dict put back as the snapshot saw it was then
    answered from the cache with the members it no longer held (also shared by value).
    Now a change seen after the answer (by the guard taken before it) answers again."""
    _guard_by(members, monkeypatch)
    registry = Registry().copy()
    layers: dict[str, Any] = {"l0": _F8}
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=layers)
    real: Callable[..., object] = snapshot
    taken: list[object] = []

    def then_mutated(spec: object, field_names: tuple[str, ...]) -> object:
        taken.append(real(spec, field_names))
        if len(taken) == 1:
            layers["l1"] = _F4  # after the first snapshot, before the adapter
        return taken[-1]

    monkeypatch.setattr(registry_module, "_snapshot", then_mutated)
    both = _page() + _page(heads=4)
    assert registry.traits_of(group).page_size_bytes == both
    del layers["l1"]  # as the first snapshot saw it
    for _ in range(2):
        assert registry.traits_of(group).page_size_bytes == _page() == group.page_size_bytes
    layers["l1"] = _F4
    assert registry.traits_of(group).page_size_bytes == both
    assert taken[0] != taken[1]  # the first answer was taken again, with its own snapshot
