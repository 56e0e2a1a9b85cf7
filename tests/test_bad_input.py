"""Bad input gets a named refusal, never a parent's answer, a stale answer or a bare error.

Each case was found by probing the core: a spec whose own math fails, a real-page override,
a group spec mutated after it was resolved, nonsense field values, an adapter returning
the wrong type, and a registration racing a resolution. Sizes are hand-computed from
vLLM's formulas (``num_heads * num_states * (head_size + head_size_v) * itemsize``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import (
    AdapterError,
    AdapterResultError,
    InvalidSpecError,
    KVLayoutTraits,
    KVSpecTraitsError,
    SpecPropertyError,
    UnsupportedSpecError,
    traits_of,
)
from kvspec_traits.extend import LayoutTraits, Registry

BUILTIN = "kvspec_traits._vllm_adapters._builtins"


def _replace(registry: Registry, cls: type[Any], adapter: Callable[[Any], KVLayoutTraits]) -> None:
    """Replace the adapter of ``cls``, keeping the fields its registration declares
    (without reads= a registration declares none)."""
    declared = registry.registrations()[cls]
    registry.register(cls, adapter, replace=True, reads=declared.reads, ignores=declared.ignores)


# 16 tokens * 8 heads * (128 + 128) * 2 B (bfloat16) = 65536
PAGE = 65536


def _full_kwargs() -> dict[str, Any]:
    return {"block_size": 16, "num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}


# -- the spec's own math failing is a refusal ---------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AttributeErrorPageSpec(kvi.FullAttentionSpec):
    @property
    def page_size_bytes(self) -> int:
        return self.no_such_field  # type: ignore[attr-defined, no-any-return]


@dataclass(frozen=True, kw_only=True)
class NotImplementedPageSpec(kvi.FullAttentionSpec):
    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError("page math of a backend not built here")


@dataclass(frozen=True, kw_only=True)
class ZeroDivisionStatesSpec(kvi.FullAttentionSpec):
    @property
    def num_states(self) -> int:
        return self.block_size // 0


@pytest.mark.parametrize(
    ("cls", "prop", "error"),
    [
        (AttributeErrorPageSpec, "page_size_bytes", AttributeError),
        (NotImplementedPageSpec, "page_size_bytes", NotImplementedError),
        # page_size_bytes is checked first, and vLLM computes it through num_states
        (ZeroDivisionStatesSpec, "page_size_bytes", ZeroDivisionError),
    ],
    ids=["AttributeError", "NotImplementedError", "ZeroDivisionError"],
)
def test_an_error_from_the_specs_own_math_is_a_refusal(
    cls: type[kvi.FullAttentionSpec], prop: str, error: type[Exception]
) -> None:
    # main treated AttributeError/NotImplementedError as "not defined" and answered as
    # the parent: 65536 B pages of a spec that cannot say what its page is.
    with pytest.raises(SpecPropertyError, match=rf"{cls.__name__}.*own `{prop}` raised") as info:
        traits_of(cls(**_full_kwargs()))
    err = info.value
    assert isinstance(err, UnsupportedSpecError)
    assert (err.spec_type, err.field, type(err.error)) == (cls, prop, error)
    assert isinstance(err.__cause__, error)
    # Named by what it adapts, never by its private module path (issue 25).
    assert err.adapter == "the built-in adapter for FullAttentionSpec"
    assert "the built-in adapter for FullAttentionSpec" in str(err)
    assert "_vllm_adapters" not in str(err)


def test_the_base_class_placeholder_is_still_not_defined_not_a_failure() -> None:
    # HiSparse pages inherit KVCacheSpec.num_heads, which raises NotImplementedError:
    # that is vLLM's "no such property", and the pages resolve.
    spec = kvi.HiSparseResidentSpec(block_size=64, page_size=64 * 656)
    assert traits_of(spec).page_size_bytes == 64 * 656


# -- real_page_size_bytes is checked --------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RealPageSpec(kvi.FullAttentionSpec):
    """Claims 64 more bytes of real content than its parent's math gives."""

    @property
    def real_page_size_bytes(self) -> int:
        return super().real_page_size_bytes + 64


def test_a_real_page_override_is_compared_and_refused() -> None:
    spec = RealPageSpec(**_full_kwargs())
    assert (spec.page_size_bytes, spec.real_page_size_bytes) == (PAGE, PAGE + 64)
    with pytest.raises(UnsupportedSpecError, match=r"unpadded_page_size_bytes=65536.*65600"):
        traits_of(spec)


def test_an_adapter_contradicting_real_page_size_bytes_is_a_mismatch() -> None:
    from kvspec_traits import TraitsMismatchError

    registry = Registry().copy()
    spec = kvi.MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    right = registry.traits_of(spec)
    assert isinstance(right, LayoutTraits)

    def padded_content(s: kvi.MambaSpec) -> LayoutTraits:
        # says 4 more bytes of content, and a page as large (vLLM's page is 128 B)
        return replace(
            right, components=(), unpadded_page_size_bytes=132, page_size_bytes=132, state_bytes=132
        )

    _replace(registry, kvi.MambaSpec, padded_content)
    with pytest.raises(TraitsMismatchError) as info:
        registry.traits_of(spec)
    assert info.value.field in {"page_size_bytes", "unpadded_page_size_bytes"}


# -- group specs: a mutated dict is answered afresh -------------------------------------------


def test_a_group_spec_mutated_after_resolution_is_answered_afresh() -> None:
    members: dict[str, kvi.KVCacheSpec] = {"l0": kvi.FullAttentionSpec(**_full_kwargs())}
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=members)
    assert traits_of(group).page_size_bytes == PAGE == group.page_size_bytes
    # vLLM's group spec is frozen, but its dict is not.
    members["l1"] = kvi.FullAttentionSpec(**_full_kwargs())
    assert group.page_size_bytes == 2 * PAGE
    t = traits_of(group)
    assert t.page_size_bytes == 2 * PAGE
    assert [c.name for c in t.components] == ["l0/k", "l0/v", "l1/k", "l1/v"]
    # ... and so is a member replaced by another
    members["l1"] = kvi.FullAttentionSpec(**{**_full_kwargs(), "block_size": 16, "num_kv_heads": 4})
    assert traits_of(group).page_size_bytes == PAGE + PAGE // 2 == group.page_size_bytes
    # an unchanged group keeps its answer
    assert traits_of(group) is traits_of(group)


def test_an_emptied_group_is_refused_with_a_named_error() -> None:
    members: dict[str, kvi.KVCacheSpec] = {"l0": kvi.FullAttentionSpec(**_full_kwargs())}
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=members)
    traits_of(group)
    members.clear()
    with pytest.raises(InvalidSpecError, match="kv_cache_specs") as info:
        traits_of(group)
    assert info.value.field == "kv_cache_specs"
    assert info.value.adapter == "the built-in adapter for UniformTypeKVCacheSpecs"


# -- nonsense field values: InvalidSpecError naming spec, field and adapter -------------------


def _window_specs(window: Any) -> list[tuple[kvi.KVCacheSpec, str, str]]:
    base = _full_kwargs()
    return [
        (kvi.SlidingWindowSpec(**base, sliding_window=window), "sliding_window", "_sliding"),
        (
            kvi.SlidingWindowMLASpec(
                block_size=64,
                num_kv_heads=1,
                head_size=576,
                dtype=torch.bfloat16,
                sliding_window=window,
            ),
            "sliding_window",
            "_sliding",
        ),
        (
            kvi.ChunkedLocalAttentionSpec(**base, attention_chunk_size=window),
            "attention_chunk_size",
            "_chunked",
        ),
        (kvi.RSWASpec(**base, rswa_window=window), "rswa_window", "_rswa"),
    ]


@pytest.mark.parametrize(("good", "bad"), [(128, 128.0), (1, True)], ids=["float", "bool"])
def test_a_valid_equal_spec_answered_first_does_not_answer_for_an_invalid_one(
    good: int, bad: object
) -> None:
    # Python calls 128 == 128.0 and 1 == True, so the two specs compare (and hash) equal;
    # an answer cached by value for the valid one must not be handed to the invalid one.
    # (Found when this file ran after tests that had resolved the window-128 specs.)
    registry = Registry().copy()
    for (spec, field, _), (twin, _, _) in zip(_window_specs(good), _window_specs(bad), strict=True):
        assert spec == twin and hash(spec) == hash(twin)
        assert registry.traits_of(spec).window_tokens == good
        with pytest.raises(InvalidSpecError) as info:
            registry.traits_of(twin)
        assert (info.value.field, info.value.value) == (field, bad)


@pytest.mark.parametrize(
    "window", [None, 0, -128, "128", 128.0, True], ids=["None", "0", "-128", "str", "float", "bool"]
)
def test_a_nonsense_window_is_refused_naming_the_field(window: object) -> None:
    for spec, field, _ in _window_specs(window):
        with pytest.raises(InvalidSpecError) as info:
            traits_of(spec)
        err = info.value
        assert (err.spec_type, err.field, err.value) == (type(spec), field, window)
        # named by the class it adapts, not by a private module path (issue 25)
        assert err.adapter == f"the built-in adapter for {type(spec).__qualname__}"
        assert f"{type(spec).__qualname__}.{field}={window!r}" in str(err)
        assert err.adapter in str(err)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("block_size", -16),
        ("block_size", "16"),
        ("num_kv_heads", 0),
        ("head_size", -1),
        ("head_size_v", -1),
        ("tokens_per_state", 0),
        ("tokens_per_state", -4),
        ("tokens_per_state", 3),
        ("max_tp_shards", 0),
        ("num_head_slots", 0),
        ("state_content_bytes", 0),
        ("page_size_padded", 100),
        ("dtype", "bfloat16"),
    ],
)
def test_nonsense_attention_values_are_refused_naming_the_field(field: str, value: object) -> None:
    # tokens_per_state=0 raised a bare ZeroDivisionError on main; 3 does not divide a
    # 16-token block (5 states and a lost token); a padded page below its content
    # (100 < 65536) is no page.
    spec = kvi.FullAttentionSpec(**{**_full_kwargs(), field: value})
    with pytest.raises(InvalidSpecError) as info:
        traits_of(spec)
    err = info.value
    assert (err.spec_type, err.field, err.value) == (kvi.FullAttentionSpec, field, value)
    assert err.adapter == "the built-in adapter for FullAttentionSpec"
    assert str(err).startswith(f"FullAttentionSpec.{field}=")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"shapes": ((0, 8),)}, "shapes"),
        ({"shapes": ()}, "shapes"),
        ({"dtypes": (torch.float32, torch.float32)}, "dtypes"),
        ({"page_size_padded": 64}, "page_size_padded"),
        ({"tokens_per_state": 4}, "tokens_per_state"),
        ({"num_heads": 0}, "num_heads"),
        # vLLM's page ignores it while its [B, H, N, C] view multiplies by it
        ({"num_heads": 2}, "num_heads"),
    ],
)
def test_nonsense_state_values_are_refused_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    base: dict[str, Any] = {"block_size": 16, "shapes": ((4, 8),), "dtypes": (torch.float32,)}
    spec = kvi.MambaSpec(**{**base, **kwargs})
    with pytest.raises(InvalidSpecError) as info:
        traits_of(spec)
    assert (info.value.field, info.value.adapter) == (
        field,
        "kvspec_traits.extend.mamba_traits",
    )


@pytest.mark.parametrize("page", [0, -1, "4096"])
def test_a_nonsense_hisparse_page_is_refused(page: object) -> None:
    with pytest.raises(InvalidSpecError, match="page_size") as info:
        traits_of(kvi.HiSparseResidentSpec(block_size=64, page_size=page))  # type: ignore[arg-type]
    assert info.value.adapter == "the built-in adapter for HiSparseResidentSpec"


def test_every_error_is_one_hierarchy_and_keeps_its_builtin_base() -> None:
    from kvspec_traits import AdapterPluginError, MixedGroupTraitsError, TraitsMismatchError
    from kvspec_traits.extend import AdapterConflictError

    for cls, builtin in [
        (UnsupportedSpecError, TypeError),
        (SpecPropertyError, TypeError),
        (InvalidSpecError, ValueError),
        (TraitsMismatchError, ValueError),
        (AdapterResultError, TypeError),
        (AdapterError, RuntimeError),
        (MixedGroupTraitsError, ValueError),
        (AdapterConflictError, ValueError),
        (AdapterPluginError, RuntimeError),
    ]:
        assert issubclass(cls, KVSpecTraitsError) and issubclass(cls, builtin), cls


# -- adapters returning the wrong thing ------------------------------------------------------


def _registry_with(adapter: Any) -> Registry:
    registry = Registry().copy()
    _replace(registry, kvi.FullAttentionSpec, adapter)
    return registry


def returns_a_dict(spec: kvi.FullAttentionSpec) -> Any:
    return {"page_size_bytes": spec.page_size_bytes}


def returns_none(spec: kvi.FullAttentionSpec) -> Any:
    return None


@pytest.mark.parametrize("adapter", [returns_a_dict, returns_none])
def test_an_adapter_returning_the_wrong_type_is_named(adapter: Any) -> None:
    spec = kvi.FullAttentionSpec(**_full_kwargs())
    with pytest.raises(
        AdapterResultError,
        match=rf"{adapter.__name__}.*FullAttentionSpec"
        r".*'spec_name' is missing",
    ) as info:
        _registry_with(adapter).traits_of(spec)
    assert info.value.adapter == f"{__name__}.{adapter.__name__}"
    assert info.value.spec_type is kvi.FullAttentionSpec


def test_an_adapter_returning_mistyped_or_inconsistent_traits_is_named() -> None:
    spec = kvi.FullAttentionSpec(**_full_kwargs())
    right = traits_of(spec)
    assert isinstance(right, LayoutTraits)

    def page_as_str(s: kvi.FullAttentionSpec) -> Any:
        # an object of its own with every trait, one of them mistyped
        return SimpleNamespace(**{**right.as_dict(), "page_size_bytes": str(PAGE)})

    def window_without_size(s: kvi.FullAttentionSpec) -> LayoutTraits:
        from kvspec_traits import TokenScope

        return replace(right, token_scope=TokenScope.SLIDING_WINDOW, keeps_prompt=False)

    with pytest.raises(AdapterResultError, match=r"'page_size_bytes' is '65536' \(str\)"):
        _registry_with(page_as_str).traits_of(spec)
    with pytest.raises(AdapterResultError, match=r"'window_tokens' is None for the windowed"):
        _registry_with(window_without_size).traits_of(spec)


def test_an_adapter_raising_a_bare_error_is_wrapped_naming_it() -> None:
    def buggy(s: kvi.FullAttentionSpec) -> KVLayoutTraits:
        missing: dict[str, KVLayoutTraits] = {}
        return missing["k"]

    with pytest.raises(AdapterError, match=r"buggy raised KeyError.*FullAttentionSpec") as info:
        _registry_with(buggy).traits_of(kvi.FullAttentionSpec(**_full_kwargs()))
    assert isinstance(info.value.__cause__, KeyError)


def test_layout_traits_refuses_a_missing_trait_instead_of_storing_a_property() -> None:
    right = traits_of(kvi.FullAttentionSpec(**_full_kwargs()))
    kwargs = {f: getattr(right, f) for f in right.__dataclass_fields__}  # type: ignore[attr-defined]
    del kwargs["is_mla"]
    with pytest.raises(TypeError, match=r"missing keyword argument.*is_mla"):
        LayoutTraits(**kwargs)


def test_layout_traits_refuses_kind_traits_its_token_scope_contradicts() -> None:
    """Failure mode: an adapter that builds LayoutTraits by hand says ``token_paged`` of a
    ring, ``keeps_prompt`` of a sliding window, or ``grouped`` of one layer, and a
    connector asking those traits moves the wrong blocks (or reads one layer as a group)."""
    from kvspec_traits import TokenScope

    right = traits_of(kvi.FullAttentionSpec(**_full_kwargs()))
    assert isinstance(right, LayoutTraits)
    with pytest.raises(ValueError, match=r"token_paged=False.*contradict token_scope FULL"):
        replace(right, token_paged=False)
    with pytest.raises(ValueError, match=r"grouped=True.*a group's are GroupTraits"):
        replace(right, grouped=True)
    with pytest.raises(ValueError, match=r"keeps_prompt=True.*token_scope SLIDING_WINDOW"):
        replace(right, token_scope=TokenScope.SLIDING_WINDOW, window_tokens=128)


# -- a registration racing a resolution ------------------------------------------------------


def test_a_registration_during_a_resolution_never_leaves_the_old_answer_cached() -> None:
    registry = Registry().copy()
    spec = kvi.FullAttentionSpec(**_full_kwargs())
    right = registry.traits_of(kvi.FullAttentionSpec(**{**_full_kwargs(), "block_size": 32}))
    assert isinstance(right, LayoutTraits)
    old_answer = registry.adapters()[kvi.FullAttentionSpec]

    def new(s: kvi.FullAttentionSpec) -> LayoutTraits:
        answer = old_answer(s)
        assert isinstance(answer, LayoutTraits)
        return replace(answer, spec_name="new")

    def old_and_slow(s: kvi.FullAttentionSpec) -> LayoutTraits:
        # Another caller registers the new adapter while this one is still answering.
        _replace(registry, kvi.FullAttentionSpec, new)
        answer = old_answer(s)
        assert isinstance(answer, LayoutTraits)
        return replace(answer, spec_name="old")

    _replace(registry, kvi.FullAttentionSpec, old_and_slow)
    # main cached "old" for good: every later call returned the superseded answer
    assert registry.traits_of(spec).spec_name == "new"
    assert registry.traits_of(spec).spec_name == "new"


def test_a_registration_from_another_thread_during_a_resolution() -> None:
    registry = Registry().copy()
    spec = kvi.FullAttentionSpec(**_full_kwargs())
    builtin = registry.adapters()[kvi.FullAttentionSpec]
    entered, registered = threading.Event(), threading.Event()

    def named(name: str) -> Any:
        def adapt(s: kvi.FullAttentionSpec) -> LayoutTraits:
            if name == "old":
                entered.set()
                if not registered.wait(10):
                    raise TimeoutError("the registering thread did not run")
            answer = builtin(s)
            assert isinstance(answer, LayoutTraits)
            return replace(answer, spec_name=name)

        return adapt

    _replace(registry, kvi.FullAttentionSpec, named("old"))

    def register_new() -> None:
        entered.wait(10)
        _replace(registry, kvi.FullAttentionSpec, named("new"))
        registered.set()

    thread = threading.Thread(target=register_new)
    thread.start()
    first = registry.traits_of(spec)
    thread.join(10)
    assert first.spec_name == "new"
    assert registry.traits_of(spec).spec_name == "new"


def test_vllms_test_mamba_spec_with_one_dtype_for_two_states_is_refused() -> None:
    """The ``MambaSpec`` of vLLM's kv_connector test helper (``make_kv_cache_config(...,
    mamba_enabled=True)`` in tests/v1/kv_connector/unit/utils.py, 0.32-0.34): two states of
    16 elements and one dtype. vLLM's ``page_size_bytes`` zips shapes with dtypes, so the
    second state falls out of the page: 16 x 2 B = 32 B for 64 B of state (upstream wrong).
    ``traits_of`` refuses it naming ``dtypes``, so a connector migrated to traits stops on
    it where ``isinstance`` never looked at it: the migrated-suite difference
    (expected_differences.toml, ``[[migrated]]``) this proves."""
    spec = kvi.MambaSpec(
        block_size=16, shapes=((16,), (16,)), dtypes=(torch.float16,), mamba_cache_mode="none"
    )
    assert spec.page_size_bytes == 16 * 2  # the second state is not in vLLM's page
    with pytest.raises(InvalidSpecError) as info:
        traits_of(spec)
    assert (info.value.field, info.value.value) == ("dtypes", (torch.float16,))
    assert "one per shape" in str(info.value)


def test_vllms_test_full_attention_spec_without_dtype_is_refused() -> None:
    """vLLM 0.34's mooncake store worker tests build ``FullAttentionSpec(block_size=16,
    num_kv_heads=8, head_size=64, dtype=None)``. vLLM's ``page_size_bytes`` then sizes the
    page with torch's *global default* dtype (``torch.tensor([], dtype=None)``): 2 (K, V) x
    16 x 8 x 64 x 4 B = 65536 B under float32, half that once someone calls
    ``torch.set_default_dtype(torch.float16)``, so the page depends on process state, not on
    the spec (upstream wrong). ``traits_of`` refuses it naming ``dtype``: the migrated
    mooncake store code stops on it where ``isinstance`` never looked (the ``[[migrated]]``
    difference in expected_differences.toml this proves)."""
    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=None)  # type: ignore[arg-type]
    assert spec.page_size_bytes == 2 * 16 * 8 * 64 * 4
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        assert spec.page_size_bytes == 2 * 16 * 8 * 64 * 2
    finally:
        torch.set_default_dtype(default)
    with pytest.raises(InvalidSpecError) as info:
        traits_of(spec)
    assert (info.value.field, info.value.value) == ("dtype", None)


def test_vllms_test_group_of_specs_without_dtype_is_refused_by_member() -> None:
    """vLLM 0.34's ``test_worker_scales_uniform_attention_group_under_dcp`` wraps the same
    dtype-less ``FullAttentionSpec`` in a ``UniformTypeKVCacheSpecs`` (layers of 8 and of 4
    KV heads). The group's page is its members' pages, each sized with torch's global
    default dtype (``2 x 16 x 8 x 64 x 4 B + 2 x 16 x 4 x 64 x 4 B`` under float32, half
    under float16): process state, not the spec. ``traits_of`` refuses the group naming the
    member and its field (``kv_cache_specs['layer0'].dtype``), so the migrated store worker
    stops on it where ``isinstance`` only looked at the group's class (the ``[[migrated]]``
    difference in expected_differences.toml this proves)."""
    members: dict[str, kvi.KVCacheSpec] = {
        "layer0": kvi.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=None),  # type: ignore[arg-type]
        "layer1": kvi.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=None),  # type: ignore[arg-type]
    }
    group = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=members)
    assert group.page_size_bytes == 2 * 16 * 8 * 64 * 4 + 2 * 16 * 4 * 64 * 4
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        assert group.page_size_bytes == 2 * 16 * 8 * 64 * 2 + 2 * 16 * 4 * 64 * 2
    finally:
        torch.set_default_dtype(default)
    with pytest.raises(InvalidSpecError) as info:
        traits_of(group)
    assert (info.value.field, info.value.value) == ("kv_cache_specs['layer0'].dtype", None)
    assert "UniformTypeKVCacheSpecs" in str(info.value)
