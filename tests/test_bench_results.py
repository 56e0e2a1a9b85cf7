"""The result files the benchmarks write (``benchmarks/_results.py``): what each holds,
that a run replaces the last one's, and that a smoke run or a crash leaves it alone. The
docs quote these files instead of carrying dated runs, so what a file says about its run
(commit, machine, load, command, status) is what these tests pin."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import _results

REPO = Path(__file__).resolve().parents[1]


def _main(status: int, text: str) -> int:
    print(text)
    return status


def test_a_run_writes_its_output_with_where_it_came_from(tmp_path: Path) -> None:
    status = _results.run(
        "bench_x", lambda: _main(1, "| a | b |\n|---|---|\n| 1 | 2 |"), root=tmp_path
    )
    assert status == 1  # the benchmark's own status, not the recorder's
    text = (tmp_path / "bench_x.md").read_text()
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert f"- commit: {head}" in text
    assert "- result: FAILED (exit 1)" in text
    assert re.search(r"- machine: \d+ CPUs, .+, (AMX tiles|no AMX tiles)\n", text)
    assert re.search(r"- load average \(1, 5, 15 min\): [\d.]+ [\d.]+ [\d.]+ at the start", text)
    assert "- command: `python " in text
    assert "```text\n| a | b |\n|---|---|\n| 1 | 2 |\n```" in text


def test_the_next_run_replaces_the_file(tmp_path: Path) -> None:
    _results.run("bench_x", lambda: _main(1, "first"), root=tmp_path)
    _results.run("bench_x", lambda: _main(0, "second"), root=tmp_path)
    text = (tmp_path / "bench_x.md").read_text()
    assert "second" in text and "first" not in text
    assert "- result: passed (exit 0)" in text


def test_a_smoke_run_or_a_crash_keeps_the_last_result(tmp_path: Path) -> None:
    _results.run("bench_x", lambda: _main(0, "measured"), root=tmp_path)
    assert _results.run("bench_x", lambda: _main(0, "quick"), record=False, root=tmp_path) == 0

    def crash() -> int:
        print("half a table")
        raise RuntimeError("server died")

    with pytest.raises(RuntimeError):
        _results.run("bench_x", crash, root=tmp_path)
    text = (tmp_path / "bench_x.md").read_text()
    assert "measured" in text and "quick" not in text and "half a table" not in text


def test_a_long_output_keeps_its_head_and_its_verdicts(tmp_path: Path) -> None:
    lines = [f"line {i}" for i in range(1000)]
    _results.write("bench_x", "\n".join(lines), status=0, root=tmp_path)
    kept = (tmp_path / "bench_x.md").read_text().split("```text\n", 1)[1].split("\n```")[0]
    body = kept.splitlines()
    # 100 from the head, the marker, the last 200 (where the verdicts are): 301 lines
    assert len(body) == _results.MAX_LINES + 1
    assert body[: _results.HEAD_LINES] == lines[:100]
    assert body[100] == "... (700 lines left out) ..."
    assert body[101:] == lines[-200:]


def test_the_machine_says_whether_it_has_amx_tiles(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n"
    )
    with_amx = _results.machine(cpuinfo)
    assert (with_amx.model, with_amx.amx) == ("Intel(R) Xeon(R) Platinum 8480+", True)
    cpuinfo.write_text("model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx2\n")
    without = _results.machine(cpuinfo)
    assert (without.model, without.amx) == ("AMD EPYC 7B13", False)
    assert without.describe().endswith("AMD EPYC 7B13, no AMX tiles")


def test_every_benchmark_make_runs_writes_its_result_file() -> None:
    """`make bench`, `make pd-bench` and `make soak` run these scripts; each names its
    result file, so a run leaves ``benchmarks/results/<name>.md`` behind."""
    for name in (
        "bench_traits",
        "bench_audit",
        "bench_nixl",
        "bench_descriptors",
        "bench_mooncake",
        "bench_nixl_progress",
        "pd_bench",
        "soak",
    ):
        source = (REPO / "benchmarks" / f"{name}.py").read_text()
        assert re.search(rf'(record_run|write_result)\(\s*"{name}"', source), name
    # The soak writes one file per transport: soak.md (NIXL) and soak_mooncake.md.
    source = (REPO / "benchmarks" / "soak.py").read_text()
    assert re.search(r'write_result\(\s*"soak_mooncake"', source)
