"""The main job, `kvspec-traits report`, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import vllm

from kvspec_traits._cli import main


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # A fresh process, as a user runs it: classes the test modules define stay out of it.
    return subprocess.run([sys.executable, "-m", "kvspec_traits", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_report_covers_every_class_and_exits_zero() -> None:
    proc = _run("report")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert f"17/17 spec classes of vLLM {vllm.__version__} covered" in out
    assert out.rstrip().endswith("OK")
    assert max(len(line) for line in out.splitlines()) <= 100
    # the in-repo extension is loaded through its entry point and has its own adapter
    assert "kvspec_traits_example.ScaledLatentSpec" in out


def test_report_json_has_every_trait_of_every_row() -> None:
    proc = _run("report", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["ok"] is True and data["classes_not_covered"] == []
    rows = {r["label"]: r for r in data["rows"]}
    swa = rows["DeepSeek-V4 SWA-MLA compressor state"]["traits"]
    assert (swa["is_mla"], swa["tp_layout"], swa["token_scope"]) == (
        True, "replicated", "sliding_window")
    assert rows["abstract KVCacheSpec"]["status"] == "refused as required"
    assert rows["DeepSeek-V4 compressed MLA (ratio 4)"]["traits"]["per_token_bytes"] == 146


def test_no_command_prints_help_and_exits_2() -> None:
    assert main([]) == 2
