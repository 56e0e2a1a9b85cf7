"""Registry behaviour: registration rules, isolation, entry points, caching."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import AdapterPluginError, KVLayoutTraits, UnsupportedSpecError, traits_of
from kvspec_traits.extend import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    AdapterConflictError,
    LayoutTraits,
    Registry,
    default_registry,
    register_adapter,
)


def _full(block_size: int = 16) -> kvi.FullAttentionSpec:
    return kvi.FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float16
    )


def _adapter_of(registry: Registry, spec_type: type) -> object:
    return registry.adapters()[spec_type]


def test_a_conflicting_registration_names_both_adapters_and_changes_nothing() -> None:
    registry = Registry().copy()
    before = _adapter_of(registry, kvi.FullAttentionSpec)

    def other(spec: kvi.FullAttentionSpec) -> KVLayoutTraits:
        raise NotImplementedError

    with pytest.raises(
        AdapterConflictError, match=r"the built-in adapter for FullAttentionSpec.*refusing.*other"
    ) as info:
        registry.register(kvi.FullAttentionSpec, other)
    assert info.value.spec_type is kvi.FullAttentionSpec
    assert info.value.existing is before and info.value.new is other
    assert _adapter_of(registry, kvi.FullAttentionSpec) is before


def test_identical_re_registration_is_allowed_and_replace_is_explicit() -> None:
    registry = Registry().copy()
    adapter = registry.adapters()[kvi.FullAttentionSpec]
    registry.register(kvi.FullAttentionSpec, adapter)  # same object: no error

    def doubled(spec: kvi.FullAttentionSpec) -> LayoutTraits:
        raise RuntimeError("called")

    registry.register(
        kvi.FullAttentionSpec,
        doubled,
        replace=True,
        reads=ATTENTION_READS,
        ignores=ATTENTION_IGNORES,
    )
    with pytest.raises(RuntimeError, match="called"):
        registry.traits_of(_full())


def test_a_copy_is_isolated_from_the_default_registry() -> None:
    spec = _full()
    default_answer = traits_of(spec)
    registry = default_registry.copy()

    def page_only(spec: kvi.FullAttentionSpec) -> LayoutTraits:
        assert isinstance(default_answer, LayoutTraits)
        return replace(default_answer, spec_name="copied")

    registry.register(
        kvi.FullAttentionSpec,
        page_only,
        replace=True,
        reads=ATTENTION_READS,
        ignores=ATTENTION_IGNORES,
    )
    assert registry.traits_of(spec).spec_name == "copied"
    assert traits_of(spec).spec_name == "FullAttentionSpec"
    assert kvi.FullAttentionSpec in default_registry.adapters()


def test_an_empty_registry_knows_nothing() -> None:
    registry = Registry(builtins=False, entry_points=False)
    assert dict(registry.adapters()) == {}
    with pytest.raises(UnsupportedSpecError, match="neither it nor any of its bases"):
        registry.traits_of(_full())


def test_register_refuses_a_non_class_and_a_non_callable() -> None:
    registry = Registry(builtins=False, entry_points=False)
    with pytest.raises(TypeError, match="takes a class"):
        registry.register(_full(), lambda s: traits_of(s))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be callable"):
        registry.register(kvi.FullAttentionSpec, "adapter")  # type: ignore[arg-type]
    assert dict(registry.adapters()) == {}


def test_decorator_registers_on_a_given_registry_and_returns_the_function() -> None:
    registry = Registry(builtins=False, entry_points=False)

    @register_adapter(
        kvi.FullAttentionSpec, registry=registry, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES
    )
    def adapt(spec: kvi.FullAttentionSpec) -> LayoutTraits:
        answer = default_registry.traits_of(spec)
        assert isinstance(answer, LayoutTraits)
        return answer

    assert registry.adapters() == {kvi.FullAttentionSpec: adapt}
    assert registry.traits_of(_full()).page_size_bytes == 16 * 2 * 128 * 2


def test_the_owner_of_a_class_is_found_along_the_mro() -> None:
    assert default_registry.owner_of(kvi.HiddenStateCacheSpec) is kvi.HiddenStateCacheSpec
    assert default_registry.owner_of(kvi.SlidingWindowMLASpec) is kvi.SlidingWindowMLASpec


def test_warm_lookups_return_the_same_object_and_equal_specs_share_an_answer() -> None:
    registry = Registry().copy()
    a, b = _full(), _full()
    assert a is not b and a == b
    first = registry.traits_of(a)
    assert registry.traits_of(a) is first
    assert registry.traits_of(b) is first
    # a different spec gets its own answer: 32 tokens * 2 * 128 * 2 B
    assert registry.traits_of(_full(32)).page_size_bytes == 16384


def test_registration_invalidates_cached_answers() -> None:
    registry = Registry().copy()
    spec = _full()
    before = registry.traits_of(spec)
    assert isinstance(before, LayoutTraits)

    def renamed(s: kvi.FullAttentionSpec) -> LayoutTraits:
        return replace(before, spec_name="renamed")

    registry.register(
        kvi.FullAttentionSpec,
        renamed,
        replace=True,
        reads=ATTENTION_READS,
        ignores=ATTENTION_IGNORES,
    )
    assert registry.traits_of(spec).spec_name == "renamed"


def _entry_points(monkeypatch: pytest.MonkeyPatch, *values: str) -> None:
    # Real EntryPoint objects loading real objects; only the installed list is replaced.
    from importlib.metadata import EntryPoint

    import kvspec_traits._loading as reg

    eps = [
        EntryPoint(name=f"ep{i}", value=v, group=reg.ENTRY_POINT_GROUP)
        for i, v in enumerate(values)
    ]
    monkeypatch.setattr(reg, "entry_points", lambda group: eps)


def test_a_bad_entry_point_hook_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _entry_points(monkeypatch, "kvspec_traits:__version__")
    with pytest.raises(AdapterPluginError, match=r"entry point 'ep0'.*must name a function"):
        Registry(builtins=False).adapters()


def fail_to_register(registry: Registry) -> None:
    """An entry-point hook that registers one adapter, then fails."""
    registry.register(kvi.MambaSpec, lambda spec: traits_of(spec))
    raise RuntimeError("plugin bug")


def test_a_failing_plugin_leaves_the_registry_as_it_was_and_fails_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _entry_points(monkeypatch, "kvspec_traits_example:register", f"{__name__}:fail_to_register")
    registry = Registry(builtins=False)
    for _ in range(2):  # not "loaded" after a failure: the second call fails the same way
        with pytest.raises(AdapterPluginError, match=r"'ep1'.*plugin bug") as info:
            registry.adapters()
        assert info.value.entry_point == "ep1"
    # nothing half-registered: neither the first plugin's adapter nor the failing one's
    assert dict(registry._accounting.adapters) == {}


def test_a_conflict_with_a_built_in_is_refused_before_first_use() -> None:
    registry = Registry()  # nothing resolved yet: built-ins not loaded

    def mine(spec: kvi.FullAttentionSpec) -> KVLayoutTraits:
        raise NotImplementedError

    with pytest.raises(AdapterConflictError, match="FullAttentionSpec"):
        registry.register(kvi.FullAttentionSpec, mine)
    assert registry.traits_of(_full()).spec_name == "FullAttentionSpec"
