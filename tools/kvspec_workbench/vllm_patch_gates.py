"""vLLM's own gates on the files ``make vllm-patch`` changes: ruff check, ruff format and mypy
as vLLM's pre-commit runs them (vLLM's ``pyproject.toml`` settings; mypy as
``tools/pre_commit/mypy.py`` calls it for files under ``vllm/``), on the release's files and
on the patched ones, and the findings the patch adds.

    python -m kvspec_workbench.vllm_patch_gates [--keep DIR]      # make vllm-patch-gates VLLM=0.34

The vLLM is the one ``import vllm`` finds, as for ``vllm_patch.py``; its
``pyproject.toml`` comes from the release's sdist (fetched by bootstrap). A finding is
compared by file, rule and message (line numbers move with the patch): "new" is a finding the
patched file has more often than the release's. Exit status 1 when the patch adds any.
The ruff and mypy are this project's pinned versions, for both sides, so a difference is
the patch's, never a tool's. A repository tool, not part of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvspec_traits.migrate import MigrationPlan
from kvspec_workbench.vllm_patch import vllm_patch, vllm_pyproject, vllm_root, vllm_version


@dataclass(frozen=True, order=True)
class Finding:
    """One tool's complaint about one file, without its line (which the patch moves)."""

    tool: str
    path: str
    rule: str
    message: str

    def show(self) -> str:
        return f"{self.tool} {self.path}: {self.rule} {self.message}"


def build_tree(dest: Path, root: Path, pyproject: str, patch: Path | None) -> None:
    """vLLM's package (the release's, or patched) with its ``pyproject.toml`` under ``dest``."""
    shutil.copytree(
        root / "vllm", dest / "vllm", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    (dest / "pyproject.toml").write_text(pyproject)
    if patch is not None:
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.parent)}
        subprocess.run(
            ["git", "apply", "--include=vllm/*", str(patch)], check=True, cwd=dest, env=env
        )


def ruff_findings(tree: Path, files: list[str]) -> list[Finding]:
    """``ruff check`` and ``ruff format --check`` with vLLM's settings, no fixes."""
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-fix", "--output-format", "json", *files],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    found = [
        Finding("ruff", os.path.relpath(d["filename"], tree), d["code"] or "", d["message"])
        for d in json.loads(check.stdout or "[]")
    ]
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *files],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in fmt.stdout.splitlines():
        if line.startswith("Would reformat: "):
            found.append(Finding("ruff-format", line.removeprefix("Would reformat: "), "", ""))
    return found


_MYPY_LINE = re.compile(
    r"^(?P<path>[^:]+):\d+:(?:\d+:)? error: (?P<msg>.*?)(?:  \[(?P<code>[a-z-]+)\])?$"
)


def mypy_findings(tree: Path, files: list[str], cache: Path) -> list[Finding]:
    """mypy as vLLM's ``tools/pre_commit/mypy.py`` runs it on files under ``vllm/``."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-version",
            "3.11",
            "--cache-dir",
            str(cache),
            "--no-error-summary",
            "--show-column-numbers",
            *files,
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    found = []
    for line in run.stdout.splitlines():
        m = _MYPY_LINE.match(line)
        if m is not None:
            found.append(Finding("mypy", m["path"], m["code"] or "", m["msg"]))
    if run.returncode not in (0, 1) or (run.returncode == 1 and not found):
        raise SystemExit(f"vllm-patch-gates: mypy failed:\n{run.stdout}\n{run.stderr}")
    return found


def write_files(dest: Path, texts: dict[str, str], pyproject: str) -> None:
    """Only ``texts`` (with their packages' ``__init__.py``) and vLLM's ``pyproject.toml``:
    all ruff needs to judge them as in vLLM's tree."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "pyproject.toml").write_text(pyproject)
    for rel, text in texts.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
        for parent in Path(rel).parents:
            if parent != Path(".") and not (dest / parent / "__init__.py").exists():
                (dest / parent / "__init__.py").touch()


def ruff_gate(plan: MigrationPlan, version: str) -> tuple[list[Finding], list[Finding]]:
    """vLLM's ruff (check and format) on the release's and the patched files: the findings
    on each side."""
    pyproject = vllm_pyproject(version)
    sides = []
    with tempfile.TemporaryDirectory(prefix="vllm-ruff-gate-") as tmp:
        for side in ("release", "patched"):
            tree = Path(tmp) / side
            texts = {f.display: f.before if side == "release" else f.after for f in plan.files}
            write_files(tree, texts, pyproject)
            sides.append(ruff_findings(tree, sorted(texts)))
    return sides[0], sides[1]


def new_findings(before: list[Finding], after: list[Finding]) -> list[Finding]:
    """The findings ``after`` has more often than ``before``."""
    extra = Counter(after) - Counter(before)
    return sorted(extra.elements())


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--keep", type=Path, help="build the two trees here and keep them")
    p.add_argument("--no-mypy", action="store_true", help="ruff only")
    args = p.parse_args()
    root = vllm_root()
    version = vllm_version(root).split("+", 1)[0]
    text, plan = vllm_patch(root)
    work = args.keep or Path(tempfile.mkdtemp(prefix="vllm-gates-"))
    work.mkdir(parents=True, exist_ok=True)
    patch = work / "vllm.patch"
    patch.write_text(text)
    files = sorted(str(Path(f.path).resolve().relative_to(root.resolve())) for f in plan.files)
    pyproject = vllm_pyproject(version)
    results: dict[str, list[Finding]] = {}
    for side, patched in (("release", None), ("patched", patch)):
        tree = work / side
        if tree.exists():
            shutil.rmtree(tree)
        build_tree(tree, root, pyproject, patched)
        found = ruff_findings(tree, files)
        if not args.no_mypy:
            found += mypy_findings(tree, files, work / "mypy-cache")
        results[side] = found
    new = new_findings(results["release"], results["patched"])
    print(
        f"vllm-patch-gates: vLLM {version}, {len(files)} files changed by the patch: "
        f"{len(results['release'])} findings on the release's files, "
        f"{len(results['patched'])} on the patched ones, {len(new)} new"
    )
    for f in new:
        print(f"  new: {f.show()}")
    if args.keep is None:
        shutil.rmtree(work)
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
