"""The server tests import their harness as ``tests.e2e.pd_harness`` (the name mypy
gives it), so the repository root must be importable."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
