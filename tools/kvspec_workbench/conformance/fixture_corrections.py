"""The corrections vLLM's own kv_connector tests need once KV cache specs are judged by
their fields (issue 35): part of the patch a maintainer would apply (``make vllm-patch``
puts them in it, each listed in its header), and what ``run_migrated.py`` runs the
migrated tree's tests on.

vLLM's tests build some specs that describe no layout, which ``isinstance`` never noticed
and ``traits_of`` refuses by name. Each rule fixes the fixture so that it says what the
test already relied on; no test is skipped and no assertion is loosened:

- ``dtype``: a spec built with ``dtype=None``. vLLM sizes it with
  ``get_dtype_size(None)``, ``torch.tensor([], dtype=None).element_size()``: torch's global
  default dtype at that moment (float32, 4 bytes, in these tests), so its page depends on
  the process. The fixture gets ``dtype=torch.float32``: the page it already had, stated.
- ``state dtypes``: a ``MambaSpec`` with fewer dtypes than state shapes
  (``shapes=((16,), (16,)), dtypes=(torch.float16,)``). vLLM's ``page_size_bytes`` zips
  shapes with dtypes, so it counts the first state only (16 x 2 = 32 B of the 64 B two
  fp16 states hold): a worker would register and move half of each state. The fixture
  repeats the last dtype for the states without one.
- ``state shapes``: a ``MambaSpec`` whose ``shapes`` is a tuple of ints
  (``shapes=(1, 1)``) instead of a tuple of shapes: vLLM's own ``page_size_bytes`` raises
  ``TypeError`` on it (no test asked); the fixture becomes the one ``(1, 1)`` state the
  test file's other fixtures give (``shapes=((1, 1),)``).
- ``abstract base``: ``test_fail_closed_cases`` asks the offloading connector's canonical
  mapping of a bare ``KVCacheSpec(block_size=4)``, vLLM's abstract base, which no layer has
  and which has no layout fields; the rewritten check refuses it by name
  (``UnsupportedSpecError``) where the class check answered "not attention" (None). The
  test expects the refusal.
- ``ring flag`` (0.34): ``test_shared_base_regions_with_distinct_block_lens_stay_separate``
  asserts ``_region_is_mla == [True, False]``: the compressor ring (``CircularBufferSpec``,
  one KV head, ``head_size_v == 0``) aliasing the MLA page was SPLIT because its class is
  not in the MLA list; its traits say one latent-like row per token, no V, TP-replicated,
  so the rewritten line marks it REPLICATE. At the test's TP 1 the same bytes move; under
  heterogeneous TP SPLIT would cut the ring's single head. The test expects ``[True,
  True]``.

- ``group traits``: NIXL's worker keeps, per transfer group, the traits of its first member
  in ``_group_spec_types`` (the patch's hand edit, hand_edits.py), where it kept
  that member's class. Tests that inject classes there (``worker._group_spec_types =
  (FullAttentionSpec, MambaSpec)``) or pass them to ``compute_tp_mapping`` get the traits of
  one spec of each class instead (``group_traits``, added to the suite's ``utils.py``):
  the same groups, asked as the worker now asks them. A test that builds the tuple from a
  config's groups asks their traits directly.

- ``stand-in spec``: MoRIIO's scheduler tests give the attention groups of a fake config
  ``kv_cache_spec=object()``, which ``isinstance(spec, MambaSpec)`` called "not Mamba";
  the rewritten check asks its traits and refuses a non-spec by name. The stand-in
  becomes a full-attention spec (the kind the tests mean: not a Mamba group).

A rule's anchor found more than once raises ``FixtureError`` (a correction is never
guessed); one found nowhere corrects nothing, and the judge then shows the test that
needs it. Pure: LibCST and the standard library.
"""

from __future__ import annotations

import difflib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

__all__ = [
    "Correction",
    "FixtureError",
    "corrected_sources",
    "fixture_diff",
    "write_corrected_tree",
]

SUITE = "tests/v1/kv_connector"


class FixtureError(RuntimeError):
    """A correction's anchor is missing or ambiguous in this release's tests."""


@dataclass(frozen=True)
class Correction:
    path: str
    """The test file, from the tests root (``tests/v1/...``)."""
    line: int
    rule: str
    before: str
    after: str


WHY = {
    "dtype": "dtype=None is sized with torch's global default dtype (process-dependent); "
    "float32, the page the test already had, stated",
    "state dtypes": "one dtype for several state shapes: vLLM's page_size_bytes zips them and "
    "counts the first state only; the last dtype repeated for the others",
    "state shapes": "shapes=(1, 1) is a tuple of ints, not of shapes: vLLM's own "
    "page_size_bytes raises TypeError ('int' object is not iterable); the one (1, 1) state "
    "the test's other fixtures give",
    "abstract base": "vLLM's abstract KVCacheSpec has no layout; traits_of refuses it by name "
    "(UnsupportedSpecError) where the class check answered None",
    "group traits": "NIXL's _group_spec_types holds each group's traits (the patch's hand "
    "edit), not its class: the classes a test injects become the traits of one spec of "
    "each (group_traits in the suite's utils.py)",
    "stand-in spec": "object() stood for an attention group; traits_of refuses a non-spec "
    "by name, so the group gets a full-attention spec (not Mamba, as the test meant)",
    "ring flag": "the compressor ring (one KV head, no V) is TP-replicated by its traits: "
    "REPLICATE, not the SPLIT its class gave it (same bytes at TP 1)",
}


def _name(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return ""


class _Specs(cst.CSTTransformer):
    """The ``dtype`` and ``state dtypes`` rules on one module."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, path: str, module: cst.Module) -> None:
        self.path = path
        self.module = module
        self.found: list[Correction] = []

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        name = _name(original.func)
        if not name.endswith("Spec"):
            return updated
        line = self.get_metadata(PositionProvider, original).start.line
        args = list(updated.args)
        for i, arg in enumerate(args):
            kw = arg.keyword.value if arg.keyword is not None else None
            if kw == "dtype" and isinstance(arg.value, cst.Name) and arg.value.value == "None":
                value = cst.parse_expression("torch.float32")
                args[i] = arg.with_changes(value=value)
                self._note(line, "dtype", "dtype=None", "dtype=torch.float32")
        if name == "MambaSpec":
            args = self._state_shapes(args, line)
            args = self._state_dtypes(args, line)
        return updated.with_changes(args=args)

    def _state_shapes(self, args: list[cst.Arg], line: int) -> list[cst.Arg]:
        by_kw = {a.keyword.value: i for i, a in enumerate(args) if a.keyword is not None}
        if "shapes" not in by_kw:
            return args
        shapes = args[by_kw["shapes"]].value
        if not isinstance(shapes, cst.Tuple) or not shapes.elements:
            return args
        if not all(isinstance(e.value, cst.Integer) for e in shapes.elements):
            return args
        fixed = cst.Tuple(elements=[cst.Element(shapes.deep_clone())])
        args[by_kw["shapes"]] = args[by_kw["shapes"]].with_changes(value=fixed)
        self._note(
            line,
            "state shapes",
            self.module.code_for_node(shapes),
            self.module.code_for_node(fixed),
        )
        return args

    def _state_dtypes(self, args: list[cst.Arg], line: int) -> list[cst.Arg]:
        by_kw = {a.keyword.value: i for i, a in enumerate(args) if a.keyword is not None}
        if "shapes" not in by_kw or "dtypes" not in by_kw:
            return args
        shapes, dtypes = args[by_kw["shapes"]].value, args[by_kw["dtypes"]].value
        if not (isinstance(shapes, cst.Tuple) and isinstance(dtypes, cst.Tuple)):
            return args
        missing = len(shapes.elements) - len(dtypes.elements)
        if missing <= 0 or not dtypes.elements:
            return args
        last = dtypes.elements[-1].value
        elements = [cst.Element(e.value) for e in dtypes.elements]
        elements += [cst.Element(last.deep_clone()) for _ in range(missing)]
        fixed = cst.Tuple(elements=elements)
        args[by_kw["dtypes"]] = args[by_kw["dtypes"]].with_changes(value=fixed)
        self._note(
            line,
            "state dtypes",
            self.module.code_for_node(dtypes),
            self.module.code_for_node(fixed),
        )
        return args

    def _note(self, line: int, rule: str, before: str, after: str) -> None:
        self.found.append(Correction(self.path, line, rule, before, after))


def _with_import(text: str, statement: str) -> str:
    """``text`` with ``statement`` among its top-level imports, unless it is there: a
    third-party one (``kvspec_traits``) before vLLM's own, as vLLM's isort orders them;
    ``torch`` or ``pytest`` before the first third-party import."""
    lines = text.splitlines(keepends=True)
    if statement + "\n" in lines:
        return text
    first_party = statement.startswith("from kvspec_traits")
    for i, line in enumerate(lines):
        if first_party and line.startswith(("from vllm", "import vllm", "from tests")):
            # At the end of the third-party group: before the blank line above vLLM's.
            lines.insert(i - 1 if i and not lines[i - 1].strip() else i, statement + "\n")
            return "".join(lines)
        if not first_party and line.startswith(("import ", "from ")):
            if line.startswith(("from __future__", "from collections", "from unittest")):
                continue
            lines.insert(i, statement + "\n")
            return "".join(lines)
    raise FixtureError(f"no top-level import to put {statement!r} beside")


def _replace_once(text: str, path: str, old: str, new: str) -> tuple[str, int]:
    count = text.count(old)
    if count != 1:
        raise FixtureError(
            f"{path}: expected the line {old.strip()!r} once, found it {count} times"
        )
    return text.replace(old, new), text[: text.index(old)].count("\n") + 1


_ABSTRACT_OLD = (
    "    # Non-attention specs\n"
    "    assert _try_mapping(KVCacheSpec(block_size=4), None, _ctx(0, tp=4, total=8)) is None\n"
)
_ABSTRACT_NEW = (
    "    # Non-attention specs: vLLM's abstract base is no layer's spec (no layout\n"
    '    # fields); its traits are refused by name instead of answered as "not attention".\n'
    "    with pytest.raises(UnsupportedSpecError):\n"
    "        _try_mapping(KVCacheSpec(block_size=4), None, _ctx(0, tp=4, total=8))\n"
)
_RING_OLD = "    assert worker._region_is_mla == [True, False]\n"
_RING_NEW = (
    "    # The ring (one KV head, no V) is TP-replicated by its traits: REPLICATE.\n"
    "    assert worker._region_is_mla == [True, True]\n"
)
_RING_TEST = "def test_shared_base_regions_with_distinct_block_lens_stay_separate():"


_GROUP_TRAITS_HELPER = '''

def group_traits(*spec_types: type) -> tuple:
    """What a NIXL worker's ``_group_spec_types`` holds for transfer groups of these spec
    classes: the traits of one spec of each (the worker asks traits, not classes)."""
    from kvspec_traits import traits_of
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    def spec_of(spec_type: type):
        if issubclass(spec_type, MambaSpec):
            return spec_type(block_size=16, shapes=((16,),), dtypes=(torch.float32,))
        layout: dict[str, Any] = dict(
            block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32
        )
        if issubclass(spec_type, SlidingWindowSpec):
            layout["sliding_window"] = 128
        return spec_type(**layout)

    return tuple(traits_of(spec_of(spec_type)) for spec_type in spec_types)
'''
_GROUP_ASSIGN = re.compile(r"^( +)(\w+)\._group_spec_types = (.+)$", flags=re.M)
_GROUP_FROM_CONFIG_OLD = (
    "        type(g.kv_cache_spec) for g in worker.kv_cache_config.kv_cache_groups\n"
)
_GROUP_FROM_CONFIG_NEW = (
    "        representative_traits(traits_of(g.kv_cache_spec))\n"
    "        for g in worker.kv_cache_config.kv_cache_groups\n"
)
_TP_KEYWORD_OLD = "        group_spec_types=group_spec_types,\n"
_TP_KEYWORD_NEW = "        group_spec_types=group_traits(*group_spec_types),\n"
_UNIT = "tests/v1/kv_connector/unit/"


def _group_traits(path: str, text: str) -> tuple[str, list[Correction]]:
    """The ``group traits`` rule on one file of the unit suite."""
    found: list[Correction] = []
    if path == _UNIT + "utils.py":
        if "def group_traits(" in text:
            raise FixtureError(f"{path}: already has a group_traits")
        line = text.count("\n") + 2
        found.append(Correction(path, line, "group traits", "-", "def group_traits(...)"))
        return text.rstrip("\n") + "\n" + _GROUP_TRAITS_HELPER, found
    if "_group_spec_types = " not in text and _TP_KEYWORD_OLD not in text:
        return text, found
    if path == _UNIT + "test_tp_mapping.py" and _TP_KEYWORD_OLD in text:
        text, line = _replace_once(text, path, _TP_KEYWORD_OLD, _TP_KEYWORD_NEW)
        found.append(
            Correction(path, line, "group traits", _TP_KEYWORD_OLD.strip(), _TP_KEYWORD_NEW.strip())
        )

    def wrap(match: re.Match[str]) -> str:
        indent, owner, value = match.groups()
        if value == "tuple(":  # built from a config's groups: asked directly above
            return match.group(0)
        if value.startswith("(") and value.endswith(")"):
            new = f"group_traits{value}"
        elif value.isidentifier():
            new = f"group_traits(*{value})"
        else:
            raise FixtureError(f"{path}: no group_traits rule for `{match.group(0).strip()}`")
        line = text[: match.start()].count("\n") + 1
        found.append(Correction(path, line, "group traits", value, new))
        return f"{indent}{owner}._group_spec_types = {new}"

    text = _GROUP_ASSIGN.sub(wrap, text)
    if _GROUP_FROM_CONFIG_OLD in text:
        text, line = _replace_once(text, path, _GROUP_FROM_CONFIG_OLD, _GROUP_FROM_CONFIG_NEW)
        text = _with_import(text, "from kvspec_traits import representative_traits, traits_of")
        found.append(
            Correction(
                path,
                line,
                "group traits",
                _GROUP_FROM_CONFIG_OLD.strip(),
                " ".join(_GROUP_FROM_CONFIG_NEW.split()),
            )
        )
    if any(c.after.startswith("group_traits") for c in found):
        text = _with_import(text, "from tests.v1.kv_connector.unit.utils import group_traits")
    return text, found


_STAND_IN_OLD = "kv_cache_spec=object()"
_STAND_IN_NEW = (
    "kv_cache_spec=FullAttentionSpec(\n"
    "{indent}    block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32\n"
    "{indent})"
)


def _stand_in_specs(path: str, text: str) -> tuple[str, list[Correction]]:
    """The ``stand-in spec`` rule (MoRIIO's scheduler tests)."""
    if not path.endswith("unit/test_moriio_hma_scheduler.py") or _STAND_IN_OLD not in text:
        return text, []
    found: list[Correction] = []
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if _STAND_IN_OLD in line:
            indent = line[: len(line) - len(line.lstrip())]
            lines[i] = line.replace(_STAND_IN_OLD, _STAND_IN_NEW.format(indent=indent))
            found.append(
                Correction(path, i + 1, "stand-in spec", "object()", "FullAttentionSpec(...)")
            )
    text = "".join(lines)
    text = _with_import(text, "import torch")
    if not re.search(r"^    FullAttentionSpec,$|import .*\bFullAttentionSpec\b", text, re.M):
        text = _with_import(text, "from vllm.v1.kv_cache_interface import FullAttentionSpec")
    return text, found


_ANCHORS = (
    _STAND_IN_OLD,
    "dtype=None",
    "MambaSpec(",
    _ABSTRACT_OLD,
    _RING_TEST,
    "_group_spec_types = ",
    _TP_KEYWORD_OLD,
    "def make_kv_cache_config(",
)


# The rules that adapt vLLM's tests to the patched code (its hand edits), not to the specs'
# page math: left out where the tests run against the release's own code (the conformance
# pass of TraitsNixlConnector).
PATCHED_CODE_RULES = ("group traits", "stand-in spec")


# What the ``dtype`` and ``state`` rules (``_Specs``) can act on; a file with neither is not
# parsed for them (parsing with positions is most of the corrections' cost).
_SPEC_RULES_ANCHOR = re.compile(r"\bdtype\s*=\s*None\b|\bMambaSpec\s*\(")


def _corrected(path: str, text: str, *, patched: bool = True) -> tuple[str, list[Correction]]:
    new, found = text, []
    if _SPEC_RULES_ANCHOR.search(text):
        module = cst.parse_module(text)
        specs = _Specs(path, module)
        # Just parsed and not shared: no defensive deep copy.
        new = MetadataWrapper(module, unsafe_skip_copy=True).visit(specs).code
        found = list(specs.found)
    if any(c.rule == "dtype" for c in found):
        new = _with_import(new, "import torch")
    if path.endswith("offloading_connector/test_canonical_mapping.py") and _ABSTRACT_OLD in new:
        new, line = _replace_once(new, path, _ABSTRACT_OLD, _ABSTRACT_NEW)
        new = _with_import(new, "from kvspec_traits import UnsupportedSpecError")
        new = _with_import(new, "import pytest")
        found.append(Correction(path, line, "abstract base", "is None", "raises"))
    if path.endswith("test_nixl_desc_geometry.py") and _RING_TEST in new:
        start = new.index(_RING_TEST)
        end = new.find("\ndef ", start + 1)
        body = new[start : end if end != -1 else len(new)]
        fixed, _ = _replace_once(body, path, _RING_OLD, _RING_NEW)
        line = new[:start].count("\n") + body[: body.index(_RING_OLD)].count("\n") + 1
        new = new[:start] + fixed + new[start + len(body) :]
        found.append(Correction(path, line, "ring flag", "[True, False]", "[True, True]"))
    if not patched:
        return new, found
    new, grouped = _group_traits(path, new)
    new, stand_ins = _stand_in_specs(path, new)
    return new, found + grouped + stand_ins


def corrected_sources(
    tests_root: Path, *, patched: bool = True
) -> dict[str, tuple[str, str, list[Correction]]]:
    """Each test file of vLLM's kv_connector suite under ``tests_root`` that a rule
    corrects: its path from the root -> (text, corrected text, corrections). ``patched``
    False: only the rules about the specs themselves (not PATCHED_CODE_RULES)."""
    files = sorted((tests_root / SUITE).rglob("*.py"))
    # The same tree asked again in one process (the patch, then the tests that check it)
    # is answered from the first answer while no file of it changed.
    stamp = tuple((f.as_posix(), st.st_mtime_ns, st.st_size) for f in files for st in [f.stat()])
    key = (tests_root.resolve(), patched)
    if (hit := _ANSWERED.get(key)) is not None and hit[0] == stamp:
        return dict(hit[1])
    out: dict[str, tuple[str, str, list[Correction]]] = {}
    for file in files:
        rel = file.relative_to(tests_root).as_posix()
        text = file.read_text()
        if not any(anchor in text for anchor in _ANCHORS):
            continue  # nothing a rule looks for: not parsed (most of the suite)
        new, found = _corrected(rel, text, patched=patched)
        if found:
            out[rel] = (text, new, found)
    _ANSWERED[key] = (stamp, out)
    return dict(out)


_ANSWERED: dict[
    tuple[Path, bool],
    tuple[tuple[tuple[str, int, int], ...], dict[str, tuple[str, str, list[Correction]]]],
] = {}


def fixture_diff(tests_root: Path) -> tuple[str, list[Correction]]:
    """The corrections as a unified diff against the release's tree (``a/tests/...``)
    and the list of them."""
    parts: list[str] = []
    every: list[Correction] = []
    for rel, (text, new, found) in corrected_sources(tests_root).items():
        parts.extend(
            difflib.unified_diff(
                text.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"a/{rel}",
                tofile=f"b/{rel}",
            )
        )
        every.extend(found)
    return "".join(parts), every


def write_corrected_tree(tests_root: Path, dest: Path, *, patched: bool = True) -> list[Correction]:
    """A copy of ``tests_root`` at ``dest`` (replaced) with the corrections written
    (``patched`` False: the spec rules only, see ``corrected_sources``)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(tests_root, dest, symlinks=True)
    every: list[Correction] = []
    for rel, (_, new, found) in corrected_sources(tests_root, patched=patched).items():
        (dest / rel).write_text(new)
        every.extend(found)
    return every
