"""The worker-wide layout facts vLLM's NIXL worker derives from spec classes, here from
traits (pure: vLLM's types are named for type checking only)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvspec_traits._group import representative_traits
from kvspec_traits._registry import Registry, default_registry
from kvspec_traits._traits import KVLayoutTraits, TokenScope, TPLayout
from kvspec_traits.transfer._config import CacheGroupTraits, TransferGroup, cache_group_traits
from kvspec_traits.transfer._region import has_ring, is_state
from kvspec_traits.vllm_connector._errors import UnknownStateBlocksError
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "LayoutFacts",
    "SchedulerFacts",
    "layout_facts",
    "replicated_state_group",
    "scheduler_facts",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutFacts:
    """The worker-wide layout facts vLLM's NIXL worker derives from spec classes,
    here from traits. Group indices are positions in ``transfer_groups`` unless named
    ``kv_cache_group``."""

    transfer_groups: tuple[TransferGroup, ...]
    """The transferred cache groups, as the planner numbers them
    (:func:`kvspec_traits.transfer._config.transfer_groups`)."""
    layer_traits: Mapping[str, KVLayoutTraits]
    group_is_state: tuple[bool, ...]
    """Per transfer group: holds recurrent states (vLLM: an SSM group)."""
    transfer_block_size: int | None
    """LCM of the token-paged transfer groups' block sizes (None if there are none)."""
    hybrid: bool
    """Some layer does not keep every token (vLLM: the hybrid allocator is needed)."""
    has_state: bool
    has_ring: bool
    mla: bool
    """Some transferred layer caches one latent per token (vLLM: ``use_mla``)."""
    replicated_state_kv_cache_group: int | None
    """The cache group whose layers are all TP-replicated states next to a ring (vLLM:
    the CSA-linear PLE group)."""


def layout_facts(kv_cache_config: KVCacheConfig, registry: Registry | None = None) -> LayoutFacts:
    """Answer the worker's layout questions from the traits of ``kv_cache_config``."""
    reg = registry if registry is not None else default_registry
    # Every group: vLLM's worker finds a ring (CSA-linear) and the PLE group among all.
    groups = cache_group_traits(kv_cache_config, reg, every_group=True)
    transferred = [g for g in groups if g.transfer is not None]
    layer_traits = {layer: t for g in transferred for layer, t in g.layers.items()}
    kinds = [representative_traits(g.traits) for g in transferred]
    # vLLM leaves groups not addressed by token position out of the transfer block size.
    block_sizes = [k.block_size for k in kinds if k.token_paged]
    ring = has_ring(representative_traits(g.traits) for g in groups)
    return LayoutFacts(
        transfer_groups=tuple(g.transfer for g in transferred if g.transfer is not None),
        layer_traits=layer_traits,
        group_is_state=tuple(is_state(k) for k in kinds),
        transfer_block_size=math.lcm(*block_sizes) if block_sizes else None,
        hybrid=any(t.token_scope is not TokenScope.FULL for t in layer_traits.values()),
        has_state=any(is_state(t) for t in layer_traits.values()),
        has_ring=ring,
        mla=any(t.is_mla and t.token_paged for t in layer_traits.values()),
        replicated_state_kv_cache_group=replicated_state_group(groups) if ring else None,
    )


def replicated_state_group(groups: Sequence[CacheGroupTraits]) -> int | None:
    """The cache group (index in ``kv_cache_groups``, transferred or not) whose layers
    are all TP-replicated recurrent states, as vLLM's worker finds its PLE group
    (``_ple_group_index``) in a ring-buffer (CSA-linear) model; ``groups``: every cache
    group's traits (:func:`~kvspec_traits.transfer._config.cache_group_traits`).

    A question about cache groups, asked before any region exists: raises
    ``ValueError`` for more than one such group, or one of several layers (vLLM keeps
    one PLE layer). It differs from
    :func:`~kvspec_traits.vllm_connector._fields.replicated_state_region`, which asks
    the plan how many *regions* hold a replicated state member (in any model, mixed
    with other members or not): two replicated-state layers overlaid on one region pass
    that rule and fail this one; a model without a ring is never asked this one.
    """
    found = [
        g
        for g in groups
        if g.layers
        and all(is_state(t) and t.tp_layout is TPLayout.REPLICATED for t in g.layers.values())
    ]
    if len(found) > 1 or any(len(g.layers) != 1 for g in found):
        raise ValueError(
            f"{CONNECTOR_NAME}: a ring-buffer model may have at most one replicated "
            f"recurrent-state layer (found groups {[g.kv_cache_group for g in found]})"
        )
    return found[0].kv_cache_group if found else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerFacts:
    """What vLLM's NIXL scheduler decides from spec classes (``base_scheduler.py``:
    ``isinstance(..., FullAttentionSpec / SlidingWindowSpec / MambaSpec)``), here from
    traits. Per-group tuples are in transfer-group order."""

    hybrid: bool
    """As :attr:`LayoutFacts.hybrid` (vLLM: ``_is_hma_required`` unless the hybrid
    allocator is disabled): only then are blocks clipped per group."""
    window_blocks: tuple[int, ...]
    """Per group: the trailing blocks a windowed group sends (vLLM's ``blocks_per_sw``),
    0 for a group whose every block is sent."""
    state_scratch_blocks: tuple[int | None, ...]
    """Per group: for a recurrent-state group, the speculative scratch slots trailing
    its state (vLLM's ``_ssm_spec_blocks``), ``None`` for any other group."""
    has_state: bool
    """A transferred layer holds a recurrent state (vLLM: ``_has_mamba``, which makes the
    prefiller leave the last prompt token to the decoder)."""


def scheduler_facts(
    kv_cache_config: KVCacheConfig, registry: Registry | None = None
) -> SchedulerFacts:
    """Answer the NIXL scheduler's per-group questions from traits:

    - windowed: ``token_scope`` :attr:`~TokenScope.SLIDING_WINDOW` sends its last
      ``cdiv(window_tokens, block_size) + 1`` blocks (the window may start inside a
      block), as vLLM does for ``SlidingWindowSpec``; every other scope sends every
      block the request holds (a ring's blocks are all live, a chunk or an R-SWA prompt
      is kept whole);
    - state: :func:`~kvspec_traits.transfer._region.is_state` groups keep only their
      state-bearing slot, behind the spec's ``num_speculative_blocks`` scratch slots.

    Raises :class:`UnknownStateBlocksError` for a state group whose spec does not say
    how many scratch slots it allocates.
    """
    reg = registry if registry is not None else default_registry
    facts = layout_facts(kv_cache_config, reg)
    windows: list[int] = []
    scratch: list[int | None] = []
    for group in cache_group_traits(kv_cache_config, reg):
        kind = representative_traits(group.traits)
        window = kind.window_tokens if kind.token_scope is TokenScope.SLIDING_WINDOW else None
        windows.append(-(-window // kind.block_size) + 1 if window else 0)  # cdiv + 1
        spec = kv_cache_config.kv_cache_groups[group.kv_cache_group].kv_cache_spec
        scratch.append(_scratch_blocks(spec, group.kv_cache_group) if is_state(kind) else None)
    return SchedulerFacts(
        hybrid=facts.hybrid,
        window_blocks=tuple(windows),
        state_scratch_blocks=tuple(scratch),
        has_state=facts.has_state,
    )


def _scratch_blocks(spec: object, kv_cache_group: int) -> int:
    """``num_speculative_blocks`` of a state group's spec (of each member of a group
    spec, which must agree)."""
    members = getattr(spec, "kv_cache_specs", None)
    found = {
        getattr(s, "num_speculative_blocks", None)
        for s in (members.values() if isinstance(members, Mapping) else (spec,))
    }
    value = found.pop() if len(found) == 1 else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UnknownStateBlocksError(type(spec).__qualname__, kv_cache_group)
    return value
