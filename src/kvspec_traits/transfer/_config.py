"""Reading vLLM's KV cache config (or specs) for planning: which cache groups are
transferred and in what order (:func:`transfer_groups`), the traits of each group and
of its layers (:func:`cache_group_traits`): the answers the planner and the connector
share. One traits lookup per group spec (or per layer spec).

Pure: vLLM's types are named for type checking only. The config is read through the
fields every vLLM series the connector supports (0.32-0.34) has (``enable_kv_transfer``,
``host_resident``, ``hisparse_host_num_blocks``), without probing: no vLLM version
knowledge lives in this package (the connector's is in ``vllm_connector._quirks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from kvspec_traits._group import traits_for_layer
from kvspec_traits._registry import Registry
from kvspec_traits._traits import KVLayoutTraits
from kvspec_traits.transfer._errors import MissingLayerError
from kvspec_traits.transfer._region import region_sort_key

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

__all__ = [
    "CacheGroupTraits",
    "TransferGroup",
    "cache_group_traits",
    "LayerFacts",
    "config_facts",
    "facts_of_config",
    "facts_of_specs",
    "transfer_groups",
]


@dataclasses.dataclass(frozen=True)
class TransferGroup:
    """A cache group that takes part in KV transfer."""

    index: int
    """Its position among the transferred groups (vLLM's ``transfer_groups``): the
    region group id of its layers."""
    kv_cache_group: int
    """Its position in ``kv_cache_groups``."""
    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    host_resident: bool
    """Lives in vLLM's HiSparse host pool (on the host, its own block count)."""
    num_blocks: int | None
    """The block count of its pool when that is not the config's ``num_blocks`` (the
    host pool's for a host-resident group, as vLLM's ``KVCacheConfig.num_blocks_of``)."""


def transfer_groups(config: KVCacheConfig) -> tuple[TransferGroup, ...]:
    """The cache groups of ``config`` that are transferred, in transfer order: those
    with ``enable_kv_transfer``, numbered as vLLM's ``KVCacheConfig.transfer_groups``.
    Host-resident groups are transferred too (vLLM's NIXL worker registers them from
    the host pool), over their pool's block count."""
    host_blocks = config.hisparse_host_num_blocks
    found: list[TransferGroup] = []
    for position, group in enumerate(config.kv_cache_groups):
        if not group.enable_kv_transfer:
            continue
        found.append(
            TransferGroup(
                index=len(found),
                kv_cache_group=position,
                layer_names=tuple(group.layer_names),
                spec=group.kv_cache_spec,
                host_resident=group.host_resident,
                num_blocks=host_blocks if group.host_resident else None,
            )
        )
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class CacheGroupTraits:
    """The traits of one cache group of a ``KVCacheConfig`` and of its layers."""

    kv_cache_group: int
    """Its position in ``kv_cache_groups``."""
    traits: KVLayoutTraits
    """Of the group's spec (a group of several spec types: its ``GroupTraits``)."""
    layers: Mapping[str, KVLayoutTraits]
    """Each member layer's traits (:func:`traits_for_layer`), in the group's order,
    transferable or not."""
    transfer: TransferGroup | None
    """Its place among the transferred groups; ``None`` if it is not transferred."""


def cache_group_traits(
    config: KVCacheConfig, reg: Registry, *, every_group: bool = False
) -> tuple[CacheGroupTraits, ...]:
    """The traits of the transferred cache groups of ``config`` and of their layers, in
    ``kv_cache_groups`` order; with ``every_group``, of the groups that are not
    transferred too (their specs must then have adapters). One lookup per group."""
    transferred = {g.kv_cache_group: g for g in transfer_groups(config)}
    found: list[CacheGroupTraits] = []
    for position, group in enumerate(config.kv_cache_groups):
        transfer = transferred.get(position)
        if transfer is None and not every_group:
            continue
        traits = reg.traits_of(group.kv_cache_spec)
        layers = {layer: traits_for_layer(traits, layer) for layer in group.layer_names}
        found.append(CacheGroupTraits(position, traits, layers, transfer))
    return tuple(found)


def _not_transferable(traits: KVLayoutTraits) -> str:
    """The :attr:`RegionPlan.skipped_layers` reason of a layer whose traits say it is
    not transferable."""
    return f"{traits.spec_name} is not transferable (scope {traits.token_scope.value})"


class LayerFacts(NamedTuple):
    """What planning needs of every layer, from the config or the specs."""

    traits: dict[str, KVLayoutTraits]
    """Each transferable layer's traits."""
    groups: dict[str, int]
    """Each transferable layer's transfer group id."""
    blocks: dict[str, int]
    """A layer's block count where it is not the pool's (``num_blocks``)."""
    num_blocks: int
    """The pool's block count."""
    skipped: dict[str, str]
    """The layers not transferred, each with why."""


def config_facts(
    kv_caches: Mapping[str, Any],
    config: KVCacheConfig | None,
    specs: Mapping[str, KVCacheSpec] | None,
    group_ids: Mapping[str, int] | None,
    num_blocks: int | None,
    reg: Registry,
) -> LayerFacts:
    """Traits, transfer group and (where it differs from the pool's) block count of
    every layer: one traits lookup per layer (or per group spec), never per request.
    From ``config`` (:func:`facts_of_config`) or from ``specs`` and ``num_blocks``
    (:func:`facts_of_specs`); ``ValueError`` for both or neither."""
    del kv_caches
    if config is not None:
        if specs is not None:
            raise ValueError("pass kv_cache_config or specs, not both")
        return facts_of_config(config, num_blocks, reg)
    if specs is None or num_blocks is None:
        raise ValueError("plan_regions needs kv_cache_config, or specs and num_blocks")
    return facts_of_specs(specs, group_ids, num_blocks, reg)


def facts_of_config(config: KVCacheConfig, num_blocks: int | None, reg: Registry) -> LayerFacts:
    """The :class:`LayerFacts` of a ``KVCacheConfig``: its transferred groups' layers, one
    traits lookup per group spec; ``num_blocks`` (if given) instead of the config's."""
    facts = LayerFacts({}, {}, {}, config.num_blocks if num_blocks is None else num_blocks, {})
    transferred = {g.kv_cache_group: g for g in cache_group_traits(config, reg)}
    for position, group in enumerate(config.kv_cache_groups):
        found = transferred.get(position)
        if found is None or found.transfer is None:
            for layer in group.layer_names:
                facts.skipped[layer] = "its cache group has enable_kv_transfer=False"
            continue
        transfer = found.transfer
        for layer, layer_traits in found.layers.items():
            if transfer.num_blocks is not None:
                facts.blocks[layer] = transfer.num_blocks
            if not layer_traits.transferable:
                facts.skipped[layer] = _not_transferable(layer_traits)
                continue
            facts.traits[layer] = layer_traits
            facts.groups[layer] = transfer.index
    return facts


def facts_of_specs(
    specs: Mapping[str, KVCacheSpec],
    group_ids: Mapping[str, int] | None,
    num_blocks: int,
    reg: Registry,
) -> LayerFacts:
    """The :class:`LayerFacts` of per-layer ``specs``, each transferable layer in its
    ``group_ids`` group (every layer in group 0 without them); :class:`MissingLayerError`
    for a transferable layer ``group_ids`` leaves out."""
    facts = LayerFacts({}, {}, {}, num_blocks, {})
    without_group = []
    for layer, spec in specs.items():
        layer_traits = reg.traits_of(spec)
        if not layer_traits.transferable:
            facts.skipped[layer] = _not_transferable(layer_traits)
            continue
        facts.traits[layer] = layer_traits
        if group_ids is None:
            facts.groups[layer] = 0
        elif layer in group_ids:
            facts.groups[layer] = group_ids[layer]
        else:
            without_group.append(layer)
    if without_group:
        raise MissingLayerError(
            sorted(without_group, key=region_sort_key),
            "group_ids",
            "give every transferable layer of specs its transfer group id (0, 1, ...), "
            "or omit group_ids to put every layer in group 0",
        )
    return facts
