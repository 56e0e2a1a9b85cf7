"""kvspec-traits: what every vLLM KV cache spec looks like to a KV-transfer connector.

Ask ``traits_of(spec).is_mla`` (or ``.tp_layout``, ``.token_scope``, ``.per_token_bytes``,
...) instead of listing spec classes. Importing this package imports neither vLLM nor
torch; the built-in adapters load the first time a spec is resolved.

``__all__`` holds what a consumer of traits needs: ``traits_of``, the traits and their
value types, the transfer rule (``blocks_to_transfer``), and the errors resolving a spec
can raise. Writing adapters (``Registry``, ``register_adapter``, the built-ins' building
blocks) is :mod:`kvspec_traits.extend`.
"""

from kvspec_traits._errors import (
    AdapterError,
    AdapterPluginError,
    AdapterResultError,
    InvalidBlockCountError,
    InvalidSpecError,
    KVSpecTraitsError,
    MissingDependencyError,
    MixedGroupTraitsError,
    NotASpecError,
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
from kvspec_traits._transfer_rule import blocks_to_transfer

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
    # which blocks a transfer moves
    "blocks_to_transfer",
    # the errors resolving a spec can raise
    "AdapterError",
    "AdapterPluginError",
    "AdapterResultError",
    "InvalidBlockCountError",
    "InvalidSpecError",
    "KVSpecTraitsError",
    "MissingDependencyError",
    "MixedGroupTraitsError",
    "NotASpecError",
    "SpecPropertyError",
    "TraitsMismatchError",
    "UnsupportedSpecError",
]
