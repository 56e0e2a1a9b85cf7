"""The class-set cache key follows the library's sources, whatever modules it has.

The key used to name a fixed list of core files: a module added to the package (an adapter
split off ``_vllm_adapters.py``) or moved left a stale cache answering with the old
adapters. These tests work on a copy of the package, so nothing of the real tree is
touched and nothing imports vLLM.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvspec_traits.audit._cache import PACKAGE_ROOT, cache_file, library_sources, library_stamp


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "kvspec_traits"
    shutil.copytree(PACKAGE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_every_source_file_of_the_package_counts() -> None:
    found = {p.relative_to(PACKAGE_ROOT).as_posix() for p in library_sources()}
    # Modules the old hand-written list left out, at the top and in subpackages.
    assert {"_errors.py", "_deps.py", "__init__.py", "audit/_cache.py"} <= found
    assert found == {
        p.relative_to(PACKAGE_ROOT).as_posix()
        for p in PACKAGE_ROOT.rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_a_new_module_changes_the_key(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    before = library_stamp(root)
    assert library_stamp(root) == before  # stable while nothing changes
    (root / "_new_adapters.py").write_text("X = 1\n")
    assert library_stamp(root) != before
    sub = root / "adapters"
    sub.mkdir()
    with_top = library_stamp(root)
    (sub / "__init__.py").write_text("")
    assert library_stamp(root) != with_top  # a new subpackage too


def test_a_moved_module_changes_the_key(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    target = root / "core" / "_group.py"
    target.parent.mkdir()
    source = root / "_group.py"
    st = source.stat()
    before = library_stamp(root)
    shutil.move(source, target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # same content, same stat
    assert library_stamp(root) != before


def test_an_edit_anywhere_in_the_package_changes_the_cache_file(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    cache = tmp_path / "cache"
    before = cache_file(cache, None, (), root=root)
    # a module no list of "core files" would name: the package's consumer-facing catalog
    edited = root / "catalog.py"
    edited.write_text(edited.read_text() + "\n# edited\n")
    assert cache_file(cache, None, (), root=root) != before
    assert cache_file(cache, None, ("ext 1.0",), root=root) != cache_file(
        cache, None, (), root=root
    )
