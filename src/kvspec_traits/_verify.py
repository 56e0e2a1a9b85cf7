"""Check traits against the spec's own byte math (vLLM's properties, read by name).

Every resolution goes through here once per distinct spec. A property the spec's class
does not have is skipped, and so is the base class's placeholder that raises
``NotImplementedError`` (vLLM's ``KVCacheSpec.num_heads`` and friends), so the same check
serves attention pages, recurrent states, opaque pages and group specs. Any other error
from a property, and any error from a property a subclass defines itself, is the spec's
own math failing: :class:`SpecPropertyError`, a refusal.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from typing import Any, Final

from kvspec_traits._caches import MAX_CLASSES
from kvspec_traits._errors import SpecPropertyError
from kvspec_traits._traits import KVLayoutTraits

__all__ = ["CHECKED_PROPERTIES", "first_mismatch", "inherited_page_property"]

_MISSING: Final = object()
# Per (class, property name), least recently used dropped first (10 names are checked).
_CLASS_FACTS: Final = 16 * MAX_CLASSES


@lru_cache(maxsize=_CLASS_FACTS)
def _placeholder(spec_type: type[Any], name: str) -> bool:
    """Whether ``spec_type.name`` is the definition of the class that introduced the
    name (the root-most one in the MRO): vLLM's abstract placeholders live there."""
    owners = [k for k in spec_type.__mro__ if k is not object and name in vars(k)]
    return len(owners) == 1 or (bool(owners) and vars(owners[0])[name] is vars(owners[-1])[name])


@lru_cache(maxsize=_CLASS_FACTS)
def _defined(spec_type: type[Any], name: str) -> bool:
    return any(name in vars(k) for k in spec_type.__mro__ if k is not object)


def _spec_value(spec: object, name: str) -> Any:
    spec_type: Any = type(spec)
    instance_dict = getattr(spec, "__dict__", None)
    if not _defined(spec_type, name) and not (instance_dict and name in instance_dict):
        return _MISSING
    try:
        return getattr(spec, name)
    except NotImplementedError as exc:
        if _placeholder(spec_type, name):
            return _MISSING
        raise SpecPropertyError(spec, name, exc) from exc
    except Exception as exc:
        raise SpecPropertyError(spec, name, exc) from exc


def _recurrent(tokens_per_state: Any) -> Any:
    # vLLM marks a recurrent state with tokens_per_state <= 0 (MambaSpec: -1); traits say None.
    if isinstance(tokens_per_state, int | Fraction) and tokens_per_state <= 0:
        return None
    return tokens_per_state


# (trait name, spec property name, normaliser of the spec value): each pair is checked
# on its own wherever the spec has the property.
_CHECKS: Final[tuple[tuple[str, str, Any], ...]] = (
    ("page_size_bytes", "page_size_bytes", None),
    ("unpadded_page_size_bytes", "unpadded_page_size_bytes", None),
    ("unpadded_page_size_bytes", "real_page_size_bytes", None),
    ("num_head_slots", "num_heads", None),
    ("state_bytes", "state_content_size_bytes", None),
    ("tokens_per_state", "tokens_per_state", _recurrent),
    ("states_per_block", "num_states", None),
    ("block_size", "block_size", None),
    ("prefix_cacheable", "prefix_cacheable", None),
    ("uses_slot_mapping", "uses_slot_mapping", None),
)

CHECKED_PROPERTIES: Final = tuple(dict.fromkeys(prop for _, prop, _ in _CHECKS))
"""The spec properties every resolution compares with the traits."""


def first_mismatch(spec: object, traits: KVLayoutTraits) -> tuple[str, object, object] | None:
    """The first trait that contradicts the spec, as ``(trait, traits value, spec value)``.

    Raises :class:`SpecPropertyError` when one of the spec's own properties fails.
    """
    for trait, name, normalise in _CHECKS:
        want = _spec_value(spec, name)
        if want is _MISSING:
            continue
        if normalise is not None:
            want = normalise(want)
        got = getattr(traits, trait)
        if type(got) is not type(want) and isinstance(got, bool) != isinstance(want, bool):
            # 1 == True: a bool where a count belongs (or the reverse) is a mismatch.
            return trait, got, want
        if got != want:
            return trait, got, want
    return None


def _owner(spec_type: type[Any], name: str) -> int | None:
    """Position in ``spec_type``'s MRO of the class that defines ``name`` (None: none)."""
    return next((i for i, k in enumerate(spec_type.__mro__) if name in vars(k)), None)


_PAGE_TRAITS: Final = ("page_size_bytes", "unpadded_page_size_bytes")


def inherited_page_property(
    spec: object, trait: str, traits: KVLayoutTraits
) -> tuple[str, str, str] | None:
    """Why a page-size mismatch may be the spec's fault, not the adapter's: the spec's
    class overrides one page property (``page_size_bytes``, say) but inherits the other
    from a base whose formula no longer describes its page, and the adapter agrees with
    the overridden one. Returns ``(inherited property, the class it comes from, the
    overridden property)``, or None."""
    if trait not in _PAGE_TRAITS:
        return None
    spec_type = type(spec)
    for checked_trait, prop, _ in _CHECKS:
        if checked_trait != trait:
            continue
        want = _spec_value(spec, prop)
        inherited_at = _owner(spec_type, prop)
        if want is _MISSING or want == getattr(traits, trait) or not inherited_at:
            continue  # agrees, or defined by the spec's own class
        for other_trait, other, _ in _CHECKS:
            if other_trait not in _PAGE_TRAITS or other_trait == trait:
                continue
            other_at = _owner(spec_type, other)
            if (
                other_at is not None
                and other_at < inherited_at
                and _spec_value(spec, other) == getattr(traits, other_trait)
            ):
                return prop, spec_type.__mro__[inherited_at].__qualname__, other
    return None
