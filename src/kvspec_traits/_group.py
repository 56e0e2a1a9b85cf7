"""Traits of a group spec (vLLM's ``UniformTypeKVCacheSpecs``): per member and aggregated.

A group page is the members' pages side by side, so byte sizes add up; every other trait
is the members' common value, and asking for one they disagree on raises
:class:`MixedGroupTraitsError` instead of answering for whichever layer came first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType

from kvspec_traits._errors import MixedGroupTraitsError
from kvspec_traits._traits import (
    GroupRule,
    KVLayoutTraits,
    PageComponent,
    TokenScope,
    TPLayout,
    TraitValue,
    group_rule,
    trait_names,
)

__all__ = ["GroupTraits", "representative_traits", "traits_for_layer"]

# How the group answers each trait: declared once, on the trait's annotation in
# LayoutTraits (kvspec_traits._traits.GroupRule).
_RULES = {name: group_rule(name) for name in trait_names()}


class GroupTraits(KVLayoutTraits):
    """Traits of a group of layers that vLLM allocates as one page.

    ``members`` maps each layer name to its own traits, in the group's order.
    """

    __slots__ = ("_members", "_spec_name", "_values")

    def __init__(
        self,
        spec_name: str,
        members: Mapping[str, KVLayoutTraits],
        *,
        block_size: int | None = None,
    ) -> None:
        if not members:
            raise ValueError(f"{spec_name}: a group spec with no member layers has no layout")
        self._spec_name = spec_name
        self._members: Mapping[str, KVLayoutTraits] = MappingProxyType(dict(members))
        values: dict[str, TraitValue | MixedGroupTraitsError] = {}
        for name in trait_names():
            if name == "spec_name":
                continue
            per_layer = {layer: getattr(t, name) for layer, t in self._members.items()}
            values[name] = _aggregate(name, per_layer)
        if block_size is not None:
            # The group's own block size: the one its block table is indexed by.
            values["block_size"] = block_size
        self._values = values

    @property
    def members(self) -> Mapping[str, KVLayoutTraits]:
        """Each member layer's own traits."""
        return self._members

    def _get(self, name: str) -> TraitValue:
        value = self._values[name]
        if isinstance(value, MixedGroupTraitsError):
            # a fresh error each time: re-raising one object would grow its traceback
            raise MixedGroupTraitsError(value.trait, value.values)
        return value

    def __repr__(self) -> str:
        return f"GroupTraits({self._spec_name}, members={list(self._members)})"

    @property
    def spec_name(self) -> str:
        return self._spec_name

    @property
    def is_mla(self) -> bool:
        return bool(self._get("is_mla"))

    @property
    def tp_layout(self) -> TPLayout:
        value = self._get("tp_layout")
        if not isinstance(value, TPLayout):
            raise TypeError(value)
        return value

    @property
    def tp_shards(self) -> int | None:
        return _opt_int(self._get("tp_shards"))

    @property
    def token_scope(self) -> TokenScope:
        value = self._get("token_scope")
        if not isinstance(value, TokenScope):
            raise TypeError(value)
        return value

    @property
    def window_tokens(self) -> int | None:
        return _opt_int(self._get("window_tokens"))

    @property
    def block_size(self) -> int:
        return _int(self._get("block_size"))

    @property
    def num_head_slots(self) -> int:
        return _int(self._get("num_head_slots"))

    @property
    def kv_head_contiguous(self) -> bool:
        return bool(self._get("kv_head_contiguous"))

    @property
    def tokens_per_state(self) -> int | Fraction | None:
        return _opt_num(self._get("tokens_per_state"))

    @property
    def states_per_block(self) -> int:
        return _int(self._get("states_per_block"))

    @property
    def state_bytes(self) -> int:
        return _int(self._get("state_bytes"))

    @property
    def unpadded_page_size_bytes(self) -> int:
        return _int(self._get("unpadded_page_size_bytes"))

    @property
    def page_size_bytes(self) -> int:
        return _int(self._get("page_size_bytes"))

    @property
    def per_token_bytes(self) -> int | Fraction | None:
        return _opt_num(self._get("per_token_bytes"))

    @property
    def dtype(self) -> str | None:
        value = self._get("dtype")
        return None if value is None else str(value)

    @property
    def kv_quant_mode(self) -> str:
        return str(self._get("kv_quant_mode"))

    @property
    def components(self) -> tuple[PageComponent, ...]:
        return tuple(
            dataclasses.replace(c, name=f"{layer}/{c.name}")
            for layer, t in self._members.items()
            for c in t.components
        )

    @property
    def prefix_cacheable(self) -> bool:
        return bool(self._get("prefix_cacheable"))

    @property
    def uses_slot_mapping(self) -> bool:
        return bool(self._get("uses_slot_mapping"))

    @property
    def transferable(self) -> bool:
        return bool(self._get("transferable"))

    @property
    def attention_page(self) -> bool:
        return bool(self._get("attention_page"))

    @property
    def token_paged(self) -> bool:
        return bool(self._get("token_paged"))

    @property
    def keeps_prompt(self) -> bool:
        return bool(self._get("keeps_prompt"))

    @property
    def holds_hidden_states(self) -> bool:
        return bool(self._get("holds_hidden_states"))

    @property
    def grouped(self) -> bool:
        return True  # the members' pages side by side: traits_for_layer reads each


def _aggregate(name: str, per_layer: dict[str, TraitValue]) -> TraitValue | MixedGroupTraitsError:
    values = list(per_layer.values())
    rule = _RULES[name]
    if rule is GroupRule.MEMBERS:
        return None  # built by the group's property (layer-prefixed components, grouped)
    if rule is GroupRule.SUM:
        if any(v is None for v in values):
            if all(v is None for v in values):
                return None
            return MixedGroupTraitsError(name, dict(per_layer))
        total: int | Fraction = sum((v for v in values if isinstance(v, int | Fraction)), 0)
        if isinstance(total, Fraction) and total.denominator == 1:
            return int(total)
        return total
    if rule is GroupRule.ALL:
        return all(values)
    first = values[0]
    if all(v == first for v in values[1:]):
        return first
    return MixedGroupTraitsError(name, dict(per_layer))


def _int(value: TraitValue) -> int:
    if not isinstance(value, int):
        raise TypeError(f"expected an int, got {value!r}")
    return value


def _opt_int(value: TraitValue) -> int | None:
    return None if value is None else _int(value)


def _opt_num(value: TraitValue) -> int | Fraction | None:
    if value is None or isinstance(value, int | Fraction):
        return value
    raise TypeError(f"expected a number, got {value!r}")


def traits_for_layer(traits: KVLayoutTraits, layer: str) -> KVLayoutTraits:
    """The traits of one layer of a KV cache group: its member's own traits when the group
    spec is a ``UniformTypeKVCacheSpecs``, else the group's traits (every layer of a plain
    group shares its spec). Raises ``KeyError`` naming the layer if a group lacks it."""
    if isinstance(traits, GroupTraits):
        try:
            return traits.members[layer]
        except KeyError:
            raise KeyError(
                f"layer {layer!r} is not a member of this group (members: {list(traits.members)})"
            ) from None
    return traits


def representative_traits(traits: KVLayoutTraits) -> KVLayoutTraits:
    """The traits that stand for a group's kind: its first member's for a group spec (as
    vLLM's ``get_representative_spec_type``), else the traits themselves."""
    if isinstance(traits, GroupTraits):
        return next(iter(traits.members.values()))
    return traits
