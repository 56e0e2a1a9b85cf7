"""Where the audit's class sets are cached, and the key that says which cache file holds
the class sets of this vLLM, this kvspec-traits and these extensions.

Nothing here imports vLLM or the library's adapters: the key is computed from paths,
package metadata and file stats only.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Final

from kvspec_traits._registry import ENTRY_POINT_GROUP

__all__ = [
    "PACKAGE_ROOT",
    "cache_file",
    "default_cache_dir",
    "file_stat",
    "installed_extensions",
    "installed_vllm_dir",
    "library_sources",
    "library_stamp",
    "read_json",
    "write_json",
]

_CACHE_ENV: Final = "KVSPEC_TRAITS_CACHE_DIR"
PACKAGE_ROOT: Final = Path(__file__).resolve().parent.parent
"""The ``kvspec_traits`` package directory whose sources key the cache."""


def default_cache_dir() -> Path:
    """``$KVSPEC_TRAITS_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvspec-traits``, else
    ``~/.cache/kvspec-traits``."""
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvspec-traits"


def installed_vllm_dir() -> Path | None:
    """The directory of the ``vllm`` package Python would import (``PYTHONPATH`` first),
    found without importing it; ``None`` when there is none."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def installed_extensions() -> tuple[str, ...]:
    """The installed packages publishing adapters in the ``kvspec_traits.adapters``
    entry-point group, as sorted ``"name version"`` strings, read from their metadata
    (nothing is imported)."""
    found = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        found.add(f"{dist.name} {dist.version}" if dist is not None else f"{ep.value} ?")
    return tuple(sorted(found))


def file_stat(path: str) -> tuple[int, int] | None:
    """``(mtime_ns, size)`` of a file, ``None`` when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def library_sources(root: Path = PACKAGE_ROOT) -> Iterator[Path]:
    """Every Python source file of the package under ``root``, at any depth, sorted.

    The class sets depend on the traits, the registry, the adapters, the catalog and the
    audit's questions, and on whatever those import; rather than name those modules (a
    list a new or moved module would silently leave stale), every source file counts: a
    change anywhere in the package only costs one rebuild."""
    found = [
        p
        for p in root.rglob("*.py")
        if "__pycache__" not in p.relative_to(root).parts and p.is_file()
    ]
    yield from sorted(found)


def library_stamp(root: Path = PACKAGE_ROOT) -> str:
    """A digest of the package's source files under ``root``: their paths relative to it
    (a module added, removed or moved changes it) and their stats (an edit changes it)."""
    h = hashlib.sha256()
    for path in library_sources(root):
        rel = path.relative_to(root).as_posix()
        h.update(f"{rel}:{file_stat(str(path))}\n".encode())
    return h.hexdigest()[:16]


def cache_file(
    cache_dir: Path, vdir: Path | None, extensions: tuple[str, ...], *, root: Path = PACKAGE_ROOT
) -> Path:
    """The cache file for this vLLM directory, this library's sources and these installed
    extensions (installing, upgrading or removing one changes the key: its classes are in
    the sets)."""
    stamp = library_stamp(root)
    key = hashlib.sha256(f"{vdir}|{root}|{stamp}|{';'.join(extensions)}".encode()).hexdigest()
    return cache_dir / f"audit-classes-{key[:16]}.json"


def read_json(path: Path) -> Any:
    """The JSON in ``path``, ``None`` when it is missing or damaged (it is rebuilt)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` atomically; an unwritable cache only costs the next run the vLLM
    import."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".audit-classes-")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
