"""docs/connector-guide.md and the README's "Use" block as tests, and the trait names
that misled a connector author (issue 25).

The guide's Python blocks, in order, are one module: it is run against the installed
vLLM (every number on the page is an assertion there, hand-computed from vLLM's page
formulas in the text beside it) and type-checked with mypy strict. On main there was no
guide, no public example config, and the README's block read ``page_size_bytes`` of a
group spec once per layer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvspec_traits import KVSpecTraitsError, traits_for_layer, traits_of
from kvspec_traits.catalog import (
    EXAMPLE_CONFIGS,
    ExampleConfig,
    UnknownExampleConfigError,
    example_config,
    example_config_name,
)
from tests import fresh
from tests.doc_blocks import mypy_strict, mypy_strict_on_blocks, named_block, python_blocks

if TYPE_CHECKING:
    from typing import assert_type

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "connector-guide.md"
README = REPO / "README.md"


def test_the_guide_runs() -> None:
    source = "\n\n".join(python_blocks(GUIDE.read_text()))
    assert "traits_for_layer" in source and "plan_regions" in source
    exec(compile(source, str(GUIDE), "exec"), {"__name__": "connector_guide"})


def test_the_guide_passes_mypy_strict(tmp_path: Path) -> None:
    """Without a ``# type: ignore``: on main the guide typed ``layer_traits(config)`` with
    one, for want of an exported name for the config's type (issue 40)."""
    assert "type: ignore" not in GUIDE.read_text()
    proc = mypy_strict_on_blocks(GUIDE, tmp_path / "connector_guide.py")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "connector_blocks.py"
    script.write_text(named_block(GUIDE.read_text(), script.name))
    return script


def _run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    _script(tmp_path)
    return fresh.run([sys.executable, "-m", "connector_blocks", *args], cwd=tmp_path, timeout=300)


def test_the_guides_script_passes_mypy_strict(tmp_path: Path) -> None:
    proc = mypy_strict(_script(tmp_path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_guides_script_says_what_each_layer_of_deepseek_v4_moves(tmp_path: Path) -> None:
    """1000 tokens over 64-token blocks fill cdiv(1000, 64) = 16 blocks: the compressed
    MLA (17 * 576 = 9792 B pages) and indexer (4 * 576 = 2304 B) layers move all 16, the
    128-token window the last cdiv(128, 64) + 1 = 3 (37440 B pages), the ring its one
    32768 B page; 4 layers of each (example_config's default)."""
    proc = _run_script(tmp_path, "deepseek_v4", "1000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "model.layers.0.attn.mla: FULL, positions 0-15 of 16, 156672 B" in lines  # 16 * 9792
    # 16 * 2304 = 36864; 3 * 37440 = 112320
    assert "model.layers.3.attn.indexer.k_cache: FULL, positions 0-15 of 16, 36864 B" in lines
    swa = "model.layers.2.attn.compressor.swa: SLIDING_WINDOW, positions 13-15 of 16, 112320 B"
    assert swa in lines
    assert "model.layers.1.attn.compressor.ring: RING, positions 0-0 of 1, 32768 B" in lines
    assert lines[-1] == f"total: {4 * (16 * 9792 + 16 * 2304 + 3 * 37440 + 32768)} B"
    assert len(lines) == 4 * 4 + 1


def test_the_guides_script_on_a_state_model_and_a_bad_name(tmp_path: Path) -> None:
    """Jamba, 100000 tokens: a Mamba layer moves its one state page whatever the length;
    the attention layer (16-token blocks of 65536 B) cdiv(100000, 16) = 6250 blocks."""
    proc = _run_script(tmp_path, "jamba", "100000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "model.layers.0.mamba: RECURRENT_STATE, positions 0-0 of 1, 65536 B" in lines
    assert "model.layers.1.attn: FULL, positions 0-6249 of 6250, 409600000 B" in lines  # * 65536
    # 3 state layers and 1 attention layer of the 4
    assert lines[-1] == f"total: {3 * 65536 + 6250 * 65536} B"
    bad = _run_script(tmp_path, "llama", "10")
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "example_config takes one of 'llama_gqa', 'deepseek_v4', 'jamba', got 'llama'"
    )


def test_the_guide_says_which_blocks_each_token_scope_moves() -> None:
    from kvspec_traits import TokenScope

    table = GUIDE.read_text().split("## 4.", 1)[1].split("```python", 1)[0]
    for scope in TokenScope:
        assert f"`{scope.name}`" in table or ("`SPARSE_*`" in table and "SPARSE" in scope.name)


def test_the_readme_use_block_runs_and_counts_a_group_once() -> None:
    """The README's block read ``traits_of(layer_spec)  # groups included`` then
    ``page_size_bytes``: for a UniformTypeKVCacheSpecs layer that is the whole group's
    page, counted once per layer. It now asks per layer through traits_for_layer."""
    (block,) = [b for b in python_blocks(README.read_text()) if "traits_for_layer" in b]
    assert "groups included" not in README.read_text()
    exec(compile(block, str(README), "exec"), {})
    config = example_config("deepseek_v4", layers=2)
    group = config.kv_cache_groups[0]
    group_traits = traits_of(group.kv_cache_spec)
    per_layer = [traits_for_layer(group_traits, n).page_size_bytes for n in group.layer_names]
    # 2 compressed MLA pages (17 * 576 B) and 2 indexer pages (4 * 576 B): a group page
    # is its layers' pages side by side.
    assert per_layer == [9792, 9792, 2304, 2304]
    assert group_traits.page_size_bytes == sum(per_layer)


def test_example_configs_are_real_vllm_configs() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    for name in EXAMPLE_CONFIGS:
        config = example_config(name, num_blocks=4)
        assert isinstance(config, KVCacheConfig)
        assert config.num_blocks == 4
        named = {n for t in config.kv_cache_tensors for n in t.layers}
        assert named == {n for g in config.kv_cache_groups for n in g.layer_names}
    with pytest.raises(UnknownExampleConfigError, match="'llama_gqa', 'deepseek_v4', 'jamba'"):
        example_config("llama")  # type: ignore[arg-type]
    with pytest.raises(UnknownExampleConfigError, match="got 'llama'") as raised:
        example_config_name("llama")
    assert isinstance(raised.value, KVSpecTraitsError) and isinstance(raised.value, ValueError)
    assert raised.value.name == "llama"
    assert [example_config_name(str(n)) for n in EXAMPLE_CONFIGS] == list(EXAMPLE_CONFIGS)


if TYPE_CHECKING:
    # A str from a command line is no ExampleConfig until example_config_name says so.
    example_config(sys.argv[1])  # type: ignore[arg-type]
    assert_type(example_config_name(sys.argv[1]), ExampleConfig)


def test_the_readme_seed_line_is_what_migrate_writes(tmp_path: Path) -> None:
    """The README's fix of NIXL's seed line asked ``tp_layout`` while ``migrate``
    wrote ``is_mla`` for the same line (issue 25): they now say the same."""
    from kvspec_traits.audit import load_universe
    from kvspec_traits.migrate import plan_migration

    seed = tmp_path / "seed.py"
    seed.write_text((REPO / "tests" / "fixtures" / "audit" / "seed_before.py").read_text())
    plan = plan_migration([seed], load_universe(extensions=False))
    (edit,) = [e for e in plan.edits if "MLAAttentionSpec" in e.before]
    assert f"`is_mla_region = {edit.after}`" in README.read_text()


@pytest.mark.parametrize(
    "page",
    ["README.md", "docs/connector-guide.md", "docs/traits/is_mla.md", "docs/migration.md"],
)
def test_is_mla_says_no_separate_v_wherever_it_surprises(page: str) -> None:
    """``is_mla`` is True for a ring buffer, a 3-head hidden-state cache and HiSparse
    pages; every page that teaches it says so (issue 25)."""
    text = " ".join((REPO / page).read_text().split())
    assert "no separate V" in text
    for where in ("ring buffer", "HiddenStateCacheSpec", "HiSparse"):
        assert where in text, where


def test_tp_shards_says_what_a_head_sharded_layer_has() -> None:
    """``tp_shards`` is None for Llama's head-sharded layer: the doc now says that
    means one shard per TP rank, and names the call that gives the number."""
    from kvspec_traits import TPLayout
    from kvspec_traits.transfer import shard_count

    llama = traits_of(example_config("llama_gqa").kv_cache_groups[0].kv_cache_spec)
    assert (llama.tp_layout, llama.tp_shards) == (TPLayout.HEAD_SHARDED, None)
    assert shard_count(llama.tp_layout, llama.tp_shards, 4) == 4
    text = " ".join((REPO / "docs" / "traits" / "tp_shards.md").read_text().split())
    assert 'None means "one shard per TP rank"' in text
    assert "shard_count(tp_layout, tp_shards, tp_size)" in text
