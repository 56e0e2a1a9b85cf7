"""Region planning: per-layer KV cache tensors -> regions, decided from traits alone.

Pure: imports neither NIXL nor vLLM nor torch at import time. A tensor is read only for
its address, shape, strides, element size and storage; a spec only through
``Registry.traits_of`` (one call per layer, or one per group spec), so no decision here
names a spec class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvspec_traits._registry import Registry, default_registry
from kvspec_traits._traits import has_ring
from kvspec_traits.transfer._config import (
    LayerFacts,
    facts_of_config,
    facts_of_specs,
    transfer_groups,
)
from kvspec_traits.transfer._errors import MissingLayerError
from kvspec_traits.transfer._geometry import (
    Piece,
    device_id_of,
    layer_pieces,
    mem_type_of,
    rows_of,
)
from kvspec_traits.transfer._merge import merge_region
from kvspec_traits.transfer._region import MemoryRange, PlanLayout, Rows, region_sort_key
from kvspec_traits.transfer._region_plan import RegionPlan
from kvspec_traits.transfer._tp import shard_count, with_kv_heads

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
    layout: PlanLayout | None = None,
    total_kv_heads: int | None = None,
) -> RegionPlan:
    """Plan the regions of one rank's KV cache.

    Pass either ``kv_cache_config`` (group ids, per-layer specs and ``num_blocks`` are
    read from it; only ``enable_kv_transfer`` groups take part, numbered as vLLM's
    ``transfer_groups``) or ``specs`` with ``num_blocks`` (and optionally
    ``group_ids``; default 0). ``kv_caches`` maps layer names to the tensors vLLM
    allocated (``[B, H, N, C]`` views, or flat byte views).

    Views whose rows are kernel blocks (vLLM's kernel block splitting: ``num_blocks *
    ratio`` rows) are planned in whole blocks, the ids requests carry, unless
    ``layout`` asks for sub-blocks. Views at one base address share a region. What else
    two valid plans of the same bytes may differ in (sub-blocks, region order, whole
    rows, overlaid pages of other sizes) is ``layout``'s (:class:`PlanLayout`; default:
    ``PlanLayout()``).

    ``total_kv_heads``: the model's KV heads over the whole TP group (vLLM's
    ``model_config.get_total_num_kv_heads()``; ``None`` for an MLA model or where
    unknown). A head-sharded region whose specs leave their shard count unset
    (vLLM's attention specs) then has that many shards, so a model with fewer KV heads
    than ranks is planned, fingerprinted and read as replicas of its heads
    (:func:`~kvspec_traits.transfer.with_kv_heads`); without it, one shard per rank.

    Raises :class:`RegionConflictError` when layers sharing a region disagree on a
    fact the transfer needs, :class:`UnsupportedLayoutError` for a tensor that is not
    a whole number of strided blocks (or not split into ``layout.sub_blocks``),
    :class:`MissingLayerError` for a transferable layer with no tensor in ``kv_caches``
    (a tensor with no spec is skipped, as vLLM's worker skips it), ``ValueError`` for
    inconsistent arguments.
    """
    options = _Options(
        tp_size=tp_size,
        tp_rank=tp_rank,
        registry=registry if registry is not None else default_registry,
        layout=layout if layout is not None else PlanLayout(),
        total_kv_heads=total_kv_heads,
    )
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of tp_size {tp_size}")
    if kv_cache_config is not None:
        if specs is not None:
            raise ValueError("pass kv_cache_config or specs, not both")
        return _plan_of_config(kv_caches, kv_cache_config, num_blocks, options)
    if specs is None or num_blocks is None:
        raise ValueError("plan_regions needs kv_cache_config, or specs and num_blocks")
    return _plan_of_specs(kv_caches, specs, group_ids, num_blocks, options)


@dataclass(frozen=True)
class _Options:
    """What both modes of :func:`plan_regions` plan with besides the layers' facts."""

    tp_size: int
    tp_rank: int
    registry: Registry
    layout: PlanLayout
    total_kv_heads: int | None


def _plan_of_config(
    kv_caches: Mapping[str, torch.Tensor],
    config: KVCacheConfig,
    num_blocks: int | None,
    options: _Options,
) -> RegionPlan:
    """:func:`plan_regions` from a ``KVCacheConfig``: its ``enable_kv_transfer`` groups,
    numbered as vLLM's ``transfer_groups``, over its ``num_blocks`` (or the one given)."""
    facts = facts_of_config(config, num_blocks, options.registry)
    return _plan(kv_caches, facts, len(transfer_groups(config)), options)


def _plan_of_specs(
    kv_caches: Mapping[str, torch.Tensor],
    specs: Mapping[str, KVCacheSpec],
    group_ids: Mapping[str, int] | None,
    num_blocks: int,
    options: _Options,
) -> RegionPlan:
    """:func:`plan_regions` from per-layer specs, each layer in its ``group_ids`` group
    (default 0), over ``num_blocks``."""
    facts = facts_of_specs(specs, group_ids, num_blocks, options.registry)
    num_groups = max(group_ids.values(), default=0) + 1 if group_ids else 1
    return _plan(kv_caches, facts, num_groups, options)


def _plan(
    kv_caches: Mapping[str, torch.Tensor],
    facts: LayerFacts,
    num_groups: int,
    options: _Options,
) -> RegionPlan:
    """Both modes' plan once each layer's facts are known."""
    # vLLM allocates a tensor for every layer of a transfer group (layers that share
    # another layer's cache get that tensor too), so a transferable spec without one
    # is a caller error; planning on would silently leave the layer's blocks behind.
    without_tensor = facts.traits.keys() - kv_caches.keys()
    if without_tensor:
        raise MissingLayerError(
            sorted(without_tensor, key=region_sort_key),
            "kv_caches",
            "pass every layer's KV cache tensor (the kv_caches vLLM gives "
            "register_kv_caches), or a config/specs without those layers",
        )
    layout = options.layout
    rows = layout.rows
    if rows is None:
        rows = Rows.NONE if has_ring(facts.traits.values()) else Rows.SCATTERED
    storages = _storages_of(kv_caches, facts, layout, rows)
    one_stride = Rows.LATENT in rows and _one_stride(storages, kv_caches, facts.traits)
    regions = tuple(
        with_kv_heads(merge_region(index, members), options.total_kv_heads)
        for index, members in enumerate(_region_members(storages, rows, layout, one_stride))
    )
    for region in regions:
        shard_count(region.tp_layout, region.tp_shards, options.tp_size, region=region.name)
    return RegionPlan(
        regions=regions,
        registrations=tuple(
            replace(reg, layers=tuple(storages.spans[key]))
            for key, reg in storages.registrations.items()
        ),
        num_blocks=facts.num_blocks,
        tp_size=options.tp_size,
        tp_rank=options.tp_rank,
        skipped_layers=facts.skipped,
        num_groups=max(num_groups, 1),
    )


def _storages_of(
    kv_caches: Mapping[str, torch.Tensor], facts: LayerFacts, layout: PlanLayout, rows: Rows
) -> _Storages:
    """Every planned layer's view noted in its storage, with its region candidates; a
    tensor with no spec is skipped (noted in ``facts.skipped``), as vLLM's worker skips it."""
    storages = _Storages()
    ordered = sorted(kv_caches, key=region_sort_key) if layout.order == "model" else kv_caches
    for layer in ordered:
        traits = facts.traits.get(layer)
        if traits is None:
            facts.skipped.setdefault(layer, "no KV cache spec for this layer")
            continue
        cache = kv_caches[layer]
        key = storages.add(layer, cache)
        storages.pieces.setdefault(key, []).extend(
            layer_pieces(
                layer,
                cache,
                traits,
                facts.groups[layer],
                facts.blocks.get(layer, facts.num_blocks),
                layout.sub_blocks,
                storages.registrations[key] if Rows.SCATTERED in rows else None,
            )
        )
    return storages


class _Storages:
    """Per storage allocation (base, memory type): what to register, where each layer's
    view lies in it, and the region candidates of its layers."""

    def __init__(self) -> None:
        self.pieces: dict[tuple[int, str], list[Piece]] = {}
        self.registrations: dict[tuple[int, str], MemoryRange] = {}
        self.spans: dict[tuple[int, str], list[tuple[str, int, int]]] = {}

    def add(self, layer: str, cache: torch.Tensor) -> tuple[int, str]:
        """Note ``layer``'s view; the key of the storage it lies in."""
        storage = cache.untyped_storage()
        key = (storage.data_ptr(), mem_type_of(cache))
        if key not in self.registrations:
            self.registrations[key] = MemoryRange(
                base=key[0], length=storage.nbytes(), device_id=device_id_of(cache), mem_type=key[1]
            )
        # (layer, first byte, bytes its view spans): strides are non-negative
        spanned = (
            cache.element_size()
            * (1 + sum((n - 1) * s for n, s in zip(cache.shape, cache.stride(), strict=True)))
            if cache.numel()
            else 0
        )
        self.spans.setdefault(key, []).append((layer, cache.data_ptr(), spanned))
        return key


def _one_stride(
    storages: _Storages, kv_caches: Mapping[str, torch.Tensor], layer_traits: Mapping[str, object]
) -> bool:
    """One storage, every planned view at one block stride (what whole latent rows need)."""
    strides = {
        kv_caches[layer].stride(0) * kv_caches[layer].element_size()
        for layer in kv_caches
        if layer in layer_traits
    }
    return len(storages.registrations) == 1 and len(strides) == 1


def _region_members(
    storages: _Storages, rows: Rows, layout: PlanLayout, one_stride: bool
) -> list[list[Piece]]:
    """The pieces of each region, in order: pieces at one base (and memory type) share a
    region, apart from pages of other sizes where the layout separates them and the
    replicated states it plans apart (moving their content, the same on every rank)."""
    regions: dict[tuple[int, str, int, str], list[Piece]] = {}
    apart = layout.replicated_states_apart
    for key, storage_pieces in storages.pieces.items():
        registration = storages.registrations[key]
        for piece in rows_of(storage_pieces, registration, rows, one_stride=one_stride):
            size = piece.block_len if layout.separate_page_sizes else 0
            if piece.layer in apart:
                piece = replace(piece, block_len=piece.traits.unpadded_page_size_bytes)
            own = piece.layer if piece.layer in apart else ""
            regions.setdefault((piece.base, piece.mem_type, size, own), []).append(piece)
    return list(regions.values())
