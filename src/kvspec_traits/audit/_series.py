"""Which vLLM series the audit judges with: the installed one, the one of the vLLM tree
it scans (its ``vllm/_version.py``), or the one ``--vllm SERIES`` names; and the class
sets kvspec-traits ships for each supported series (vLLM's classes alone), for judging
a series that is not installed.

Nothing here imports vLLM: versions are read from ``_version.py`` as text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from kvspec_traits._deps import vllm_series
from kvspec_traits.audit._cache import installed_vllm_dir, read_json
from kvspec_traits.audit._universe import ClassSetsUnavailableError, Universe

__all__ = [
    "SHIPPED_DIR",
    "installed_vllm_version",
    "shippable",
    "shipped_file",
    "shipped_series",
    "shipped_universe",
    "tree_vllm_version",
    "version_file_version",
]

SHIPPED_DIR: Final = Path(__file__).resolve().parent / "class_sets"
"""``vllm-<series>.json``: the class sets of each supported vLLM series, written by
``tools/kvspec_workbench/audit_class_sets.py`` (``make audit-class-sets``)."""

_VERSION_LINE: Final = re.compile(
    r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
    re.MULTILINE,
)


def version_file_version(path: Path) -> str | None:
    """The version a vLLM ``_version.py`` assigns (``__version__ = version = '0.34.0'``),
    read as text; None when the file is missing or says none."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = _VERSION_LINE.search(text)
    return found.group(1) if found else None


def installed_vllm_version() -> str | None:
    """The version of the vLLM package Python would import, from its ``_version.py``
    (None without one)."""
    root = installed_vllm_dir()
    return None if root is None else version_file_version(root / "_version.py")


def _tree_version(path: Path) -> str | None:
    """The vLLM version of the tree ``path`` lies in: a path inside a ``vllm`` package
    with a ``_version.py``, or a checkout holding ``vllm/_version.py``."""
    try:
        path = path.resolve()
    except OSError:
        return None
    own = path / "vllm" / "_version.py"
    if path.is_dir() and own.is_file():
        return version_file_version(own)
    for folder in (path, *path.parents):
        if folder.name == "vllm" and (folder / "_version.py").is_file():
            return version_file_version(folder / "_version.py")
    return None


def tree_vllm_version(paths: Sequence[Path]) -> str | None:
    """The vLLM version of the trees ``paths`` lie in, when they all say one (paths
    outside any vLLM tree do not count); None when none says or they differ."""
    found = {v for v in map(_tree_version, paths) if v is not None}
    return found.pop() if len(found) == 1 else None


def shipped_file(series: str) -> Path:
    """Where the class sets of vLLM ``series`` ship."""
    return SHIPPED_DIR / f"vllm-{series}.json"


def shippable(universe: Universe) -> dict[str, Any]:
    """``universe`` as the JSON a shipped file holds: no machine's paths (the sources
    that key the local cache, the vLLM directory), no extensions."""
    if universe.extensions:
        raise ValueError("the shipped class sets are vLLM's alone: build them without extensions")
    return {**universe.to_json(), "vllm_path": "", "sources": {}}


def shipped_series() -> tuple[str, ...]:
    """The series whose class sets kvspec-traits ships, oldest first."""
    names = [p.stem.removeprefix("vllm-") for p in SHIPPED_DIR.glob("vllm-*.json")]
    return tuple(sorted(names, key=lambda s: tuple(int(n) for n in s.split("."))))


def shipped_universe(series: str) -> Universe:
    """The shipped class sets of vLLM ``series`` (``"0.34"``, or a version of it).
    Raises :class:`ClassSetsUnavailableError` naming the shipped series otherwise."""
    series = vllm_series(series)
    data = read_json(shipped_file(series)) if series in shipped_series() else None
    if not isinstance(data, dict):
        raise ClassSetsUnavailableError(
            f"--vllm {series}: kvspec-traits ships the class sets of vLLM "
            f"{', '.join(shipped_series())}; for another series pass --classes FILE, saved "
            "with --save-classes where that vLLM is installed"
        )
    try:
        return Universe.from_json(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ClassSetsUnavailableError(
            f"the shipped class sets of vLLM {series} ({shipped_file(series)}) do not "
            f"load ({exc}); reinstall kvspec-traits"
        ) from exc
