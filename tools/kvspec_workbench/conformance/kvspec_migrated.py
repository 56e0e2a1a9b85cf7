"""Pytest plugin: import ``vllm.distributed.kv_transfer`` from a migrated copy.

Loaded with ``-p kvspec_workbench.conformance.kvspec_migrated`` before any other plugin
(tools/ on ``PYTHONPATH``); ``KVSPEC_MIGRATED_ROOT`` is the folder holding the migrated
``kv_transfer/`` (``python -m kvspec_workbench.migrate_kv_transfer --out``). A meta-path
finder answers for the package itself, so its submodules load from the copy through its
``__path__``. At the end
of the session the plugin writes, to ``KVSPEC_MIGRATED_PROOF``, the file the package was
imported from (the proof that the copy was the one tested).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

PACKAGE = "vllm.distributed.kv_transfer"
ROOT = os.environ.get("KVSPEC_MIGRATED_ROOT", "")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [ROOT])


if ROOT:
    if PACKAGE in sys.modules:
        raise SystemExit(f"{PACKAGE} was imported before kvspec_migrated could redirect it")
    sys.meta_path.insert(0, _Finder())


def pytest_sessionfinish(session: pytest.Session) -> None:
    proof = os.environ.get("KVSPEC_MIGRATED_PROOF")
    if not proof:
        return
    module = sys.modules.get(PACKAGE)
    Path(proof).write_text(
        json.dumps(
            {
                "root": ROOT,
                "imported_from": getattr(module, "__file__", None),
                "migrated": bool(ROOT) and str(getattr(module, "__file__", "")).startswith(ROOT),
            }
        )
    )
