"""A TP rank's KV caches with known bytes, for the Mooncake transfer tests: every rank
of a TP group holds its slice of one seeded TP-1 "truth" (vLLM's head split), so what a
transfer must deliver is computed from the truth alone, not from the plan."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig

from tests.nixl_helpers import layouts

__all__ = ["OTHER_SEED", "rank_caches", "slice_heads"]

OTHER_SEED = 99
"""Fills the replicated layers of producer ranks above 0: a transfer that reads a
replicated page from a rank other than ``rank % producer TP`` shows these bytes."""


def slice_heads(truth: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], rank: int) -> None:
    """Give ``dst`` (a TP rank's caches) rank ``rank``'s heads of ``truth`` (the TP-1
    caches): vLLM's split of KV heads, ``heads`` per rank in rank order; a layer with
    as many heads as the truth is replicated (the same bytes on every rank)."""
    for layer, cache in dst.items():
        heads = cache.shape[1]
        full = truth[layer].view(torch.uint8)
        if heads == full.shape[1]:
            cache.view(torch.uint8).copy_(full)
        else:
            cache.view(torch.uint8).copy_(full[:, rank * heads : (rank + 1) * heads])


def rank_caches(
    family: str,
    num_blocks: int,
    tp: int,
    rank: int,
    seed: int | None,
    *,
    producer: bool = True,
    whole: bool = False,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Rank ``rank`` of TP ``tp``: zeros (``seed`` None), or its slice of the truth of
    ``seed`` (its replicated layers filled from :data:`OTHER_SEED` on a producer rank
    above 0); ``whole``: the seed's bytes over the whole allocation (for layouts whose
    TP slices are not the head split, such as a Mamba state's)."""
    config, caches = layouts.build(family, num_blocks, tp=tp)
    if seed is None:
        return config, caches
    if tp == 1 or whole:
        layouts.fill_pattern(caches, seed)
        return config, caches
    _, truth = layouts.build(family, num_blocks)
    layouts.fill_pattern(truth, seed)
    slice_heads(truth, caches, rank)
    if producer and rank > 0:
        _, other = layouts.build(family, num_blocks)
        layouts.fill_pattern(other, OTHER_SEED)
        replicated = {
            layer: cache
            for layer, cache in caches.items()
            if cache.shape[1] == truth[layer].shape[1]
        }
        slice_heads(other, replicated, 0)
    return config, caches
