"""The corrections the vLLM patch makes to vLLM's own kv_connector test fixtures
(kvspec_workbench.conformance.fixture_corrections, issue 35), on the release's real tests tree
of the series on the path: each rule finds its fixtures, and each corrected fixture
states what vLLM's page math already gave the test, or what it should have."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import vllm
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from kvspec_workbench.conformance import fixture_corrections

REPO = Path(__file__).resolve().parents[1]
SERIES_TESTS = {"0.32": "0.32.0", "0.33": "0.33.0", "0.34": "0.34.0"}


def _module() -> ModuleType:
    return fixture_corrections


@pytest.fixture(scope="module")
def corrected() -> dict[str, tuple[str, str, list[Any]]]:
    series = ".".join(vllm.__version__.split(".")[:2])
    tree = REPO / ".cache" / f"vllm-tests-{SERIES_TESTS[series]}"
    sources: dict[str, tuple[str, str, list[Any]]] = _module().corrected_sources(tree.resolve())
    return sources


def test_every_dtype_less_spec_is_given_float32_the_page_it_had(
    corrected: dict[str, tuple[str, str, list[Any]]],
) -> None:
    """vLLM sizes ``dtype=None`` with torch's global default (float32 here):
    ``FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64)`` is
    16 x 8 x (64 + 64) x 4 B = 65536 B either way, now stated."""
    assert torch.get_default_dtype() == torch.float32
    implicit = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=None)  # type: ignore[arg-type]
    stated = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.float32)
    assert implicit.page_size_bytes == stated.page_size_bytes == 16 * 8 * (64 + 64) * 4
    files = {
        rel for rel, (_, _, found) in corrected.items() if any(c.rule == "dtype" for c in found)
    }
    assert any("mooncake_store" in rel for rel in files)
    for rel in files:
        before, after, _ = corrected[rel]
        assert "dtype=None" in before and "dtype=None" not in after, rel
        assert re.search(r"^import torch$", after, flags=re.MULTILINE), rel


def test_a_state_spec_gets_one_dtype_per_state(
    corrected: dict[str, tuple[str, str, list[Any]]],
) -> None:
    """``MambaSpec(shapes=((16,), (16,)), dtypes=(torch.float16,))``: vLLM's page counts
    the first state only (16 x 2 B = 32 B); with a dtype per state both (64 B)."""
    one = MambaSpec(block_size=16, shapes=((16,), (16,)), dtypes=(torch.float16,))
    two = MambaSpec(block_size=16, shapes=((16,), (16,)), dtypes=(torch.float16,) * 2)
    assert (one.page_size_bytes, two.page_size_bytes) == (16 * 2, 2 * 16 * 2)
    before, after, found = corrected["tests/v1/kv_connector/unit/utils.py"]
    assert "dtypes=(torch.float16,)," in before
    assert "dtypes=(torch.float16, torch.float16)" in after
    assert [c.rule for c in found] == ["state dtypes", "group traits"]


def test_the_abstract_base_case_expects_the_refusal(
    corrected: dict[str, tuple[str, str, list[Any]]],
) -> None:
    _, after, _ = corrected[
        "tests/v1/kv_connector/unit/offloading_connector/test_canonical_mapping.py"
    ]
    assert "with pytest.raises(UnsupportedSpecError):" in after
    assert "from kvspec_traits import UnsupportedSpecError" in after
    assert "KVCacheSpec(block_size=4), None, _ctx(0, tp=4, total=8)) is None" not in after


def test_a_rule_anchored_twice_is_refused(tmp_path: Path) -> None:
    """An anchor found twice is never guessed at: FixtureError names the file."""
    module = _module()
    test = tmp_path / "tests/v1/kv_connector/unit/offloading_connector/test_canonical_mapping.py"
    test.parent.mkdir(parents=True)
    test.write_text("import pytest\n\n\ndef f():\n" + module._ABSTRACT_OLD * 2)
    with pytest.raises(module.FixtureError, match=r"test_canonical_mapping\.py"):
        module.corrected_sources(tmp_path)


def test_a_state_spec_given_a_tuple_of_ints_gets_one_shape(
    corrected: dict[str, tuple[str, str, list[Any]]],
) -> None:
    """``MambaSpec(shapes=(1, 1), dtypes=(float32,))`` has no page even for vLLM (its
    ``page_size_bytes`` raises TypeError); the fixture is the one (1, 1) state the file's
    other fixtures give: 1 x 1 x 4 B = 4 B."""
    flat = MambaSpec(block_size=16, shapes=(1, 1), dtypes=(torch.float32,))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _ = flat.page_size_bytes
    one = MambaSpec(block_size=16, shapes=((1, 1),), dtypes=(torch.float32,))
    assert one.page_size_bytes == 1 * 1 * 4
    before, after, found = corrected["tests/v1/kv_connector/unit/test_mooncake_store_worker.py"]
    rules = [c.rule for c in found]
    assert rules.count("state shapes") == before.count("shapes=(1, 1),") == 2
    assert "shapes=(1, 1)," not in after


def test_classes_injected_into_group_spec_types_become_their_traits(
    corrected: dict[str, tuple[str, str, list[Any]]],
) -> None:
    """The patch's NIXL worker keeps each group's traits in ``_group_spec_types`` (hand
    edit, kvspec_workbench.hand_edits). Every test that injects classes there, or passes them to
    ``compute_tp_mapping``, gets ``group_traits(...)``; the helper the rule adds to the
    suite's utils.py, run here on vLLM's classes, answers the patched helpers' questions
    as ``issubclass`` answered them on the class."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    from kvspec_traits import TokenScope

    unit = "tests/v1/kv_connector/unit/"
    found = [c for _, _, cs in corrected.values() for c in cs if c.rule == "group traits"]
    files = {c.path for c in found}
    assert files >= {unit + "utils.py", unit + "test_tp_mapping.py"}
    assert unit + "test_nixl_connector_hma.py" in files
    for rel in files - {unit + "utils.py"}:
        before, after, _ = corrected[rel]
        # every injection is corrected: none left assigning classes
        injected = re.findall(r"\._group_spec_types = (.+)$", before, flags=re.M)
        assert injected, rel
        for value in re.findall(r"\._group_spec_types = (.+)$", after, flags=re.M):
            assert value.startswith("group_traits") or value == "tuple(", (rel, value)
        assert "from tests.v1.kv_connector.unit.utils import group_traits" in after, rel
    _, helper_module, _ = corrected[unit + "utils.py"]
    helper = helper_module[helper_module.index("\ndef group_traits(") :]
    namespace: dict[str, Any] = {"torch": torch, "Any": Any}
    exec(compile(helper, "group_traits", "exec"), namespace)
    classes = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec)
    traits = namespace["group_traits"](*classes, MambaSpec)
    assert [t.spec_name for t in traits] == [c.__name__ for c in (*classes, MambaSpec)]
    for cls, t in zip((*classes, MambaSpec), traits, strict=True):
        assert t.attention_page == issubclass(cls, AttentionSpec), cls
        assert (t.token_scope is TokenScope.RECURRENT_STATE) == issubclass(cls, MambaSpec), cls


def test_moriio_stand_in_group_specs_become_full_attention(
    corrected: dict[str, tuple[str, str, list[Any]]],
) -> None:
    """MoRIIO's scheduler tests give attention groups ``kv_cache_spec=object()``;
    ``isinstance(object(), MambaSpec)`` said "not Mamba", and the rewritten check asks
    traits, which refuse a non-spec. The stand-in becomes a full-attention spec, whose
    traits say "not Mamba" too."""
    from kvspec_traits import TokenScope, UnsupportedSpecError, traits_of

    with pytest.raises(UnsupportedSpecError):
        traits_of(object())  # type: ignore[arg-type]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    assert traits_of(spec).token_scope is not TokenScope.RECURRENT_STATE
    assert not isinstance(object(), MambaSpec) and not isinstance(spec, MambaSpec)
    before, after, found = corrected["tests/v1/kv_connector/unit/test_moriio_hma_scheduler.py"]
    stand_ins = [c for c in found if c.rule == "stand-in spec"]
    assert len(stand_ins) == before.count("kv_cache_spec=object()") > 0
    assert "kv_cache_spec=object()" not in after
    assert after.count("block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32") >= len(
        stand_ins
    )
