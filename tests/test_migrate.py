"""``kvspec-traits migrate`` on fixtures: every rewrite form's diff text, the rewritten code's
answers on every catalog spec (real vLLM spec instances), idempotence, formatting and
comments, and the files it must refuse to rewrite."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from kvspec_traits._cli import main as cli_main
from kvspec_traits.audit import Universe, audit_paths, load_universe
from kvspec_traits.catalog import representative_specs
from kvspec_traits.migrate import EXIT_REFUSED, plan_migration, write_plan

FIXTURE = Path(__file__).parent / "fixtures" / "migrate" / "forms.py"

RECURRENT = "traits_of(spec).token_scope is TokenScope.RECURRENT_STATE"
# (function, the line as written, the line after migrating)
FORMS: list[tuple[str, str, str]] = [
    ("one_class", "    return isinstance(spec, MambaSpec)", f"    return {RECURRENT}"),
    (
        "class_tuple",
        "    return isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec))"
        "  # one latent per token",
        "    return traits_of(spec).is_mla  # one latent per token",
    ),
    ("module_alias", "    return isinstance(spec, kvi.MambaSpec)", f"    return {RECURRENT}"),
    (
        "negation",
        "    if not isinstance(spec, MambaSpec):  # attention-like pages",
        "    if traits_of(spec).token_scope is not TokenScope.RECURRENT_STATE:"
        "  # attention-like pages",
    ),
    (
        "or_chain",
        "    return isinstance(spec, MLAAttentionSpec) or isinstance(spec, SlidingWindowMLASpec)",
        "    return traits_of(spec).is_mla",
    ),
    (
        "and_chain",
        "    return (not isinstance(spec, MLAAttentionSpec)",
        "    return (not traits_of(spec).is_mla)",
    ),
    (
        "mixed_chain",
        "    return spec.block_size > 0 and isinstance(spec, MambaSpec)",
        f"    return spec.block_size > 0 and {RECURRENT}",
    ),
    ("exact_type", "    return type(spec) is MambaSpec", f"    return {RECURRENT}"),
    (
        "seed",
        "    is_mla_region = isinstance(layer_spec, MLAAttentionSpec)",
        "    is_mla_region = traits_of(layer_spec).is_mla",
    ),
    # the traits of issue 20 (the left sites of vLLM 0.34's kv_transfer)
    (
        "attention_page",
        "    return isinstance(spec, AttentionSpec)  # a paged per-token K/V page",
        "    return traits_of(spec).attention_page  # a paged per-token K/V page",
    ),
    (
        "token_paged",
        "    return not isinstance(spec, (MambaSpec, CircularBufferSpec))",
        "    return traits_of(spec).token_paged",
    ),
    (
        "keeps_prompt",
        "    return isinstance(spec, FullAttentionSpec)",
        "    return traits_of(spec).keeps_prompt",
    ),
    (
        "grouped",
        "    if isinstance(spec, UniformTypeKVCacheSpecs):",
        "    if traits_of(spec).grouped:",
    ),
    (
        "get_representative_spec_type",
        "    if type(spec) is UniformTypeKVCacheSpecs:",
        "    if traits_of(spec).grouped:",
    ),
    (
        "representative_type",
        "    return get_representative_spec_type(spec) is CircularBufferSpec",
        "    return representative_traits(traits_of(spec)).token_scope is TokenScope.RING",
    ),
    (
        "representative_subclass",
        "    return issubclass(",
        "    return representative_traits(traits_of(spec)).is_mla",
    ),
    # no single value names the classes: two values of one enum trait do, exactly
    (
        "scope_set",
        "    return isinstance(spec, (kvi.SlidingWindowSpec, kvi.MambaSpec))",
        "    return traits_of(spec).token_scope in "
        "(TokenScope.SLIDING_WINDOW, TokenScope.RECURRENT_STATE)",
    ),
    # `A and not B` as two traits: each operand keeps its line
    (
        "sliding_not_mla",
        "        isinstance(spec, kvi.SlidingWindowSpec)",
        # (the function asks traits_of once: `spec_traits = traits_of(spec)` before it)
        "        spec_traits.token_scope is TokenScope.SLIDING_WINDOW",
    ),
    # the function names CircularBufferSpec, for which is_mla alone answers otherwise (a
    # ring stores no V): the query also asks the page kind MLA pages share
    (
        "mla_beside_a_ring",
        "    return isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)) and bool(handled)",
        "    return spec_traits.is_mla and spec_traits.uses_slot_mapping and bool(handled)",
    ),
]

# Where the traits query answers otherwise than the class check, by the adapters' traits
# (hand-checked against vllm/v1/kv_cache_interface.py's class tree):
# - CircularBufferSpec (an AttentionSpec ring of compressor state) and HiSparseHot/Resident
#   (KVCacheSpec subclasses) store one latent per token, so their traits say is_mla, but
#   none subclasses MLAAttentionSpec or SlidingWindowMLASpec. They are another page kind
#   (not transferable / no slot mapping), which the audit compares separately; the edit
#   names them in ``differs_on`` and the diff header says so.
# - UniformTypeKVCacheSpecs (a group of DeepSeek-V3 MLA layers in the catalog): traits_of
#   answers for the members; isinstance on the wrapper says False.
OTHER_KIND = {"CircularBufferSpec", "HiSparseHotSpec", "HiSparseResidentSpec"}
IS_MLA_DIFFERS = OTHER_KIND | {"UniformTypeKVCacheSpecs"}
# - attention_page and keeps_prompt on that group: the members' answer (True), where
#   isinstance on the wrapper said False. keeps_prompt is False for a bare AttentionSpec
#   (no vLLM manager allocates it), as isinstance(spec, FullAttentionSpec) is, and True
#   for RSWASpec (a FullAttentionSpec whose manager keeps the prompt).
# - the representative forms ask the group's first member, as vLLM's helper does.
DIFFERS: dict[str, set[str]] = {
    "attention_page": {"UniformTypeKVCacheSpecs"},
    "keeps_prompt": {"UniformTypeKVCacheSpecs"},
    "representative_subclass": OTHER_KIND,
    "class_tuple": IS_MLA_DIFFERS,
    "or_chain": IS_MLA_DIFFERS,
    "and_chain": IS_MLA_DIFFERS,
    # the ring is asked apart (no slot mapping); HiSparse's resident copies have one
    "mla_beside_a_ring": {"HiSparseResidentSpec", "UniformTypeKVCacheSpecs"},
    # the seed line misses SlidingWindowMLASpec (DeepSeek-V4's compressor caches): fixed
    "seed": IS_MLA_DIFFERS | {"SlidingWindowMLASpec"},
}
FIXED = {"seed": {"SlidingWindowMLASpec"}}


@pytest.fixture(scope="module")
def universe() -> Universe:
    # vLLM's classes alone: the pinned output does not depend on installed extensions.
    return load_universe(extensions=False)


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory, universe: Universe) -> Path:
    target = tmp_path_factory.mktemp("migrate") / "forms.py"
    shutil.copy(FIXTURE, target)
    plan = plan_migration([target], universe)
    if write_plan(plan):
        raise RuntimeError("the fixture copy was refused")
    return target


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_diff_per_form(universe: Universe, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["migrate", str(FIXTURE)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    for name, before, after in FORMS:
        assert f"\n-{before}\n" in out, name
        assert f"\n+{after}\n" in out, name
    assert "\n+from kvspec_traits import TokenScope, representative_traits, traits_of\n" in out
    assert out.count("import TokenScope, representative_traits, traits_of") == 1
    # the chain's second line goes into the first
    assert "\n-            and not isinstance(spec, SlidingWindowMLASpec))\n" in out
    # ... unless it is asked by a trait of its own
    assert "\n-        and not isinstance(spec, kvi.SlidingWindowMLASpec)\n" in out
    assert "\n+        and not spec_traits.is_mla\n" in out
    # the miss is named before the diff's `---` line (patch ignores it)
    head = out.split("\n--- a/")[0]
    assert (
        "forms.py:52 fixes a miss (the original leaves out SlidingWindowMLASpec): "
        "isinstance(layer_spec, MLAAttentionSpec) -> traits_of(layer_spec).is_mla"
    ) in head
    assert "would rewrite 19 in 1 files (1 fixing a miss); left 1" in captured.err
    # a class set grown on one path only (`supported += (...)` under an `if`): the audit
    # reads the union, which the check tests on that path alone, so it is left
    assert (
        "forms.py:117: isinstance(spec, supported)  [its classes are the name "
        "'supported', bound more than once in the function"
    ) in captured.err
    assert out.startswith("# kvspec-traits: ")  # stdout is the patch alone


@pytest.mark.parametrize("name", [f[0] for f in FORMS])
def test_same_answers_on_every_catalog_spec(name: str, migrated: Path) -> None:
    before: Callable[[object], bool] = getattr(_load(FIXTURE, "forms_before"), name)
    after: Callable[[object], bool] = getattr(_load(migrated, "forms_after"), name)
    entries = representative_specs()
    differ = {type(e.spec).__name__ for e in entries if before(e.spec) != after(e.spec)}
    assert differ == DIFFERS.get(name, set())
    for e in entries:  # where the original missed a class, the rewrite is right
        if type(e.spec).__name__ in FIXED.get(name, set()):
            assert after(e.spec) is True


def test_edits_name_the_classes_answered_otherwise(universe: Universe) -> None:
    plan = plan_migration([FIXTURE], universe)
    by_line = {e.line: e for e in plan.edits}
    assert set(by_line[21].differs_on) == OTHER_KIND  # class_tuple
    assert by_line[17].differs_on == ()  # one_class: MambaSpec is the recurrent state
    strict = plan_migration([FIXTURE], universe, strict=True)
    # the is_mla queries (and the representative one) answer otherwise for other kinds
    assert len(strict.edits) == 13
    # and the set built on a path (117); the ring's guard leaves HiSparse's resident copies (123)
    assert {s.line for s in strict.skips} == {21, 35, 39, 52, 96, 117, 123}


def test_idempotent(migrated: Path, universe: Universe) -> None:
    text = migrated.read_text()
    again = plan_migration([migrated], universe)
    assert again.files == [] and again.edits == []
    assert write_plan(again) == []
    assert migrated.read_text() == text


SOURCE = """\
from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

def f(spec, flag):
    # keep this comment
    if   isinstance( spec , MambaSpec ) :   # and this one
        pass
    same = isinstance(spec, MambaSpec) == flag   # a comparison operand keeps its meaning
    x = (isinstance(spec, MLAAttentionSpec))
    return [ 1 ,2 ]  # untouched
"""
EXPECTED = """\
from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec
from kvspec_traits import TokenScope, traits_of

def f(spec, flag):
    # keep this comment
    spec_traits = traits_of(spec)
    if   spec_traits.token_scope is TokenScope.RECURRENT_STATE :   # and this one
        pass
    same = (spec_traits.token_scope is TokenScope.RECURRENT_STATE) == flag   # a comparison operand keeps its meaning
    x = (spec_traits.is_mla)
    return [ 1 ,2 ]  # untouched
"""  # noqa: E501
# (the function asks traits_of once per spec: one line added, before the first use, taking
# the comments above it)


def test_formatting_and_comments_survive(tmp_path: Path, universe: Universe) -> None:
    path = tmp_path / "odd.py"
    path.write_text(SOURCE)
    plan = plan_migration([path], universe)
    assert write_plan(plan) == []
    assert path.read_text() == EXPECTED


def test_refuses_a_file_that_does_not_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.py"
    text = (
        "from vllm.v1.kv_cache_interface import MambaSpec\n"
        "def f(spec):\n    return isinstance(spec, MambaSpec)\n"
        "def g(:\n"
    )
    path.write_text(text)
    assert cli_main(["migrate", "--write", str(path)]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "# refused" in err and "cannot parse" in err
    assert path.read_text() == text


def test_refuses_a_file_changed_since_it_was_read(tmp_path: Path, universe: Universe) -> None:
    path = tmp_path / "racing.py"
    shutil.copy(FIXTURE, path)
    plan = plan_migration([path], universe)
    assert len(plan.edits) == 19
    edited = path.read_text() + "\n# someone else's edit\n"
    path.write_text(edited)
    refused = write_plan(plan)
    assert [r.error for r in refused] == [
        "changed since it was read; not rewritten (run migrate again)"
    ]
    assert path.read_text() == edited


def test_json_lists_edits_and_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mixed.py"
    path.write_text(
        "from vllm.v1.kv_cache_interface import MambaSpec, SinkFullAttentionSpec\n"
        "def f(spec):\n"
        "    return isinstance(spec, MambaSpec), isinstance(spec, SinkFullAttentionSpec)\n"
    )
    assert cli_main(["migrate", "--json", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(e["line"], e["before"], e["after"]) for e in out["edits"]] == [
        (3, "isinstance(spec, MambaSpec)", RECURRENT)
    ]
    assert [(s["line"], s["text"]) for s in out["skips"]] == [
        (3, "isinstance(spec, SinkFullAttentionSpec)")
    ]
    assert out["skips"][0]["reason"].startswith("no trait question")
    assert out["written"] is False and out["refused"] == []
    assert "traits_of" not in path.read_text()  # a dry run writes nothing


def test_without_libcst_says_what_to_install() -> None:
    code = (
        "import sys\nsys.modules['libcst'] = None\n"
        "from kvspec_traits._cli import main\nsys.exit(main(['migrate', '.']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "`pip install libcst`" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_dry_run_is_a_patch_that_git_applies(
    tmp_path: Path, migrated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "w"
    work.mkdir()
    shutil.copy(FIXTURE, work / "forms.py")
    # the display path is relative to the working directory: run from `work`
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        assert cli_main(["migrate", "forms.py"]) == 0
        (work / "fix.patch").write_text(capsys.readouterr().out)
        subprocess.run(["git", "apply", "-p1", "fix.patch"], cwd=work, check=True)
    assert (work / "forms.py").read_text() == migrated.read_text()  # what --write wrote


def test_audit_and_migrate_agree_on_spec_kind_forms(universe: Universe) -> None:
    """Failure mode (issue 25 item 4): on a tree written with vLLM's kind enum, the audit
    suggested `traits_of(kind)...` (a kind is no spec: it would raise) and missed
    `kind in _PAGED_KINDS`, while migrate rewrote none of the kind checks, not even
    `get_kv_cache_spec_kind(spec) == KVCacheSpecKind.MAMBA`, nor the MRO walks. Now every
    site the audit answers with an exact trait question on a spec in reach is rewritten to
    exactly the audit's suggestion, and every other site is listed as left, with why."""
    audit_dir = Path(__file__).parent / "fixtures" / "audit"
    targets = [audit_dir / "issue23" / "kinds.py", audit_dir / "more_forms.py"]
    plan = plan_migration(targets, universe)
    edits = {(Path(e.path).name, e.line): e for e in plan.edits}
    skips = {(Path(s.path).name, s.line): s for s in plan.skips}
    result = audit_paths(targets, universe)
    assert len(result.sites) == len(edits) + len(skips) == 20
    for site in result.sites:
        key = (Path(site.path).name, site.raw.line)
        a = site.answer
        if key in edits:
            assert a is not None and edits[key].after == a.expression, key
        else:
            assert key in skips, key
        assert a is None or "traits_of(k)" not in a.expression
    # the kind of a spec in reach, the kind variable computed from it, the MRO walks
    assert edits[("kinds.py", 33)].after == (
        "traits_of(spec).token_scope is TokenScope.RECURRENT_STATE"
    )
    assert edits[("more_forms.py", 36)].after == "traits_of(spec).is_mla"
    assert {k[1] for k in edits if k[0] == "more_forms.py"} == {36, 40, 44, 48}
    assert "not computed from a spec in reach" in skips[("kinds.py", 37)].reason
    assert "closest match only" in skips[("kinds.py", 25)].reason  # the module-level set
