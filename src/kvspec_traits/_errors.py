"""Named errors. Each carries the offending object and says in its message how to fix it.

Every error the library raises on purpose derives from :class:`KVSpecTraitsError` and from
the builtin it refines (``TypeError``, ``ValueError``, ``RuntimeError``), so a caller may
catch either. Errors about one spec name the spec's class, the field or trait involved and
the adapter that was asked (``.spec_type``, ``.field``, ``.adapter``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AdapterConflictError",
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
    "UnknownFieldNameError",
    "UnsupportedSpecError",
    "describe_adapter",
    "not_a_spec_error",
]


def _qualname(tp: type[Any]) -> str:
    return f"{tp.__module__}.{tp.__qualname__}"


def _short_repr(value: object, limit: int = 300) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__qualname__}: repr raised {type(exc).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}..."


def _repr_through(value: object, field: str, limit: int = 300) -> str:
    """``value``'s repr cut at ``limit`` characters, but never before ``field=...``
    (the field an error is about)."""
    text = _short_repr(value, limit=1 << 20)
    if len(text) <= limit:
        return text
    start = text.find(f"{field}=")
    cut = limit
    if start >= 0:
        end = text.find(", ", start)
        cut = max(limit, len(text) if end < 0 else end)
    return text if cut >= len(text) else f"{text[:cut]}..."


class KVSpecTraitsError(Exception):
    """Base of every error kvspec-traits raises on purpose.

    ``.adapter`` names the adapter that was asked (``module.qualname``), or is None when
    no adapter was involved. The registry fills it in for errors an adapter raises.
    """

    adapter: str | None = None

    def _message(self) -> str:
        return super().__str__()

    def _set_adapter(self, adapter: str) -> None:
        # Called by the registry on an error raised inside an adapter that did not
        # name itself; the message is rebuilt so that it names the adapter too.
        if self.adapter is None:
            self.adapter = adapter
            self.args = (self._message(),)


class UnsupportedSpecError(KVSpecTraitsError, TypeError):
    """No adapter can answer for this spec: a refusal, never a guess.

    Raised for a class with no adapter of its own whose nearest adapted ancestor would
    give traits that do not reproduce the spec's own byte math; for a field (or, with
    ``.members``, an overridden property or method) that no adapter accounts for; for
    abstract specs; and for objects that are not KV cache specs. ``.spec_type`` is the
    class, ``.field`` and ``.value`` the unaccounted field and its value when one is the
    cause, ``.members`` the overridden members when they are.
    """

    _NO_VALUE: Any = object()

    def __init__(
        self,
        spec_type: type[Any],
        reason: str,
        *,
        fixable: bool = True,
        field: str | None = None,
        value: object = _NO_VALUE,
        members: tuple[str, ...] = (),
        adapter: str | None = None,
    ) -> None:
        self.spec_type = spec_type
        self.reason = reason
        self.fixable = fixable
        self.field = field
        self.value = None if value is UnsupportedSpecError._NO_VALUE else value
        self.members = members
        self.adapter = adapter
        super().__init__(self._message())

    def _message(self) -> str:
        spec_type = self.spec_type
        bases = ", ".join(_qualname(b) for b in spec_type.__bases__)
        fix = (
            f" Register an adapter with `@register_adapter({spec_type.__qualname__})` from "
            f"`kvspec_traits.extend` (its fields declared with reads=/ignores=) on a function "
            f"`def adapt(spec: {spec_type.__qualname__}) -> LayoutTraits`, and publish it "
            f"in the `kvspec_traits.adapters` entry-point group (docs/extending.md)."
        )
        asked = f" (adapter asked: {self.adapter})" if self.adapter else ""
        return (
            f"kvspec-traits has no adapter for {_qualname(spec_type)} (bases: {bases}): "
            f"{self.reason}{asked}.{fix if self.fixable else ''}"
        )


class NotASpecError(UnsupportedSpecError):
    """``traits_of`` was given something a spec is easily mistaken for: a spec *class*
    (``traits_of(MLAAttentionSpec)``), a cache group (vLLM's ``KVCacheGroupSpec``, which
    holds a spec) or a whole ``KVCacheConfig``. ``.obj`` is what was given,
    ``.spec_type`` its type; the message gives the call to make instead."""

    def __init__(self, obj: object, what: str, fix: str) -> None:
        self.obj = obj
        self.what = what
        self.fix = fix
        super().__init__(type(obj), what, fixable=False)

    def _message(self) -> str:
        return f"traits_of takes one KV cache spec instance, but was given {self.what}: {self.fix}"


def _has(obj: object, *names: str) -> bool:
    try:
        return all(hasattr(obj, name) for name in names)
    except Exception:  # a broken __getattr__: not one of the look-alikes
        return False


def not_a_spec_error(obj: object) -> NotASpecError | None:
    """The :class:`NotASpecError` for ``obj`` when it is a spec's look-alike (read by
    attribute names, vLLM is not imported), else None."""
    if isinstance(obj, type):
        name = obj.__qualname__
        return NotASpecError(
            obj,
            f"the class {_qualname(obj)} itself",
            f"pass an instance, as vLLM builds it (traits_of({name}(block_size=..., ...))), "
            "or a layer's spec from the KVCacheConfig (group.kv_cache_spec)",
        )
    if _has(obj, "kv_cache_spec", "layer_names"):
        return NotASpecError(
            obj,
            f"a cache group ({_qualname(type(obj))}, which holds one spec for its layers)",
            "pass group.kv_cache_spec, or use traits_for_layer(traits_of("
            "group.kv_cache_spec), layer) for one layer's own traits",
        )
    if _has(obj, "kv_cache_groups"):
        return NotASpecError(
            obj,
            f"a whole config ({_qualname(type(obj))})",
            "ask per cache group: for group in config.kv_cache_groups: "
            "traits_of(group.kv_cache_spec), then traits_for_layer(traits, layer) per layer",
        )
    return None


class SpecPropertyError(UnsupportedSpecError):
    """The spec's own byte math raised while its traits were checked against it.

    A refusal: an error in ``page_size_bytes`` (or another size property the check
    reads) means the spec cannot say what its page holds, so no traits are given.
    ``.field`` is the property, ``.error`` the exception it raised (also the cause).
    """

    def __init__(
        self, spec: object, prop: str, error: BaseException, *, adapter: str | None = None
    ) -> None:
        self.spec = spec
        self.error = error
        super().__init__(
            type(spec),
            f"its own `{prop}` raised {type(error).__name__}: {error} "
            f"(spec: {_short_repr(spec)}), so its traits cannot be checked against it",
            field=prop,
            adapter=adapter,
            fixable=False,
        )


class InvalidSpecError(KVSpecTraitsError, ValueError):
    """A spec field holds a value that describes no layout (``block_size=0``, a window of
    ``None`` on a windowed spec, ``tokens_per_state=0``, a string where an int belongs).

    ``.spec`` is the spec, ``.spec_type`` its class, ``.field`` the field, ``.value`` its
    value, ``.expected`` what the field must hold, ``.adapter`` the adapter that read it.
    """

    def __init__(
        self, spec: object, field: str, value: object, expected: str, *, adapter: str | None = None
    ) -> None:
        self.spec = spec
        self.spec_type: type[Any] = type(spec)
        self.field = field
        self.value = value
        self.expected = expected
        self.adapter = adapter
        super().__init__(self._message())

    def _message(self) -> str:
        by = f" (read by adapter {self.adapter})" if self.adapter else ""
        return (
            f"{self.spec_type.__qualname__}.{self.field}={_short_repr(self.value)} "
            f"describes no KV cache layout: {self.field} must be {self.expected}{by}. "
            f"Fix the code that builds the spec (spec: {_short_repr(self.spec)})."
        )


class InvalidBlockCountError(KVSpecTraitsError, ValueError):
    """A block count given to :func:`kvspec_traits.blocks_to_transfer` is not a
    non-negative int. ``.argument`` names the parameter, ``.value`` holds what was
    given."""

    def __init__(self, argument: str, value: object) -> None:
        self.argument = argument
        self.value = value
        super().__init__(
            f"{argument} must be a count of blocks (an int >= 0), got {_short_repr(value)}; "
            f"pass len(block_ids) of the group's block list"
            if argument == "num_blocks"
            else f"{argument} must be a count of blocks (an int >= 0), got "
            f"{_short_repr(value)}; pass the spec's num_speculative_blocks (0 without "
            "speculative decoding)"
        )


class TraitsMismatchError(KVSpecTraitsError, ValueError):
    """An adapter's traits disagree with the spec's own byte math.

    ``.field`` is the trait, ``.traits_value`` and ``.spec_value`` the two values,
    ``.spec`` the spec instance, ``.adapter`` the adapter. When the spec's class overrides
    one page property but inherits the one that disagrees (and the adapter agrees with the
    override), the spec is the likelier culprit: ``.inherited_from`` names the class the
    disagreeing property comes from and ``.overridden`` the property the spec overrides
    (both None otherwise), and the message says so.
    """

    def __init__(
        self,
        spec: object,
        field: str,
        traits_value: object,
        spec_value: object,
        adapter: str,
        *,
        inherited: tuple[str, str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.spec_type: type[Any] = type(spec)
        self.field = field
        self.traits_value = traits_value
        self.spec_value = spec_value
        self.adapter = adapter
        self.inherited_from = inherited[1] if inherited else None
        self.overridden = inherited[2] if inherited else None
        name = type(spec).__qualname__
        shown = _repr_through(spec, field)
        if inherited is None:
            super().__init__(
                f"{field}: adapter {adapter} gives {field}={traits_value!r} for {name}, but "
                f"the spec itself says {spec_value!r}. The adapter is wrong for this spec: fix "
                f"it, or register a dedicated adapter for {name}. (spec: {shown})"
            )
            return
        prop, base, overridden = inherited
        super().__init__(
            f"{field}: {name} overrides {overridden} but inherits {prop} from {base}, "
            f"which says {spec_value!r}, while adapter {adapter} gives {field}={traits_value!r} "
            f"(and agrees with the overridden {overridden}). The spec inherits a page "
            f"property it should override: define {prop} on {name} as well, so that vLLM "
            f"and kvspec-traits read one page; if {base}'s {spec_value!r} is right, fix "
            f"the adapter instead. (spec: {shown})"
        )


class AdapterResultError(KVSpecTraitsError, TypeError):
    """An adapter returned something that is not valid traits: not a ``KVLayoutTraits``
    (a missing or mistyped trait), or traits that contradict themselves (a windowed
    scope without a window).

    ``.spec`` is the spec, ``.adapter`` the adapter, ``.field`` the trait at fault,
    ``.result`` what the adapter returned.
    """

    def __init__(
        self, spec: object, adapter: str, field: str, result: object, problem: str
    ) -> None:
        self.spec = spec
        self.spec_type: type[Any] = type(spec)
        self.adapter = adapter
        self.field = field
        self.result = result
        super().__init__(
            f"adapter {adapter} returned invalid traits for {type(spec).__qualname__}: "
            f"trait {field!r} {problem} (returned {_short_repr(result)}). An adapter must "
            f"return kvspec_traits.extend.LayoutTraits (or another KVLayoutTraits)."
        )


class AdapterError(KVSpecTraitsError, RuntimeError):
    """An adapter raised an exception of its own (a bug in the adapter, or a spec value it
    did not expect). ``.spec`` is the spec, ``.adapter`` the adapter, ``.error`` the
    exception (also ``__cause__``)."""

    def __init__(self, spec: object, adapter: str, error: BaseException) -> None:
        self.spec = spec
        self.spec_type: type[Any] = type(spec)
        self.adapter = adapter
        self.error = error
        super().__init__(
            f"adapter {adapter} raised {type(error).__name__}: {error} for "
            f"{type(spec).__qualname__} (spec: {_short_repr(spec)}); fix the adapter, or "
            f"have it raise kvspec_traits.InvalidSpecError naming the field at fault."
        )


class MixedGroupTraitsError(KVSpecTraitsError, ValueError):
    """The members of a group spec disagree on a trait asked of the whole group.

    ``.trait`` is the trait; ``.values`` maps each layer name to its value.
    """

    def __init__(self, trait: str, values: dict[str, object]) -> None:
        self.trait = trait
        self.values = values
        shown = ", ".join(f"{layer}={value!r}" for layer, value in values.items())
        super().__init__(
            f"the layers of this UniformTypeKVCacheSpecs group disagree on {trait!r} "
            f"({shown}); ask `.members[layer]` for the per-layer answer"
        )


class AdapterConflictError(KVSpecTraitsError, ValueError):
    """A second, different adapter was registered for a spec class that has one.

    ``.spec_type``, ``.existing`` and ``.new`` name the class and both adapters.
    """

    def __init__(self, spec_type: type[Any], existing: object, new: object) -> None:
        self.spec_type = spec_type
        self.existing = existing
        self.new = new
        super().__init__(
            f"{_qualname(spec_type)} already has adapter "
            f"{describe_adapter(existing, spec_type)}; refusing "
            f"{describe_adapter(new, spec_type)}. Use `Registry.copy()` for an isolated "
            f"registry, or `kvspec_traits.extend.register_adapter(..., replace=True)` to "
            f"replace it on purpose."
        )


class UnknownFieldNameError(KVSpecTraitsError, ValueError):
    """A ``reads=`` or ``ignores=`` declaration names something the spec class does not
    have (a misspelt field would leave the real one unaccounted while looking declared).

    ``.spec_type`` is the class, ``.what`` ``"reads"`` or ``"ignores"``, ``.names`` the
    unknown names, ``.fields`` the class's dataclass fields.
    """

    def __init__(
        self, spec_type: type[Any], what: str, names: list[str], fields: frozenset[str]
    ) -> None:
        self.spec_type = spec_type
        self.what = what
        self.names = tuple(names)
        self.fields = fields
        listed = ", ".join(sorted(fields)) or "none"
        super().__init__(
            f"{what}= for {_qualname(spec_type)} names {', '.join(map(repr, names))}, which "
            f"is neither a field nor a member of {spec_type.__qualname__} (its fields: "
            f"{listed}). Fix the spelling in the register_adapter call."
        )


class AdapterPluginError(KVSpecTraitsError, RuntimeError):
    """A package in the ``kvspec_traits.adapters`` entry-point group failed to load or to
    register. ``.entry_point`` is its name; the registry is left as it was before loading."""

    def __init__(self, entry_point: str, message: str) -> None:
        self.entry_point = entry_point
        super().__init__(message)


class MissingDependencyError(KVSpecTraitsError, ModuleNotFoundError):
    """A part of kvspec-traits needs a package that is not installed.

    ``.name`` is the missing top-level module (as for any ``ModuleNotFoundError``),
    ``.feature`` the part that needs it and ``.install`` what to install. The core
    (``import kvspec_traits``) needs nothing; resolving vLLM specs needs vLLM and its
    torch, the NIXL shim numpy and NIXL, the connector plugin vLLM.
    """

    def __init__(self, name: str, feature: str, install: str) -> None:
        self.feature = feature
        self.install = install
        super().__init__(
            f"{feature} needs the {name!r} module, which is not installed. {install}", name=name
        )


_PUBLIC_BUILDING_BLOCKS = frozenset({"attention_traits", "mamba_traits"})


def describe_adapter(adapter: object, owner: type[Any] | None = None) -> str:
    """How messages name an adapter: ``module.qualname`` for a package's own function;
    a built-in by what it adapts (its module is private) or by its public name in
    ``kvspec_traits.extend``."""
    module = str(getattr(adapter, "__module__", None) or "?")
    name = str(getattr(adapter, "__qualname__", None) or repr(adapter))
    if module == "kvspec_traits" or module.startswith("kvspec_traits._"):
        if name in _PUBLIC_BUILDING_BLOCKS:
            return f"kvspec_traits.extend.{name}"
        if owner is not None:
            return f"the built-in adapter for {owner.__qualname__}"
        return "a kvspec-traits built-in adapter"
    return f"{module}.{name}"
