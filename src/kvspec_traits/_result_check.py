"""Checking an adapter's result: every trait of the type it must have, in its range,
and consistent with the others, before the spec's own byte math is compared."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from kvspec_traits._errors import (
    AdapterResultError,
    MixedGroupTraitsError,
)
from kvspec_traits._traits import (
    PageComponent,
    TokenScope,
    trait_names,
    trait_types,
)

if TYPE_CHECKING:
    pass

__all__ = ["TRAIT_TYPES", "check_result", "same", "snapshot", "value_types"]

_NO_DEFAULT: Final = object()


def same(value: object, default: object) -> bool:
    if value is default:
        return True
    if type(value) is not type(default):
        return False
    try:
        return bool(value == default)
    except Exception:  # a value that cannot be compared is not the default
        return False


def _frozen(value: object) -> object:
    # One level: a group spec's dict holds frozen member specs, compared by identity
    # first. Built in C (items(), tuple()), so a 61-layer group costs a few microseconds.
    if isinstance(value, dict):
        return (dict, tuple(value.items()))
    if isinstance(value, list):
        return (list, tuple(value))
    if isinstance(value, set):
        return (set, frozenset(value))
    return value


def snapshot(spec: object, field_names: tuple[str, ...]) -> object:
    """The spec's field values, with containers turned into tuples, and the types of
    those values: equal snapshots mean an unchanged spec (members compare by identity
    first, so this is cheap)."""
    if field_names:
        values: object = tuple(_frozen(getattr(spec, name, None)) for name in field_names)
    else:
        values = _frozen(dict(getattr(spec, "__dict__", {})))
    return values, value_types(spec, field_names)


def value_types(spec: object, field_names: tuple[str, ...]) -> object:
    """The types of a spec's field values, through containers and member specs: specs
    that compare equal while a value differs in type (``128`` and ``128.0``, ``1`` and
    ``True``: Python calls them equal) must not share one cached answer, since one is
    refused and the other is not."""
    names = field_names or tuple(getattr(spec, "__dict__", {}))
    return tuple(_types(getattr(spec, name, None), 0) for name in names)


def _types(value: object, depth: int) -> object:
    if depth > 4:  # deeper than any spec nests (group -> members -> their fields)
        return type(value)
    if isinstance(value, (tuple, list, set, frozenset)):
        return (type(value), tuple(_types(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((_types(k, depth + 1), _types(v, depth + 1)) for k, v in value.items()))
    fields = getattr(type(value), "__dataclass_fields__", None)
    if fields is not None:
        return (type(value), tuple(_types(getattr(value, f, None), depth + 1) for f in fields))
    return type(value)


# trait -> (accepted types, may be None), read from LayoutTraits's annotations.
TRAIT_TYPES: Final[dict[str, tuple[tuple[type[Any], ...], bool]]] = trait_types()
_POSITIVE: Final = frozenset(
    {"block_size", "num_head_slots", "states_per_block", "tp_shards", "tokens_per_state"}
)
_NON_NEGATIVE: Final = frozenset(
    {"state_bytes", "unpadded_page_size_bytes", "page_size_bytes", "per_token_bytes"}
)
_WINDOWED: Final = frozenset(
    {TokenScope.SLIDING_WINDOW, TokenScope.CHUNKED, TokenScope.PROMPT_AND_WINDOW, TokenScope.RING}
)


_MIXED: Final = object()  # a group's trait its members disagree on


def _read(spec: object, traits: object, adapter: str, name: str) -> object:
    # The trait's value, or _MIXED; anything else it raises is the adapter's error.
    try:
        return getattr(traits, name)
    except MixedGroupTraitsError:
        return _MIXED  # a group whose members disagree: a valid answer, asked per layer
    except AttributeError:
        raise AdapterResultError(spec, adapter, name, traits, "is missing") from None
    except Exception as exc:
        raise AdapterResultError(
            spec, adapter, name, traits, f"raised {type(exc).__name__}: {exc}"
        ) from exc


def _check_value(spec: object, traits: object, adapter: str, name: str, value: Any) -> None:
    # The trait's type (a bool is no int) and its sign.
    accepted, optional = TRAIT_TYPES[name]
    if value is None and optional:
        return
    if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
        want = " or ".join(t.__name__ for t in accepted) + (" or None" if optional else "")
        raise AdapterResultError(
            spec, adapter, name, traits, f"is {value!r} ({type(value).__name__}), not {want}"
        )
    if name in _POSITIVE and value <= 0:
        raise AdapterResultError(spec, adapter, name, traits, f"is {value!r}, not > 0")
    if name in _NON_NEGATIVE and value < 0:
        raise AdapterResultError(spec, adapter, name, traits, f"is {value!r}, not >= 0")


def _check_window(spec: object, traits: object, adapter: str, values: dict[str, object]) -> None:
    # A windowed scope has a positive window; any other has none.
    scope, window = values.get("token_scope"), values.get("window_tokens", _NO_DEFAULT)
    if window is _NO_DEFAULT or scope is None:
        return  # a group whose members disagree on one of them
    if scope in _WINDOWED and (not isinstance(window, int) or window <= 0):
        raise AdapterResultError(
            spec,
            adapter,
            "window_tokens",
            traits,
            f"is {window!r} for the windowed scope {scope}; a positive "
            "number of tokens is required",
        )
    if scope not in _WINDOWED and window is not None:
        raise AdapterResultError(
            spec,
            adapter,
            "window_tokens",
            traits,
            f"is {window!r} for the unwindowed scope {scope}; it must be None",
        )


def check_result(spec: object, traits: object, adapter: str) -> None:
    """Raise :class:`AdapterResultError` unless ``traits`` is a valid KVLayoutTraits."""
    values: dict[str, object] = {}
    for name in trait_names():
        value = _read(spec, traits, adapter, name)
        if value is _MIXED:
            continue
        _check_value(spec, traits, adapter, name, value)
        values[name] = value
    components = values.get("components", ())
    if isinstance(components, tuple) and not all(isinstance(c, PageComponent) for c in components):
        raise AdapterResultError(
            spec, adapter, "components", traits, "holds something other than PageComponent"
        )
    _check_window(spec, traits, adapter, values)
    page, unpadded = values.get("page_size_bytes"), values.get("unpadded_page_size_bytes")
    if isinstance(page, int) and isinstance(unpadded, int) and page < unpadded:
        raise AdapterResultError(
            spec,
            adapter,
            "page_size_bytes",
            traits,
            f"is {page}, smaller than its content {unpadded}",
        )
