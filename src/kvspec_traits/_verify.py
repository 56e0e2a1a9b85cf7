"""Check traits against the spec's own byte math (vLLM's properties, read by name).

Every resolution goes through here once per distinct spec. A spec property that the spec
does not define (vLLM's base raises ``NotImplementedError``) is skipped, so the same check
serves attention pages, recurrent states, opaque pages and group specs.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from kvspec_traits._errors import TraitsMismatchError
from kvspec_traits._traits import KVLayoutTraits

__all__ = ["first_mismatch", "verify"]

_MISSING = object()


def _spec_value(spec: object, name: str) -> Any:
    try:
        return getattr(spec, name)
    except (NotImplementedError, AttributeError):
        return _MISSING


def _recurrent(tokens_per_state: Any) -> Any:
    # vLLM marks a recurrent state with tokens_per_state <= 0 (MambaSpec: -1); traits say None.
    if isinstance(tokens_per_state, int | Fraction) and tokens_per_state <= 0:
        return None
    return tokens_per_state


# (trait name, spec property names in order of preference, normaliser of the spec value)
_CHECKS: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("page_size_bytes", ("page_size_bytes",), None),
    ("unpadded_page_size_bytes", ("unpadded_page_size_bytes", "real_page_size_bytes"), None),
    ("num_head_slots", ("num_heads",), None),
    ("state_bytes", ("state_content_size_bytes",), None),
    ("tokens_per_state", ("tokens_per_state",), _recurrent),
    ("states_per_block", ("num_states",), None),
    ("block_size", ("block_size",), None),
    ("prefix_cacheable", ("prefix_cacheable",), None),
    ("uses_slot_mapping", ("uses_slot_mapping",), None),
)


def first_mismatch(spec: object, traits: KVLayoutTraits) -> tuple[str, object, object] | None:
    """The first trait that contradicts the spec, as ``(trait, traits value, spec value)``."""
    for trait, names, normalise in _CHECKS:
        for name in names:
            want = _spec_value(spec, name)
            if want is _MISSING:
                continue
            if normalise is not None:
                want = normalise(want)
            got = getattr(traits, trait)
            if got != want:
                return trait, got, want
            break
    return None


def verify(spec: object, traits: KVLayoutTraits, *, adapter: str) -> None:
    """Raise :class:`TraitsMismatchError` if ``traits`` contradict ``spec``."""
    mismatch = first_mismatch(spec, traits)
    if mismatch is not None:
        field, got, want = mismatch
        raise TraitsMismatchError(spec, field, got, want, adapter)
