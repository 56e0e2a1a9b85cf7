"""The built-in registrations: which adapter answers for which vLLM spec class.

Classes are looked up by name in the installed ``vllm.v1.kv_cache_interface``, one at a
time: a class a vLLM release does not have (renamed, removed, not yet added) simply gets
no adapter, and the rest still register. That keeps the refusal closed: a spec of a class
with no adapter of its own is answered through its nearest adapted ancestor (with its
field accounting and byte-math check), and a direct ``KVCacheSpec`` subclass is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from vllm.v1 import kv_cache_interface as _kvi

from kvspec_traits._accounting import declare_series_names
from kvspec_traits._errors import InvalidSpecError, KVSpecTraitsError, UnsupportedSpecError
from kvspec_traits._group import GroupTraits
from kvspec_traits._registry import register_adapter, resolving_registry
from kvspec_traits._traits import KVLayoutTraits, LayoutTraits, TokenScope
from kvspec_traits._vllm_adapters._common import (
    _MAMBA_IGNORES,
    _MAMBA_READS,
    _SPEC_READS,
    _WINDOW_READS,
    ATTENTION_IGNORES,
    ATTENTION_READS,
    BASE_IGNORES,
    BUILTINS,
    _window,
    attention_traits,
    positive_int,
)
from kvspec_traits._vllm_adapters._recurrent import (
    _HISPARSE_IGNORES,
    _HISPARSE_READS,
    _hisparse,
    mamba_traits,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheSpec,
        RSWASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

__all__ = ["ABSENT", "REGISTERED", "spec_class"]

_registered: list[str] = []
_absent: list[str] = []


def spec_class(name: str) -> type[Any] | None:
    """The spec class ``name`` of the installed vLLM, ``None`` when it has none."""
    found = getattr(_kvi, name, None)
    return found if isinstance(found, type) else None


def _register(
    names: tuple[str, ...],
    adapter: Callable[[Any], KVLayoutTraits],
    *,
    reads: tuple[str, ...],
    ignores: tuple[str, ...],
) -> None:
    # The lists span the supported series (and several classes): a name the installed
    # vLLM's class lacks is a real name there, never a misspelling (see field_names_of).
    declare_series_names(reads, ignores)
    for name in names:
        cls = spec_class(name)
        if cls is None:
            _absent.append(name)
            continue
        register_adapter(cls, adapter, registry=BUILTINS, reads=reads, ignores=ignores)
        _registered.append(name)


def _abstract(spec: KVCacheSpec) -> LayoutTraits:
    # Reached by KVCacheSpec itself and by any direct subclass without its own adapter.
    raise UnsupportedSpecError(
        type(spec),
        "KVCacheSpec is abstract and a direct subclass has no layout fields an adapter could read",
    )


_register(("KVCacheSpec",), _abstract, reads=("block_size",), ignores=BASE_IGNORES)


def _keeps_every_token(spec: AttentionSpec) -> LayoutTraits:
    # FullAttentionSpec's `sliding_window`/`attention_chunk_size` only change the kernel:
    # the manager keeps every token's block (hybrid allocator off), so the scope is FULL.
    return attention_traits(spec)


def _bare(spec: AttentionSpec) -> LayoutTraits:
    # A bare AttentionSpec has no window of its own, but no vLLM manager allocates it
    # (KVCacheSpecRegistry has no entry for it): nothing promises to keep its prompt.
    return attention_traits(spec, keeps_prompt=False)


_register(("AttentionSpec",), _bare, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES)

# One function, registered for each class by name: a subclass not listed here still goes
# through the MRO walk, its field accounting and its byte-math check, never silently
# through this list.
_register(
    ("FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec"),
    _keeps_every_token,
    reads=ATTENTION_READS,
    ignores=ATTENTION_IGNORES,
)


def _hidden_states(spec: AttentionSpec) -> LayoutTraits:
    # vLLM's marker subclass of MLAAttentionSpec ("Marker for hidden-state cache layers
    # used by extract_hidden_states"): an MLA page of num_kv_heads hidden states of
    # head_size each, kept for every token; what it holds is the class's only news.
    return attention_traits(spec, holds_hidden_states=True)


_register(
    ("HiddenStateCacheSpec",), _hidden_states, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES
)


def _rswa(spec: RSWASpec) -> LayoutTraits:
    return attention_traits(
        spec, token_scope=TokenScope.PROMPT_AND_WINDOW, window_tokens=_window(spec, "rswa_window")
    )


_register(("RSWASpec",), _rswa, reads=(*ATTENTION_READS, "rswa_window"), ignores=ATTENTION_IGNORES)


def _chunked(spec: ChunkedLocalAttentionSpec) -> LayoutTraits:
    return attention_traits(
        spec, token_scope=TokenScope.CHUNKED, window_tokens=_window(spec, "attention_chunk_size")
    )


_register(
    ("ChunkedLocalAttentionSpec",),
    _chunked,
    reads=(*ATTENTION_READS, "attention_chunk_size"),
    ignores=ATTENTION_IGNORES,
)


def _sliding(spec: SlidingWindowSpec) -> LayoutTraits:
    return attention_traits(
        spec, token_scope=TokenScope.SLIDING_WINDOW, window_tokens=_window(spec, "sliding_window")
    )


# bounded_replay (SlidingWindowMLASpec) reaches the traits through spec.prefix_cacheable.
_register(
    ("SlidingWindowSpec", "SlidingWindowMLASpec"),
    _sliding,
    reads=(*ATTENTION_READS, *_WINDOW_READS),
    ignores=ATTENTION_IGNORES,
)


def _ring(spec: CircularBufferSpec) -> LayoutTraits:
    # block_size is the ring capacity: one block per request, rewritten in place.
    return attention_traits(
        spec, token_scope=TokenScope.RING, window_tokens=_window(spec, "block_size")
    )


_register(("CircularBufferSpec",), _ring, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES)


def _encoder_only(spec: EncoderOnlyAttentionSpec) -> LayoutTraits:
    # Encoder-only layers keep nothing across steps (vLLM sizes them at 0 bytes).
    return attention_traits(spec, token_scope=TokenScope.NONE, transferable=False)


_register(
    ("EncoderOnlyAttentionSpec",), _encoder_only, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES
)


def _cross(spec: CrossAttentionSpec) -> LayoutTraits:
    # Encoder outputs are recomputed by the engine that runs the encoder; vLLM's
    # connectors do not move them (Mooncake's store lists them as unsupported).
    return attention_traits(spec, token_scope=TokenScope.ENCODER, transferable=False)


_register(("CrossAttentionSpec",), _cross, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES)

# -- recurrent state ----------------------------------------------------------------------

_register(("MambaSpec",), mamba_traits, reads=_MAMBA_READS, ignores=_MAMBA_IGNORES)

# -- HiSparse -------------------------------------------------------------------------------


def _hisparse_hot(spec: HiSparseHotSpec) -> LayoutTraits:
    return _hisparse(spec, TokenScope.SPARSE_HOT)


def _hisparse_resident(spec: HiSparseResidentSpec) -> LayoutTraits:
    return _hisparse(spec, TokenScope.SPARSE_RESIDENT)


_register(("HiSparseHotSpec",), _hisparse_hot, reads=_HISPARSE_READS, ignores=_HISPARSE_IGNORES)
_register(
    ("HiSparseResidentSpec",),
    _hisparse_resident,
    reads=_HISPARSE_READS,
    ignores=_HISPARSE_IGNORES,
)

# -- groups -----------------------------------------------------------------------------------


def _group(spec: UniformTypeKVCacheSpecs) -> GroupTraits:
    block_size = positive_int(spec, "block_size")
    members = spec.kv_cache_specs
    if not isinstance(members, dict) or not members:
        raise InvalidSpecError(
            spec,
            "kv_cache_specs",
            members,
            "a non-empty dict of layer name -> spec (a group spec with "
            "no member layers has no layout)",
        )
    registry = resolving_registry()
    traits: dict[str, Any] = {}
    for layer, member in members.items():
        try:
            traits[layer] = registry.traits_of(member)
        except InvalidSpecError as err:
            # Named from the group down to the member's field.
            raise InvalidSpecError(
                spec,
                f"kv_cache_specs[{layer!r}].{err.field}",
                err.value,
                err.expected,
                adapter=err.adapter,
            ) from err
        except KVSpecTraitsError as err:
            err.add_note(f"(layer {layer!r} of a {type(spec).__qualname__})")
            raise
    return GroupTraits(type(spec).__qualname__, traits, block_size=block_size)


_register(
    ("UniformTypeKVCacheSpecs",),
    _group,
    reads=(*_SPEC_READS, "kv_cache_specs"),
    ignores=BASE_IGNORES,
)

REGISTERED: Final = tuple(_registered)
"""The spec classes of the installed vLLM that have a built-in adapter, by name."""
ABSENT: Final = tuple(_absent)
"""Spec classes the built-ins know that the installed vLLM does not have (no adapter
registered for them)."""
