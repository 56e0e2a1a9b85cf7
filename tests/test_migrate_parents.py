"""``migrate``'s parent map (``_hoist.parent_map``, read off the nodes' fields) answers what
LibCST's ``ParentNodeProvider`` answers, node for node, on real modules: the hoist and
narrow passes ask it where a ``traits_of`` call sits, and it replaced the provider because
the provider's visit cost most of a migrate run."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, ParentNodeProvider

from kvspec_traits.migrate._hoist import parent_map

REPO = Path(__file__).resolve().parents[1]
# Real modules of many shapes: the migrate passes themselves (visitors, comprehensions,
# lambdas, decorators, walrus), the e2e harness (dataclasses, context managers, f-strings,
# try/except/finally), the connector (nested functions, async-free threading code).
MODULES = [
    *sorted((REPO / "src" / "kvspec_traits" / "migrate").glob("_[a-z]*.py")),
    REPO / "tests" / "e2e" / "pd_harness.py",
    REPO / "src" / "kvspec_traits" / "vllm_connector" / "_connector.py",
]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_parent_map_is_libcsts_node_for_node(path: Path) -> None:
    module = cst.parse_module(path.read_text())
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    theirs = dict(wrapper.resolve(ParentNodeProvider))
    ours = parent_map(module)
    assert len(theirs) > 1000, "a real module has many nodes"
    assert ours.keys() == theirs.keys()
    wrong = [n for n, p in theirs.items() if ours[n] is not p]
    assert not wrong, f"{len(wrong)} nodes with another parent, first {type(wrong[0]).__name__}"
    # And the map is a tree over the module: every node reaches the module by its parents.
    for node in list(ours)[::97]:
        seen = 0
        while node in ours:
            node = ours[node]
            seen += 1
            assert seen < 10_000
        assert node is module


def test_a_node_outside_the_module_has_no_parent() -> None:
    module = cst.parse_module("x = f(a.b)\n")
    other = cst.parse_expression("a.b")
    parents = parent_map(module)
    assert other not in parents and module not in parents
    line = cst.ensure_type(module.body[0], cst.SimpleStatementLine)
    call = cst.ensure_type(cst.ensure_type(line.body[0], cst.Assign).value, cst.Call)
    assert isinstance(parents[call.args[0].value], cst.Arg)
    assert parents[call.args[0]] is call and parents[call] is line.body[0]
