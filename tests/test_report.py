"""The main job, `kvspec-traits report`, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import vllm

from kvspec_traits._cli import _table, main
from kvspec_traits.catalog import refused_specs, representative_specs
from tests import fresh


def _run(*args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    # A fresh process, as a user runs it: classes the test modules define stay out of it.
    env = dict(os.environ)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return fresh.run([sys.executable, "-m", "kvspec_traits", *args], timeout=300, env=env)


@pytest.fixture(scope="module")
def report() -> str:
    proc = _run("report", columns=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout


def test_report_covers_every_class_and_exits_zero(report: str) -> None:
    out = report
    assert f"17/17 spec classes of vLLM {vllm.__version__} covered" in out
    assert out.rstrip().endswith("OK")
    # the in-repo extension is loaded through its entry point and has its own adapter
    assert "kvspec_traits_example.ScaledLatentSpec" in out


def test_report_shows_every_class_name_and_example_whole_at_any_terminal_width(report: str) -> None:
    lines = report.splitlines()
    header = lines[1]
    example_col, mla_col = header.index("example"), header.index("mla")
    for entry in (*representative_specs(), *refused_specs()):
        name, label = type(entry.spec).__qualname__, entry.label
        row = [
            line
            for line in lines
            if line.startswith(f"{name} ") and line[example_col:].startswith(f"{label} ")
        ]
        assert row, f"no row with the whole class name {name!r} and example {label!r}"
        # Columns sized to their content: the example column starts after the longest
        # class name, and the next one after the longest example.
        assert re.match(r"(yes|no) ", row[0][mla_col:]) or "refused" in row[0], row[0]
    assert example_col == 1 + max(
        len(type(e.spec).__qualname__) for e in (*representative_specs(), *refused_specs())
    )
    # The terminal's width changes nothing (neither cut nor wrapped).
    narrow = _run("report", columns=20)
    assert narrow.returncode == 0, narrow.stderr[-2000:]
    assert narrow.stdout == report


def test_table_columns_fit_their_widest_cell_and_a_failure_runs_on() -> None:
    failure = "TraitsMismatchError: " + "x" * 120
    lines = _table(
        ["class", "example", "mla", "page B"],
        [
            ["ChunkedLocalAttentionSpec", "Llama-4", "no", "65536"],
            ["A", "a rather long example label", "yes", "8"],
            ["Broken", "some example", failure],
        ],
        right=frozenset({3}),
    )
    assert lines == [
        "class                     example                     mla page B",
        "-" * 64,
        "ChunkedLocalAttentionSpec Llama-4                     no   65536",
        "A                         a rather long example label yes      8",
        f"Broken                    some example                {failure}",
    ]


def test_report_json_has_every_trait_of_every_row() -> None:
    proc = _run("report", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["ok"] is True and data["classes_not_covered"] == []
    rows = {r["label"]: r for r in data["rows"]}
    swa = rows["DeepSeek-V4 SWA-MLA compressor state"]["traits"]
    assert (swa["is_mla"], swa["tp_layout"], swa["token_scope"]) == (
        True,
        "replicated",
        "sliding_window",
    )
    assert rows["abstract KVCacheSpec"]["status"] == "refused as required"
    assert rows["DeepSeek-V4 compressed MLA (ratio 4)"]["traits"]["per_token_bytes"] == 146


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib
    from pathlib import Path

    from kvspec_traits import __version__

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert __version__ == project["project"]["version"]
    proc = _run("--version")  # as a user runs it
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"kvspec-traits {__version__}\n", "")
    with pytest.raises(SystemExit) as done:
        main(["audit", "--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"kvspec-traits {__version__}\n"


def test_no_command_prints_help_and_exits_2() -> None:
    assert main([]) == 2


def test_an_extension_that_does_not_load_is_one_sentence_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvspec_traits import AdapterPluginError, _cli

    def broken(registry: object = None) -> None:
        raise AdapterPluginError("example", "entry point 'example' failed to import: boom")

    monkeypatch.setattr(_cli, "_collect", broken)
    assert main(["report"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "kvspec-traits report: entry point 'example' failed to import: boom\n"
