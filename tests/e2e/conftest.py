"""The server tests import their harness as ``tests.e2e.pd_harness`` (the name mypy
gives it), so the repository root must be importable. The patched vLLM tree the patched
pairs serve is built once per session (writing the patch runs migrate and vLLM's fixers:
tens of seconds a time on a loaded machine), never once per pair."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.e2e.patched_vllm import PatchedTree

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def patched_kv_transfer(tmp_path_factory: pytest.TempPathFactory) -> PatchedTree:
    """The installed vLLM's kv_transfer with ``make vllm-patch``'s patch applied, shared
    by every patched pair: each server only reads it."""
    from tests.e2e.patched_vllm import patched_tree

    return patched_tree(tmp_path_factory.mktemp("patched-vllm"))
