"""The ``kvspec-traits`` command: ``report`` (the main job), ``audit`` and ``migrate``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Final

from kvspec_traits._argparse import SuggestingParser

if TYPE_CHECKING:
    from kvspec_traits.catalog import CatalogEntry
    from kvspec_traits.extend import Registry

__all__ = ["main"]


@dataclass
class _Row:
    spec_class: str
    label: str
    status: str  # "verified" | "refused as required" | error text
    ok: bool
    traits: dict[str, Any] = field(default_factory=dict)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Fraction):
        return str(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and hasattr(value, "name"):  # enums
        return value.value
    if hasattr(value, "__dataclass_fields__"):
        return {k: _jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    return value


@dataclass
class _Fields:
    """Field accounting of one spec class: what the adapter serving it reads, what it
    knows does not affect the layout, and what nobody accounts for."""

    spec_class: str
    read: list[str]
    ignored: list[str]
    unaccounted: list[str]


def _fields(registry: Registry, classes: Sequence[type[Any]]) -> list[_Fields]:
    import dataclasses

    from kvspec_traits import UnsupportedSpecError

    out = []
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            continue
        names = [f.name for f in dataclasses.fields(cls)]
        try:
            accounted = registry.accounted_fields(cls)
            unaccounted = set(registry.unaccounted_fields(cls))
            read_names = registry.read_fields(cls)
        except UnsupportedSpecError:
            accounted, unaccounted, read_names = frozenset(), set(names), frozenset()
        out.append(
            _Fields(
                spec_class=cls.__qualname__,
                read=[n for n in names if n in read_names and n not in unaccounted],
                ignored=[n for n in names if n in accounted and n not in read_names],
                unaccounted=[n for n in names if n in unaccounted],
            )
        )
    return out


def _verified(traits_of: Callable[[Any], Any], entry: CatalogEntry) -> _Row:
    """One example's row: its traits, resolved and verified, or why they are not."""
    from kvspec_traits import traits_as_dict

    name = type(entry.spec).__qualname__
    try:
        traits = traits_of(entry.spec)
    except Exception as exc:  # the report shows every failure, then exits non-zero
        return _Row(name, entry.label, f"{type(exc).__name__}: {exc}", False)
    return _Row(
        name,
        entry.label,
        "verified",
        True,
        {k: _jsonable(v) for k, v in traits_as_dict(traits).items()},
    )


def _extension_rows(registry: Registry) -> list[_Row]:
    """The installed extensions' representatives (``representative_specs()`` beside
    each entry point), each resolved and verified like vLLM's."""
    from kvspec_traits.catalog import extension_specs

    return [_verified(registry.traits_of, entry) for entry in extension_specs()]


def _collect(
    registry: Registry | None = None,
) -> tuple[list[_Row], list[str], list[str], list[str], str, list[_Fields]]:
    from kvspec_traits._deps import needs

    with needs("listing the traits of the installed vLLM's KV cache specs"):
        import vllm

    from kvspec_traits import UnsupportedSpecError
    from kvspec_traits.catalog import refused_specs, representative_specs, spec_classes
    from kvspec_traits.extend import ENTRY_POINT_GROUP, Registry, default_registry

    if registry is None:
        registry = default_registry
    traits_of = registry.traits_of

    rows = [_verified(traits_of, entry) for entry in representative_specs()]
    covered = {r.spec_class for r in rows if r.ok}
    for entry in refused_specs():
        name = type(entry.spec).__qualname__
        try:
            traits_of(entry.spec)
        except UnsupportedSpecError:
            rows.append(_Row(name, entry.label, "refused as required", True))
            covered.add(name)
        else:
            rows.append(_Row(name, entry.label, "answered, but must be refused", False))
    found = [c.__qualname__ for c in spec_classes()]
    missing = [c for c in found if c not in covered]
    # Extensions are checked as vLLM is: each representative they provide is resolved
    # and verified, and each class they define needs an adapter of its own, published
    # through the entry point (a class registered only when its module is imported
    # works in this process alone).
    registry.adapters()  # loads the entry points, which import their classes
    rows.extend(_extension_rows(registry))
    extra = [c for c in spec_classes(vllm_only=False) if c.__qualname__ not in found]
    published = Registry(name="entry points").adapters() if extra else {}
    for cls in extra:
        try:
            own = registry.owner_of(cls) is cls
        except UnsupportedSpecError:
            own = False
        name = f"{cls.__module__}.{cls.__qualname__}"
        if not own:
            missing.append(f"{name} (no adapter of its own)")
        elif cls not in published:
            missing.append(
                f"{name} (registered only when its module is imported: publish the "
                f"registration in the {ENTRY_POINT_GROUP!r} entry-point group)"
            )
    fields = _fields(registry, [*spec_classes(), *extra])
    return (
        rows,
        found,
        missing,
        [f"{c.__module__}.{c.__qualname__}" for c in extra],
        vllm.__version__,
        fields,
    )


_TP_SHORT = {"replicated": "repl", "head_sharded": "heads", "state_sharded": "state"}


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int]
) -> list[str]:
    """Lines of a table whose columns are as wide as their widest cell (never cut, whatever
    the terminal's width). A row shorter than the header ends in one cell that runs on
    unpadded (a failure's message); it does not widen the column it starts in."""
    widths = [len(h) for h in header]
    for row in rows:
        cells = row if len(row) == len(header) else row[:-1]
        for i, cell in enumerate(cells):
            widths[i] = max(widths[i], len(cell))

    def line(row: Sequence[str]) -> str:
        if len(row) < len(header):
            return " ".join(
                [*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=False)), row[-1]]
            )
        return " ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    head = line(header)
    return [head, "-" * len(head), *(line(r) for r in rows)]


def _import_modules(modules: Sequence[str]) -> bool:
    # --import MODULE ...: False (said on stderr) when one does not import.
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # one sentence, no traceback: the module is the user's
            print(
                f"kvspec-traits report: --import {module}: it does not import "
                f"({type(exc).__name__}: {exc})",
                file=sys.stderr,
            )
            return False
    return True


@dataclass(frozen=True, slots=True)
class _Collected:
    """What ``report`` prints: a row per example, the classes of vLLM found, those not
    covered, the extensions' classes, vLLM's version and each class's field accounting."""

    rows: list[_Row]
    found: list[str]
    missing: list[str]
    extra: list[str]
    version: str
    fields: list[_Fields]

    @property
    def ok(self) -> bool:
        unaccounted = [f for f in self.fields if f.unaccounted]
        return all(r.ok for r in self.rows) and not self.missing and not unaccounted


def _print_json(c: _Collected) -> None:
    json.dump(
        {
            "vllm_version": c.version,
            "ok": c.ok,
            "classes_found": c.found,
            "classes_not_covered": c.missing,
            "extension_classes": c.extra,
            "fields": {
                f.spec_class: {
                    "read": f.read,
                    "ignored": f.ignored,
                    "unaccounted": f.unaccounted,
                }
                for f in c.fields
            },
            "rows": [r.__dict__ for r in c.rows],
        },
        sys.stdout,
        indent=2,
    )
    print()


def _row_cells(r: _Row) -> list[str]:
    t = r.traits
    if not (r.ok and t):
        return [r.spec_class, r.label, r.status]
    return [
        r.spec_class,
        r.label,
        "yes" if t["is_mla"] else "no",
        _TP_SHORT[t["tp_layout"]],
        t["token_scope"],
        str(t["page_size_bytes"]),
        _fmt(t["per_token_bytes"]),
    ]


def _print_table(c: _Collected) -> None:
    rows, found = c.rows, c.found
    print(f"kvspec-traits report: vLLM {c.version}")
    lines = _table(
        ["spec class", "example", "mla", "tp", "scope", "page B", "B/tok"],
        [_row_cells(r) for r in rows],
        right=frozenset({5, 6}),
    )
    print("\n".join(lines))
    print(
        "tp: repl = replicated on every TP rank, heads = split by KV heads, "
        "state = split recurrent state"
    )
    print(lines[1])
    for r in rows:
        if not r.ok:
            print(f"FAILED {r.spec_class} ({r.label}): {r.status}")
    print(
        f"coverage: {sum(x in {r.spec_class for r in rows if r.ok} for x in found)}/"
        f"{len(found)} spec classes of vLLM {c.version} covered; "
        f"{sum(r.ok for r in rows)}/{len(rows)} examples verified"
    )
    if c.extra:
        print(
            f"extension classes: {len(c.extra)} ({', '.join(c.extra)}); "
            "each needs an adapter of its own"
        )
    if c.missing:
        print("not covered: " + ", ".join(c.missing))
    _print_fields(c.fields)
    print("OK" if c.ok else "NOT OK")


def _report(args: argparse.Namespace, registry: Registry | None = None) -> int:
    from kvspec_traits._errors import AdapterPluginError, MissingDependencyError

    if not _import_modules(args.imports):
        return 2
    try:
        collected = _Collected(*_collect(registry))
    except (MissingDependencyError, AdapterPluginError) as exc:
        # Nothing to report on (no vLLM here, or an installed extension that does not
        # load): one sentence saying what to fix, no traceback.
        print(f"kvspec-traits report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json(collected)
    else:
        _print_table(collected)
    return 0 if collected.ok else 1


def _print_fields(fields: Sequence[_Fields]) -> None:
    import textwrap

    print("fields, per class (read: the traits come from it; ignored: known not to change a page):")
    for f in fields:
        text = (
            f"{f.spec_class}: read {', '.join(f.read) or '-'}; ignored "
            f"{', '.join(f.ignored) or '-'}"
        )
        if f.unaccounted:
            text += f"; UNACCOUNTED {', '.join(f.unaccounted)}"
        print(textwrap.fill(text, width=100, initial_indent="  ", subsequent_indent="      "))
    total = sum(len(f.read) + len(f.ignored) + len(f.unaccounted) for f in fields)
    bad = [(f.spec_class, n) for f in fields for n in f.unaccounted]
    if bad:
        print(
            textwrap.fill(
                f"unaccounted fields: {len(bad)} of {total} "
                f"({', '.join(f'{c}.{n}' for c, n in bad)}); a spec holding one away from its "
                "default is refused",
                width=100,
                subsequent_indent="  ",
            )
        )
    else:
        print(f"fields: all {total} fields of {len(fields)} classes accounted for")


_REPORT_HELP: Final = """\
List the traits of every KV cache spec class of the installed vLLM, each verified against
vLLM's own byte math, and the fields of each class the adapters account for. Installed
extensions (packages in the kvspec_traits.adapters entry-point group) are checked the same
way: each spec their representative_specs() returns is resolved and verified, and each
spec class they define needs an adapter of its own, published through the entry point.

A package is found through its entry point only. To check one before it has an entry
point (or whose entry point is missing), name its module with --import: its classes are
then listed, and one registered only by importing it is reported as unpublished.
"""

_REPORT_EXIT: Final = """\
exit status:
  0  OK: every class, example, extension and field is covered
  1  NOT OK: something is not (each failure is listed)
  2  nothing to report: no vLLM here, an installed extension fails to load, or a
     module given to --import does not import
"""

_MAIN_HELP: Final = """\
Layout traits of vLLM KV cache specs, for KV-transfer connectors.

Each command's --help says more. Documentation: README.md and docs/*.md, in the
checkout this was installed from and in its source distribution (`make dist` there).
"""


def _parser() -> argparse.ArgumentParser:
    from kvspec_traits import __version__

    plain = argparse.RawDescriptionHelpFormatter
    parser = SuggestingParser(
        prog="kvspec-traits",
        description=_MAIN_HELP,
        epilog="exit status: that of the command; 2 without one",
        formatter_class=plain,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__}",
        help="print the kvspec-traits version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    rep = sub.add_parser(
        "report",
        help="traits of every vLLM KV spec class, verified",
        description=_REPORT_HELP,
        epilog=_REPORT_EXIT,
        formatter_class=plain,
    )
    rep.add_argument("--json", action="store_true", help="machine-readable output")
    rep.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (repeatable): check an extension not (yet) published "
        "through its entry point",
    )
    sub.add_parser(
        "audit", help="find branches on KV spec classes in connector code", add_help=False
    )
    sub.add_parser(
        "migrate", help="rewrite branches on KV spec classes into traits queries", add_help=False
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["migrate"]:
        from kvspec_traits._errors import MissingDependencyError

        try:
            migrate_main: Callable[[list[str]], int] = importlib.import_module(
                "kvspec_traits.migrate"
            ).main
        except MissingDependencyError as exc:  # no LibCST: say what to install
            print(f"kvspec-traits migrate: {exc}", file=sys.stderr)
            return 2
        return migrate_main(argv[1:])
    if argv[:1] == ["audit"]:
        # Imported by name: the audit package loads only for this sub-command.
        audit_main: Callable[[list[str]], int] = importlib.import_module("kvspec_traits.audit").main
        return audit_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "report":
        return _report(args)
    parser.print_help()
    return 2
