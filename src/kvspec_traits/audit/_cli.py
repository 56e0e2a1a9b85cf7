"""``kvspec-traits audit``: argument parsing, output and the exit status."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final, TextIO

from kvspec_traits._argparse import SuggestingParser
from kvspec_traits._deps import vllm_series
from kvspec_traits._errors import KVSpecTraitsError
from kvspec_traits.audit._audit import AuditResult, audit_paths
from kvspec_traits.audit._files import DEFAULT_MAX_FILE_BYTES, not_a_file_or_folder
from kvspec_traits.audit._infer import CONFIDENCES
from kvspec_traits.audit._questions import QUESTIONS
from kvspec_traits.audit._report import drop_notes, render_json, render_sarif, render_table
from kvspec_traits.audit._series import (
    installed_vllm_version,
    shipped_series,
    shipped_universe,
    tree_vllm_version,
)
from kvspec_traits.audit._universe import (
    ClassSetsUnavailableError,
    Universe,
    installed_vllm_dir,
    load_universe,
)

__all__ = [
    "EXIT_FILE_ERRORS",
    "EXIT_MISSES",
    "EXIT_USAGE",
    "add_common_options",
    "check_paths",
    "class_sets",
    "main",
]

EXIT_MISSES: Final = 1
"""Set when ``--fail-on-miss`` is given and a site misses a class."""
EXIT_USAGE: Final = 2
"""Bad arguments, or no class sets (vLLM not importable): nothing was scanned."""
EXIT_FILE_ERRORS: Final = 4
"""Set when a file could not be read or parsed (the others were scanned)."""


class SubpackageNotFoundError(KVSpecTraitsError, ValueError):
    """``--installed-vllm NAME`` names no sub-package (or more than one) of vLLM."""


_DESCRIPTION: Final = """\
Find code that branches on vLLM KV cache spec classes (isinstance checks, class tuples,
type comparisons, spec-kind tests), the trait each branch asks for, and the spec classes
it leaves out. The class sets come from the installed vLLM (and installed extensions) and
are cached; --classes reads saved ones instead. docs/audit.md (in the source
distribution) explains every column.
"""

_EXIT_STATUS: Final = f"""\
exit status (or-ed together):
  0  clean: every file scanned, and no miss counted (see --fail-on-miss)
  {EXIT_MISSES}  --fail-on-miss was given and a site misses a class
  {EXIT_USAGE}  bad arguments, a PATH or --classes FILE that is not a readable file or
     folder, an output that cannot be written, or no class sets: nothing was reported
  {EXIT_FILE_ERRORS}  a file below a PATH could not be read or parsed (the rest was scanned)
"""

_MAX_CLASSES_BYTES: Final = 64 * 1024 * 1024


def add_common_options(p: argparse.ArgumentParser) -> None:
    """The options ``audit`` and ``migrate`` share: ``--version``, ``--classes FILE``,
    ``--vllm SERIES`` and ``--no-extensions`` (where the class sets come from)."""
    from kvspec_traits import __version__

    p.add_argument(
        "--version",
        action="version",
        version=f"kvspec-traits {__version__}",
        help="print the kvspec-traits version and exit",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--classes",
        type=Path,
        metavar="FILE",
        help="read the class sets from FILE (written by audit --save-classes) instead "
        "of the installed vLLM",
    )
    source.add_argument(
        "--vllm",
        metavar="SERIES",
        help="judge with the class sets of vLLM SERIES (one of "
        f"{', '.join(shipped_series())}, shipped with kvspec-traits) when the installed "
        "vLLM is another; default: the series of a scanned vLLM tree (its "
        "vllm/_version.py), else the installed vLLM",
    )
    p.add_argument(
        "--no-extensions",
        action="store_true",
        help="class sets of vLLM alone: leave out the spec classes of installed "
        "extensions (the kvspec_traits.adapters entry points)",
    )


def check_paths(paths: Sequence[Path]) -> str | None:
    """Why one of ``paths`` cannot be scanned (missing, or neither a regular file nor a
    folder: a FIFO would block, /dev/zero never end), or None. Checked before any class
    set is built."""
    for path in paths:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            return f"no such file or folder: {path}"
        except OSError as exc:
            return f"cannot read {path}: {exc.strerror or exc}"
        problem = not_a_file_or_folder(mode)
        if problem is not None:
            return f"{path} is {problem}"
    return None


def _from_file(path: Path) -> Universe:
    """``--classes FILE``: a regular file of at most 64 MiB, checked before it is opened."""
    problem = check_paths([path])
    if problem is None and not path.is_file():
        problem = f"{path} is a folder, not a file written by --save-classes"
    if problem is None and path.stat().st_size > _MAX_CLASSES_BYTES:
        problem = f"{path} is over {_MAX_CLASSES_BYTES} bytes: not a file --save-classes wrote"
    if problem is not None:
        raise ClassSetsUnavailableError(f"--classes: {problem}")
    try:
        return Universe.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ClassSetsUnavailableError(
            f"--classes {path}: not class sets written by --save-classes ({exc})"
        ) from exc


def class_sets(
    args: argparse.Namespace, *, refresh: bool = False, paths: Sequence[Path] = ()
) -> tuple[Universe, tuple[str, ...]]:
    """The class sets the common options ask for, and the notes to print about them.

    ``--classes FILE``, else ``--vllm SERIES`` (the installed vLLM's when it is of that
    series, else the shipped ones), else the shipped sets of the series of the vLLM tree
    ``paths`` lie in when that is not the installed series, else the installed vLLM's
    (cached), with the installed extensions' classes unless ``--no-extensions``. A note
    says when the sets are of another series than the installed vLLM, or than the
    scanned tree. Raises :class:`ClassSetsUnavailableError` with one sentence."""
    installed = installed_vllm_version()
    tree = tree_vllm_version(paths)
    mine = vllm_series(installed) if installed else None

    def from_installed() -> Universe:
        return load_universe(refresh=refresh, extensions=not args.no_extensions)

    if args.classes is not None:
        universe, why = _from_file(args.classes), f"from --classes {args.classes}"
    elif args.vllm is not None:
        wanted = vllm_series(args.vllm)
        universe = from_installed() if wanted == mine else shipped_universe(wanted)
        why = f"as --vllm {args.vllm} asks"
    elif tree is not None and vllm_series(tree) != mine and vllm_series(tree) in shipped_series():
        universe = shipped_universe(tree)
        why = f"the series of the scanned vLLM tree ({tree}, its vllm/_version.py)"
    else:
        universe, why = from_installed(), "the installed vLLM's"
    return universe, _series_notes(universe, installed, tree, why)


def _series_notes(
    universe: Universe, installed: str | None, tree: str | None, why: str
) -> tuple[str, ...]:
    judged = vllm_series(universe.vllm_version)
    notes: list[str] = []
    if installed is None or vllm_series(installed) != judged:
        shipped = "" if universe.vllm_path else " (shipped: vLLM's classes alone)"
        here = f"the installed vLLM is {installed}" if installed else "no vLLM is installed"
        notes.append(
            f"judging with the class sets of vLLM {universe.vllm_version}{shipped}, {why}; {here}"
        )
    if tree is not None and vllm_series(tree) != judged:
        series = vllm_series(tree)
        fix = (
            f"pass --vllm {series}"
            if series in shipped_series()
            else f"kvspec-traits ships none for {series}: pass --classes FILE, saved with "
            f"--save-classes where vLLM {series} is installed"
        )
        notes.append(
            f"the scanned tree is vLLM {tree} (its vllm/_version.py), judged with the class "
            f"sets of vLLM {universe.vllm_version}: {fix}"
        )
    return tuple(notes)


def _parser() -> argparse.ArgumentParser:
    p = SuggestingParser(
        prog="kvspec-traits audit",
        description=_DESCRIPTION,
        epilog=_EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_options(p)
    p.add_argument(
        "paths",
        nargs="*",
        type=Path,
        metavar="PATH",
        help="files or folders to scan (folders: every *.py below)",
    )
    p.add_argument(
        "--installed-vllm",
        nargs="?",
        const="",
        default=None,
        metavar="SUBPACKAGE",
        help="scan the installed vLLM's own code, or one sub-package of it "
        "(dotted, e.g. distributed.kv_transfer, or a unique folder name, "
        "e.g. kv_transfer)",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="JSON instead of the table")
    fmt.add_argument(
        "--sarif", action="store_true", help="SARIF 2.1.0 (for code-scanning annotations)"
    )
    p.add_argument("-o", "--output", type=Path, help="write the report here, not stdout")
    p.add_argument(
        "--fail-on-miss",
        action="store_true",
        help=f"exit with status {EXIT_MISSES} (or-ed in) when any site misses a class",
    )
    p.add_argument(
        "--min-confidence",
        choices=CONFIDENCES,
        default="low",
        help="report only verdicts at or above this confidence (default "
        "%(default)s: all); also what --fail-on-miss counts",
    )
    p.add_argument(
        "--notes",
        action="store_true",
        help="also list 'possible miss' and group-wrapper notes (off by default: right "
        "less than half the time on hand-checked code)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip files and folders whose name or path matches (repeatable)",
    )
    p.add_argument(
        "--max-file-bytes",
        type=int,
        default=DEFAULT_MAX_FILE_BYTES,
        metavar="N",
        help="report and skip files larger than this (default %(default)s)",
    )
    p.add_argument(
        "--save-classes",
        type=Path,
        metavar="FILE",
        help="write the class sets used to FILE (alone: save them and exit)",
    )
    p.add_argument(
        "--refresh-classes",
        action="store_true",
        help="recompute the class sets from vLLM even if the cache is fresh",
    )
    p.add_argument(
        "--show-classes",
        action="store_true",
        help="print, for every trait value, the spec classes that have it, and exit",
    )
    return p


def _vllm_target(sub: str) -> tuple[Path, Path]:
    """(folder to scan, folder paths are shown relative to) for --installed-vllm."""
    root = installed_vllm_dir()
    if root is None:
        raise SubpackageNotFoundError(
            "--installed-vllm: no vLLM package on sys.path; install vLLM or scan a PATH"
        )
    if not sub:
        return root, root.parent
    direct = root.joinpath(*sub.removeprefix("vllm.").split("."))
    if direct.is_dir():
        return direct, root.parent
    if direct.with_suffix(".py").is_file():  # a module: `v1.kv_cache_interface`
        return direct.with_suffix(".py"), root.parent
    found = sorted(p for p in root.rglob(sub) if p.is_dir() and (p / "__init__.py").exists())
    if len(found) == 1:
        return found[0], root.parent
    if not found:
        raise SubpackageNotFoundError(
            f"--installed-vllm {sub}: vLLM at {root} has no sub-package {sub!r}; give a "
            f"dotted path below vllm (e.g. distributed.kv_transfer) or a folder name"
        )
    names = ", ".join(".".join(p.relative_to(root.parent).parts) for p in found)
    raise SubpackageNotFoundError(
        f"--installed-vllm {sub}: {len(found)} sub-packages are named {sub!r} ({names}); "
        f"give the dotted path of one"
    )


def _show_classes(u: Universe, out: TextIO) -> None:
    out.write(
        f"spec classes of vLLM {u.vllm_version} by trait value "
        f"(from kvspec_traits.catalog; ~ = varies between representatives)\n"
    )
    for q in QUESTIONS:
        per = u.answers.get(q.name, {})
        labels = sorted({v for vals in per.values() for v in vals})
        out.write(f"\n{q.name}\n")
        for label in labels:
            names = sorted(n for n in u.concrete if per.get(n) == frozenset({label}))
            varies = sorted(
                n for n in u.concrete if label in per.get(n, ()) and len(per.get(n, ())) > 1
            )
            row = ", ".join([*names, *(f"~{n}" for n in varies)])
            out.write(f"  {label:<28} {row}\n")
    if u.group_names:
        out.write(
            f"\ngroup wrappers: {', '.join(sorted(u.group_names))} "
            f"(group-only attributes: {', '.join(sorted(u.group_attributes))})\n"
        )


def _write_report(
    result: AuditResult, args: argparse.Namespace, out: TextIO, hidden_notes: int = 0
) -> None:
    # A scanned file's name may not be valid UTF-8 (its bytes kept as surrogates): it is
    # written with backslash escapes, never an encoding error.
    if args.output is None and hasattr(out, "reconfigure"):
        out.reconfigure(errors="backslashreplace")
    handle = (
        args.output.open("w", encoding="utf-8", errors="backslashreplace") if args.output else None
    )
    try:
        sink = handle if handle is not None else out
        if args.json or args.sarif:
            doc = render_sarif(result) if args.sarif else render_json(result)
            json.dump(doc, sink, indent=2)
            sink.write("\n")
        else:
            render_table(result, sink, hidden_notes=hidden_notes)
        sink.flush()
    except BrokenPipeError:
        # `kvspec-traits audit ... | head`: the reader left; the status still counts.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        if handle is not None:
            handle.close()


class _UsageError(KVSpecTraitsError, ValueError):
    """A refusal ``main`` writes to stderr before it returns :data:`EXIT_USAGE` (never
    raised past ``main``; a library error all the same, under the one root)."""


def _universe(args: argparse.Namespace, err: TextIO) -> Universe:
    # The class sets to judge with (saved with --save-classes), after the paths are checked.
    problem = check_paths(args.paths)
    if problem is not None:
        raise _UsageError(problem)
    try:
        universe, notes = class_sets(args, refresh=args.refresh_classes, paths=args.paths)
    except (ClassSetsUnavailableError, OSError, ValueError, KeyError) as exc:
        raise _UsageError(f"no class sets: {exc}") from exc
    for note in notes:
        err.write(f"kvspec-traits audit: note: {note}\n")
    if args.save_classes is not None:
        try:
            args.save_classes.write_text(json.dumps(universe.to_json(), indent=1), encoding="utf-8")
        except OSError as exc:
            raise _UsageError(f"cannot save the class sets: {exc}") from exc
    return universe


def _audited(args: argparse.Namespace, universe: Universe) -> tuple[AuditResult, int]:
    # The result as reported, and how many notes it hides.
    targets: list[Path] = list(args.paths)
    display_root: Path | None = None
    if args.installed_vllm is not None:
        try:
            folder, display_root = _vllm_target(args.installed_vllm)
        except SubpackageNotFoundError as exc:
            raise _UsageError(str(exc)) from exc
        targets.append(folder)
    result = audit_paths(
        targets,
        universe,
        exclude=args.exclude,
        max_file_bytes=args.max_file_bytes,
        display_root=display_root,
    )
    if args.min_confidence != "low":
        result = result.at_least(args.min_confidence)
    hidden = 0
    if not args.notes:  # "possible miss" and group-wrapper notes (docs/audit.md)
        result, hidden = drop_notes(result)
    return result, hidden


def _status(args: argparse.Namespace, result: AuditResult) -> int:
    status = 0
    if args.fail_on_miss and result.misses:
        status |= EXIT_MISSES
    if result.errors:
        status |= EXIT_FILE_ERRORS
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the audit; returns the exit status (see ``EXIT_*``; 0: clean)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    err = sys.stderr
    out: TextIO = sys.stdout
    scan = bool(args.paths) or args.installed_vllm is not None
    try:
        if not scan and not args.show_classes and args.save_classes is None:
            raise _UsageError(
                "nothing to scan: give PATH ... or --installed-vllm "
                "(or --save-classes FILE to save the class sets alone)"
            )
        universe = _universe(args, err)
        if args.show_classes:
            _show_classes(universe, out)
            return 0
        if not scan:  # --save-classes alone: the sets are saved, nothing to scan
            return 0
        result, hidden = _audited(args, universe)
    except _UsageError as exc:
        err.write(f"kvspec-traits audit: {exc}\n")
        return EXIT_USAGE
    try:
        _write_report(result, args, out, hidden)
    except OSError as exc:  # -o /dev/full, a full disk, a closed stdout
        where = args.output if args.output else "the report"
        err.write(f"kvspec-traits audit: cannot write {where}: {exc.strerror or exc}\n")
        return EXIT_USAGE
    return _status(args, result)
