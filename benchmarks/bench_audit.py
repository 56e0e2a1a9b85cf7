"""``kvspec-traits audit`` over the whole installed vLLM against a plain parse of it.

The baseline, measured in the same run, reads and ``ast.parse``-s every ``*.py`` file of the
installed vLLM package: any audit that looks at every file's syntax pays at least that. The
audit parses only files that name a spec class and walks only the lines that do, so the
target is a ratio of at most ``TARGET``. Also printed: the whole command in a fresh process
with the class sets cached (what a pre-commit hook pays), and the one-off class-set build
(imports vLLM). Run: ``.venv/bin/python benchmarks/bench_audit.py`` (add
``PYTHONPATH=.cache/vllm-0.33.0`` for the 0.33 modules).
"""

from __future__ import annotations

import ast
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._results

from benchmarks._results import run as record_run
from kvspec_traits.audit import audit_paths, load_universe
from kvspec_traits.audit._universe import installed_vllm_dir

TARGET = 0.5


def _best(fn: Callable[[], object], repeat: int) -> float:
    # CPU seconds of this process, best of `repeat`: on a shared 2-core machine other
    # processes stretch wall time by several x, but barely touch our own CPU time.
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _parse_all(files: list[Path]) -> None:
    for path in files:
        with contextlib.suppress(SyntaxError, ValueError):
            ast.parse(path.read_bytes())


def _command(args: list[str], env: dict[str, str]) -> float:
    # CPU seconds of one `kvspec-traits audit` process, interpreter start-up included.
    start = _children_cpu()
    subprocess.run(
        [sys.executable, "-m", "kvspec_traits.audit", *args],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        timeout=600,
    )
    return _children_cpu() - start


def main() -> int:
    root = installed_vllm_dir()
    if root is None:
        print("no vLLM on sys.path", file=sys.stderr)
        return 2
    files = sorted(root.rglob("*.py"))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, KVSPEC_TRAITS_CACHE_DIR=cache)
        build = _command(["--show-classes"], env)  # cold: imports vLLM, fills the cache
        universe = load_universe(cache_dir=Path(cache))
        result = audit_paths([root], universe)
        audit = _best(lambda: audit_paths([root], universe), repeat=3)
        baseline = _best(lambda: _parse_all(files), repeat=2)
        command = min(_command(["--installed-vllm", "-o", os.devnull], env) for _ in range(2))
    ratio = audit / baseline
    print(
        f"vLLM {universe.vllm_version} at {root}: {len(files)} files, "
        f"{result.files_parsed} parsed by the audit, {len(result.sites)} sites"
    )
    print(f"{'measurement (CPU seconds, best of 2-3)':<58} {'seconds':>8} {'x baseline':>11}")
    rows = [
        ("baseline: read + ast.parse every file", baseline),
        ("audit_paths(whole vLLM), class sets loaded", audit),
        ("kvspec-traits audit --installed-vllm (fresh process)", command),
        ("class-set build on a cold cache (imports vLLM, once)", build),
    ]
    for name, seconds in rows:
        print(f"{name:<58} {seconds:>8.2f} {seconds / baseline:>11.2f}")
    verdict = "OK" if ratio <= TARGET else "SLOWER THAN TARGET"
    print(f"audit / baseline = {ratio:.2f} (target <= {TARGET}): {verdict}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(record_run("bench_audit", main))
