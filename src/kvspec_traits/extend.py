"""For adapter authors: registering adapters, and the built-in adapters' own building blocks.

A consumer needs only :mod:`kvspec_traits` (``traits_of``, the traits, the errors it
raises). Teaching the library a new spec class takes the names here::

    from kvspec_traits.extend import (
        ATTENTION_IGNORES, ATTENTION_READS, LayoutTraits, attention_traits, register_adapter,
    )

    @register_adapter(ScaledFullSpec, reads=(*ATTENTION_READS, "scale_bytes"),
                      ignores=ATTENTION_IGNORES)
    def adapt(spec: ScaledFullSpec) -> LayoutTraits:
        return attention_traits(spec)

Importing this module imports neither vLLM nor torch; the building blocks taken from the
built-in adapters (``attention_traits``, ``mamba_traits``, ``positive_int``,
``dtype_name`` and the field lists) import both the first time one is used. See
``docs/extending.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from kvspec_traits._accounting import LAYOUT_MEMBERS, Registration
from kvspec_traits._deps import needs
from kvspec_traits._errors import AdapterConflictError, UnknownFieldNameError
from kvspec_traits._loading import ENTRY_POINT_GROUP
from kvspec_traits._registry import (
    Adapter,
    Registry,
    default_registry,
    register_adapter,
    resolving_registry,
)
from kvspec_traits._traits import LayoutTraits

if TYPE_CHECKING:
    from kvspec_traits._vllm_adapters import (
        ATTENTION_IGNORES,
        ATTENTION_READS,
        BASE_IGNORES,
        attention_traits,
        dtype_name,
        mamba_traits,
        positive_int,
    )

__all__ = [
    "ATTENTION_IGNORES",
    "ATTENTION_READS",
    "BASE_IGNORES",
    "ENTRY_POINT_GROUP",
    "LAYOUT_MEMBERS",
    "Adapter",
    "AdapterConflictError",
    "LayoutTraits",
    "Registration",
    "Registry",
    "UnknownFieldNameError",
    "attention_traits",
    "default_registry",
    "dtype_name",
    "mamba_traits",
    "positive_int",
    "register_adapter",
    "resolving_registry",
]

_BUILDING_BLOCKS: Final = frozenset(
    {
        "ATTENTION_IGNORES",
        "ATTENTION_READS",
        "BASE_IGNORES",
        "attention_traits",
        "dtype_name",
        "mamba_traits",
        "positive_int",
    }
)
"""Names served by the built-in adapters, which import vLLM and torch: loaded on use."""


def __getattr__(name: str) -> Any:
    if name not in _BUILDING_BLOCKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with needs(f"the adapter building blocks (kvspec_traits.extend.{name})"):
        adapters = importlib.import_module("kvspec_traits._vllm_adapters")
    value = getattr(adapters, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
