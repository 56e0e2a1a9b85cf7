"""Named errors. Each carries the offending object and says in its message how to fix it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AdapterConflictError",
    "AdapterPluginError",
    "MissingDependencyError",
    "MixedGroupTraitsError",
    "TraitsMismatchError",
    "UnsupportedSpecError",
]


def _qualname(tp: type[Any]) -> str:
    return f"{tp.__module__}.{tp.__qualname__}"


class UnsupportedSpecError(TypeError):
    """No adapter can answer for this spec class.

    Raised for a class with no adapter of its own whose nearest adapted ancestor would
    give traits that do not reproduce the spec's own byte math, for abstract specs, and
    for objects that are not KV cache specs. ``.spec_type`` is the class.
    """

    def __init__(self, spec_type: type[Any], reason: str, *, fixable: bool = True) -> None:
        self.spec_type = spec_type
        self.reason = reason
        bases = ", ".join(_qualname(b) for b in spec_type.__bases__)
        fix = (
            f" Register an adapter with "
            f"`@kvspec_traits.register_adapter({spec_type.__qualname__})` on a function "
            f"`def adapt(spec: {spec_type.__qualname__}) -> KVLayoutTraits`, or publish it "
            f"in the `kvspec_traits.adapters` entry-point group."
        )
        super().__init__(
            f"kvspec-traits has no adapter for {_qualname(spec_type)} (bases: {bases}): "
            f"{reason}.{fix if fixable else ''}"
        )


class TraitsMismatchError(ValueError):
    """An adapter's traits disagree with the spec's own byte math.

    ``.field`` is the trait, ``.traits_value`` and ``.spec_value`` the two values,
    ``.spec`` the spec instance.
    """

    def __init__(self, spec: object, field: str, traits_value: object, spec_value: object,
                 adapter: str) -> None:
        self.spec = spec
        self.field = field
        self.traits_value = traits_value
        self.spec_value = spec_value
        self.adapter = adapter
        super().__init__(
            f"traits of {type(spec).__qualname__} from adapter {adapter} give "
            f"{field}={traits_value!r}, but the spec itself says {spec_value!r} "
            f"(spec: {spec!r}). The adapter is wrong for this spec: fix it, or register "
            f"a dedicated adapter for {type(spec).__qualname__}."
        )


class MixedGroupTraitsError(ValueError):
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


class AdapterConflictError(ValueError):
    """A second, different adapter was registered for a spec class that has one.

    ``.spec_type``, ``.existing`` and ``.new`` name the class and both adapters.
    """

    def __init__(self, spec_type: type[Any], existing: object, new: object) -> None:
        self.spec_type = spec_type
        self.existing = existing
        self.new = new
        super().__init__(
            f"{_qualname(spec_type)} already has adapter {_describe(existing)}; refusing "
            f"{_describe(new)}. Use `Registry.copy()` for an isolated registry, or "
            f"`register_adapter(..., replace=True)` to replace it on purpose."
        )


class AdapterPluginError(RuntimeError):
    """A package in the ``kvspec_traits.adapters`` entry-point group failed to load or to
    register. ``.entry_point`` is its name; the registry is left as it was before loading."""

    def __init__(self, entry_point: str, message: str) -> None:
        self.entry_point = entry_point
        super().__init__(message)


class MissingDependencyError(ModuleNotFoundError):
    """A part of kvspec-traits needs a package that is not installed.

    ``.name`` is the missing top-level module (as for any ``ModuleNotFoundError``),
    ``.feature`` the part that needs it and ``.install`` what to install. The core
    (``import kvspec_traits``) needs nothing; resolving vLLM specs needs vLLM and its
    torch, the NIXL shim numpy and NIXL, the connector plugin vLLM.
    """

    def __init__(self, name: str, feature: str, install: str) -> None:
        self.feature = feature
        self.install = install
        super().__init__(f"{feature} needs the {name!r} module, which is not installed. "
                         f"{install}", name=name)


def _describe(adapter: object) -> str:
    module = getattr(adapter, "__module__", "?")
    name = getattr(adapter, "__qualname__", repr(adapter))
    return f"{module}.{name}"
