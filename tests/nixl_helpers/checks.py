"""Byte checks for transfers, computed from vLLM's per-layer views (not from the plan)."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from tests.nixl_helpers.layouts import backing

__all__ = ["assert_transferred", "request_blocks"]


def request_blocks(config: KVCacheConfig, per_group: int = 3, start: int = 1) -> list[list[int]]:
    """Disjoint block ids per transfer group (a block id belongs to one group at a
    time): group g gets a run of ``per_group`` consecutive ids."""
    return [
        list(range(start + g * per_group, start + (g + 1) * per_group))
        for g in range(len(config.transfer_groups))
    ]


def _page(cache: torch.Tensor, block: int, base: int, num_blocks: int) -> tuple[int, int]:
    # Kernel-block rows: a manager block is `ratio` consecutive, abutting rows (vLLM's
    # group_kernel_blocks; create_kv_cache_views splits only dense pages).
    ratio = cache.shape[0] // num_blocks
    first = cache[block * ratio]
    return first.data_ptr() - base, first.nbytes * ratio


def assert_transferred(
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
    config: KVCacheConfig,
    block_ids: list[list[int]],
) -> int:
    """Every requested (layer, block) page of ``dst`` equals ``src``'s; every page of a
    block no group requested is still zero. Returns the bytes compared."""
    src_raw, dst_raw = backing(src), backing(dst)
    src_base = src_raw.data_ptr()
    dst_base = dst_raw.data_ptr()
    requested = {b for ids in block_ids for b in ids}
    compared = 0
    for gid, group in enumerate(config.transfer_groups):
        for layer in group.layer_names:
            for block in range(config.num_blocks):
                s_off, length = _page(src[layer], block, src_base, config.num_blocks)
                d_off, d_len = _page(dst[layer], block, dst_base, config.num_blocks)
                assert (s_off, length) == (d_off, d_len), layer
                got = dst_raw[d_off : d_off + length]
                if block in block_ids[gid]:
                    assert torch.equal(got, src_raw[s_off : s_off + length]), (layer, block)
                    compared += length
                elif block not in requested:
                    assert not bool(got.any()), f"{layer} block {block} was written"
    return compared
