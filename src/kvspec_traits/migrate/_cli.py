"""``kvspec-traits migrate PATH...``: rewrite branches on spec classes into traits queries.

Dry run by default: prints a unified diff (headed by one ``# kvspec-traits: ... fixes a
miss`` line per rewritten miss) on stdout, and the sites left alone with why on stderr.
``--write`` applies the diff; ``--json`` prints the edits, skips and refused files
instead. See docs/migration.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from kvspec_traits._argparse import SuggestingParser
from kvspec_traits.audit._cli import add_common_options, check_paths, class_sets
from kvspec_traits.migrate._migrate import MigrationPlan, plan_migration, write_plan

__all__ = ["EXIT_REFUSED", "EXIT_USAGE", "main"]

EXIT_REFUSED: Final = 1
"""Some file was not rewritten: it fails to parse, or changed since it was read."""
EXIT_USAGE: Final = 2
"""Bad arguments, a PATH that is not a file or folder, or no class sets: nothing done."""

_DESCRIPTION: Final = """\
Rewrite code that branches on vLLM KV cache spec classes into traits queries (the sites
kvspec-traits audit finds that a query answers exactly), keeping formatting and comments.

A dry run by default: the unified diff goes to stdout (one "# kvspec-traits: ... fixes a
miss" line heads each rewritten miss), and the sites left alone, with why, to stderr.
--write applies it; --json prints the edits, the sites left and the refused files instead.
docs/migration.md (in the source distribution) lists every form.
"""

_EXIT_STATUS: Final = f"""\
exit status:
  0  done (or, without --write, the diff printed)
  {EXIT_REFUSED}  a file was not rewritten: it fails to parse, or changed since it was read
  {EXIT_USAGE}  bad arguments, a PATH that is not a file or folder, or no class sets
"""


def _parser() -> argparse.ArgumentParser:
    p = SuggestingParser(
        prog="kvspec-traits migrate",
        description=_DESCRIPTION,
        epilog=_EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_options(p)
    p.add_argument(
        "paths", nargs="+", type=Path, metavar="PATH", help="files or folders to migrate"
    )
    p.add_argument("--write", action="store_true", help="apply the edits to the files")
    p.add_argument(
        "--json", action="store_true", help="print edits, skips and refused files as JSON"
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip paths matching GLOB (repeatable)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="also leave sites whose traits query answers otherwise for a class "
        "of another page kind (see docs/migration.md)",
    )
    p.add_argument("--quiet", action="store_true", help="do not list the sites left alone")
    return p


def _summary(plan: MigrationPlan, *, wrote: bool) -> str:
    edits = plan.edits
    misses = sum(e.fixes_miss for e in edits)
    verb = "rewrote" if wrote else "would rewrite"
    return (
        f"kvspec-traits migrate: {plan.sites} sites; {verb} {len(edits)} in "
        f"{len(plan.files)} files ({misses} fixing a miss); left {len(plan.skips)}; "
        f"refused {len(plan.refused)} files"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = check_paths(args.paths)
    if problem is not None:
        print(f"kvspec-traits migrate: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from kvspec_traits.audit import ClassSetsUnavailableError

    try:
        universe, notes = class_sets(args, paths=args.paths)
    except ClassSetsUnavailableError as exc:
        print(f"kvspec-traits migrate: no class sets: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for note in notes:
        print(f"kvspec-traits migrate: note: {note}", file=sys.stderr)
    plan = plan_migration(args.paths, universe, exclude=args.exclude, strict=args.strict)
    refused = list(plan.refused)
    if args.write:
        late = write_plan(plan)
        refused += late
        written = {r.path for r in late}
        plan.files = [f for f in plan.files if f.display not in written]
    if args.json:
        out = plan.as_json()
        out["refused"] = [r.as_json() for r in refused]
        # True only when a file was rewritten (not for a --write that matched nothing).
        out["written"] = bool(args.write and plan.files)
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        if not args.write:
            for f in plan.files:
                sys.stdout.write(f.diff())
        # stdout is the patch alone (`migrate src > fix.patch; git apply fix.patch`)
        if not args.quiet:
            for s in plan.skips:
                print(f"# left {s.path}:{s.line}: {s.text}  [{s.reason}]", file=sys.stderr)
        for r in refused:
            print(f"# refused {r.path}: {r.error}", file=sys.stderr)
        print(_summary(plan, wrote=args.write), file=sys.stderr)
    return EXIT_REFUSED if refused else 0
