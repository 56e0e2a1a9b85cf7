"""Adding a trait: every place that must know it does, or says why not.

A trait is declared once, as a property of the ``KVLayoutTraits`` protocol and a field of
``LayoutTraits``. Derived from that definition: the trait names, the type check of adapter
results (``_result_check.TRAIT_TYPES``, from the field's annotation) and how a group of
layers combines it (``_group``, from the ``GroupRule`` on the annotation; COMMON when
none). The trait pages are checked against it (tests/test_docs.py). The places below
cannot be derived, so this test is their checklist (each names the file to edit):

- ``_group.py`` GroupTraits: a typed property (the static type the protocol promises);
- ``_verify.py`` _CHECKS: the spec property the trait is verified against, or why none;
- ``_result_check.py`` _POSITIVE/_NON_NEGATIVE: the range of a numeric trait, or why none;
- the handshake fingerprint (nixl/_plan.py) and the audit's questions (audit/_questions.py);
- the protocol docstring's 'Source:' line.

A new trait that is not wired fails here, naming the place to edit.
"""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvspec_traits import KVLayoutTraits, trait_names
from kvspec_traits._group import _RULES, GroupTraits
from kvspec_traits._result_check import _NON_NEGATIVE, _POSITIVE, TRAIT_TYPES
from kvspec_traits._traits import GroupRule, trait_types
from kvspec_traits._verify import _CHECKS
from kvspec_traits.audit._questions import QUESTIONS
from kvspec_traits.extend import LayoutTraits
from kvspec_traits.transfer import FINGERPRINT_VERSION, Region
from kvspec_traits.transfer._fingerprint import LOCAL_KEYS, NOT_FINGERPRINTED, RECORD_KEYS

# Where each trait goes in the per-region handshake fingerprint (a key of the record
# transfer/_fingerprint.py's traits_record derives from Region's fields), or why a peer
# that differs in it moves the same bytes.
FINGERPRINT: dict[str, str | tuple[None, str]] = {
    "spec_name": (None, "a class name; peers pair on what moves, whatever classes say it"),
    "is_mla": "replicated",
    "tp_layout": "tp_layout",
    "tp_shards": "tp_shards",
    "token_scope": "scope",
    "window_tokens": (
        None,
        "the tokens a page keeps, not its bytes: vLLM's compatibility "
        "hash covers the model config that sets it",
    ),
    "block_size": "block_len",
    "num_head_slots": "num_head_slots",
    "kv_head_contiguous": "kv_head_contiguous",
    "tokens_per_state": (None, "tokens a state stands for; its bytes are state_components"),
    "states_per_block": "block_len",
    "state_bytes": "state_components",
    "unpadded_page_size_bytes": "block_len",
    "page_size_bytes": "block_len",
    "per_token_bytes": "block_len",
    "dtype": "dtype",
    "kv_quant_mode": "kv_quant_mode",
    "components": "head_segment",
    "prefix_cacheable": (None, "the scheduler's choice of blocks, not their bytes"),
    "uses_slot_mapping": (None, "how the model writes a page, not what the page holds"),
    "transferable": (None, "an untransferable layer gets no region (plan.skipped_layers)"),
    "attention_page": (None, "the page kind; its bytes are state_components and head_segment"),
    "token_paged": (None, "which blocks move, already in the record as state and scratch"),
    "keeps_prompt": (None, "the scheduler's choice of blocks, not their bytes"),
    "holds_hidden_states": (
        None,
        "what a page's bytes mean, not their layout: a region of hidden states moves as "
        "any page of its geometry, and vLLM's compatibility hash covers the drafter "
        "config that adds the layer",
    ),
    "grouped": (None, "a region is per layer (traits_for_layer), never a group's page"),
}

# The audit's trait questions (audit/_questions.py, QUESTIONS) by trait, or why no class
# check can stand for the trait.
_SIZE = (None, "a size, different per model within one class: no class check stands for it")
AUDIT: dict[str, str | tuple[None, str]] = {
    "spec_name": (None, "the class name itself: a check on it is a class check"),
    "is_mla": "is_mla",
    "tp_layout": "tp_layout",
    "tp_shards": _SIZE,
    "token_scope": "token_scope",
    "window_tokens": "windowed",
    "block_size": _SIZE,
    "num_head_slots": _SIZE,
    "kv_head_contiguous": (None, "a field of 0.34's full-attention spec, not a class"),
    "tokens_per_state": _SIZE,
    "states_per_block": _SIZE,
    "state_bytes": _SIZE,
    "unpadded_page_size_bytes": _SIZE,
    "page_size_bytes": _SIZE,
    "per_token_bytes": _SIZE,
    "dtype": _SIZE,
    "kv_quant_mode": (None, "a dtype setting of one spec, not a class"),
    "components": _SIZE,
    "prefix_cacheable": "prefix_cacheable",
    "uses_slot_mapping": "uses_slot_mapping",
    "transferable": "transferable",
    "attention_page": "attention_page",
    "token_paged": "token_paged",
    "keeps_prompt": "keeps_prompt",
    "holds_hidden_states": "holds_hidden_states",
    "grouped": "grouped",
}

# The spec property each trait is checked against on every resolution (_verify.py
# _CHECKS), or why it is not.
_NO_PROPERTY = "vLLM's spec API has no property for it"
VERIFIED: dict[str, tuple[str, ...] | tuple[None, str]] = {
    "spec_name": (None, "the class name the adapter reports"),
    "is_mla": (None, _NO_PROPERTY),
    "tp_layout": (None, _NO_PROPERTY),
    "tp_shards": (None, _NO_PROPERTY),
    "token_scope": (None, _NO_PROPERTY),
    "window_tokens": (None, "a field the adapters read (sliding_window, ...), not a property"),
    "block_size": ("block_size",),
    "num_head_slots": ("num_heads",),
    "kv_head_contiguous": (None, _NO_PROPERTY),
    "tokens_per_state": ("tokens_per_state",),
    "states_per_block": ("num_states",),
    "state_bytes": ("state_content_size_bytes",),
    "unpadded_page_size_bytes": ("unpadded_page_size_bytes", "real_page_size_bytes"),
    "page_size_bytes": ("page_size_bytes",),
    "per_token_bytes": (None, _NO_PROPERTY),
    "dtype": (None, "a torch dtype on the spec, compared through the page size"),
    "kv_quant_mode": (None, "an enum field, compared through the page size"),
    "components": (None, "checked to add up to unpadded_page_size_bytes (LayoutTraits)"),
    "prefix_cacheable": ("prefix_cacheable",),
    "uses_slot_mapping": ("uses_slot_mapping",),
    "transferable": (None, _NO_PROPERTY),
    # checked against token_scope instead (LayoutTraits.__post_init__)
    "attention_page": (None, _NO_PROPERTY),
    "token_paged": (None, _NO_PROPERTY),
    "keeps_prompt": (None, _NO_PROPERTY),
    "holds_hidden_states": (None, "a marker class with no field of its own (class identity)"),
    "grouped": (None, "True exactly for GroupTraits (LayoutTraits refuses True)"),
}

# The range the result check holds a numeric trait to (_result_check.py).
RANGES: dict[str, str | tuple[None, str]] = {
    "tp_shards": "positive",
    "window_tokens": (None, "checked with token_scope: positive exactly when windowed"),
    "block_size": "positive",
    "num_head_slots": "positive",
    "tokens_per_state": "positive",
    "states_per_block": "positive",
    "state_bytes": "non-negative",
    "unpadded_page_size_bytes": "non-negative",
    "page_size_bytes": "non-negative",
    "per_token_bytes": "non-negative",
}

TRAITS = trait_names()


def test_the_protocol_and_the_value_type_name_the_same_traits_in_order() -> None:
    protocol = [
        name for name, member in vars(KVLayoutTraits).items() if isinstance(member, property)
    ]
    assert tuple(protocol) == TRAITS == tuple(f.name for f in fields(LayoutTraits))


@pytest.mark.parametrize("trait", TRAITS)
def test_every_trait_is_wired(trait: str) -> None:
    missing = []
    if trait not in VERIFIED:
        missing.append("_verify.py _CHECKS (a spec property to verify it), then VERIFIED here")
    accepted, _ = TRAIT_TYPES[trait]
    if accepted[0] is int and trait not in RANGES:
        missing.append("_result_check.py _POSITIVE/_NON_NEGATIVE (its range), then RANGES here")
    if not isinstance(vars(GroupTraits).get(trait), property):
        missing.append("_group.py GroupTraits (how a group of layers answers it)")
    if trait not in FINGERPRINT:
        missing.append(
            "the handshake fingerprint (a Region field, transfer/_region.py, filled by "
            "transfer/_merge.py), then FINGERPRINT in this test"
        )
    if trait not in AUDIT:
        missing.append("the audit's questions (audit/_questions.py), then AUDIT in this test")
    if "Source:" not in (getattr(KVLayoutTraits, trait).__doc__ or ""):
        missing.append("the protocol docstring's 'Source:' line (the trait page)")
    assert missing == [], f"trait {trait!r} is not wired into: " + "; ".join(missing)


def test_the_checklists_name_real_places() -> None:
    record = _record_keys()
    questions = {q.name for q in QUESTIONS}
    assert set(FINGERPRINT) == set(AUDIT) == set(TRAITS)
    for trait, where in FINGERPRINT.items():
        if isinstance(where, str):
            assert where in record, (trait, where)
    for trait, where in AUDIT.items():
        if isinstance(where, str):
            assert where in questions, (trait, where)
    # Every question is some trait's.
    assert questions <= {w for w in AUDIT.values() if isinstance(w, str)}


def _record_keys() -> set[str]:
    """The keys of a region's fingerprint record: every Region field but those left out."""
    return {
        RECORD_KEYS.get(f.name, f.name) for f in fields(Region) if f.name not in NOT_FINGERPRINTED
    }


# The record keys of fingerprint version 6 (4 added the stage, "pp", beside the records;
# 5 the block sizes, the state groups of a shared region, each state component's TP
# runs; 6 a state page's padding, "state_pad", a derived key compared between equal TP
# sizes only: LOCAL_KEYS). A new
# Region field joins the record by itself (traits_record iterates Region's fields): a
# peer running the previous release would then be refused with a diff in every region,
# so the version must say so.
RECORD_V6 = {
    "name", "layers", "block_len", "replicated", "tp_layout", "tp_shards", "paged", "state",
    "state_tp_layout", "state_components", "scratch", "scope", "dtype", "kv_quant_mode",
    "num_head_slots", "head_segment", "head_major", "kv_head_contiguous", "group_id",
    "replicated_state", "block_sizes", "page_head_slots", "state_group_ids", "state_pad",
}  # fmt: skip


def test_a_new_region_field_is_fingerprinted_or_says_why_not() -> None:
    names = {f.name for f in fields(Region)}
    assert set(NOT_FINGERPRINTED) <= names, set(NOT_FINGERPRINTED) - names
    assert set(RECORD_KEYS) <= names - set(NOT_FINGERPRINTED)
    assert not set(LOCAL_KEYS) & names  # derived keys, not fields
    if FINGERPRINT_VERSION == 6:
        assert _record_keys() | set(LOCAL_KEYS) == RECORD_V6, (
            "the fingerprint record changed: bump FINGERPRINT_VERSION "
            "(transfer/_fingerprint.py), or add the field to NOT_FINGERPRINTED with why"
        )


def test_the_derived_places_follow_the_definition() -> None:
    # Derived, not listed: the result check's types and the group's rules come from
    # LayoutTraits's annotations, for every trait.
    assert trait_types() == TRAIT_TYPES
    assert set(TRAIT_TYPES) == set(_RULES) == set(TRAITS)
    # hand-checked against vLLM's UniformTypeKVCacheSpecs: sizes add up, the flags hold
    # only if every member's does, components are the members', the rest is common
    assert {n: r for n, r in _RULES.items() if r is not GroupRule.COMMON} == {
        "unpadded_page_size_bytes": GroupRule.SUM,
        "page_size_bytes": GroupRule.SUM,
        "per_token_bytes": GroupRule.SUM,
        "components": GroupRule.MEMBERS,
        "grouped": GroupRule.MEMBERS,
        "prefix_cacheable": GroupRule.ALL,
        "transferable": GroupRule.ALL,
    }


def test_the_hand_checklists_match_their_places() -> None:
    checked: dict[str, list[str]] = {}
    for trait, prop, _ in _CHECKS:
        checked.setdefault(trait, []).append(prop)
    assert set(VERIFIED) == set(TRAITS)
    assert {t: tuple(p) for t, p in checked.items()} == {
        t: v for t, v in VERIFIED.items() if v[0] is not None
    }
    assert {t for t, r in RANGES.items() if r == "positive"} == _POSITIVE
    assert {t for t, r in RANGES.items() if r == "non-negative"} == _NON_NEGATIVE
