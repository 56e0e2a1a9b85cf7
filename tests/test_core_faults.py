"""Faults that once escaped the core as bare errors: a broken installed plugin package
and a spec made without its constructor. Each is a named KVSpecTraitsError now."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import AdapterPluginError, InvalidSpecError, KVSpecTraitsError, traits_of
from kvspec_traits.extend import Registry


def _full() -> kvi.FullAttentionSpec:
    return kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)


def _install_dist(site: Path, name: str, entry_point: str) -> None:
    """A distribution as pip leaves it: only a dist-info, whose entry point in the adapters
    group is ``entry_point`` (its value need not even parse)."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvspec_traits.adapters]\n{entry_point}\n")


def test_an_unparsable_entry_point_is_named_and_breaks_no_resolution_half_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failure mode: an installed package whose entry-point value importlib cannot parse
    (``my-plugin.mod:register``) made every traits_of() raise ``AttributeError: 'NoneType'
    object has no attribute 'group'``, naming no plugin (``_loading`` read ``ep.module``
    outside its guard).

    It is a plugin that cannot load, so it is refused like one that fails to import
    (fail closed, docs/extending.md): AdapterPluginError naming the entry point, its value
    and its package, on every call, the registry left as it was."""
    _install_dist(tmp_path, "my-plugin", "bad = my-plugin.mod:register")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry()
    for _ in range(2):  # not marked loaded after a failure: the same named error again
        with pytest.raises(AdapterPluginError) as info:
            registry.traits_of(_full())
        message = str(info.value)
        assert info.value.entry_point == "bad"
        assert "'my-plugin.mod:register'" in message
        assert "'my-plugin' 0.1" in message  # the package to fix or uninstall
        assert "not a valid entry point" in message
        assert isinstance(info.value, KVSpecTraitsError)
    # Nothing half-registered: the built-ins only, as before loading.
    builtins = Registry(entry_points=False).adapters()
    assert set(registry._accounting.adapters) == set(builtins)
    # A registry that does not load entry points still answers:
    # 16 tokens * 2 heads * (64 + 64) * 2 B.
    assert Registry(entry_points=False).traits_of(_full()).page_size_bytes == 8192


def test_a_spec_made_without_its_constructor_is_an_invalid_spec_naming_the_field() -> None:
    """Failure mode: ``traits_of(object.__new__(FullAttentionSpec))`` raised a bare
    AttributeError from hashing the spec (its frozen dataclass ``__hash__`` reads fields
    that were never set)."""
    spec = object.__new__(kvi.FullAttentionSpec)
    with pytest.raises(InvalidSpecError, match=r"block_size=<unset>.*object\.__new__") as info:
        traits_of(spec)
    assert (info.value.field, info.value.spec_type) == ("block_size", kvi.FullAttentionSpec)
    assert isinstance(info.value, KVSpecTraitsError)
    # Half-built: the first field still unset is named.
    object.__setattr__(spec, "block_size", 16)
    with pytest.raises(InvalidSpecError, match="num_kv_heads=<unset>") as again:
        traits_of(spec)
    assert again.value.field == "num_kv_heads"
