"""Region planning: per-layer KV cache tensors -> regions, decided from traits alone.

Pure: imports neither NIXL nor vLLM nor torch at import time. A tensor is read only for
its address, shape, strides, element size and storage; a spec only through
``Registry.traits_of`` (one call per layer, or one per group spec), so no decision here
names a spec class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from kvspec_traits._registry import Registry, default_registry
from kvspec_traits._traits import TokenScope
from kvspec_traits.transfer._config import config_facts, transfer_groups
from kvspec_traits.transfer._errors import MissingLayerError
from kvspec_traits.transfer._geometry import (
    Piece,
    as_member_row,
    as_rows,
    device_id_of,
    layer_pieces,
    mem_type_of,
    paged_ratio,
)
from kvspec_traits.transfer._merge import merge_region
from kvspec_traits.transfer._region import MemoryRange, RegionPlan, region_sort_key
from kvspec_traits.transfer._tp import shard_count

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

__all__ = ["plan_regions"]


def plan_regions(
    kv_caches: Mapping[str, torch.Tensor],
    kv_cache_config: KVCacheConfig | None = None,
    *,
    specs: Mapping[str, KVCacheSpec] | None = None,
    group_ids: Mapping[str, int] | None = None,
    num_blocks: int | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    registry: Registry | None = None,
    packed_rows: bool = False,
    kernel_blocks: bool = False,
    kernel_ratio: int | None = None,
    model_order: bool = True,
    whole_rows: bool | None = None,
    split_by_block_len: bool = False,
    packed_member_rows: bool = False,
) -> RegionPlan:
    """Plan the NIXL regions of one rank's KV cache.

    Pass either ``kv_cache_config`` (group ids, per-layer specs and ``num_blocks`` are
    read from it; only ``enable_kv_transfer`` groups take part, numbered as vLLM's
    ``transfer_groups``) or ``specs`` with ``num_blocks`` (and optionally
    ``group_ids``; default 0). ``kv_caches`` maps layer names to the tensors vLLM
    allocated (``[B, H, N, C]`` views, or flat byte views).

    ``packed_rows=True`` makes each block-outermost storage (every view advancing by
    one row of several pages, the storage exactly ``num_blocks`` rows) one region whose
    block is the whole row, as vLLM 0.32 registers padded DeepSeek-V4 rows: one
    descriptor per block instead of one per page, at the cost of moving every page of
    the row. Storages with a recurrent-state member keep one region per page. A row
    region is never split by heads (:attr:`Region.head_major` is False).

    ``packed_member_rows=True`` registers whole block rows for the pages that are the
    same on every TP rank, as vLLM 0.33+ does for block-outermost MLA caches: when every
    view shares one storage and one block stride, each replicated, token-paged,
    latent (MLA) view of a block-major storage becomes a region of whole rows at the
    storage's base (block length = stride), and :attr:`Region.packed_members` says
    where its page sits in the row. Other views keep their own pages.

    Views whose rows are kernel blocks (vLLM's kernel block splitting: ``num_blocks *
    ratio`` rows) are planned in manager blocks, the ids requests carry.
    ``kernel_blocks=True`` keeps vLLM's worker granularity instead (``block_len /
    ratio``, ``num_blocks * ratio``), for code that feeds the plan to vLLM's own
    descriptor machinery. ``kernel_ratio`` (the worker's
    ``_physical_blocks_per_logical_kv_block``; default: the paged views' common ratio)
    then also sets recurrent-state members in vLLM's worker form: ``ratio`` blocks of
    ``page / ratio`` bytes per state page, which vLLM's ``_build_mamba_local`` reads back
    as whole pages ``ratio`` kernel blocks apart (so a state can share a region with
    split attention pages). A paged view that is not split by that ratio raises
    :class:`UnsupportedLayoutError` (its kernel descriptors would address other blocks).

    A paged view whose block is not one dense page of its spec's size (layers
    interleaved inside a block, as BHLNC puts them; a page padded past its content) in
    a block-major storage (``num_blocks`` rows of the view's block stride, plus less
    than a row) is planned as the whole storage row, as vLLM registers it: one region
    per storage whose block is the row, shared by every such layer, never split by
    heads. vLLM does not do this for CSA-linear models (a ring-buffer layer present),
    whose shared rows it registers per owner: the default (``whole_rows=None``) follows
    that from the traits; ``True``/``False`` force it.

    Regions follow model-layer order (:func:`region_sort_key`); ``model_order=False``
    keeps the order of ``kv_caches`` instead, as vLLM's worker does for CSA-linear
    (ring-buffer) models, whose region indices its descriptor code relies on.

    Views at one base address share a region; ``split_by_block_len=True`` keys regions by
    base address and block length instead, as vLLM 0.34 does: overlaid groups paging the
    same bytes with different page sizes (a compressor ring over an MLA page) are then
    separate regions, each moving its own page, where by default they share one region
    that moves the longest page.

    Raises :class:`RegionConflictError` when layers sharing a region disagree on a
    fact the transfer needs, :class:`UnsupportedLayoutError` for a tensor that is not
    a whole number of strided blocks, :class:`MissingLayerError` for a transferable
    layer with no tensor in ``kv_caches`` (a tensor with no spec is skipped, as vLLM's
    worker skips it), ``ValueError`` for inconsistent arguments.
    """
    reg = registry if registry is not None else default_registry
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of tp_size {tp_size}")
    layer_traits, layer_groups, layer_blocks, n_blocks, skipped = config_facts(
        kv_caches, kv_cache_config, specs, group_ids, num_blocks, reg
    )
    # vLLM allocates a tensor for every layer of a transfer group (layers that share
    # another layer's cache get that tensor too), so a transferable spec without one
    # is a caller error; planning on would silently leave the layer's blocks behind.
    without_tensor = layer_traits.keys() - kv_caches.keys()
    if without_tensor:
        raise MissingLayerError(
            sorted(without_tensor, key=region_sort_key),
            "kv_caches",
            "pass every layer's KV cache tensor (the kv_caches vLLM gives "
            "register_kv_caches), or a config/specs without those layers",
        )

    if kernel_ratio is None and kernel_blocks:
        kernel_ratio = paged_ratio(kv_caches, layer_traits, layer_blocks, n_blocks)
    if kernel_ratio is not None and (kernel_ratio < 1 or not kernel_blocks):
        raise ValueError(f"kernel_ratio {kernel_ratio} needs kernel_blocks=True and >= 1")
    if whole_rows is None:
        whole_rows = not any(t.token_scope is TokenScope.RING for t in layer_traits.values())
    by_storage: dict[tuple[int, str], list[Piece]] = {}
    registrations: dict[tuple[int, str], MemoryRange] = {}
    spans: dict[tuple[int, str], list[tuple[str, int, int]]] = {}
    for layer in sorted(kv_caches, key=region_sort_key) if model_order else kv_caches:
        traits = layer_traits.get(layer)
        if traits is None:
            skipped.setdefault(layer, "no KV cache spec for this layer")
            continue
        cache = kv_caches[layer]
        storage = cache.untyped_storage()
        key = (storage.data_ptr(), mem_type_of(cache))
        if key not in registrations:
            registrations[key] = MemoryRange(
                base=key[0], length=storage.nbytes(), device_id=device_id_of(cache), mem_type=key[1]
            )
        spans.setdefault(key, []).append(
            # (layer, first byte, bytes its view spans): strides are non-negative
            (
                layer,
                cache.data_ptr(),
                cache.element_size()
                * (1 + sum((n - 1) * s for n, s in zip(cache.shape, cache.stride(), strict=True)))
                if cache.numel()
                else 0,
            )
        )
        by_storage.setdefault(key, []).extend(
            layer_pieces(
                layer,
                cache,
                traits,
                layer_groups[layer],
                layer_blocks.get(layer, n_blocks),
                kernel_blocks,
                kernel_ratio,
                registrations[key] if whole_rows else None,
            )
        )

    shared_rows = (
        packed_member_rows
        and len(registrations) == 1
        and len(
            {
                kv_caches[layer].stride(0) * kv_caches[layer].element_size()
                for layer in kv_caches
                if layer in layer_traits
            }
        )
        == 1
    )
    pieces: dict[tuple[int, str, int], list[Piece]] = {}
    for key, storage_pieces in by_storage.items():
        if packed_rows:
            storage_pieces = as_rows(storage_pieces, registrations[key])
        if shared_rows:
            storage_pieces = [as_member_row(p, registrations[key]) for p in storage_pieces]
        for piece in storage_pieces:
            region_key = (piece.base, piece.mem_type, piece.block_len if split_by_block_len else 0)
            pieces.setdefault(region_key, []).append(piece)

    regions = tuple(merge_region(index, members) for index, members in enumerate(pieces.values()))
    for region in regions:
        shard_count(region.tp_layout, region.tp_shards, tp_size, region=region.name)
    if kv_cache_config is not None:
        num_groups = len(transfer_groups(kv_cache_config))
    else:
        num_groups = max(group_ids.values(), default=0) + 1 if group_ids else 1
    return RegionPlan(
        regions=regions,
        registrations=tuple(
            replace(reg, layers=tuple(spans[key])) for key, reg in registrations.items()
        ),
        num_blocks=n_blocks,
        tp_size=tp_size,
        tp_rank=tp_rank,
        skipped_layers=skipped,
        num_groups=max(num_groups, 1),
    )
