"""Pytest plugin of the conformance pass: vLLM's own NIXL connector tests, run against
upstream's classes or against ``TraitsNixlConnector`` bound in their place.

Loaded with ``-p kvspec_workbench.conformance.kvspec_conformance`` (tools/ on ``PYTHONPATH``).
Environment:

- ``KVSPEC_CONFORMANCE_SUBJECT``: ``upstream`` (vLLM's classes, untouched) or ``traits``
  (every NIXL connector, worker and scheduler class vLLM defines, pull and push:
  ``NixlConnector``/``NixlPullConnector``, ``NixlPushConnector``, their workers and their
  schedulers (``NixlConnectorScheduler`` too), rebound to ours in every
  module of vLLM's ``nixl`` package before any test module is imported, so ``from ...
  import NixlConnector`` and the tests' fake-wrapper subclasses get ours, and the
  factory's ``"NixlConnector"`` loads ours).
- ``KVSPEC_CONFORMANCE_REPORT``: where to write the JSON outcome of every test.

The binding is proved after collection: every collected test module that holds one of
those names must hold ours (else the session stops with exit code 3), and the factory
must resolve ``"NixlConnector"`` to ours. The report records the modules checked and how
many traits workers and schedulers (pull or push) the tests of each file constructed: a
file whose tests build them with ``object.__new__`` only runs upstream's methods on our
classes and constructs none, which run.py's table says. (vLLM's base classes,
``NixlBaseConnector``/``NixlBaseConnectorWorker``/``NixlBaseConnectorScheduler``, are
ours' bases, never built alone, and stay.) It also records, per test file, how many tests
were collected and why a file was not (an import error, a module-level skip), and per test
that did not pass, why (the skip's reason, the failure's message): run_migrated.py's table
says why a file cannot run on this machine.

Stubs, only for what cannot exist on a CPU machine without a network: ``ray`` (when not
installed) and the hub's model configs (``config.json`` of the few models the tests name,
served from a local hub cache with ``HF_HUB_OFFLINE=1``). One shim, for vLLM's Mooncake
connector tests alone (``test_mooncake_connector*.py``, whichever subject): vLLM's
``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()``,
which raises on a CPU-only torch ("Cannot access accelerator device when none is
available"); while such a test runs, and only when torch has no accelerator, it answers
0, the index of the one device a CPU process has (``_cpu_device_index``), and is put back
after the test. Nothing else is replaced.

Speed, the same for both subjects: vLLM's autouse cleanup runs a full ``gc.collect()`` after
every test (twice where a test also uses ``dist_init``), which walks the whole heap: the
import-time heap (vLLM, torch, transformers: ~650k objects, 0.4-1.3 s a test) and whatever
the tests before left reachable. After collection the plugin moves that heap into the
permanent generation (``gc.freeze()``), and after each cleanup's collection it freezes what
survived it, so each cleanup walks only what the test just allocated. The cleanup's
``gc.unfreeze()`` is kept as vLLM wrote it whenever anything else froze objects since (an
engine core calls ``gc.freeze()`` after start-up). Measured on vLLM 0.32's
test_nixl_connector.py (178 tests, quiet machine): the collections took 32 s of a 138 s run
with only the import heap frozen.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SUBJECT = os.environ.get("KVSPEC_CONFORMANCE_SUBJECT", "upstream")
if SUBJECT not in ("upstream", "traits"):
    raise SystemExit(f"KVSPEC_CONFORMANCE_SUBJECT must be upstream or traits, not {SUBJECT!r}")
REBOUND = {
    "NixlConnector": "TraitsNixlConnector",
    "NixlPullConnector": "TraitsNixlConnector",
    "NixlConnectorWorker": "TraitsNixlConnectorWorker",
    "NixlPullConnectorWorker": "TraitsNixlConnectorWorker",
    "NixlPushConnector": "TraitsNixlPushConnector",
    "NixlPushConnectorWorker": "TraitsNixlPushConnectorWorker",
    "NixlConnectorScheduler": "TraitsNixlConnectorScheduler",
    "NixlPullConnectorScheduler": "TraitsNixlConnectorScheduler",
    "NixlPushConnectorScheduler": "TraitsNixlPushConnectorScheduler",
}
# Where each of ours is defined (the upstream subject must not import them, so by name).
OURS_MODULE = {
    "TraitsNixlConnector": "kvspec_traits.vllm_connector._connector",
    "TraitsNixlConnectorWorker": "kvspec_traits.vllm_connector._connector",
    "TraitsNixlPushConnector": "kvspec_traits.vllm_connector._push",
    "TraitsNixlPushConnectorWorker": "kvspec_traits.vllm_connector._push",
    "TraitsNixlConnectorScheduler": "kvspec_traits.vllm_connector._scheduler",
    "TraitsNixlPushConnectorScheduler": "kvspec_traits.vllm_connector._scheduler",
}
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def _hub_cache() -> Path:
    """A Hugging Face hub cache holding only the stored config.json files."""
    root = Path(tempfile.mkdtemp(prefix="kvspec-conformance-hub-"))
    revision = "0" * 40
    for config in sorted((HERE / "hub").glob("*.json")):
        repo = root / f"models--{config.stem}"
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_bytes(config.read_bytes())
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return root


# At import (before vLLM's conftest imports huggingface_hub, which reads these once).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(_hub_cache())
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_outcomes: dict[str, str] = {}
# Per test file: how many tests were collected, or why it was not ("failed: ..." for an
# import error, "skipped: ..." for a module-level skip); per test that did not pass: why (a
# skip's reason, a failure's one-line message).
_collected: dict[str, int] = {}
_uncollected: dict[str, str] = {}
_reasons: dict[str, str] = {}
_binding: dict[str, Any] = {"subject": SUBJECT}
_constructed = [0]
# Traits workers constructed per test file (the file of the test running at the time).
_constructed_by_file: dict[str, int] = {}
_current_file = ["(collection)"]
# Traits schedulers (pull or push) constructed per test file.
_schedulers_by_file: dict[str, int] = {}


def _rebind() -> None:
    import importlib
    import pkgutil

    from kvspec_traits.vllm_connector import _connector, _scheduler

    package = importlib.import_module(NIXL_PACKAGE)
    modules = [package] + [
        importlib.import_module(f"{NIXL_PACKAGE}.{info.name}")
        for info in pkgutil.iter_modules(package.__path__)
    ]
    rebound: list[str] = []
    for module in modules:
        for name, replacement in REBOUND.items():
            if name in vars(module):
                ours = importlib.import_module(OURS_MODULE[replacement])
                setattr(module, name, getattr(ours, replacement))
                rebound.append(f"{module.__name__}.{name}")
    # Both workers (pull and push) run TraitsWorkerBase.__init__ once per construction.
    init = _connector.TraitsWorkerBase.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _constructed[0] += 1
        _constructed_by_file[_current_file[0]] = _constructed_by_file.get(_current_file[0], 0) + 1
        init(self, *args, **kwargs)

    _connector.TraitsWorkerBase.__init__ = counting_init  # type: ignore[method-assign]
    # Both schedulers likewise (TraitsSchedulerBase.__init__), counted apart.
    scheduler_init = _scheduler.TraitsSchedulerBase.__init__

    def counting_scheduler_init(self: Any, *args: Any, **kwargs: Any) -> None:
        key = _current_file[0]
        _schedulers_by_file[key] = _schedulers_by_file.get(key, 0) + 1
        scheduler_init(self, *args, **kwargs)

    _scheduler.TraitsSchedulerBase.__init__ = counting_scheduler_init  # type: ignore[method-assign]
    _binding["rebound"] = rebound


def _lift_the_model_runners_triton_check() -> None:
    """vLLM 0.34's CPU platform refuses every config on x86 without triton-cpu
    (``check_and_update_config``: "vLLM on x86 CPUs requires Triton (triton-cpu)"), a
    need of its model runner. triton-cpu is not on PyPI, and the NIXL tests run no model,
    so the check reads True while a config is checked, and only there, for both subjects
    alike. On 0.32/0.33 (no such check) this changes nothing."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if triton_utils.HAS_TRITON:
        return
    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def lifted(cls: Any, vllm_config: Any) -> None:
        triton_utils.HAS_TRITON = True
        try:
            check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    CpuPlatform.check_and_update_config = classmethod(lifted)  # type: ignore[method-assign, assignment]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for CPU-runnable tests")
    _lift_the_model_runners_triton_check()
    if SUBJECT == "traits":
        _rebind()


class _Ours:
    """Stands for one of our classes by its qualified name, so the upstream subject never
    imports our connector module (importing it rebinds base_worker.NixlAgentMetadata,
    which would change what upstream's own handshake decodes)."""

    def __init__(self, replacement: str) -> None:
        self.qualname = f"{OURS_MODULE[replacement]}.{replacement}"

    def matches(self, value: object) -> bool:
        return (
            f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
            == self.qualname
        )


def _test_modules_bound(
    items: list[pytest.Item], expected: dict[str, _Ours]
) -> tuple[dict[str, list[str]], list[str]]:
    """Per collected test module, the rebound names it holds; and each such name that is
    not the subject's class (ours for ``traits``, upstream's for ``upstream``)."""
    checked: dict[str, list[str]] = {}
    wrong: list[str] = []
    seen: set[str] = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        for name, ours_cls in expected.items():
            if name not in vars(module):
                continue
            checked.setdefault(module.__name__, []).append(name)
            is_ours = ours_cls.matches(vars(module)[name])
            if is_ours != (SUBJECT == "traits"):
                wrong.append(f"{module.__name__}.{name} = {vars(module)[name]!r}")
    return checked, wrong


def pytest_collection_finish(session: pytest.Session) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for item in session.items:  # what will run (after any deselection)
        test_file = _upstream_id(item.nodeid).split("::", 1)[0]
        _collected[test_file] = _collected.get(test_file, 0) + 1
    expected = {name: _Ours(replacement) for name, replacement in REBOUND.items()}
    if SUBJECT == "upstream" and set(OURS_MODULE.values()) & set(sys.modules):
        pytest.exit(
            "conformance binding (upstream): kvspec_traits' connector module was "
            "imported, so upstream's run is not upstream's alone",
            returncode=3,
        )
    checked, wrong = _test_modules_bound(session.items, expected)
    for qualified in _binding.get("rebound", []):
        module_name, _, name = qualified.rpartition(".")
        if not expected[name].matches(getattr(sys.modules[module_name], name)):
            wrong.append(f"{qualified} was rebound and changed back")
    for connector in ("NixlConnector", "NixlPushConnector"):
        factory_cls = KVConnectorFactory.get_connector_class_by_name(connector)
        if expected[connector].matches(factory_cls) != (SUBJECT == "traits"):
            wrong.append(f"KVConnectorFactory {connector!r} = {factory_cls!r}")
        _binding[f"factory_{connector}"] = f"{factory_cls.__module__}.{factory_cls.__qualname__}"
    _binding["modules_checked"] = checked
    if wrong:
        pytest.exit(f"conformance binding ({SUBJECT}) did not take: {wrong}", returncode=3)
    _freeze_the_import_heap()


class _GcWithTheImportHeapFrozen:
    """``gc`` as vLLM's ``parallel_state`` sees it: ``unfreeze()`` leaves the frozen heap
    frozen, unless something else froze objects since (then it unfreezes everything, exactly
    as vLLM's cleanup does); ``collect()`` collects as vLLM asks, then freezes what survived;
    every other name is ``gc``'s own."""

    def __init__(self, frozen: int) -> None:
        self._frozen = frozen

    def unfreeze(self) -> None:
        # The permanent generation shrinks as frozen objects die, and grows only when
        # something calls gc.freeze() again: growth means another freeze, which vLLM's
        # cleanup means to undo, so undo it (and ours with it) as vLLM would.
        if gc.get_freeze_count() > self._frozen:
            gc.unfreeze()

    def collect(self, generation: int = 2) -> int:
        # What survives vLLM's full collection is reachable now, so no later collection
        # could free it while it stays so: frozen, the next cleanup walks only what the
        # next test allocates (objects freed by reference counting are freed as ever).
        found = gc.collect(generation)
        gc.freeze()
        self._frozen = gc.get_freeze_count()
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(gc, name)


def _freeze_the_import_heap() -> None:
    from vllm.distributed import parallel_state

    gc.collect()
    gc.freeze()
    setattr(parallel_state, "gc", _GcWithTheImportHeapFrozen(gc.get_freeze_count()))  # noqa: B010
    _binding["import_heap_frozen"] = gc.get_freeze_count()


# Tests parametrized by the worker class get their id from the class's name: under our
# binding, upstream's id names ours. Reported under upstream's id, so the two runs compare.
_ID_NAMES = {
    "[TraitsNixlConnectorWorker": "[NixlPullConnectorWorker",
    "-TraitsNixlConnectorWorker": "-NixlPullConnectorWorker",
    "[TraitsNixlPushConnectorWorker": "[NixlPushConnectorWorker",
    "-TraitsNixlPushConnectorWorker": "-NixlPushConnectorWorker",
    "[TraitsNixlConnectorScheduler": "[NixlPullConnectorScheduler",
    "-TraitsNixlConnectorScheduler": "-NixlPullConnectorScheduler",
    "[TraitsNixlPushConnectorScheduler": "[NixlPushConnectorScheduler",
    "-TraitsNixlPushConnectorScheduler": "-NixlPushConnectorScheduler",
}


def _upstream_id(nodeid: str) -> str:
    for ours, upstream in _ID_NAMES.items():
        nodeid = nodeid.replace(ours, upstream)
    return nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _current_file[0] = item.nodeid.split("::", 1)[0]


MOONCAKE_TESTS = "test_mooncake_connector*.py"
"""vLLM's test files whose worker needs a device index (the CPU shim's scope)."""


def _cpu_device_index() -> int:
    """``torch.accelerator.current_device_index()`` of a CPU-only process: device 0."""
    return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """vLLM's Mooncake worker tests with the CPU shim (module docstring), set up, run and
    torn down with it; every other test untouched."""
    import fnmatch

    if not fnmatch.fnmatchcase(Path(str(item.path)).name, MOONCAKE_TESTS):
        yield
        return
    import torch

    accelerator = torch.accelerator
    if accelerator.is_available():
        yield
        return
    original = accelerator.current_device_index
    accelerator.current_device_index = _cpu_device_index
    try:
        yield
    finally:
        accelerator.current_device_index = original


def _why(report: pytest.CollectReport | pytest.TestReport) -> str:
    """One line saying why a test was skipped or failed, or a file was not collected."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")[:200]
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0][:200] if crash.message else ""
    lines = [line for line in str(longrepr).splitlines() if line.startswith("E ")]
    return (lines[-1][1:].strip() if lines else str(longrepr).strip()[-200:])[:200]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed or report.skipped:
        _uncollected[report.nodeid] = f"{report.outcome}: {_why(report)}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = _upstream_id(report.nodeid)
    previous = _outcomes.get(nodeid)
    if (report.failed or report.skipped) and nodeid not in _reasons:
        _reasons[nodeid] = _why(report)
    if report.failed:
        _outcomes[nodeid] = "failed"
    elif report.skipped and previous != "failed":
        _outcomes[nodeid] = "skipped"
    elif report.when == "call" and report.passed and previous is None:
        _outcomes[nodeid] = "passed"
    if report.when == "teardown":
        _write_report(partial=True)  # a run stopped early still says what it saw


def _write_report(*, partial: bool) -> None:
    path = os.environ.get("KVSPEC_CONFORMANCE_REPORT")
    # Upstream's run must never load our connector (its import rebinds a base_worker name).
    _binding["ours_imported"] = bool(set(OURS_MODULE.values()) & set(sys.modules))
    _binding["traits_workers_constructed"] = _constructed[0]
    _binding["traits_workers_by_file"] = dict(_constructed_by_file)
    _binding["traits_schedulers_by_file"] = dict(_schedulers_by_file)
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "binding": _binding,
                    "outcomes": _outcomes,
                    "collected": _collected,
                    "uncollected": _uncollected,
                    "reasons": _reasons,
                    "partial": partial,
                },
                indent=1,
                sort_keys=True,
            )
        )
        tmp.replace(path)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    _binding["traits_workers_constructed"] = _constructed[0]
    terminalreporter.write_line(
        f"kvspec conformance: subject={SUBJECT}, "
        f"modules checked={sorted(_binding.get('modules_checked', {}))}, "
        f"factory NixlConnector={_binding.get('factory_NixlConnector')}, "
        f"traits workers constructed={_constructed[0]}"
    )
    _write_report(partial=False)
