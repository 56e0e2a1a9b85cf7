"""Reading vLLM's KV cache config (or specs) for planning: traits, transfer group and
block count of every layer. One traits lookup per layer (or per group spec).

Pure: vLLM's types are named for type checking only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvspec_traits._group import traits_for_layer
from kvspec_traits._registry import Registry
from kvspec_traits._traits import KVLayoutTraits
from kvspec_traits.transfer._errors import MissingLayerError
from kvspec_traits.transfer._region import region_sort_key

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

__all__ = ["config_facts"]


def _not_transferable(traits: KVLayoutTraits) -> str:
    """The :attr:`RegionPlan.skipped_layers` reason of a layer whose traits say it is
    not transferable."""
    return f"{traits.spec_name} is not transferable (scope {traits.token_scope.value})"


def config_facts(
    kv_caches: Mapping[str, Any],
    config: KVCacheConfig | None,
    specs: Mapping[str, KVCacheSpec] | None,
    group_ids: Mapping[str, int] | None,
    num_blocks: int | None,
    reg: Registry,
) -> tuple[dict[str, KVLayoutTraits], dict[str, int], dict[str, int], int, dict[str, str]]:
    """Traits, transfer group and (where it differs from the pool's) block count of
    every layer: one traits lookup per layer (or per group spec), never per request."""
    traits: dict[str, KVLayoutTraits] = {}
    groups: dict[str, int] = {}
    blocks: dict[str, int] = {}
    skipped: dict[str, str] = {}
    if config is not None:
        if specs is not None:
            raise ValueError("pass kv_cache_config or specs, not both")
        n_blocks = config.num_blocks if num_blocks is None else num_blocks
        transfer_index = 0
        for group in config.kv_cache_groups:
            if not group.enable_kv_transfer:
                for layer in group.layer_names:
                    skipped[layer] = "its cache group has enable_kv_transfer=False"
                continue
            group_traits = reg.traits_of(group.kv_cache_spec)
            host_blocks = getattr(config, "hisparse_host_num_blocks", None)
            for layer in group.layer_names:
                if getattr(group, "host_resident", False) and host_blocks is not None:
                    # A host-resident group lives in the HiSparse host pool, which has
                    # its own block count (vLLM's KVCacheConfig.num_blocks_of).
                    blocks[layer] = host_blocks
                layer_traits = traits_for_layer(group_traits, layer)
                if not layer_traits.transferable:
                    skipped[layer] = _not_transferable(layer_traits)
                    continue
                traits[layer] = layer_traits
                groups[layer] = transfer_index
            transfer_index += 1
        return traits, groups, blocks, n_blocks, skipped
    if specs is None or num_blocks is None:
        raise ValueError("plan_regions needs kv_cache_config, or specs and num_blocks")
    without_group = []
    for layer, spec in specs.items():
        layer_traits = reg.traits_of(spec)
        if not layer_traits.transferable:
            skipped[layer] = _not_transferable(layer_traits)
            continue
        traits[layer] = layer_traits
        if group_ids is None:
            groups[layer] = 0
        elif layer in group_ids:
            groups[layer] = group_ids[layer]
        else:
            without_group.append(layer)
    if without_group:
        raise MissingLayerError(
            sorted(without_group, key=region_sort_key),
            "group_ids",
            "give every transferable layer of specs its transfer group id (0, 1, ...), "
            "or omit group_ids to put every layer in group 0",
        )
    del kv_caches
    return traits, groups, blocks, num_blocks, skipped
