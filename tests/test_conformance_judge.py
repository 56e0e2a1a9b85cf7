"""The judge of the migrated kv_transfer (kvspec_workbench.conformance.run_migrated,
issue 20): which of vLLM's test files it runs, where it keeps their unmigrated outcomes, and
when it fails.

Everything here works on small trees written under tmp_path (a tests tree and a migrated
kv_transfer with the shapes vLLM's have) and on the real expected_differences.toml; nothing
imports vLLM or torch (a series-independent module).
"""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import kvspec_workbench.conformance

CONFORMANCE = Path(kvspec_workbench.conformance.__file__).parent
UNIT = "tests/v1/kv_connector/unit"
KVT = "vllm.distributed.kv_transfer"


def _load(name: str) -> ModuleType:
    """A module of the workbench's conformance judges (its ``name`` there)."""
    return importlib.import_module(f"kvspec_workbench.conformance.{name}")


@pytest.fixture(scope="module")
def judge() -> ModuleType:
    return _load("run_migrated")


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def tests_root(tmp_path: Path) -> Path:
    """A tests tree whose files import the migrated module ``nixl.worker`` in each way a
    vLLM test does, or import only ``factory`` (a kv_transfer module that imports it)."""
    root = tmp_path / "vllm-tests"
    _write(
        root,
        {
            f"{UNIT}/test_any.py": "def test_a(): pass\n",
            f"{UNIT}/offloading_connector/test_config.py": "def test_b(): pass\n",
            f"{UNIT}/test_config.py": "def test_c(): pass\n",
            "tests/v1/core/test_direct.py": f"from {KVT}.nixl.worker import W\n",
            "tests/v1/core/test_in_body.py": f"def test_x():\n    from {KVT}.nixl import worker\n",
            "tests/v1/core/utils.py": f"import {KVT}.nixl.worker\n",
            "tests/v1/core/test_via_helper.py": "from .utils import F\n",
            "tests/v1/core/test_via_tests.py": "from tests.v1.core.utils import F\n",
            "tests/v1/core/test_via_factory.py": f"from {KVT}.factory import F\n",
            "tests/v1/core/test_unrelated.py": "import torch\n",
        },
    )
    return root


def test_every_unit_file_and_the_tests_that_import_a_migrated_module(
    judge: ModuleType, tests_root: Path
) -> None:
    """The whole unit folder (its subfolders too, and two files of one name), then the
    files outside it that import the migrated module by name, at the top or inside a
    test's body. Not a file that imports another kv_transfer module (vLLM's
    ``kv_connector/v1/__init__.py`` imports a migrated module), nor one whose test helper
    does (the unit suite's ``utils.py`` imports NIXL's worker) unless helpers are asked
    for: either would take in every test that touches the scheduler."""
    unit = {
        f"{UNIT}/offloading_connector/test_config.py": "unit",
        f"{UNIT}/test_any.py": "unit",
        f"{UNIT}/test_config.py": "unit",
    }
    direct = {
        "tests/v1/core/test_direct.py": f"{KVT}.nixl.worker",
        "tests/v1/core/test_in_body.py": f"{KVT}.nixl.worker",
    }
    graph = judge.ImportGraph(tests_root, {f"{KVT}.nixl.worker"})
    assert judge.find_files(graph) == {**unit, **direct}
    graph = judge.ImportGraph(tests_root, {f"{KVT}.nixl.worker"}, helpers=True)
    assert judge.find_files(graph) == {
        **unit,
        **direct,
        "tests/v1/core/test_via_helper.py": f"tests.v1.core.utils -> {KVT}.nixl.worker",
        "tests/v1/core/test_via_tests.py": f"tests.v1.core.utils -> {KVT}.nixl.worker",
    }


def test_the_migrated_modules_are_the_changed_files(judge: ModuleType, tmp_path: Path) -> None:
    before, after = tmp_path / "a", tmp_path / "b"
    same = {"__init__.py": "", "kv_connector/v1/base.py": "x = 1\n"}
    _write(before, {**same, "kv_connector/v1/nixl/__init__.py": "a = 1\n"})
    _write(after, {**same, "kv_connector/v1/nixl/__init__.py": "a = 2\n", "new.py": ""})
    assert judge.migrated_modules(before, after) == {
        f"{KVT}.kv_connector.v1.nixl",
        f"{KVT}.new",
    }


def test_the_unmigrated_outcomes_share_run_pys_cache(tests_root: Path) -> None:
    """One cache: a NIXL file run.py names by its name and the judge by its path has one
    entry; two files of one name in different folders have two; a file outside the unit
    folder is keyed by its own folder's helpers too (an edit there reruns it)."""
    run = _load("run")
    root = tests_root
    files = [
        "test_any.py",
        f"{UNIT}/test_any.py",
        f"{UNIT}/test_config.py",
        f"{UNIT}/offloading_connector/test_config.py",
        "tests/v1/core/test_via_helper.py",
    ]
    keys = run.upstream_cache("0.32", root, files)
    assert keys["test_any.py"] == keys[f"{UNIT}/test_any.py"]
    assert keys["test_any.py"].name.startswith("test_any.py-")
    assert keys[f"{UNIT}/offloading_connector/test_config.py"].name.startswith(
        "offloading_connector--test_config.py-"
    )
    assert len({keys[f] for f in files}) == 4
    (root / "tests/v1/core/utils.py").write_text("changed = True\n")
    again = run.upstream_cache("0.32", root, files)
    assert again["tests/v1/core/test_via_helper.py"] != keys["tests/v1/core/test_via_helper.py"]
    assert again[f"{UNIT}/test_any.py"] == keys[f"{UNIT}/test_any.py"]


def _outcomes(judge: ModuleType, outcomes: dict[str, str], reasons: dict[str, str]) -> object:
    result = judge.Outcomes()
    collected = {f"{UNIT}/test_any.py": len(outcomes)}
    result.add({"outcomes": outcomes, "collected": collected, "reasons": reasons})
    return result


def test_the_verdict_fails_on_a_lost_test_unless_listed_with_a_proof(
    judge: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lost (passes unmigrated, not migrated) and unlisted: 1. Listed by a pattern whose
    refusal the failure says, with a proof test that exists under tests/: 0. The same entry
    for a failure that says something else: 1 (an entry never covers another failure).
    Listed with a proof that does not exist: 1. An entry none of whose tests is lost
    (stale): 1. A test that only gets better is shown, not failed."""
    files = {f"{UNIT}/test_any.py": "unit"}
    a, b, c = (f"{UNIT}/test_any.py::test_{n}" for n in "abc")
    refusal = "InvalidSpecError: FullAttentionSpec.dtype=None"
    before = _outcomes(judge, {a: "passed", b: "passed", c: "failed"}, {c: "AssertionError"})
    after = _outcomes(judge, {a: "passed", b: "failed", c: "passed"}, {b: f"x.{refusal} ..."})
    proof = "tests/test_conformance_judge.py::test_every_proof_of_the_migrated_list_exists"
    entry = {"kind": "migrated", "proof": proof, "refusal": refusal}
    assert judge.verdict("0.34", files, before, after, {}) == 1
    assert "[LOST] " + b in capsys.readouterr().out
    pattern = f"{UNIT}/test_any.py::test_[b]"
    assert judge.verdict("0.34", files, before, after, {pattern: entry}) == 0
    out = capsys.readouterr().out
    assert f"[differs] {c}: failed -> passed" in out
    assert f"[listed] 1 tests of {pattern}" in out
    assert f"{'test_any.py':56}      3      2      2      2      1" in out
    other = {**entry, "refusal": "InvalidSpecError: MambaSpec.dtypes"}
    assert judge.verdict("0.34", files, before, after, {pattern: other}) == 1
    missing = {**entry, "proof": "tests/x::y"}
    assert judge.verdict("0.34", files, before, after, {pattern: missing}) == 1
    assert judge.verdict("0.34", files, before, after, {pattern: entry, a: entry}) == 1
    assert "listed but not lost" in capsys.readouterr().out


def test_every_proof_of_the_migrated_list_exists(judge: ModuleType) -> None:
    """The ``[[migrated]]`` list is empty (issue 35: a patch a maintainer could take
    leaves no test of vLLM's suite lost; the invalid fixtures it met are corrected in the
    patch, kvspec_workbench.conformance.fixture_corrections). An entry added again must name a
    test of ours that exists and have every field the runners read; ``proof_exists``
    tells an existing proof from an absent one."""
    data = tomllib.loads((CONFORMANCE / "expected_differences.toml").read_text())
    assert data.get("migrated", []) == []
    run = _load("run")
    assert judge.proof_exists(
        "tests/test_fixture_corrections.py::test_a_rule_anchored_twice_is_refused"
    )
    assert {"test", "series", "unmigrated", "migrated", "why", "proof"} <= run.KINDS["migrated"]
    assert not judge.proof_exists("tests/test_conformance_judge.py::test_absent")
    assert not judge.proof_exists("tools/kvspec_workbench/conformance/run.py::main")


def test_a_crashed_file_is_not_complete(judge: ModuleType) -> None:
    """The judge reruns, one by one, the files of a process that died: a file is complete
    when every test collected has an outcome, or when it could not be collected."""
    result = judge.Outcomes()
    result.add(
        {
            "outcomes": {f"{UNIT}/test_any.py::test_a": "passed"},
            "collected": {f"{UNIT}/test_any.py": 2, f"{UNIT}/test_config.py": 1},
            "uncollected": {f"{UNIT}/test_x.py": "failed: ModuleNotFoundError: mooncake"},
        }
    )
    assert not result.complete(f"{UNIT}/test_any.py")
    assert not result.complete(f"{UNIT}/test_config.py")
    assert result.complete(f"{UNIT}/test_x.py")
    assert judge.why_not(f"{UNIT}/test_x.py", result).startswith(
        "not collected: failed: ModuleNotFoundError"
    )
    json.dumps(vars(result))  # what the cache keeps is JSON
