"""Adding a trait: every place that must know it does, or says why not.

A trait is declared once, as a property of the ``KVLayoutTraits`` protocol. The value type
(``LayoutTraits``) and the trait pages are derived from it or checked against it elsewhere
(tests/test_docs.py); the places below cannot be derived, so this test is their checklist.
A new trait that is not wired fails here, naming the place to edit.
"""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from kvspec_traits import KVLayoutTraits, LayoutTraits, trait_names
from kvspec_traits._group import GroupTraits
from kvspec_traits._result_check import TRAIT_TYPES as _TRAIT_TYPES
from kvspec_traits.audit._questions import QUESTIONS
from kvspec_traits.nixl._plan import Region

# Where each trait goes in the per-region handshake fingerprint (nixl/_plan.py,
# Region.traits_record), or why a peer that differs in it moves the same bytes.
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
    if trait not in _TRAIT_TYPES:
        missing.append("_result_check.py TRAIT_TYPES (the type check of adapter results)")
    if not isinstance(vars(GroupTraits).get(trait), property):
        missing.append("_group.py GroupTraits (how a group of layers answers it)")
    if trait not in FINGERPRINT:
        missing.append(
            "the handshake fingerprint (nixl/_plan.py Region.traits_record), "
            "then FINGERPRINT in this test"
        )
    if trait not in AUDIT:
        missing.append("the audit's questions (audit/_questions.py), then AUDIT in this test")
    if "Source:" not in (getattr(KVLayoutTraits, trait).__doc__ or ""):
        missing.append("the protocol docstring's 'Source:' line (the trait page)")
    assert missing == [], f"trait {trait!r} is not wired into: " + "; ".join(missing)


def test_the_checklists_name_real_places() -> None:
    record = inspect.getsource(Region.traits_record)
    questions = {q.name for q in QUESTIONS}
    assert set(FINGERPRINT) == set(AUDIT) == set(TRAITS)
    for trait, where in FINGERPRINT.items():
        if isinstance(where, str):
            assert f'"{where}":' in record, (trait, where)
    for trait, where in AUDIT.items():
        if isinstance(where, str):
            assert where in questions, (trait, where)
    # Every question is some trait's.
    assert questions <= {w for w in AUDIT.values() if isinstance(w, str)}
