"""Readings of the kind of code a check is in, on the hand-built class universe of
test_audit_infer (no vLLM): class-keyed tables and exact checks in tests.

A dict keyed by spec classes is an exact check only through its lookup. ``TABLE[type(x)]``
raises KeyError for a class that is no key: loud, a note. A lookup with a fallback
(``.get``, ``in``, a subscript under ``except KeyError``) gives such a class the fallback
silently: an exact-type warning. A table never looked up by type in the scan is read by
code outside it: a note. Before issue 23's second part every such table was an exact-type
warning (four of the five held-out warnings then were ``D[type(spec)]`` tables). An exact
check in a test states what the test expects of the specs it built: no warning.
"""

from __future__ import annotations

import ast
from dataclasses import replace

import pytest

from kvspec_traits.audit import AuditResult, Site, audit_paths, infer
from kvspec_traits.audit._names import NameResolver
from kvspec_traits.audit._tables import RAISES, SILENT, type_lookups
from tests.test_audit_infer import U, _site

_SOURCES = {
    "raising.py": (
        "from fake import Full, Latent\n"
        "MANAGERS = {Full: 'paged', Latent: 'latent'}\n"
        "def manager(spec):\n"
        "    return MANAGERS[type(spec)]\n"
    ),
    "fallback.py": (
        "from fake import Full, Latent\n"
        "KIND = {Full: 'paged', Latent: 'latent'}\n"
        "def kind(spec):\n"
        "    return KIND.get(type(spec), 'paged')\n"
    ),
    "caught.py": (
        "from fake import Full, Latent\n"
        "SIZES = {Full: 2, Latent: 1}\n"
        "def factor(spec):\n"
        "    try:\n"
        "        return SIZES[type(spec)]\n"
        "    except KeyError:\n"
        "        return 2\n"
    ),
    "config.py": (
        "from fake import Full, Latent\n"
        "def build(cls):\n"
        "    return cls(blocks_per_type={Full: 10, Latent: 4})\n"
    ),
    "reader.py": (  # names a spec class, so the scan reads it
        "from fake import Full\n"
        "def blocks(cfg, spec: Full):\n"
        "    return cfg.blocks_per_type[type(spec)]\n"
    ),
    "test_expect.py": (
        "from fake import Full\n"
        "def test_emits_plain(specs):\n"
        "    assert all(type(s) is Full for s in specs)\n"
        "    fulls = [s for s in specs if type(s) is Full]\n"
        "    assert len(fulls) == 2\n"
    ),
    "plain.py": (
        "from fake import Full\n"
        "def plain(specs):\n"
        "    return [s for s in specs if type(s) is Full]\n"
    ),
    "refusing/check.py": (  # its own package: its raises state no limit for the others
        "from fake import Full, Latent\n"
        "def check(spec, group):\n"
        "    uniform = all(type(s) is Latent for s in group)\n"
        "    if type(spec) is not Full and not uniform:\n"
        "        raise RuntimeError('unsupported')\n"
    ),
    "narrow.py": (  # genesis-vllm-patches g4_60e_kv_cache_utils.py, in small
        "from fake import Full, Latent\n"
        "def native_mix(specs):\n"
        '    """Only the exact native class takes the mixed path; subclasses keep theirs."""\n'
        "    return any(type(s) is Full for s in specs)\n"
        "def plain_mix(specs):\n"
        '    """Whether any spec is native."""\n'
        "    return any(type(s) is Full for s in specs)\n"
    ),
    "local_sets.py": (  # vLLM 0.34 moriio_connector.py:655, genesis g4_60e :223 and :581
        "from fake import Full, Latent, Sink\n"
        "def supported_groups(specs, read_mode):\n"
        "    supported = (Full,)\n"
        "    if read_mode:\n"
        "        supported += (Latent,)\n"
        "    return [s for s in specs if isinstance(s, supported)]\n"
        "def exact_types(specs):\n"
        "    kinds = {Full, Sink}\n"
        "    return all(type(s) in kinds for s in specs)\n"
        "def shadowed(specs):\n"
        "    other = (Full,)\n"
        "    return [s for s in specs if isinstance(s, other)]\n"
        "def shadowing(items):\n"
        "    other = [1, 2]\n"
        "    return [i for i in items if isinstance(i, other)]\n"
    ),
    "register.py": (
        "from fake import Full, Latent\n"
        "import registry\n"
        "registry.spec_manager_map.update({Full: 'paged', Latent: 'latent'})\n"
    ),
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> AuditResult:
    root = tmp_path_factory.mktemp("tables")
    for name, text in _SOURCES.items():
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_text(text)
    return audit_paths([root], U, display_root=root)


def _table(result: AuditResult, path: str) -> Site:
    (site,) = [s for s in result.sites if s.path == path and s.raw.form == "class-dict"]
    return site


def test_subscript_lookup_is_a_note(result: AuditResult) -> None:
    """Failure mode: `MANAGERS[type(spec)]` raises KeyError for LatentChild and Sink (the
    subclasses of the keys that are no keys themselves) but was an exact-type warning, as
    if they were silently mishandled."""
    site = _table(result, "raising.py")
    assert (site.verdict, site.confidence) == ("possible-miss", "low")
    assert site.skipped_subclasses == ("LatentChild", "Sink")
    assert "MANAGERS[type(x)]" in site.reason and "raises KeyError" in site.reason
    assert not site.has_miss


def test_a_lookup_with_a_fallback_stays_an_exact_type_warning(result: AuditResult) -> None:
    """`.get(type(spec), default)` and a subscript under `except KeyError` give LatentChild
    and Sink the fallback silently: the exact-type warning stays."""
    for path, table in (("fallback.py", "KIND"), ("caught.py", "SIZES")):
        site = _table(result, path)
        assert (site.verdict, site.confidence) == ("exact-type", "medium"), path
        assert f"{table} is looked up by type with a fallback" in site.reason


def test_a_keyword_table_is_matched_with_its_lookup_in_another_module(
    result: AuditResult,
) -> None:
    """Failure mode: `cls(blocks_per_type={...})`, read in reader.py as
    `cfg.blocks_per_type[type(spec)]`, was an exact-type warning."""
    site = _table(result, "config.py")
    assert site.raw.table == "blocks_per_type"
    assert site.verdict == "possible-miss" and "blocks_per_type[type(x)]" in site.reason


def test_a_table_registered_elsewhere_is_a_note(result: AuditResult) -> None:
    """Failure mode: a table merged into another package's (`registry.spec_manager_map.
    update({...})`), which the scan never looks up, was an exact-type warning; the lookup
    that decides is outside the scan."""
    site = _table(result, "register.py")
    assert (site.raw.table, site.raw.lookup) == ("spec_manager_map", "")
    assert site.verdict == "possible-miss" and "never looks up by type" in site.reason


def test_type_lookups_name_each_table_and_how() -> None:
    tree = ast.parse(
        "a = T1[type(x)]\n"
        "b = cfg.T2.get(type(x))\n"
        "c = type(x) in T3\n"
        "d = T4[x.__class__]\n"
        "T5[type(x)] = 1\n"  # a store registers, it looks nothing up
        "try:\n    e = T6[type(x)]\nexcept (ValueError, KeyError):\n    pass\n"
        "try:\n    f = T7[type(x)]\nexcept ValueError:\n    pass\n"
    )
    resolver = NameResolver(tree, module="m", is_package=False, known=frozenset(), exports={})
    assert type_lookups(tree, resolver) == {
        "T1": {RAISES},
        "T2": {SILENT},
        "T3": {SILENT},
        "T4": {RAISES},
        "T6": {SILENT},
        "T7": {RAISES},
    }


def test_an_exact_check_in_a_test_is_what_the_test_expects(result: AuditResult) -> None:
    """Failure mode: `assert all(type(s) is FullAttentionSpec ...)` in a test (vllm-metal
    asserts its policy emits the plain class, not its TurboQuant subclass) was an
    exact-type warning; only class-name strings in test assertions were read as the
    test's expectation. The same check in production code still warns."""
    in_test = [s for s in result.sites if s.path == "test_expect.py"]
    assert [(s.raw.line, s.verdict) for s in in_test] == [(3, "ok"), (4, "ok")]
    assert in_test[0].reason.startswith("a test's assertion on an exact class")
    assert in_test[1].reason.startswith("a check in a test on an exact class")
    (prod,) = [s for s in result.sites if s.path == "plain.py"]
    assert prod.verdict == "miss"  # a warning: it skips Full's subclasses Latent, LatentChild, Sink
    assert prod.skipped_subclasses == ("Latent", "LatentChild", "Sink")


def test_exact_checks_whose_failing_classes_reach_a_raise_are_notes(result: AuditResult) -> None:
    """Failure mode (pegaflow's connector/common.py): `if type(spec) is not Full and not
    uniform: raise`, with `uniform = all(type(s) is Latent ...)` computed just before, was
    an exact-type warning and a miss; the classes either check lets fail reach the raise,
    loudly."""
    by_line = {s.raw.line: s for s in result.sites if s.path == "refusing/check.py"}
    flag, guard = by_line[3], by_line[4]
    assert (flag.verdict, flag.confidence) == ("possible-miss", "low")
    assert "validation" in flag.raw.context and flag.reason.startswith("guards a raise")
    assert (guard.verdict, guard.confidence) == ("possible-miss", "low")
    assert guard.reason.startswith("guards a raise") and "refused loudly" in guard.reason


def test_the_subclasses_an_exact_check_skips_are_loud_only_where_failing_raises() -> None:
    """Failure mode (pegaflow's `if type(spec) not in (FullAttentionSpec,
    MLAAttentionSpec) ...: raise`): an exact check whose failing classes reach a raise was
    an exact-type warning, as if the subclasses it skips went on silently. Only the
    failing side is refused: `if type(s) in (A, B): raise` refuses A and B, and the
    subclasses it skips go on, a warning still."""

    def judged(negated: bool, context: str) -> Site:
        raw = _site("Full", "Chunk", form="type-compare", exact=True, negated=negated)
        return infer(replace(raw, context=(context,)), U)

    for negated, context, start in (
        (True, "validation", "guards a raise"),
        (False, "assert", "an assertion"),
        (False, "chain-raises", "its if/elif chain ends in raise"),
    ):
        site = judged(negated, context)
        assert (site.verdict, site.confidence) == ("possible-miss", "low"), context
        assert site.reason == (
            f"{start}: the subclasses it skips (Latent, LatentChild, Sink) are refused loudly"
        )
    assert judged(False, "validation").verdict == "exact-type"  # `if type(s) in (...): raise`


def test_a_docstring_that_speaks_of_exact_types_does_not_silence_a_check(
    result: AuditResult,
) -> None:
    """A rule tried in issue 23's part 3 and removed in its part 4: an exact check in a
    function whose docstring says "exact" or speaks of subclasses was read as deliberate
    (written from genesis-vllm-patches `_is_tq_native_mixed_kv_cache_spec`). On every
    hand-checked tree it changed only the two sites of the function it was written from,
    so it was no tested rule; a docstring is not a comment on the check, and the words
    are common in docstrings of functions whose checks are misses. Both checks warn."""
    by_line = {s.raw.line: s for s in result.sites if s.path == "narrow.py"}
    assert by_line[4].verdict == by_line[7].verdict == "miss"
    assert "exact-doc" not in by_line[4].raw.context


def test_class_sets_assigned_inside_functions_are_followed(result: AuditResult) -> None:
    """Failure mode (vLLM 0.34 `moriio_connector.py:655` `supported = (...)`, `supported
    += (CircularBufferSpec,)`, `isinstance(spec, supported)`; genesis-vllm-patches
    `supported_spec_types = {...}` and `tq_spec_types = (...)` inside functions): a set of
    classes bound inside a function was not followed, so the check was no site (3 of the
    8 held-out part 3 sites not found). `+=` adds its classes; a name bound elsewhere to
    something else is left alone."""
    by_line = {s.raw.line: s for s in result.sites if s.path == "local_sets.py"}
    assert by_line[6].raw.classes == ("Full", "Latent")
    assert by_line[9].raw.classes == ("Full", "Sink") and by_line[9].raw.exact
    assert 12 not in by_line and 15 not in by_line  # `other` is bound twice, differently
    resolver = NameResolver(
        ast.parse(_SOURCES["local_sets.py"]),
        module="local_sets",
        is_package=False,
        known=frozenset(U.classes),
        exports={},
    )
    assert resolver.local_sets == {"supported": ("Full", "Latent"), "kinds": ("Full", "Sink")}
    assert "supported" not in resolver.class_sets  # not exported to other modules
