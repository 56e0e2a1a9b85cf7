"""Fixtures of the server tests: the tiny models, built once per session into .cache/."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The tests import the harness as tests.e2e.pd_harness (how mypy names it too).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    """``.cache/models`` with every tiny model built (seconds the first time, then a
    stamp check): the recipes are in scripts/make_tiny_models.py."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    spec = importlib.util.spec_from_file_location("make_tiny_models",
                                                  REPO / "scripts" / "make_tiny_models.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("scripts/make_tiny_models.py is missing")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = REPO / ".cache" / "models"
    for recipe in module.MODELS.values():
        module.build_model(recipe, out)
    return out
