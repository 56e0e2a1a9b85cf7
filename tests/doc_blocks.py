"""The documentation pages that run as tests (docs/extending.md, docs/connector-guide.md):
their Python blocks, and a mypy strict run of those blocks as one module (or of one
named block, a whole file)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def named_block(text: str, name: str) -> str:
    """The one block fenced ```python file=NAME (a whole file to copy; the page's module
    of plain ```python blocks leaves it out)."""
    (found,) = re.findall(rf"^```python file={re.escape(name)}\n(.*?)^```", text, flags=re.S | re.M)
    return str(found)


def mypy_strict_on_blocks(page: Path, module: Path) -> subprocess.CompletedProcess[str]:
    """``page``'s Python blocks written as ``module`` and type-checked with the project's
    mypy.ini (strict) and cache."""
    module.write_text("\n\n".join(python_blocks(page.read_text())))
    return mypy_strict(module)


def mypy_strict(module: Path) -> subprocess.CompletedProcess[str]:
    """``module`` type-checked with the project's mypy.ini (strict) and cache."""
    return subprocess.run(
        [
            sys.executable,
            *("-m", "mypy", "--config-file", str(REPO / "mypy.ini")),
            *("--cache-dir", str(REPO / ".mypy_cache"), str(module)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=REPO,
    )
