"""vLLM's own NIXL connector unit tests on the migrated kv_transfer tree, against the
same tests on the installed (unmigrated) tree, on the installed vLLM (0.32 series).

    run_migrated.py MIGRATED_ROOT   # the folder holding kv_transfer/ (migrate_kv_transfer.py --out)

Both runs use upstream's classes (the conformance plugin's ``upstream`` subject); the
migrated run loads ``vllm.distributed.kv_transfer`` from the copy (kvspec_migrated.py) and
proves it did. ``KVSPEC_CONFORMANCE_FILES`` (space-separated names) narrows the files as
for run.py. Prints passed/run per file for both, and every test whose outcome differs.
Exit status: 0 when no test that passes unmigrated fails migrated, 1 otherwise, 2 when a run
produced no report or the copy was not the one imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import REPO, pytest_command, shards  # noqa: E402

RUNS = ("unmigrated", "migrated")


def main() -> int:
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "kv_transfer").is_dir():
        raise SystemExit("usage: run_migrated.py MIGRATED_ROOT (holding kv_transfer/)")
    root = str(Path(sys.argv[1]).resolve())
    tests_root = REPO / ".cache" / "vllm-tests-0.32.0"
    out_dir = REPO / ".cache" / "conformance" / "migrated"
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [f for s in shards(1) for f in s]
    procs = []
    for run in RUNS:
        report, proof = out_dir / f"{run}.json", out_dir / f"{run}-proof.json"
        report.unlink(missing_ok=True)
        proof.unlink(missing_ok=True)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(HERE), str(REPO / "src")]),
            VLLM_TARGET_DEVICE="cpu",
            KVSPEC_EXPECT_VLLM="0.32",
            NIXL_LOG_LEVEL="WARN",
            KVSPEC_CONFORMANCE_SUBJECT="upstream",
            KVSPEC_CONFORMANCE_REPORT=str(report),
            KVSPEC_MIGRATED_PROOF=str(proof),
            KVSPEC_MIGRATED_ROOT=root if run == "migrated" else "",
        )
        cmd = pytest_command(
            str(REPO / ".venv" / "bin" / "python"), tests_root, files, ("kvspec_migrated",)
        )
        log = (out_dir / f"{run}.log").open("wb")
        procs.append(
            (
                run,
                subprocess.Popen(
                    cmd, cwd=tests_root, env=env, stdout=log, stderr=subprocess.STDOUT
                ),
                report,
                proof,
            )
        )
    outcomes: dict[str, dict[str, str]] = {}
    for run, proc, report, proof in procs:
        rc = proc.wait()
        print(f"== {run}: pytest exit {rc} (log {out_dir / f'{run}.log'})")
        if not report.exists():
            print(f"!! {run} produced no report")
            return 2
        outcomes[run] = json.loads(report.read_text())["outcomes"]
        if run == "migrated" and not json.loads(proof.read_text())["migrated"]:
            print(f"!! the migrated copy was not imported: {proof.read_text()}")
            return 2
    names = " ".join(Path(f).name for f in files)
    for run in RUNS:
        c = Counter(outcomes[run].values())
        print(f"{run:>10}: {c['passed']}/{sum(c.values())} passed ({names})")
    differ = sorted(
        k
        for k in outcomes["unmigrated"].keys() | outcomes["migrated"].keys()
        if outcomes["unmigrated"].get(k) != outcomes["migrated"].get(k)
    )
    for k in differ:
        print(f"  differs: {k}: {outcomes['unmigrated'].get(k)} -> {outcomes['migrated'].get(k)}")
    lost = [k for k in differ if outcomes["unmigrated"].get(k) == "passed"]
    print(f"passed unmigrated, not migrated: {len(lost)}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
