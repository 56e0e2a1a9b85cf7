"""The seam to vLLM (``vllm_connector/_seam.py``), checked on the vLLM series under test.

Its table, :data:`~kvspec_traits.vllm_connector._seam.NAMES`, lists every name of vLLM's
that the connector reads, writes, overrides or calls. Each entry is checked against the
installed vLLM (0.32; 0.33 and 0.34 first on PYTHONPATH): present where the table says
the series has it, absent where it says the series lacks it, the failure naming the
name and the series. Then the source: no name of the table, and no other private name
of vLLM's, is used under src/kvspec_traits outside the seam (read from the source with
``ast``, as tests/test_import_graph.py reads imports), and docs/architecture.md shows the
table as it is.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvspec_traits.vllm_connector import _seam as seam
from kvspec_traits.vllm_connector._gate import installed_vllm, vllm_series
from kvspec_traits.vllm_connector._seam import NAMES, Kind, VllmName

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvspec_traits"
SEAM = SRC / "vllm_connector" / "_seam.py"
SERIES = vllm_series(installed_vllm())
ALL_SERIES = ("0.32", "0.33", "0.34")
# Interpreter internals: reading or rebuilding a host function is host contact too.
INTERPRETER = frozenset(
    {"__globals__", "__code__", "__func__", "__self__", "__closure__", "__defaults__"}
    | {"__kwdefaults__"}
)
# Cut for a public way (the seam's docstring and docs/architecture.md say which).
CUT = frozenset({"_registry"})
# Private by Python's conventions, not vLLM's: ABCMeta's cache on every ABC subclass.
PYTHONS = frozenset({"_abc_impl"})


def _owner_name(owner: object) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return str(getattr(owner, "__qualname__", owner))


def _label(entry: VllmName) -> str:
    return f"{_owner_name(entry.owner)}.{entry.name}"


# -- each entry against the installed vLLM ----------------------------------------------


def _vllm_classes(owner: type) -> list[type]:
    return [c for c in owner.__mro__ if c.__module__.split(".")[0] == "vllm"]


@functools.cache
def _self_assignments(cls: type) -> frozenset[str]:
    """The attributes ``cls``'s own code sets on ``self`` (``self.x = ...``, annotated
    or augmented), read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return frozenset(
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    )


def _assigned(owner: type, name: str) -> bool:
    """Whether vLLM's code of ``owner`` (or a vLLM base) sets ``self.<name>``."""
    return any(name in _self_assignments(cls) for cls in _vllm_classes(owner))


def _static(owner: object, name: str) -> object | None:
    try:
        found: object = inspect.getattr_static(owner, name)
    except AttributeError:
        return None
    return found


def _present(entry: VllmName) -> bool:
    owner, name = entry.owner, entry.name
    if entry.kind is Kind.ATTRIBUTE:
        if not isinstance(owner, type):
            raise TypeError(f"{_label(entry)}: an attribute's owner is a class")
        return _assigned(owner, name)
    if entry.kind is Kind.FUNCTION_GLOBAL:
        if not isinstance(owner, types.FunctionType):
            raise TypeError(f"{_label(entry)}: a function global's owner is a function")
        return name in owner.__code__.co_names and name in owner.__globals__
    found = _static(owner, name)
    if entry.kind in (Kind.OVERRIDDEN, Kind.CALLED):
        return isinstance(found, types.FunctionType)
    if entry.kind is Kind.MODULE_FLAG:
        return isinstance(found, bool)
    return found is not None and not callable(found)  # a class attribute


@pytest.mark.parametrize("entry", NAMES, ids=_label)
def test_each_name_is_where_the_table_says(entry: VllmName) -> None:
    has = _present(entry)
    says = SERIES in entry.series
    assert has == says, (
        f"{_label(entry)} ({entry.kind}): the seam's table says vLLM "
        f"{'/'.join(sorted(entry.series))} {'have' if says else 'lack'} it, but vLLM "
        f"{SERIES} ({vllm.__version__}) {'has' if has else 'lacks'} it"
    )


def test_the_table_is_well_formed() -> None:
    labels = [_label(e) for e in NAMES]
    assert len(labels) == len(set(labels)), "a name listed twice"
    for entry in NAMES:
        assert entry.series and entry.series <= set(ALL_SERIES), _label(entry)
        assert entry.why.strip() and "\n" not in entry.why, _label(entry)
    assert not {e.name for e in NAMES} & CUT


def test_the_public_way_that_replaced_the_factory_registry() -> None:
    """``register_with_vllm`` registers through ``register_connector``, relying on its
    refusal of a registered name: a ``ValueError``, its only error."""
    name = "KvspecSeamProbeConnector"
    KVConnectorFactory.register_connector(name, "no.such.module", name)
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector(name, "no.such.module", name)
    source = inspect.getsource(KVConnectorFactory.register_connector)
    assert source.count("raise ") == 1, "register_connector raises more than its refusal"


def _seam_classes() -> list[type]:
    return [seam.SeamWorker, seam.SeamPullWorker, seam.SeamPushWorker, seam.SeamScheduler]


def _our_classes() -> list[type]:
    from kvspec_traits.vllm_connector import (
        TraitsNixlConnector,
        TraitsNixlConnectorScheduler,
        TraitsNixlConnectorWorker,
        TraitsNixlPushConnector,
        TraitsNixlPushConnectorScheduler,
        TraitsNixlPushConnectorWorker,
    )

    classes = [
        TraitsNixlConnector,
        TraitsNixlConnectorScheduler,
        TraitsNixlConnectorWorker,
        TraitsNixlPushConnector,
        TraitsNixlPushConnectorScheduler,
        TraitsNixlPushConnectorWorker,
    ]
    return [c for cls in classes for c in cls.__mro__ if c.__module__.startswith("kvspec_traits")]


def _vllm_has(cls: type, name: str) -> bool:
    return any(_static(c, name) is not None or _assigned(c, name) for c in _vllm_classes(cls))


def test_the_seams_names_of_ours_shadow_nothing_of_vllms() -> None:
    """The public names the seam classes give vLLM's private state and hooks are new
    names on vLLM's classes (a series that adds one would be shadowed, silently)."""
    clashes = sorted(
        f"{cls.__qualname__}.{name}"
        for cls in _seam_classes()
        for name in vars(cls)
        if not name.startswith("_") and _vllm_has(cls, name)
    )
    assert clashes == [], f"vLLM {SERIES} has these names too: {clashes}"


def test_our_classes_use_no_private_name_of_vllms_outside_the_seam() -> None:
    """Every private name defined in our connector classes outside the seam is ours:
    vLLM's classes have no such name (else it would be vLLM's, used off the table)."""
    seam_classes = set(_seam_classes())
    ours = sorted(
        f"{cls.__qualname__}.{name}"
        for cls in _our_classes()
        if cls not in seam_classes
        for name in vars(cls)
        if name.startswith("_")
        and not name.startswith("__")
        and name not in PYTHONS
        and _vllm_has(cls, name)
    )
    assert ours == [], f"vLLM {SERIES}'s private names in our classes: {ours}"


# -- no private name of vLLM's outside the seam (the source) ----------------------------


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _used_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) of every name the module uses as an attribute, a string given to
    getattr/hasattr/setattr/delattr (or any string constant that is exactly a name, but
    a type variable's own), an imported name, a method or a class attribute it defines."""
    typevars = {
        id(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "TypeVar"
        and node.args
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.isidentifier() and id(node) not in typevars:
                yield node.lineno, node.value
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.lineno, node.name
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign | ast.AnnAssign):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    for target in targets:
                        if isinstance(target, ast.Name):
                            yield target.lineno, target.id


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _uses(names: frozenset[str]) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _modules()
        if path != SEAM
        for line, name in _used_names(_parsed(path))
        if name in names
    )


def test_the_tables_names_are_used_in_the_seam_only() -> None:
    # A function global is a public name of vLLM's module (the seam replaces it in a copy
    # of the handshake's globals), imported as such elsewhere: the internals are checked.
    names = frozenset(e.name for e in NAMES if e.kind is not Kind.FUNCTION_GLOBAL)
    assert _uses(names | CUT) == []


def test_interpreter_internals_are_read_in_the_seam_only() -> None:
    assert _uses(INTERPRETER) == []


@functools.cache
def _vllm_private_names() -> frozenset[str]:
    """Every private identifier of the installed vLLM's KV-transfer code and of the module
    whose flag the seam switches (attributes, methods, class attributes)."""
    root = Path(vllm.__file__).parent / "distributed"
    files = [*sorted((root / "kv_transfer").rglob("*.py")), root / "utils.py"]
    return frozenset(
        name
        for path in files
        for _, name in _used_names(_parsed(path))
        if name.startswith("_") and not name.startswith("__")
    )


def test_no_other_private_name_of_vllms_is_used() -> None:
    """A private name the connector uses outside the seam is one vLLM's KV-transfer code
    does not use (so it is ours): a private name of vLLM's that the table does not list
    is caught wherever it is, and the table grows instead."""
    vllm_names = _vllm_private_names()
    assert "_has_mamba" in vllm_names  # the control: the scan reads vLLM's code
    connector = SRC / "vllm_connector"
    used = sorted(
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted(connector.glob("*.py"))
        if path != SEAM
        for line, name in _used_names(_parsed(path))
        if name in vllm_names
    )
    assert used == [], f"private names of vLLM {SERIES} outside the seam: {used}"


def test_the_seam_uses_no_private_name_of_vllms_off_the_table() -> None:
    """The seam itself names only what its table lists, or what it defines itself (its
    functions, classes, module names, and the attributes of its classes that are not
    vLLM's)."""
    listed = {e.name for e in NAMES}
    tree = _parsed(SEAM)
    defined = {
        node.id if isinstance(node, ast.Name) else node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.Name)
    }
    for obj in vars(seam).values():
        if isinstance(obj, type) and obj.__module__ == seam.__name__ and not _vllm_classes(obj):
            defined |= _self_assignments(obj)
    unlisted = sorted(
        f"{line}: {name}"
        for line, name in _used_names(tree)
        if name in _vllm_private_names() and name not in listed | defined
    )
    assert unlisted == []


# -- docs/architecture.md ---------------------------------------------------------------


def private_names(series: str) -> list[VllmName]:
    return [e for e in NAMES if series in e.series and e.name.startswith("_")]


def seam_section() -> str:
    """The Markdown of docs/architecture.md's "The seam to vLLM" table and counts."""
    counts = ", ".join(f"{s}: {len(private_names(s))}" for s in ALL_SERIES)
    public = ", ".join(f"`{e.name}`" for e in NAMES if not e.name.startswith("_"))
    lines = [
        f"Private names per series: {counts} (and {public}: public names the seam",
        "keeps too, probed, switched or replaced in a copy).",
        "",
        "| name | owner | kind | series | why no public way serves |",
        "|---|---|---|---|---|",
    ]
    for e in NAMES:
        series = ", ".join(s for s in ALL_SERIES if s in e.series)
        lines.append(f"| `{e.name}` | `{_owner_name(e.owner)}` | {e.kind} | {series} | {e.why} |")
    return "\n".join(lines) + "\n"


def test_docs_show_the_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "## The seam to vLLM" in text
    section = text.split("## The seam to vLLM", 1)[1]
    assert seam_section() in section, "docs/architecture.md: rerun tests/test_vllm_seam.py's"


def test_a_handshake_that_no_longer_decodes_by_name_is_an_unknown_series() -> None:
    """The seam binds the peer metadata class by the name vLLM's handshake decodes with
    (``NixlAgentMetadata``). The installed series' handshake does; a handshake that
    decodes otherwise (as a later series might) is a vLLM the seam does not know,
    refused by name (``UnsupportedVllmVersionError`` naming the installed version and
    the method), never run without the traits fingerprint."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )

    from kvspec_traits.vllm_connector import (
        TraitsNixlAgentMetadata,
        UnsupportedVllmVersionError,
    )

    worker = object.__new__(NixlBaseConnectorWorker)
    bound = seam._decoding_as(worker._nixl_handshake, TraitsNixlAgentMetadata)
    assert bound.__func__.__globals__["NixlAgentMetadata"] is TraitsNixlAgentMetadata  # type: ignore[attr-defined]

    class Renamed:
        def _nixl_handshake(self, host: str, port: int) -> object:
            return (host, port)  # decodes no NixlAgentMetadata

    with pytest.raises(UnsupportedVllmVersionError, match=r"Renamed\._nixl_handshake") as raised:
        seam._decoding_as(Renamed()._nixl_handshake, TraitsNixlAgentMetadata)
    assert raised.value.installed == installed_vllm()
