"""The worker-wide layout facts vLLM's NIXL worker derives from spec classes, here from
traits (pure: vLLM's types are named for type checking only)."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvspec_traits._group import representative_traits
from kvspec_traits._registry import Registry, default_registry
from kvspec_traits._traits import (
    KVLayoutTraits,
    PageComponent,
    TokenScope,
    TPLayout,
    has_ring,
    is_state,
)
from kvspec_traits._transfer_rule import transfer_rule
from kvspec_traits.transfer._config import CacheGroupTraits, TransferGroup, cache_group_traits
from kvspec_traits.vllm_connector._errors import (
    UnknownStateBlocksError,
    UnsupportedStateLayoutError,
)
from kvspec_traits.vllm_connector._names import CONNECTOR_NAME

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "GroupKind",
    "LayoutFacts",
    "SchedulerFacts",
    "StateSplit",
    "group_kind",
    "layout_facts",
    "replicated_state_group",
    "scheduler_facts",
]


class GroupKind(enum.Enum):
    """How a transfer group's blocks are addressed, which decides its descriptors: the
    question vLLM's NIXL worker answers from the group's spec class (``AttentionSpec``,
    ``CircularBufferSpec``, ``MambaSpec``), answered here from traits."""

    PAGED = "paged"
    """Token-addressed pages (attention, MLA latents, HiSparse copies): a request's
    blocks in every region of the group, split into kernel blocks."""
    RING = "ring"
    """A ring buffer (:attr:`TokenScope.RING`): one page per request rewritten in place,
    living in its own scratch regions only."""
    STATE = "state"
    """Recurrent states (:attr:`TokenScope.RECURRENT_STATE`): one indivisible page per
    block, addressed by state descriptors (never kernel blocks, never head slices)."""
    REPLICATED_STATE = "replicated state"
    """TP-replicated recurrent states outside a ring-buffer model: one indivisible page
    per block, the same bytes on every rank, in regions of their own flagged
    REPLICATE, each moving the state's content (not a hybrid allocator's padding).
    vLLM's descriptor code addresses them as it addresses a replicated (MLA) page
    group: whole blocks of the group's own regions, each read from one remote rank
    (never kernel blocks, never head slices, never the state descriptors, which
    count every state as TP-sharded)."""


def group_kind(traits: KVLayoutTraits, *, ring_model: bool = False) -> GroupKind:
    """The :class:`GroupKind` of a group from its (representative) traits; in a
    ring-buffer model (``ring_model``) a replicated state is vLLM's PLE cache, moved by
    the state descriptors (:attr:`GroupKind.STATE`)."""
    if is_state(traits):
        if traits.tp_layout is TPLayout.REPLICATED and not ring_model:
            return GroupKind.REPLICATED_STATE
        return GroupKind.STATE
    if has_ring((traits,)):
        return GroupKind.RING
    return GroupKind.PAGED


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateSplit:
    """How this rank's recurrent-state page is cut into transfer descriptors, from its
    traits' components: the first tensor (vLLM: the conv state) in one descriptor per
    run of its :attr:`~kvspec_traits.PageComponent.tp_split` (one run, the whole tensor,
    where the split is not described), then one descriptor for the rest of the state
    (vLLM: the temporal state) from ``sizes[0]`` on. Field for field vLLM's
    ``MambaConvSplitInfo``, whose descriptor code the connector runs.

    ``layer``/``spec_name`` name the state layer it was taken from; ``tp_movable``
    whether its traits describe how it divides across TP ranks (every tensor a
    ``tp_split``, the rest one run), so that a rank of another TP size may read it."""

    layer: str
    spec_name: str
    conv_rows: int
    """Elements per row of the first tensor's first dimension (``prod(shape[1:])``)."""
    local_proj_dims: tuple[int, ...]
    conv_dtype_size: int
    sizes: tuple[int, int]
    """(offset of the rest of the state in the page, bytes of the rest)."""
    tp_movable: bool


def state_split(layer: str, traits: KVLayoutTraits) -> StateSplit:
    """The :class:`StateSplit` of recurrent-state layer ``layer``. Padding components
    (uint8 ``pad<i>``, as the built-in Mamba adapter names the alignment gaps) start no
    descriptor. Raises :class:`UnsupportedStateLayoutError` for a state of one tensor
    (nothing to put in the second descriptor) or an empty first tensor."""
    offsets: list[tuple[int, PageComponent]] = []
    offset = 0
    for component in traits.components:
        if not (component.dtype == "uint8" and component.name.startswith("pad")):
            offsets.append((offset, component))
        offset += component.nbytes
    if len(offsets) < 2 or offsets[0][0] != 0:
        raise UnsupportedStateLayoutError(
            traits.spec_name,
            layer,
            "components",
            "a recurrent-state page moves as its first tensor and the rest of the page "
            f"(two descriptors or more); its components are {[c.name for c in traits.components]}",
        )
    first = offsets[0][1]
    rest_start = offsets[1][0]
    rest_end = offsets[-1][0] + offsets[-1][1].nbytes
    elements = math.prod(first.shape)
    if not first.shape or elements == 0 or first.nbytes % elements:
        raise UnsupportedStateLayoutError(
            traits.spec_name, layer, "components", f"first tensor {first} has no element size"
        )
    rest = [c for _, c in offsets[1:]]
    return StateSplit(
        layer=layer,
        spec_name=traits.spec_name,
        conv_rows=elements // first.shape[0],
        local_proj_dims=first.tp_split or (first.shape[0],),
        conv_dtype_size=first.nbytes // elements,
        sizes=(rest_start, rest_end - rest_start),
        tp_movable=first.tp_split is not None
        and len(rest) == 1
        and rest[0].tp_split is not None
        and len(rest[0].tp_split) == 1,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutFacts:
    """The worker-wide layout facts vLLM's NIXL worker derives from spec classes,
    here from traits. Group indices are positions in ``transfer_groups`` unless named
    ``kv_cache_group``."""

    transfer_groups: tuple[TransferGroup, ...]
    """The transferred cache groups, as the planner numbers them
    (:func:`kvspec_traits.transfer._config.transfer_groups`)."""
    layer_traits: Mapping[str, KVLayoutTraits]
    group_kinds: tuple[GroupKind, ...]
    """Per transfer group: how its blocks are addressed (vLLM: its spec class)."""
    transfer_block_size: int | None
    """LCM of the token-paged transfer groups' block sizes (None if there are none)."""
    hybrid: bool
    """Some layer does not keep every token (vLLM: the hybrid allocator is needed)."""
    has_state: bool
    """A transferred layer holds a recurrent state, of any TP layout (the scheduler's
    ``has_mamba``)."""
    state_descriptors: bool
    """Some state is moved by vLLM's state descriptors (the worker's ``has_mamba``): a
    TP-sharded state, or a ring model's replicated (PLE) state. A model whose only
    states are :attr:`GroupKind.REPLICATED_STATE` has none: its states move as
    replicated pages."""
    has_ring: bool
    mla: bool
    """Every transferred layer addressed as pages (token-paged, and
    :attr:`GroupKind.REPLICATED_STATE`) is TP-replicated (vLLM: ``use_mla``, which
    makes its TP mapping read every attention region from one remote rank). A model
    mixing head-sharded and replicated pages (a GQA model with an MLA draft, a
    replicated state beside head-sharded attention) is not: its regions carry their
    own REPLICATE/SPLIT flags."""
    replicated_state_layers: frozenset[str]
    """The layers of :attr:`GroupKind.REPLICATED_STATE` groups: each a region of its
    own, moving its content (``unpadded_page_size_bytes``)."""
    state_split: StateSplit | None
    """How the TP-sharded recurrent states are cut into descriptors (vLLM's conv split,
    the worker's ``conv_decomp`` in :mod:`._seam`); None without one."""
    replicated_state_kv_cache_group: int | None
    """The cache group whose layers are all TP-replicated states next to a ring (vLLM:
    the CSA-linear PLE group)."""

    def replicated_groups(self) -> frozenset[int]:
        """Transfer groups (positions) whose every layer is a TP-replicated token-paged
        page: held whole on every rank (vLLM 0.34 asks it of DCP peers, from MLA
        classes)."""
        return frozenset(
            g.index
            for g in self.transfer_groups
            if g.layer_names
            and all(
                self.layer_traits[layer].token_paged
                and self.layer_traits[layer].tp_layout is TPLayout.REPLICATED
                for layer in g.layer_names
            )
        )


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
    replicated_group = replicated_state_group(groups) if ring else None
    group_kinds = tuple(group_kind(k, ring_model=ring) for k in kinds)
    replicated_states = frozenset(
        layer
        for g, kind in zip(transferred, group_kinds, strict=True)
        if kind is GroupKind.REPLICATED_STATE
        for layer in g.layers
    )
    pages = [t for layer, t in layer_traits.items() if t.token_paged or layer in replicated_states]
    split = _model_state_split(layer_traits, ring)
    return LayoutFacts(
        transfer_groups=tuple(g.transfer for g in transferred if g.transfer is not None),
        layer_traits=layer_traits,
        group_kinds=group_kinds,
        transfer_block_size=math.lcm(*block_sizes) if block_sizes else None,
        hybrid=any(t.token_scope is not TokenScope.FULL for t in layer_traits.values()),
        has_state=any(is_state(t) for t in layer_traits.values()),
        state_descriptors=split is not None or replicated_group is not None,
        has_ring=ring,
        mla=bool(pages) and all(t.tp_layout is TPLayout.REPLICATED for t in pages),
        state_split=split,
        replicated_state_kv_cache_group=replicated_group,
        replicated_state_layers=replicated_states,
    )


def _model_state_split(layer_traits: Mapping[str, KVLayoutTraits], ring: bool) -> StateSplit | None:
    """The one :class:`StateSplit` of the model's TP-sharded states (vLLM's worker keeps
    one): every such layer must split alike. A TP-replicated state is no part of it: in
    a ring-buffer (CSA-linear) model it is vLLM's PLE cache, whose descriptors vLLM
    builds apart; elsewhere a :attr:`GroupKind.REPLICATED_STATE`, moved as replicated
    pages, which cannot be beside TP-sharded states (vLLM's state descriptors would
    then address every region but the replicated state's as state regions, and its
    page groups in every region): refused by name."""
    sharded: list[StateSplit] = []
    replicated: list[tuple[str, KVLayoutTraits]] = []
    for layer, traits in layer_traits.items():
        if not is_state(traits):
            continue
        if traits.tp_layout is TPLayout.REPLICATED:
            replicated.append((layer, traits))
            continue
        sharded.append(state_split(layer, traits))
    if replicated and sharded and not ring:
        layer, traits = replicated[0]
        raise UnsupportedStateLayoutError(
            traits.spec_name,
            layer,
            "tp_layout",
            "a TP-replicated recurrent state moves as replicated pages of its own "
            f"regions, and cannot be beside TP-sharded states ({sharded[0].layer!r}, "
            f"{sharded[0].spec_name}) outside a ring-buffer model: vLLM's state "
            "descriptors would count it as a TP-sharded state",
        )
    if not sharded:
        return None
    first = sharded[0]
    for other in sharded[1:]:
        if dataclasses.replace(other, layer=first.layer, spec_name=first.spec_name) != first:
            raise UnsupportedStateLayoutError(
                other.spec_name,
                other.layer,
                "components",
                f"its state splits otherwise than layer {first.layer!r} "
                f"({first.spec_name}), and vLLM's worker cuts every state alike",
            )
    return first


def replicated_state_group(groups: Sequence[CacheGroupTraits]) -> int | None:
    """The cache group (index in ``kv_cache_groups``, transferred or not) whose layers
    are all TP-replicated recurrent states, as vLLM's worker finds its PLE group
    (``ple_group_index`` in :mod:`._seam`) in a ring-buffer (CSA-linear) model;
    ``groups``: every cache group's traits
    (:func:`~kvspec_traits.transfer._config.cache_group_traits`).

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
    """As :attr:`LayoutFacts.hybrid` (vLLM: the scheduler's ``is_hma_required`` unless
    the hybrid allocator is disabled): only then are blocks clipped per group."""
    window_blocks: tuple[int, ...]
    """Per group: the trailing blocks a windowed group sends (vLLM's ``blocks_per_sw``),
    0 for a group whose every block is sent."""
    state_scratch_blocks: tuple[int | None, ...]
    """Per group: for a recurrent-state group, the speculative scratch slots trailing
    its state (the scheduler's ``ssm_spec_blocks``), ``None`` for any other group."""
    has_state: bool
    """A transferred layer holds a recurrent state (vLLM: ``has_mamba``, which makes the
    prefiller leave the last prompt token to the decoder)."""


def scheduler_facts(
    kv_cache_config: KVCacheConfig, registry: Registry | None = None
) -> SchedulerFacts:
    """Answer the NIXL scheduler's per-group questions from traits, with the public
    transfer rule (:func:`kvspec_traits.blocks_to_transfer`, whose numbers
    :func:`~kvspec_traits._transfer_rule.transfer_rule` gives; upstream's clipping code
    applies them):

    - windowed: ``token_scope`` :attr:`~TokenScope.SLIDING_WINDOW` sends its last
      ``cdiv(window_tokens, block_size) + 1`` blocks (the window may start inside a
      block), as vLLM does for ``SlidingWindowSpec``; every other scope sends every
      block the request holds (a ring's blocks are all live, a chunk or an R-SWA prompt
      is kept whole);
    - state: :attr:`~TokenScope.RECURRENT_STATE` groups keep only their state-bearing
      slot, behind the spec's ``num_speculative_blocks`` scratch slots.

    Raises :class:`UnknownStateBlocksError` for a state group whose spec does not say
    how many scratch slots it allocates.
    """
    reg = registry if registry is not None else default_registry
    facts = layout_facts(kv_cache_config, reg)
    windows: list[int] = []
    scratch: list[int | None] = []
    for group in cache_group_traits(kv_cache_config, reg):
        rule = transfer_rule(group.traits)
        if rule.state_scratch_blocks is not None:  # a state: its spec says how many slots
            spec = kv_cache_config.kv_cache_groups[group.kv_cache_group].kv_cache_spec
            slots = _scratch_blocks(spec, group.kv_cache_group)
            rule = transfer_rule(group.traits, num_speculative_blocks=slots)
        windows.append(rule.window_blocks)
        scratch.append(rule.state_scratch_blocks)
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
