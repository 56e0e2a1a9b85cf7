"""The miss the audit finds in vLLM's own connectors, run on real specs: offloading's
``canonical_mapping.py`` asks ``isinstance(spec, MLAAttentionSpec)`` (line 282 in 0.32-0.34),
which leaves out ``SlidingWindowMLASpec`` (DeepSeek-V4's sparse SWA cache, one latent per
token like MLA, a ``SlidingWindowSpec`` by class).

What upstream's code does with the catalog's real DeepSeek-V4 SWA cache, read from
``_layer_mapping`` and ``derive_canonical_mappings``: the layer falls into the head-split
branch; the cache tensor is neither ``(blocks, heads, block, 2 * head)`` nor
``(blocks, 2, block, heads, head)``, so ``_attention_byte_regions`` returns None and the
layer gets ``_opaque_fallback_mapping``: its page stored whole per TP rank (``tp`` copies of a
TP-replicated latent, ``parallelism_agnostic=False``, so blocks offloaded at one TP cannot be
loaded at another). No wrong bytes move; the mapping is lost, not corrupted. With the
migrated line (``traits_of(spec).is_mla``), the same layer takes the MLA branch: one
canonical page of ``page`` bytes, every TP rank a writer of the same bytes, parallelism
agnostic, and ``_verify_tiling`` (vLLM's own check) accepts the per-rank mappings.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits.audit import load_universe
from kvspec_traits.migrate import plan_migration
from tests.nixl_helpers import layouts

NB = 4


@pytest.fixture(scope="module")
def modules() -> tuple[Any, Any]:
    """vLLM's canonical_mapping module and the same file migrated, as a module."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping

    path = Path(canonical_mapping.__file__)
    plan = plan_migration([path], load_universe())
    (file_plan,) = plan.files
    misses = [e for e in file_plan.edits if e.fixes_miss]
    assert [(e.before, e.after, e.missing) for e in misses] == [
        ("isinstance(spec, MLAAttentionSpec)", "traits_of(spec).is_mla", ("SlidingWindowMLASpec",))
    ]
    migrated = types.ModuleType("canonical_mapping_migrated")
    migrated.__file__ = str(path)
    sys.modules[migrated.__name__] = migrated  # its dataclasses look their module up
    exec(compile(file_plan.after, str(path), "exec"), migrated.__dict__)
    return canonical_mapping, migrated


@pytest.fixture(scope="module")
def swa_layer() -> tuple[Any, Any, int]:
    """The catalog's DeepSeek-V4 sparse SWA cache (SlidingWindowMLASpec, fp8_ds_mla,
    block 64) and one of its layers' tensors as vLLM's create_kv_cache_views lays it out."""
    groups = layouts.deepseek_v4(tp=1)
    config = layouts.kv_cache_config(groups, NB, KVCacheLayout.LBHNC)
    caches = layouts.allocate(config, KVCacheLayout.LBHNC)
    name = next(n for n in caches if n.endswith(layouts.DSV4_CACHES["swa"]))
    spec = next(g.kv_cache_spec for g in groups if name in g.layer_names)
    assert type(spec).__name__ == "SlidingWindowMLASpec"
    return spec, caches[name], config.num_blocks


@pytest.mark.parametrize("tp", [1, 2])
def test_upstream_loses_the_swa_mla_mapping_and_the_migrated_line_certifies_it(
    swa_layer: tuple[Any, Any, int], modules: tuple[Any, Any], tp: int
) -> None:
    spec, tensor, num_blocks = swa_layer
    upstream, migrated = modules

    def ctx(module: Any, rank: int) -> Any:
        # DeepSeek-V4's model config reports one KV head (MLA), whatever the TP size.
        return module._RankContext(
            tp_size=tp, dcp_size=1, pcp_size=1, interleave=1, total_kv_heads=1, rank=rank
        )

    page = spec.real_page_size_bytes
    # The real (unpadded) page: 64 tokens x 584 B of state (448 NoPE + 128 RoPE + 8 scale);
    # the allocation pads it to a multiple of the 576 B alignment (page_size_bytes).
    assert page == 64 * 584 == 37376
    assert spec.page_size_bytes == -(-37376 // 576) * 576 == 37440
    for rank in range(tp):
        assert upstream._layer_mapping(spec, tensor, num_blocks, ctx(upstream, rank)) is None
    # so derive_canonical_mappings takes the opaque fallback: the page whole, per rank
    fallback = upstream._opaque_fallback_mapping(upstream._unpadded_page_size(spec), tp, 0)
    assert fallback.canonical_page_size_bytes == tp * spec.unpadded_page_size_bytes
    assert fallback.parallelism_agnostic is False

    per_rank = [
        migrated._layer_mapping(spec, tensor, num_blocks, ctx(migrated, rank)) for rank in range(tp)
    ]
    for rank, mapping in enumerate(per_rank):
        assert mapping is not None
        # The MLA branch's formulas (cp 1): canonical page = local page = the real page;
        # every TP rank holds the same latent, so tp writers of the one page.
        assert mapping.canonical_page_size_bytes == page
        assert mapping.local_page_size_bytes == page
        assert (mapping.num_writers, mapping.writer_index) == (tp, rank)
        assert mapping.parallelism_agnostic is True
    migrated._verify_tiling("model.layers.0.attn.compressor.swa", per_rank)
