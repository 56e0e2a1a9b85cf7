"""LayoutTraits refuses inconsistent values at construction, naming the field."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from vllm.v1 import kv_cache_interface as kvi

from kvspec_traits import TPLayout, traits_of
from kvspec_traits.extend import LayoutTraits


def _gqa() -> LayoutTraits:
    t = traits_of(
        kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    )
    assert isinstance(t, LayoutTraits)
    return t


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # 16 * 2 * (64 + 64) * 2 B = 8192 B of content cannot fit a smaller page
        ({"page_size_bytes": 8191}, "smaller than its content"),
        ({"unpadded_page_size_bytes": 4096, "page_size_bytes": 4096}, "components add up to 8192"),
        (
            {"tp_layout": TPLayout.REPLICATED, "tp_shards": None},
            "REPLICATED layout has tp_shards 1",
        ),
        ({"tp_layout": TPLayout.HEAD_SHARDED, "tp_shards": 1}, "one shard is TPLayout.REPLICATED"),
        ({"tp_layout": TPLayout.STATE_SHARDED, "tp_shards": 0}, "2 or more"),
    ],
)
def test_inconsistent_traits_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(_gqa(), **changes)  # type: ignore[arg-type]


def test_consistent_changes_are_accepted() -> None:
    padded = replace(_gqa(), page_size_bytes=8192 + 512, tp_shards=4)
    assert (padded.page_size_bytes, padded.tp_shards) == (8704, 4)
