"""Field accounting and overridden members: what a registration says about its spec
class's fields, and which classes an inherited adapter may not answer for.

For each spec class a :class:`Plan` is computed once: the class whose adapter serves it,
the fields that adapter does not account for (each must hold its default, or the class is
refused when it has none) and the layout members a subclass overrides without an adapter
of its own (refused: the parent's answer may not hold).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Final

from kvspec_traits._caches import MAX_CLASSES, put_bounded
from kvspec_traits._errors import (
    UnknownFieldNameError,
    UnsupportedSpecError,
    describe_adapter,
)
from kvspec_traits._traits import (
    KVLayoutTraits,
)
from kvspec_traits._verify import CHECKED_PROPERTIES

__all__ = [
    "LAYOUT_MEMBERS",
    "Accounting",
    "Declared",
    "Plan",
    "Registration",
    "declare_series_names",
    "field_names_of",
    "members_error",
]

LAYOUT_MEMBERS: Final = frozenset(
    {
        *CHECKED_PROPERTIES,
        "max_memory_usage_bytes",
        "merge",
        "merge_window_sizes",
        "get_num_kernel_states",
        "max_num_blocks_per_req",
        "max_admission_blocks_per_request",
        "num_retained_tokens",
        "prefix_replay_tokens",
        "copy_with_new_block_size",
        "get_block_stride_alignment",
        "block_table_token_alignment",
        "has_layer_views",
        "is_uniform_with_collection",
        "sliding_window",
        "attention_chunk_size",
        "rswa_window",
    }
)
"""Members of vLLM's spec API that decide a page's layout or which blocks a request
keeps. A subclass that overrides one of these (or a member its ancestor's adapter
``reads``) without an adapter of its own is refused: the parent's answer may not hold."""


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """One registration: the adapter and what it declares about the class's fields:
    ``reads`` the fields (and members) its answer depends on, ``ignores`` the fields known
    not to affect the layout. A registration without ``reads=`` declares none: every field
    it does not ``ignore`` must then hold its default."""

    adapter: Callable[[Any], KVLayoutTraits]
    reads: frozenset[str]
    ignores: frozenset[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Declared:
    """What one registration declares about its class's fields (see :class:`Registration`)."""

    reads: frozenset[str]
    ignores: frozenset[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Everything resolution needs to know about one spec class, computed once."""

    owner: type[Any]
    adapter: Callable[[Any], KVLayoutTraits]
    adapter_name: str
    field_names: tuple[str, ...]
    # Unaccounted fields that must hold their default: (name, default).
    at_default: tuple[tuple[str, object], ...]
    # Unaccounted fields without a default: the class is refused outright.
    required: tuple[str, ...]
    # Overridden layout members of a subclass without its own adapter.
    members: tuple[str, ...]


class Accounting:
    """The registrations of one :class:`~kvspec_traits.extend.Registry` (each class's
    adapter and what it declares about the class's fields) and the :class:`Plan` of each
    spec class computed from them, bounded by :data:`~kvspec_traits._caches.MAX_CLASSES`.

    Not locked itself: the registry holds its lock around every change and every plan
    computed, and loads its adapters before it asks for a plan.
    """

    def __init__(self) -> None:
        self.adapters: dict[type[Any], Callable[[Any], KVLayoutTraits]] = {}
        self.declared: dict[type[Any], Declared] = {}
        # The resolution plan per class (dropped oldest first past MAX_CLASSES).
        self.plans: dict[type[Any], Plan] = {}

    def set(
        self, spec_type: type[Any], adapter: Callable[[Any], KVLayoutTraits], declared: Declared
    ) -> None:
        self.adapters[spec_type] = adapter
        self.declared[spec_type] = declared
        self.plans.clear()

    def saved(self) -> tuple[dict[type[Any], Any], dict[type[Any], Declared]]:
        """A copy of the registrations, for :meth:`restore` (or another registry's)."""
        return dict(self.adapters), dict(self.declared)

    def restore(self, saved: tuple[dict[type[Any], Any], dict[type[Any], Declared]]) -> None:
        self.adapters, self.declared = dict(saved[0]), dict(saved[1])
        self.plans.clear()

    def registrations(self) -> dict[type[Any], Registration]:
        return {
            spec_type: Registration(
                adapter, self.declared[spec_type].reads, self.declared[spec_type].ignores
            )
            for spec_type, adapter in self.adapters.items()
        }

    def plan(self, spec_type: type[Any]) -> Plan:
        """The plan of ``spec_type``: :class:`UnsupportedSpecError` when neither it nor
        a base has an adapter."""
        plan = self.plans.get(spec_type)
        if plan is not None:
            return plan
        for klass in spec_type.__mro__:
            adapter = self.adapters.get(klass)
            if adapter is not None:
                plan = self._make_plan(spec_type, klass, adapter)
                put_bounded(self.plans, spec_type, plan, MAX_CLASSES)
                return plan
        raise UnsupportedSpecError(
            spec_type,
            "neither it nor any of its bases has an adapter (is it a vLLM KV cache spec? "
            "traits_of takes a spec instance, such as a FullAttentionSpec)",
            fixable=False,
        )

    def _make_plan(
        self, spec_type: type[Any], owner: type[Any], adapter: Callable[[Any], KVLayoutTraits]
    ) -> Plan:
        accounted = self.accounted(owner)
        fields = dataclasses.fields(spec_type) if dataclasses.is_dataclass(spec_type) else ()
        at_default: list[tuple[str, object]] = []
        required: list[str] = []
        for f in fields:
            if f.name in accounted:
                continue
            if f.default is not dataclasses.MISSING:
                at_default.append((f.name, f.default))
            elif f.default_factory is not dataclasses.MISSING:
                at_default.append((f.name, f.default_factory()))
            else:
                required.append(f.name)
        field_names = tuple(f.name for f in fields)
        members: list[str] = []
        if owner is not spec_type:
            relied_on = LAYOUT_MEMBERS | self.reads(owner)
            for klass in spec_type.__mro__:
                if klass is owner:
                    break
                members.extend(
                    name
                    for name in vars(klass)
                    if name in relied_on and name not in field_names and name not in members
                )
        return Plan(
            owner=owner,
            adapter=adapter,
            adapter_name=describe_adapter(adapter, owner),
            field_names=field_names,
            at_default=tuple(at_default),
            required=tuple(required),
            members=tuple(sorted(members)),
        )

    def accounted(self, klass: type[Any]) -> frozenset[str]:
        """Names the registration for ``klass`` accounts for (reads and ignores)."""
        declared = self.declared.get(klass, _NOTHING)
        return declared.reads | declared.ignores

    def reads(self, klass: type[Any]) -> frozenset[str]:
        """Names the registration for ``klass`` reads."""
        return self.declared.get(klass, _NOTHING).reads


def members_error(spec_type: type[Any], plan: Plan) -> UnsupportedSpecError:
    """The refusal of a subclass that overrides members its inherited adapter relies on."""
    return UnsupportedSpecError(
        spec_type,
        f"it overrides {', '.join(plan.members)}, which the adapter for "
        f"{plan.owner.__qualname__} relies on, so that adapter's answer may not "
        "describe it",
        members=plan.members,
        adapter=plan.adapter_name,
    )


_NOTHING: Final = Declared(frozenset(), frozenset())

# Names of vLLM's spec API that the built-in field lists (ATTENTION_READS, ...) declare:
# they span the supported vLLM series and several classes, so a name one class or series
# lacks is still a real name (never seen there), not a misspelling.
_SERIES_NAMES: set[str] = set()


def declare_series_names(*names: Iterable[str]) -> None:
    """Mark the names of a built-in field list as real names of vLLM's spec API (called
    by the built-in adapters where they define their lists)."""
    for group in names:
        _SERIES_NAMES.update(group)


def field_names_of(spec_type: type[Any], what: str, names: Iterable[str]) -> frozenset[str]:
    """The names of a ``reads=``/``ignores=`` declaration, each checked: a dataclass field
    or member of ``spec_type``, or a name of vLLM's spec API from the built-in field lists
    (which span the supported series). Anything else is refused: a misspelt name would
    leave the real field unaccounted while looking declared."""
    if isinstance(names, str):
        raise TypeError(
            f"{what} for {spec_type.__qualname__} takes field names, not one "
            f"string: write {what}=({names!r},)"
        )
    result = frozenset(names)
    bad = [n for n in result if not isinstance(n, str) or not n.isidentifier()]
    if bad:
        raise TypeError(f"{what} for {spec_type.__qualname__} must be field names, got {bad!r}")
    unknown = sorted(unknown_names(spec_type, result))
    if unknown:
        raise UnknownFieldNameError(spec_type, what, unknown, _all_fields(spec_type))
    return result


def unknown_names(spec_type: type[Any], names: Iterable[str]) -> list[str]:
    """The names that are neither a field nor a member of ``spec_type`` nor a name of
    vLLM's spec API the built-in field lists declare."""
    fields = _all_fields(spec_type)
    return [
        n for n in names if n not in fields and not hasattr(spec_type, n) and n not in _SERIES_NAMES
    ]


def _all_fields(klass: type[Any]) -> frozenset[str]:
    if not dataclasses.is_dataclass(klass):
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(klass))
