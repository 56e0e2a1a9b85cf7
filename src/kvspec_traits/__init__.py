"""kvspec-traits: what every vLLM KV cache spec looks like to a KV-transfer connector.

Ask ``traits_of(spec).is_mla`` (or ``.tp_layout``, ``.token_scope``, ``.per_token_bytes``,
...) instead of listing spec classes. Importing this package imports neither vLLM nor
torch; the built-in adapters load the first time a spec is resolved.
"""

from kvspec_traits._errors import (
    AdapterConflictError,
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
from kvspec_traits._registry import (
    ENTRY_POINT_GROUP,
    Registry,
    default_registry,
    register_adapter,
    resolving_registry,
    traits_of,
)
from kvspec_traits._traits import (
    KVLayoutTraits,
    LayoutTraits,
    PageComponent,
    TokenScope,
    TPLayout,
    trait_names,
    traits_as_dict,
)

__version__ = "0.1.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "AdapterConflictError",
    "AdapterError",
    "AdapterPluginError",
    "AdapterResultError",
    "GroupTraits",
    "InvalidSpecError",
    "KVLayoutTraits",
    "KVSpecTraitsError",
    "LayoutTraits",
    "MissingDependencyError",
    "MixedGroupTraitsError",
    "PageComponent",
    "Registry",
    "SpecPropertyError",
    "TPLayout",
    "TokenScope",
    "TraitsMismatchError",
    "UnsupportedSpecError",
    "__version__",
    "default_registry",
    "register_adapter",
    "representative_traits",
    "resolving_registry",
    "trait_names",
    "traits_as_dict",
    "traits_for_layer",
    "traits_of",
]
