"""The public surface, frozen for 0.1.0 (issue 49 item 1): every name in the ``__all__``
of a public module has its line in docs/api.md, under a heading that names the module,
and every line there names a public name. Adding or removing a public name without
saying so in docs/api.md fails here.

Failure modes: docs/api.md said ``extend``'s names were importable from ``kvspec_traits``
(they were not); ``traits_of``'s repr was ``Answers.warm_path.<locals>.traits_of``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import kvspec_traits
import kvspec_traits.extend

REPO = Path(__file__).resolve().parents[1]
API = REPO / "docs" / "api.md"

# One module per audience: connector code, adapter authors, real specs; one per transfer
# backend and per tool. Every other module of the package is private (a leading `_`) or
# one of these modules' own.
PUBLIC_MODULES = (
    "kvspec_traits",
    "kvspec_traits.extend",
    "kvspec_traits.catalog",
    "kvspec_traits.transfer",
    "kvspec_traits.nixl",
    "kvspec_traits.mooncake",
    "kvspec_traits.vllm_connector",
    "kvspec_traits.audit",
    "kvspec_traits.migrate",
)


def _documented() -> dict[str, set[str]]:
    """The names in the first cell of each table row of docs/api.md, by the module the
    section's heading names (``## Errors (`kvspec_traits`)``)."""
    found: dict[str, set[str]] = {}
    module = None
    for line in API.read_text().splitlines():
        heading = re.match(r"^## .*\(`([\w.]+)`\)\s*$", line)
        if heading:
            module = heading.group(1)
            found.setdefault(module, set())
        elif line.startswith("## "):
            module = None
        elif module is not None and line.startswith("| `"):
            found[module].add(re.match(r"^\| `(\w+)", line).group(1))  # type: ignore[union-attr]
    return found


def test_the_public_modules_are_every_public_subpackage() -> None:
    """A new public module (no leading `_`) is listed here, and so in docs/api.md."""
    package = Path(kvspec_traits.__file__).parent
    public = {
        f"kvspec_traits.{p.stem if p.is_file() else p.name}"
        for p in package.iterdir()
        if not p.name.startswith("_")
        and (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }
    assert public | {"kvspec_traits"} == set(PUBLIC_MODULES)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_has_its_line_in_api_md(module: str) -> None:
    names = set(importlib.import_module(module).__all__)
    documented = _documented().get(module, set())
    assert sorted(names - documented) == [], f"{module}: add a line to docs/api.md"
    assert sorted(documented - names) == [], f"{module}: docs/api.md names what it lacks"


def test_extends_names_are_not_importable_from_the_root() -> None:
    """docs/api.md says to import them from ``kvspec_traits.extend``: the root does not
    re-export them (one place per name)."""
    for name in kvspec_traits.extend.__all__:
        assert not hasattr(kvspec_traits, name), name
    assert "not importable from `kvspec_traits`" in " ".join(API.read_text().split())


def test_traits_of_is_a_module_level_function_with_its_own_name() -> None:
    traits_of = kvspec_traits.traits_of
    assert inspect.isfunction(traits_of)
    assert (traits_of.__module__, traits_of.__qualname__) == (
        "kvspec_traits._registry",
        "traits_of",
    )
    assert traits_of.__doc__ is not None
    assert traits_of.__doc__.startswith("The verified traits of a vLLM KV cache spec")
    # One function for both spellings: the default registry answers through it.
    assert kvspec_traits.extend.default_registry.traits_of is traits_of
    assert kvspec_traits.extend.Registry().copy().traits_of.__qualname__ == "Registry.traits_of"
