"""Finding, reading and parsing the files to scan, without ever stopping on a bad one.

A folder is scanned with all its subfolders, walked with a stack of its own rather than
by recursion (deep trees cannot exhaust Python's stack); symlinked folders are followed
and each folder is visited once (a symlink loop ends there), and a file that cannot be
read or parsed becomes a :class:`FileError` while the scan goes on.
"""

from __future__ import annotations

import ast
import errno
import fnmatch
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "SKIPPED_DIRS",
    "FileError",
    "iter_source_files",
    "module_name",
    "not_a_file_or_folder",
    "parse_source",
    "read_source",
]

DEFAULT_MAX_FILE_BYTES: Final = 8 * 1024 * 1024
SKIPPED_DIRS: Final = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        ".venv",
        "venv",
        "node_modules",
        ".tox",
        ".nox",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        ".eggs",
    }
)
"""Folder names never descended into below a target (a target itself is always read)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FileError:
    """A target the audit could not read or parse, and why."""

    path: str
    error: str


def _excluded(path: Path, patterns: Sequence[str]) -> bool:
    text = path.as_posix()
    return any(fnmatch.fnmatch(path.name, p) or fnmatch.fnmatch(text, p) for p in patterns)


@dataclass(slots=True)
class _Walk:
    """One walk over the targets: the files and folders seen so far (by device and inode,
    so a file or folder reached twice is yielded or read once) and the errors met."""

    exclude: Sequence[str]
    errors: list[FileError]
    seen_dirs: set[tuple[int, int]] = field(default_factory=set)
    seen_files: set[tuple[int, int]] = field(default_factory=set)

    def _fail(self, path: Path, exc: OSError) -> None:
        self.errors.append(FileError(path=str(path), error=_os_error(exc, path)))

    def _first_time(self, st: os.stat_result) -> bool:
        key = (st.st_dev, st.st_ino)
        if key in self.seen_files:
            return False
        self.seen_files.add(key)
        return True

    def target(self, target: Path) -> Iterator[Path]:
        try:
            st = target.stat()
        except OSError as exc:
            self._fail(target, exc)
            return
        if stat.S_ISDIR(st.st_mode):
            yield from self._tree(target)
            return
        problem = not_a_file_or_folder(st.st_mode)
        if problem is not None:
            # A FIFO would block the read forever, a device (/dev/zero) never end.
            self.errors.append(FileError(path=str(target), error=problem))
        elif self._first_time(st):
            yield target

    def _tree(self, top: Path) -> Iterator[Path]:
        # Depth first, in name order, with a stack of its own (no recursion).
        stack = [top]
        while stack:
            subdirs: list[Path] = []
            for entry in self._entries(stack.pop()):
                path = self._entry(entry, subdirs)
                if path is not None:
                    yield path
            stack.extend(reversed(subdirs))

    def _entries(self, folder: Path) -> list[os.DirEntry[str]]:
        # A folder's entries in name order; none when it was read already (a symlink
        # loop, or a folder reached twice) or cannot be read.
        try:
            fst = folder.stat()
        except OSError as exc:
            self._fail(folder, exc)
            return []
        key = (fst.st_dev, fst.st_ino)
        if key in self.seen_dirs:
            return []
        self.seen_dirs.add(key)
        try:
            with os.scandir(folder) as it:
                return sorted(it, key=lambda e: e.name)
        except OSError as exc:
            self._fail(folder, exc)
            return []

    def _entry(self, entry: os.DirEntry[str], subdirs: list[Path]) -> Path | None:
        # A file to yield, or None; a folder to descend into goes to ``subdirs``.
        path = Path(entry.path)
        if _excluded(path, self.exclude):
            return None
        try:
            is_dir = entry.is_dir()  # follows symlinks
            is_file = entry.is_file()
        except OSError as exc:
            self._fail(path, exc)
            return None
        if is_dir:
            if entry.name not in SKIPPED_DIRS:
                subdirs.append(path)
        elif is_file:
            if entry.name.endswith(".py"):
                return self._new_file(entry, path)
        elif entry.is_symlink() and entry.name.endswith(".py"):
            self.errors.append(
                FileError(path=str(path), error="broken symlink (its target does not exist)")
            )
        return None

    def _new_file(self, entry: os.DirEntry[str], path: Path) -> Path | None:
        try:
            st = entry.stat()
        except OSError as exc:
            self._fail(path, exc)
            return None
        return path if self._first_time(st) else None


def iter_source_files(
    targets: Sequence[Path], *, exclude: Sequence[str], errors: list[FileError]
) -> Iterator[Path]:
    """Every file to scan: each target file itself, and the ``*.py`` files below each
    target folder (skipping :data:`SKIPPED_DIRS` and names or paths matching
    ``exclude``). Problems go to ``errors``; nothing raises."""
    walk = _Walk(exclude=exclude, errors=errors)
    for target in targets:
        yield from walk.target(target)


def not_a_file_or_folder(mode: int) -> str | None:
    """Why a path of this ``st_mode`` is neither a regular file nor a folder (a FIFO, a
    socket, a device: reading one may block forever or never end), or None."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = (
        "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    return f"{kind}, not a source file or folder"


def _os_error(exc: OSError, path: Path) -> str:
    del path  # the caller reports it
    if isinstance(exc, FileNotFoundError):
        return "no such file or folder"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if exc.errno == errno.ELOOP:
        return "symlink loop"
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def read_source(path: Path, *, max_bytes: int) -> bytes | FileError:
    """The file's bytes, or why they are not Python source to scan."""
    try:
        st = path.stat()
        problem = not_a_file_or_folder(st.st_mode)
        if problem is not None:
            return FileError(path=str(path), error=problem)
        size = st.st_size
        if size > max_bytes:
            return FileError(
                path=str(path),
                error=f"{size} bytes, over the {max_bytes}-byte limit "
                f"(raise it with --max-file-bytes)",
            )
        data = path.read_bytes()
    except OSError as exc:
        return FileError(path=str(path), error=_os_error(exc, path))
    if b"\0" in data:
        return FileError(
            path=str(path), error="binary file (contains NUL bytes), not Python source"
        )
    return data


def parse_source(data: bytes, path: Path) -> ast.Module | FileError:
    """The syntax tree, or the parse error with its line."""
    try:
        return ast.parse(data, filename=str(path))
    except SyntaxError as exc:
        where = f"line {exc.lineno}: " if exc.lineno else ""
        return FileError(path=str(path), error=f"cannot parse: {where}{exc.msg}")
    except (ValueError, UnicodeDecodeError) as exc:
        return FileError(path=str(path), error=f"cannot decode: {exc}")
    except (RecursionError, MemoryError):
        return FileError(path=str(path), error="cannot parse: nested too deeply")


def module_name(path: Path, cache: dict[Path, str] | None = None) -> tuple[str, bool]:
    """The dotted module name of a source file, from the ``__init__.py`` files above it,
    and whether it is a package's ``__init__``."""
    folder = path.parent
    package = _package_of(folder, {} if cache is None else cache)
    stem = path.name.rsplit(".", 1)[0]
    if stem == "__init__":
        return package or stem, True
    return (f"{package}.{stem}" if package else stem), False


def _package_of(folder: Path, cache: dict[Path, str]) -> str:
    chain: list[Path] = []
    current = folder
    result = ""
    while True:
        if current in cache:
            result = cache[current]
            break
        if not (current / "__init__.py").is_file() or current.parent == current:
            break
        chain.append(current)
        current = current.parent
    # `result` is the package of `current` ("" when it is not a package).
    for part in reversed(chain):
        result = f"{result}.{part.name}" if result else part.name
        cache[part] = result
    if not chain:
        cache.setdefault(folder, result)
    return result
