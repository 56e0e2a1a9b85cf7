"""kvspec-traits' workbench: the repository's tools that build vLLM's patch and judge vLLM's
suites (README.md beside this file lists them). Not part of the kvspec-traits distribution:
it reaches into this checkout (``.cache/``, ``docs/``, the stored outcomes) and is run from
it with ``tools`` on ``PYTHONPATH`` (``python -m kvspec_workbench.<tool>``), as the Makefile
and scripts/test.sh do.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["REPO"]

# The checkout the tools work on: this package lies at .
REPO = Path(__file__).resolve().parents[2]
