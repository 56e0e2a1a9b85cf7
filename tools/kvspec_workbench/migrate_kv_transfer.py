"""Migrate a copy of the installed vLLM's ``distributed/kv_transfer`` tree and report.

    python -m kvspec_workbench.migrate_kv_transfer [--out DIR] [--seed] [--demo] [--json]

Copies the tree to ``DIR/kv_transfer`` (default: a new temporary folder), runs
``kvspec-traits migrate --write`` on it in-process and prints: the sites rewritten against
all spec-class sites (the target is 90%, issue 20) and against the audit's exact-match
sites (80%), the misses fixed, and every spec-class
branch left with why. ``--seed`` first restores the seed line of NIXL's
``register_kv_caches`` (``is_mla_region = isinstance(layer_spec, MLAAttentionSpec)``, the
line before vLLM added ``SlidingWindowMLASpec``) into the copy. ``--demo`` (``make
migrate-demo``) implies ``--seed`` and shows that line before and after, evaluated on the
catalog's real SlidingWindowMLASpec. The migrated copy is what
``conformance/run_migrated.py`` puts first on the path. A repository tool, not
part of the package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvspec_traits.audit import load_universe
from kvspec_traits.migrate import MigrationPlan, plan_migration, write_plan
from kvspec_workbench.hand_edits import apply_hand_edits

__all__ = ["SEED_FILE", "SEED_LINE", "Measured", "installed_tree", "migrate_copy", "restore_seed"]

SEED_FILE = "kv_connector/v1/nixl/base_worker.py"
SEED_LINE = "is_mla_region = isinstance(layer_spec, MLAAttentionSpec)"
_FIXED_SEED = re.compile(
    r"is_mla_region = isinstance\(\s*layer_spec, \(MLAAttentionSpec, SlidingWindowMLASpec\)\s*\)"
)


def installed_tree() -> Path:
    """The installed vLLM's ``distributed/kv_transfer`` folder (vLLM is not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "distributed" / "kv_transfer"


def _version(vllm_root: Path) -> str:
    """The release of the vLLM tree at ``vllm_root`` (its ``vllm/_version.py``)."""
    found = re.search(
        r"^__version__ = (?:version = )?['\"]([^'\"]+)['\"]",
        (vllm_root / "vllm" / "_version.py").read_text(),
        flags=re.M,
    )
    if found is None:
        raise SystemExit(f"no __version__ in {vllm_root / 'vllm' / '_version.py'}")
    return found.group(1)


def restore_seed(root: Path) -> int:
    """Put the seed line back into ``root``'s NIXL worker (every occurrence of the fixed
    tuple check); returns how many lines were restored."""
    path = root / SEED_FILE
    text, count = _FIXED_SEED.subn(SEED_LINE, path.read_text())
    path.write_text(text)
    return count


@dataclass(frozen=True, slots=True)
class Measured:
    """What one migration of the tree did."""

    root: Path
    plan: MigrationPlan
    exact_sites: int
    exact_rewritten: int
    misses_fixed: int

    @property
    def ratio(self) -> float:
        return self.exact_rewritten / self.exact_sites if self.exact_sites else 1.0

    def as_json(self) -> dict[str, object]:
        return {
            "root": str(self.root),
            "sites": self.plan.sites,
            "rewritten": len(self.plan.edits),
            "exact_sites": self.exact_sites,
            "exact_rewritten": self.exact_rewritten,
            "ratio": round(self.ratio, 3),
            "misses_fixed": self.misses_fixed,
            **self.plan.as_json(),
        }


def migrate_copy(out: Path, *, seed: bool = False, hand_edits: bool = False) -> Measured:
    """Copy the installed tree into ``out``, optionally restore the seed, migrate it with
    ``--write`` (with the patch's hand edits, hand_edits.py, if ``hand_edits``:
    the copy is then the patch's code) and measure."""
    root = out / "kv_transfer"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(installed_tree(), root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if seed and restore_seed(root) == 0:
        raise SystemExit(f"the fixed is_mla_region line is not in {SEED_FILE}")
    plan = plan_migration([root], load_universe())
    if hand_edits:
        plan, _ = apply_hand_edits(plan, root, _version(installed_tree().parents[2]))
    refused = write_plan(plan)
    if refused or plan.refused:
        raise SystemExit(f"refused: {[*plan.refused, *refused]}")
    # An exact-match site: the audit's answer is an exact trait match (edits of misses
    # are near matches, counted apart).
    exact_edits = sum(1 for e in plan.edits if e.match == "exact")
    exact_left = sum(1 for s in plan.skips if s.match == "exact")
    return Measured(
        root=root,
        plan=plan,
        exact_sites=exact_edits + exact_left,
        exact_rewritten=exact_edits,
        misses_fixed=sum(e.fixes_miss for e in plan.edits),
    )


def _report(m: Measured) -> None:
    p = m.plan
    share = len(p.edits) / p.sites if p.sites else 1.0
    print(
        f"migrated {m.root}: {p.sites} spec-class sites; rewrote {len(p.edits)} "
        f"({100 * share:.0f}%, target 90%) in {len(p.files)} files"
    )
    print(
        f"exact-match sites rewritten: {m.exact_rewritten}/{m.exact_sites} "
        f"({100 * m.ratio:.0f}%, target 80%); misses fixed: {m.misses_fixed}"
    )
    print(f"left ({len(p.skips)}):")
    for s in p.skips:
        where = s.path.rpartition("kv_transfer/")[2]
        print(f"  {where}:{s.line}: {s.text}  [{s.reason}]")


def _demo(m: Measured) -> None:
    from kvspec_traits import traits_of
    from kvspec_traits.catalog import representative_specs

    after = [
        line.strip()
        for line in (m.root / SEED_FILE).read_text().splitlines()
        if line.strip().startswith("is_mla_region = ")
    ]
    swa = next(
        e.spec for e in representative_specs() if type(e.spec).__name__ == "SlidingWindowMLASpec"
    )
    from vllm.v1 import kv_cache_interface

    seed = eval(
        SEED_LINE.partition(" = ")[2],  # the seed line's own expression
        {**vars(kv_cache_interface), "layer_spec": swa},
    )
    print(f"before: {SEED_LINE}")
    print(f"        on SlidingWindowMLASpec: {seed}  (the miss)")
    for e in m.plan.edits:
        if e.before == SEED_LINE.partition(" = ")[2]:
            print(
                f"migrate: {SEED_FILE}:{e.line} fixes a miss (the original leaves out "
                f"{', '.join(e.missing)}): {e.before} -> {e.after}"
            )
    for line in after:
        expr = line.partition("=")[2].strip()
        value = eval(expr, {"traits_of": traits_of, "layer_spec": swa})  # the migrated line
        print(f"after:  {line}")
        print(f"        on SlidingWindowMLASpec: {value}")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, help="where to put the migrated kv_transfer/")
    p.add_argument("--seed", action="store_true", help="restore the seed line first")
    p.add_argument("--demo", action="store_true", help="show the seed line before/after")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument(
        "--hand-edits",
        action="store_true",
        help="apply the patch's hand edits too (hand_edits.py): the patch's code",
    )
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvspec-migrate-"))
    out.mkdir(parents=True, exist_ok=True)
    m = migrate_copy(out, seed=args.seed or args.demo, hand_edits=args.hand_edits)
    if args.json:
        json.dump(m.as_json(), sys.stdout, indent=2)
        print()
    elif args.demo:
        _demo(m)
        print(
            f"(whole tree, seed restored: {m.exact_rewritten}/{m.exact_sites} exact-match "
            f"sites rewritten, {m.misses_fixed} misses fixed; migrated copy in {m.root})"
        )
    else:
        _report(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
