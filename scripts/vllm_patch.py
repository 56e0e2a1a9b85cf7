"""Write the migrated ``distributed/kv_transfer`` of the vLLM on the path as a patch against
vLLM's own source tree: what a vLLM maintainer would read.

    scripts/vllm_patch.py [-o FILE]      # make vllm-patch VLLM=0.34

The vLLM is the one ``import vllm`` finds (``make vllm-patch VLLM=0.34`` puts the 0.34.0
modules first on the path); it is read, never imported. The patch's paths are relative to
the root that holds the ``vllm/`` package (``a/vllm/distributed/kv_transfer/...``), so
``git apply --check`` takes it in a vLLM checkout of that release. Its header (text before
the first ``---``, which ``git apply`` and ``patch`` skip) summarises the sites rewritten per
connector, the sites left with their reasons, and the misses fixed. Nothing in the tree is
written. A repository tool, not part of the package.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

from kvspec_traits.audit import load_universe
from kvspec_traits.migrate import MigrationPlan, plan_migration

sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance"))
from fixture_corrections import WHY, Correction, fixture_diff

KV_TRANSFER = Path("vllm") / "distributed" / "kv_transfer"
REPO = Path(__file__).resolve().parents[1]


def release_tests(version: str) -> Path | None:
    """The tests tree of vLLM ``version``'s sdist (fetched by bootstrap), if here."""
    tree = REPO / ".cache" / f"vllm-tests-{version.split('+', 1)[0]}"
    return tree.resolve() if (tree / "tests").is_dir() else None


def fixtures_header(corrections: list[Correction]) -> list[str]:
    """The header's list of test-fixture corrections, by rule with its reason."""
    if not corrections:
        return []
    lines = [
        "",
        f"Test fixtures corrected ({len(corrections)}), so that vLLM's own kv_connector "
        "tests pass on the patched tree:",
    ]
    rules = Counter(c.rule for c in corrections)
    for rule, count in rules.most_common():
        lines.append(f"  {rule} ({count}): {WHY[rule]}")
        lines.extend(
            f"    {c.path}:{c.line}: {c.before} -> {c.after}" for c in corrections if c.rule == rule
        )
    return lines


def vllm_root() -> Path:
    """The folder holding the ``vllm`` package that ``import vllm`` would load."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm-patch: no vLLM on the path (make vllm-patch VLLM=0.34)")
    return Path(next(iter(spec.submodule_search_locations))).parent


def vllm_version(root: Path) -> str:
    """The release of the tree at ``root`` (its ``vllm/_version.py``), without importing it."""
    version_file = root / "vllm" / "_version.py"
    text = version_file.read_text() if version_file.exists() else ""
    found = re.search(r"^__version__ = (?:version = )?['\"]([^'\"]+)['\"]", text, flags=re.M)
    return found.group(1) if found else "unknown"


def _connector(display: str) -> str:
    """The connector a file belongs to: its folder under kv_connector/v1, else its module."""
    parts = Path(display).relative_to(KV_TRANSFER).parts
    if parts[:2] == ("kv_connector", "v1") and len(parts) > 2:
        return Path(parts[2]).stem
    return Path(*parts).with_suffix("").as_posix()


def header(plan: MigrationPlan, version: str) -> str:
    """The patch's summary: rewritten per connector, left by reason, misses fixed."""
    rewritten: Counter[str] = Counter()
    for f in plan.files:
        rewritten[_connector(f.display)] += len(f.edits)
    left: dict[str, list[str]] = defaultdict(list)
    for s in plan.skips:
        display = Path(s.path).as_posix()
        where = display[display.index(KV_TRANSFER.as_posix()) :]
        left[s.reason.partition(" (")[0].partition(":")[0]].append(f"{where}:{s.line}: {s.text}")
    misses = [e for e in plan.edits if e.fixes_miss]
    share = len(plan.edits) / plan.sites if plan.sites else 1.0
    lines = [
        f"kvspec-traits: vLLM {version} distributed/kv_transfer, branches on KV cache spec "
        "classes rewritten into traits queries (kvspec-traits migrate)",
        "",
        f"{plan.sites} spec-class sites; {len(plan.edits)} rewritten ({100 * share:.0f}%) in "
        f"{len(plan.files)} files; {len(misses)} {'miss' if len(misses) == 1 else 'misses'} "
        f"fixed; {len(plan.skips)} left.",
        "",
        "Rewritten, per connector:",
        *(f"  {name:40} {count}" for name, count in sorted(rewritten.items())),
        "",
        "Misses fixed (the original class check leaves out a class of the same layout):",
        *(
            f"  {e.path}:{e.line}: {e.before} -> {e.after} (left out: {', '.join(e.missing)})"
            for e in misses
        ),
        "",
        "Left, by reason:",
    ]
    for reason, where in sorted(left.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"  {reason} ({len(where)}):")
        lines.extend(f"    {w}" for w in where)
    return "".join(f"# {line}".rstrip() + "\n" for line in lines) + "\n"


def vllm_patch(root: Path) -> tuple[str, MigrationPlan]:
    """The patch text for the tree at ``root`` and the plan it shows."""
    cwd = Path.cwd()
    os.chdir(root)  # the plan names files relative to the working folder
    try:
        plan = plan_migration([KV_TRANSFER], load_universe())
    finally:
        os.chdir(cwd)
    if plan.refused:
        raise SystemExit(f"vllm-patch: files refused: {[r.as_json() for r in plan.refused]}")
    body = "".join(f.diff() for f in plan.files)
    version = vllm_version(root)
    tests = release_tests(version)
    fixes, corrections = fixture_diff(tests) if tests is not None else ("", [])
    head = header(plan, version)
    extra = "".join(f"# {line}".rstrip() + "\n" for line in fixtures_header(corrections))
    if extra:
        head = head.rstrip("\n") + "\n" + extra + "\n"
    return head + body + fixes, plan


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("-o", "--output", type=Path, help="write the patch here (default: stdout)")
    args = p.parse_args()
    root = vllm_root()
    text, plan = vllm_patch(root)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(
            f"vllm-patch: {args.output}: {len(plan.edits)} of {plan.sites} sites rewritten in "
            f"{len(plan.files)} files (vLLM {vllm_version(root)} at {root}); apply with "
            f"`git apply {args.output}` in a vLLM checkout of that release"
        )
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
