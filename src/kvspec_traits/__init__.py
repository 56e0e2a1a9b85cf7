"""kvspec-traits: what every vLLM KV cache spec looks like to a KV-transfer connector.

Ask ``traits_of(spec).is_mla`` (or ``.tp_layout``, ``.token_scope``, ``.per_token_bytes``,
...) instead of listing spec classes. Importing this package imports neither vLLM nor
torch; the built-in adapters load the first time a spec is resolved.

``__all__`` holds what a consumer of traits needs: ``traits_of``, the traits and their
value types, and the errors resolving a spec can raise. Writing adapters (``Registry``,
``register_adapter``, the built-ins' building blocks) is :mod:`kvspec_traits.extend`;
those names stay importable from here too, for code written before it existed.
"""

from kvspec_traits._errors import (
    AdapterError,
    AdapterPluginError,
    AdapterResultError,
    InvalidSpecError,
    KVSpecTraitsError,
    MissingDependencyError,
    MixedGroupTraitsError,
    SpecPropertyError,
    TraitsMismatchError,
    UnsupportedSpecError,
)
from kvspec_traits._group import GroupTraits, representative_traits, traits_for_layer
from kvspec_traits._registry import traits_of
from kvspec_traits._traits import (
    KVLayoutTraits,
    PageComponent,
    TokenScope,
    TPLayout,
    trait_names,
    traits_as_dict,
)

# Adapter-author names, public in kvspec_traits.extend; kept here for existing imports.
from kvspec_traits.extend import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from kvspec_traits.extend import AdapterConflictError as AdapterConflictError
from kvspec_traits.extend import LayoutTraits as LayoutTraits
from kvspec_traits.extend import Registry as Registry
from kvspec_traits.extend import default_registry as default_registry
from kvspec_traits.extend import register_adapter as register_adapter
from kvspec_traits.extend import resolving_registry as resolving_registry

__version__ = "0.1.0"

__all__ = [
    # the traits
    "GroupTraits",
    "KVLayoutTraits",
    "PageComponent",
    "TPLayout",
    "TokenScope",
    "__version__",
    "representative_traits",
    "trait_names",
    "traits_as_dict",
    "traits_for_layer",
    "traits_of",
    # the errors resolving a spec can raise
    "AdapterError",
    "AdapterPluginError",
    "AdapterResultError",
    "InvalidSpecError",
    "KVSpecTraitsError",
    "MissingDependencyError",
    "MixedGroupTraitsError",
    "SpecPropertyError",
    "TraitsMismatchError",
    "UnsupportedSpecError",
]
