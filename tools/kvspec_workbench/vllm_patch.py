"""Write the migrated ``distributed/kv_transfer`` of the vLLM on the path as a patch against
vLLM's own source tree: what a vLLM maintainer would read.

    python -m kvspec_workbench.vllm_patch [-o FILE]      # make vllm-patch VLLM=0.34

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
import ast
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from kvspec_traits.audit import load_universe
from kvspec_traits.migrate import MigrationPlan, plan_migration
from kvspec_workbench import REPO
from kvspec_workbench.conformance.fixture_corrections import WHY, Correction, fixture_diff
from kvspec_workbench.hand_edits import HandEdit, apply_hand_edits
from kvspec_workbench.patch_answers import answers_that_change, probe_changes

KV_TRANSFER = Path("vllm") / "distributed" / "kv_transfer"
SDISTS = Path(os.environ.get("KVSPEC_CACHE", Path.home() / ".cache" / "kvspec-traits")) / "sdists"


def vllm_pyproject(version: str) -> str:
    """vLLM ``version``'s own ``pyproject.toml`` (its ruff and mypy settings), read from the
    release's sdist (bootstrap fetches it for the tests tree)."""
    sdist = SDISTS / f"vllm-{version.split('+', 1)[0]}.tar.gz"
    if not sdist.is_file():
        raise SystemExit(f"vllm-patch: no sdist at {sdist}: run scripts/bootstrap.sh")
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/pyproject.toml")
        if member is None:
            raise SystemExit(f"vllm-patch: {sdist} has no pyproject.toml")
        return member.read().decode()


def precommit(texts: dict[str, str], version: str) -> dict[str, str]:
    """``texts`` (path under the vLLM root -> source) after vLLM's own pre-commit fixers:
    ``ruff check --fix`` and ``ruff format`` with the release's ``pyproject.toml``, as a
    contributor's commit runs them. They drop the spec-class imports a rewrite left unused,
    sort the ``kvspec_traits`` import among the third-party ones and wrap the lines a query
    made longer than vLLM's 88 columns. This project's pinned ruff runs them; see
    ``unchanged_by_precommit`` for why its version cannot add churn of its own."""
    with tempfile.TemporaryDirectory(prefix="vllm-precommit-") as tmp:
        root = Path(tmp)
        (root / "pyproject.toml").write_text(vllm_pyproject(version))
        for rel, text in texts.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
            # Packages, as in vLLM's tree: isort tells first-party `vllm` by them.
            for parent in Path(rel).parents:
                if parent != Path(".") and not (root / parent / "__init__.py").exists():
                    (root / parent / "__init__.py").touch()
        files = sorted(texts)
        ruff = [sys.executable, "-m", "ruff"]
        # Exit 1 = findings left that have no fix: the gates (vllm_patch_gates.py) report them.
        subprocess.run(
            [*ruff, "check", "--fix", "--quiet", "--no-cache", *files],
            cwd=root,
            check=False,
            capture_output=True,
        )
        subprocess.run([*ruff, "format", "--quiet", "--no-cache", *files], cwd=root, check=True)
        return {rel: (root / rel).read_text() for rel in files}


def unchanged_by_precommit(texts: dict[str, str], version: str) -> None:
    """Refuse when the fixers would change a release file as vLLM shipped it: then this
    ruff and vLLM's disagree, and the patch would carry edits that are not the migration's."""
    changed = [rel for rel, text in precommit(texts, version).items() if text != texts[rel]]
    if changed:
        raise SystemExit(
            f"vllm-patch: vLLM {version}'s pre-commit (ruff with its pyproject.toml) would "
            f"change these release files as shipped: {changed}. The project's ruff differs "
            "from vLLM's: pin the version vLLM's .pre-commit-config.yaml names."
        )


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


def header(plan: MigrationPlan, version: str, hand: list[HandEdit]) -> str:
    """The patch's summary: rewritten per connector, by hand, left by reason, misses
    fixed."""
    rewritten: Counter[str] = Counter()
    for f in plan.files:
        rewritten[_connector(f.display)] += len(f.edits)
    left: dict[str, list[str]] = defaultdict(list)
    for s in plan.skips:
        display = Path(s.path).as_posix()
        where = display[display.index(KV_TRANSFER.as_posix()) :]
        left[s.reason.partition(" (")[0].partition(":")[0]].append(f"{where}:{s.line}: {s.text}")
    misses = [e for e in plan.edits if e.fixes_miss]
    by_hand = sum(len(h.sites) for h in hand)
    share = (len(plan.edits) + by_hand) / plan.sites if plan.sites else 1.0
    lines = [
        f"kvspec-traits: vLLM {version} distributed/kv_transfer, branches on KV cache spec "
        "classes rewritten into traits queries (kvspec-traits migrate)",
        "",
        f"{plan.sites} spec-class sites; {len(plan.edits) + by_hand} rewritten "
        f"({100 * share:.0f}%: {len(plan.edits)} by migrate, {by_hand} by {len(hand)} hand "
        f"edits) in {len(plan.files)} files; {len(misses)} "
        f"{'miss' if len(misses) == 1 else 'misses'} fixed; {len(plan.skips)} left.",
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
    if not left:
        lines.append("  none: every site asks traits")
    for reason, sites in sorted(left.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"  {reason} ({len(sites)}):")
        lines.extend(f"    {w}" for w in sites)
    lines += hand_header(hand)
    lines += answers_header(plan)
    lines += per_file_header(plan)
    return "".join(f"# {line}".rstrip() + "\n" for line in lines) + "\n"


def hand_header(hand: list[HandEdit]) -> list[str]:
    """Each hand edit (hand_edits.py): its file, the sites it rewrites, why no
    migrate rule does, and every catalog spec on which its query answers otherwise."""
    if not hand:
        return []
    lines = [
        "",
        f"Rewritten by hand ({len(hand)} edits, {sum(len(h.sites) for h in hand)} sites; "
        "no migrate rule fits every series; tools/kvspec_workbench/hand_edits.py):",
    ]
    for h in hand:
        sites = "; ".join(h.sites) or "no site of its own"
        lines.append(f"  {KV_TRANSFER.as_posix()}/{h.path}: {sites}")
        lines.append(f"    why: {h.reason}")
        for before, after, singles, groups in probe_changes(h.probes):
            lines.append(f"    answers otherwise: {before} -> {after}")
            if singles:
                lines.append(f"      differs on {', '.join(singles)}")
            if groups:
                lines.append(
                    f"      differs on a UniformTypeKVCacheSpecs of {', '.join(groups)}: "
                    "the class check asked the wrapper, the query asks its members"
                )
    return lines


def answers_header(plan: MigrationPlan) -> list[str]:
    """Every rewritten check whose answer changes on a spec of the catalog or on a group
    wrapper of one, with those specs (patch_answers.py)."""
    changes, unevaluated = answers_that_change(plan.edits)
    lines = [
        "",
        f"Answers that change ({len(changes)} of {len(plan.edits)} rewritten checks; each "
        "check and its query evaluated on the catalog's spec of every class and on a "
        f"two-layer UniformTypeKVCacheSpecs of each; {unevaluated} asked a kind computed "
        "earlier, not evaluated alone):",
    ]
    for change in changes:
        lines.extend(f"  {line}" for line in change.lines())
    return lines


def _spec_imports(text: str) -> set[str]:
    """The names a module imports from ``vllm.v1.kv_cache_interface``."""
    return {
        alias.asname or alias.name
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ImportFrom) and node.module == "vllm.v1.kv_cache_interface"
        for alias in node.names
    }


def per_file_header(plan: MigrationPlan) -> list[str]:
    """Per file: the checks rewritten by trait, the spec-class imports the rewrite left
    unused (dropped by vLLM's own ruff), and ``traits_of`` asked once per spec."""
    lines = ["", "Per file:"]
    for f in plan.files:
        where = f.display[f.display.index(KV_TRANSFER.as_posix()) :]
        traits = Counter(e.trait for e in f.edits)
        asked = ", ".join(f"{t} {n}" for t, n in sorted(traits.items()))
        lines.append(f"  {where}: {len(f.edits)} checks -> traits ({asked})")
        dropped = sorted(_spec_imports(f.before) - _spec_imports(f.after))
        if dropped:
            lines.append(f"    imports no longer used, dropped: {', '.join(dropped)}")
        hoisted = f.after.count("_traits = traits_of(")
        if hoisted:
            lines.append(
                f"    {hoisted} spec(s) asked once per function (`<name>_traits = traits_of(...)`)"
            )
    if plan.repeated_traits:
        lines.append(
            f"  {plan.repeated_traits} subject(s) still asked more than once in one expression "
            "(a comprehension or lambda binds it: no statement to ask it once before)"
        )
    return lines


def vllm_patch(root: Path, *, code_only: bool = False) -> tuple[str, MigrationPlan]:
    """The patch text for the tree at ``root`` and the plan it shows (each file's ``after``
    is its text after vLLM's pre-commit fixers). ``code_only``: without the release's
    test-fixture corrections (the e2e servers import the code alone)."""
    cwd = Path.cwd()
    version = vllm_version(root)
    os.chdir(root)  # the plan names files relative to the working folder
    try:
        plan = plan_migration([KV_TRANSFER], load_universe())
        if plan.refused:
            raise SystemExit(f"vllm-patch: files refused: {[r.as_json() for r in plan.refused]}")
        # Applied before vLLM's pre-commit fixers, which then format them like the rest.
        plan, hand = apply_hand_edits(plan, root / KV_TRANSFER, version)
    finally:
        os.chdir(cwd)
    unchanged_by_precommit({f.display: f.before for f in plan.files}, version)
    hooked = precommit({f.display: f.after for f in plan.files}, version)
    plan.files = [dataclasses.replace(f, after=hooked[f.display]) for f in plan.files]
    body = "".join(f.diff() for f in plan.files)
    tests = None if code_only else release_tests(version)
    fixes, corrections = fixture_diff(tests) if tests is not None else ("", [])
    head = header(plan, version, hand)
    extra = "".join(f"# {line}".rstrip() + "\n" for line in fixtures_header(corrections))
    if extra:
        head = head.rstrip("\n") + "\n" + extra + "\n"
    return head + body + fixes, plan


def write_tree(root: Path, plan: MigrationPlan, dest: Path) -> None:
    """A copy of the release's kv_transfer at ``dest`` with the patched files' text."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(root / KV_TRANSFER, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for f in plan.files:
        rel = Path(f.display).relative_to(KV_TRANSFER)
        (dest / rel).write_text(f.after)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("-o", "--output", type=Path, help="write the patch here (default: stdout)")
    p.add_argument(
        "--tree",
        type=Path,
        help="also write the patched kv_transfer to TREE/kv_transfer (a copy of the "
        "release's with the patched files) and its summary as JSON on stdout: the tree "
        "`make conformance-migrated` runs vLLM's tests on",
    )
    p.add_argument(
        "--code-only",
        action="store_true",
        help="leave out the corrections of the release's test fixtures (the code alone)",
    )
    args = p.parse_args()
    root = vllm_root()
    text, plan = vllm_patch(root, code_only=args.code_only)
    if args.tree:
        write_tree(root, plan, args.tree / "kv_transfer")
        json.dump({"edits": [e.as_json() for e in plan.edits], "sites": plan.sites}, sys.stdout)
        if not args.output:
            return 0
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(
            f"vllm-patch: {args.output}: {plan.sites - len(plan.skips)} of {plan.sites} sites "
            "rewritten in "
            f"{len(plan.files)} files (vLLM {vllm_version(root)} at {root}); apply with "
            f"`git apply {args.output}` in a vLLM checkout of that release"
        )
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
