"""docs/extending.md as a test: its Python blocks, in order, are one module. Installed as a
package with a ``kvspec_traits.adapters`` entry point (a dist-info on ``sys.path``) and
imported before anything else of kvspec-traits ran, it registers by decorator and by
entry point in one module, resolves its spec, and passes mypy strict.

Also here: the same cycle in its smallest form; every public name of the core, the
NIXL shim, the audit and the vLLM connector documented somewhere under docs/ or in the
README; and every ``name(params)`` of the API tables matching the code's signature.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import fresh
from tests.doc_blocks import mypy_strict_on_blocks, python_blocks

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "extending.md"


def _install(site: Path, package: str, source: str, hook: str = "register") -> None:
    """A package on ``site`` with an entry point in the adapters group, as pip leaves it."""
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(source)
    info = site / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[kvspec_traits.adapters]\n{package} = {package}:{hook}\n"
    )


def _run(site: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *sys.path])
    return fresh.run([sys.executable, "-c", code], env=env, timeout=300, cwd=site)


def test_the_walkthrough_has_every_step_and_every_trait() -> None:
    from kvspec_traits import trait_names

    text = DOC.read_text()
    steps = re.findall(r"^## (\d)\. ", text, flags=re.M)
    assert steps == ["1", "2", "3", "4", "5", "6", "7"]
    for name in trait_names():
        assert f"[`{name}`](traits/{name}.md)" in text, name
    assert len(python_blocks(text)) >= 5


def test_the_walkthrough_runs_imported_first_with_decorator_and_entry_point(tmp_path: Path) -> None:
    source = "\n\n".join(python_blocks(DOC.read_text()))
    _install(tmp_path, "scaled_walkthrough", source)
    proc = _run(
        tmp_path,
        (
            "import scaled_walkthrough as w\n"  # first: nothing of kvspec-traits loaded yet
            "from kvspec_traits import traits_of\n"
            "from kvspec_traits.extend import Registry\n"
            "from importlib.metadata import entry_points\n"
            "assert [e.value for e in entry_points(group='kvspec_traits.adapters')\n"
            "        if e.name == 'scaled_walkthrough'] == ['scaled_walkthrough:register']\n"
            "fresh = Registry()\n"  # only the entry point registers it here
            "t = fresh.traits_of(w.spec)\n"
            "assert fresh.adapters()[w.ScaledFullSpec] is w.adapt_scaled_full\n"
            "assert t == traits_of(w.spec)\n"
            "print(t.page_size_bytes, [c.name for c in t.components])\n"
            # step 7: the audit sees the class, answered from representative_specs()
            "import json, os\n"
            "os.environ['KVSPEC_TRAITS_CACHE_DIR'] = 'audit-cache'\n"
            "from kvspec_traits.audit import main\n"
            "with open('user.py', 'w') as f:\n"
            "    f.write('def scaled(spec):\\n    return isinstance(spec, ScaledFullSpec)\\n'\n"
            "            'def full(spec):\\n    return type(spec) is FullAttentionSpec\\n')\n"
            "assert main(['--json', '-o', 'audit.json', 'user.py']) == 0\n"
            "doc = json.load(open('audit.json'))\n"
            "print(json.dumps({s['check']: [s['no_representative'], s['skipped_subclasses']]\n"
            "                  for s in doc['sites']}))\n"
        ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # 16 * 8 * (256 * 2 + 4)
    assert proc.stdout.split("\n")[-3] == "66048 ['k', 'v', 'scale']"
    # a site on ScaledFullSpec (answered: no_representative is empty), and the exact check
    # on FullAttentionSpec skips it among vLLM's subclasses of FullAttentionSpec
    sites = json.loads(proc.stdout.split("\n")[-2])
    assert sites["isinstance(spec, ScaledFullSpec)"] == [[], []]
    assert "ScaledFullSpec" in sites["type(spec) is FullAttentionSpec"][1]


# docs/extending.md, step 7: checking a package before it is published.
TARGET_INSTALL = "$ pip install --no-deps --target ./check-site ./my_package"
TARGET_REPORT = "$ PYTHONPATH=./check-site kvspec-traits report"


def test_an_unpublished_package_is_checked_from_a_folder_of_its_own(tmp_path: Path) -> None:
    """The two commands of step 7 on a package made of this page's blocks (with its
    entry point in pyproject.toml), which the shared environment does not have: the
    report finds its entry point, lists its class and verifies its representative. pip
    runs offline here (--no-index, and --no-build-isolation: the environment's setuptools
    builds instead of one fetched); the issue-40 author found no doc for this."""
    text = DOC.read_text()
    assert TARGET_INSTALL in text and TARGET_REPORT in text
    package = tmp_path / "my_package"
    (package / "src" / "scaled_walkthrough").mkdir(parents=True)
    (package / "src" / "scaled_walkthrough" / "__init__.py").write_text(
        "\n\n".join(python_blocks(text))
    )
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "scaled-walkthrough"\nversion = "0.1"\n'
        'dependencies = ["kvspec-traits"]\n'
        '[project.entry-points."kvspec_traits.adapters"]\n'
        'scaled_walkthrough = "scaled_walkthrough:register"\n'
    )
    assert importlib.util.find_spec("scaled_walkthrough") is None  # not in the shared env
    install = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"),
            *("--no-deps", "--target", "./check-site", "./my_package"),
            *("--no-index", "--no-build-isolation"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    # Only the package and its metadata: no second kvspec-traits in the folder.
    assert sorted(p.name for p in (tmp_path / "check-site").iterdir()) == [
        "scaled_walkthrough",
        "scaled_walkthrough-0.1.dist-info",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(["./check-site", env.get("PYTHONPATH", "")])
    report = fresh.run(
        [sys.executable, "-m", "kvspec_traits", "report"], env=env, cwd=tmp_path, timeout=600
    )
    out = report.stdout
    lines = out.splitlines()
    (row,) = [line for line in lines if line.startswith("ScaledFullSpec ")]
    # verified: 16 tokens * 8 heads * (2 * 128 * 2 B + 4 B of scales) = 66048 B a page
    assert "scaled-walkthrough representative 1" in row and " 66048 " in row, row
    assert "scaled_walkthrough.ScaledFullSpec" in out.split("extension classes:", 1)[1]
    # Step 6's two subclasses have no adapter of their own (that is their point): the
    # report names them and is NOT OK, as it would be once the package is published.
    (missing,) = [line for line in lines if line.startswith("not covered: ")]
    assert missing == (
        "not covered: scaled_walkthrough.DraftFullSpec (no adapter of its own), "
        "scaled_walkthrough.WindowedFullSpec (no adapter of its own)"
    )
    assert (report.returncode, lines[-1]) == (1, "NOT OK")


def test_the_walkthrough_passes_mypy_strict(tmp_path: Path) -> None:
    proc = mypy_strict_on_blocks(DOC, tmp_path / "walkthrough.py")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success" in proc.stdout


SCRATCH = """
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvspec_traits import traits_of
from kvspec_traits.extend import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    LayoutTraits,
    Registry,
    attention_traits,
    register_adapter,
)

READS = (*ATTENTION_READS, "pad")


@dataclass(frozen=True, kw_only=True)
class PaddedFullSpec(FullAttentionSpec):
    pad: int = 64

    @property
    def page_size_bytes(self) -> int:
        return super().page_size_bytes + self.pad


@register_adapter(PaddedFullSpec, reads=READS, ignores=ATTENTION_IGNORES)
def adapt(spec: PaddedFullSpec) -> LayoutTraits:
    traits = attention_traits(spec)
    return attention_traits(spec, page_size_bytes=traits.page_size_bytes + spec.pad)


def register(registry: Registry) -> None:
    registry.register(PaddedFullSpec, adapt, reads=READS, ignores=ATTENTION_IGNORES)

{at_import}
"""


@pytest.mark.parametrize(
    "at_import",
    [
        "",
        "import torch\nEARLY = traits_of(PaddedFullSpec("
        "block_size=16, num_kv_heads=1, head_size=8, "
        "dtype=torch.float32)).page_size_bytes\n",
    ],
    ids=["import only", "resolves while importing"],
)
def test_decorator_and_entry_point_in_one_module_imported_first(
    tmp_path: Path, at_import: str
) -> None:
    # main: the decorator loaded the entry points, which imported this half-initialised
    # module: AdapterPluginError "partially initialized module ... has no attribute".
    _install(tmp_path, "scratch_plugin", SCRATCH.format(at_import=at_import))
    proc = _run(
        tmp_path,
        (
            "import scratch_plugin, torch\n"
            "from kvspec_traits import traits_of\n"
            "from kvspec_traits.extend import Registry\n"
            "spec = scratch_plugin.PaddedFullSpec(block_size=16, num_kv_heads=1, head_size=8,\n"
            "                                     dtype=torch.float32)\n"
            "print(traits_of(spec).page_size_bytes, Registry().traits_of(spec).page_size_bytes,\n"
            "      getattr(scratch_plugin, 'EARLY', None))\n"
        ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # 16 tokens * 1 head * (8 + 8) * 4 B = 1024, plus the 64 B pad
    early = "1088" if at_import else "None"
    assert proc.stdout.split("\n")[-2] == f"1088 1088 {early}"


PUBLIC_MODULES = [
    "kvspec_traits",
    "kvspec_traits.extend",
    "kvspec_traits.catalog",
    "kvspec_traits.transfer",
    "kvspec_traits.nixl",
    "kvspec_traits.mooncake",
    "kvspec_traits.audit",
    "kvspec_traits.vllm_connector",
]


def test_consumer_and_author_names_are_split_and_all_resolve() -> None:
    # kvspec_traits.__all__ is what a consumer needs, kvspec_traits.extend.__all__ what an
    # adapter author adds: no name in both, every name there, and each in one place (the
    # package no longer re-exports the author's names, nor keeps a kvspec_traits.helpers).
    core = importlib.import_module("kvspec_traits")
    extend = importlib.import_module("kvspec_traits.extend")
    assert set(core.__all__).isdisjoint(extend.__all__)
    for module in (core, extend):
        assert len(set(module.__all__)) == len(module.__all__)
        assert all(hasattr(module, name) for name in module.__all__), module.__name__
    assert {"traits_of", "KVLayoutTraits", "TokenScope", "UnsupportedSpecError"} <= set(
        core.__all__
    )
    assert {"Registry", "register_adapter", "Registration", "attention_traits"} <= set(
        extend.__all__
    )
    assert not any(hasattr(core, n) for n in ("Registry", "register_adapter", "LayoutTraits"))
    assert importlib.util.find_spec("kvspec_traits.helpers") is None


def test_importing_extend_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys\nimport kvspec_traits.extend as e\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n"
        "e.attention_traits\nassert 'vllm' in sys.modules\nprint('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_documented(module: str) -> None:
    docs = "\n".join(
        p.read_text() for p in [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]
    )
    names = importlib.import_module(module).__all__
    # named in code style on its own (`Region`, not only inside `RegionPlan`), or called
    undocumented = [
        n
        for n in names
        if not re.search(rf"`(?:[\w.]+\.)?{n}(?:[`(.\[]| /)", docs) and f"{n}(" not in docs
    ]
    assert undocumented == [], (
        f"{module}: document these in docs/api.md, nixl.md, mooncake.md, audit.md or vllm.md"
    )


def _signature_mismatches(table: str, owner: Any) -> list[str]:
    """Every `name(params)` in the first cell of a table row, against the signature of
    ``owner.name`` (defaults compared as literals)."""
    bad = []
    for row in re.findall(r"^\| (.*?) \|", table, flags=re.M):
        for name, params in re.findall(r"`(\w+)\(([^`]*)\)`", row):
            doc = ast.parse(f"def f({params}): pass").body[0]
            assert isinstance(doc, ast.FunctionDef)
            args = doc.args
            written = (
                [(a.arg, "positional") for a in args.args]
                + [("*" + a.arg, "positional") for a in [args.vararg] if a]
                + [(a.arg, "keyword") for a in args.kwonlyargs]
                + [("**" + a.arg, "keyword") for a in [args.kwarg] if a]
            )
            defaults = dict(
                zip(
                    [a.arg for a in args.args][len(args.args) - len(args.defaults) :],
                    args.defaults,
                    strict=True,
                )
            )
            defaults.update(
                {
                    a.arg: d
                    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                    if d is not None
                }
            )
            obj = getattr(owner, name, None)
            if obj is None:
                bad.append(f"{name}: not in {owner.__name__}")
                continue
            sig = inspect.signature(obj)
            star: dict[Any, str] = {
                inspect.Parameter.VAR_POSITIONAL: "*",
                inspect.Parameter.VAR_KEYWORD: "**",
            }
            actual = [
                (
                    star.get(p.kind, "") + p.name,
                    "keyword" if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) else "positional",
                )
                for p in sig.parameters.values()
                if p.name not in ("self", "cls")
            ]
            if written != actual:
                bad.append(f"{name}({params}): the code has {actual}")
                continue
            for p in sig.parameters.values():
                has = p.default is not inspect.Parameter.empty
                if has != (p.name in defaults) or (
                    has and _literal(defaults[p.name]) not in (p.default, ...)
                ):  # `...` or an expression: a default, not checked
                    bad.append(f"{name}: {p.name}'s default is {p.default!r} in the code")
    return bad


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ...


class _Modules:
    """Looks a name up in several modules, in order."""

    def __init__(self, *names: str) -> None:
        self.modules = [importlib.import_module(n) for n in names]
        self.__name__ = " or ".join(names)

    def __getattr__(self, name: str) -> Any:
        for module in self.modules:
            if name in module.__all__:
                return getattr(module, name)
        return None


@pytest.mark.parametrize(
    ("page", "modules"),
    [
        ("api.md", ("kvspec_traits", "kvspec_traits.extend", "kvspec_traits.catalog")),
        ("audit.md", ("kvspec_traits.audit",)),
        ("vllm.md", ("kvspec_traits.vllm_connector",)),
    ],
)
def test_the_api_tables_match_the_signatures(page: str, modules: tuple[str, ...]) -> None:
    text = (REPO / "docs" / page).read_text()
    tables = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    assert _signature_mismatches(tables, _Modules(*modules)) == []


def test_the_nixl_api_tables_match_the_signatures() -> None:
    nixl = importlib.import_module("kvspec_traits.nixl")
    text = (REPO / "docs" / "nixl.md").read_text()
    api = text.split("## Public API\n", 1)[1].split("\n## ", 1)[0]
    functions, methods = api.split("`TraitsNixlAgent` methods:", 1)
    tables = _Modules("kvspec_traits.transfer", "kvspec_traits.nixl")
    assert _signature_mismatches(functions, tables) == []
    assert _signature_mismatches(methods, nixl.TraitsNixlAgent) == []
    assert len(re.findall(r"`\w+\(", api)) >= 25  # the tables were found


def test_the_mooncake_api_tables_match_the_signatures() -> None:
    mooncake = importlib.import_module("kvspec_traits.mooncake")
    text = (REPO / "docs" / "mooncake.md").read_text()
    api = text.split("## Public API\n", 1)[1].split("\n## ", 1)[0]
    functions, methods = api.split("`TraitsMooncakeEngine` methods:", 1)
    assert _signature_mismatches(functions, mooncake) == []
    assert _signature_mismatches(methods, mooncake.TraitsMooncakeEngine) == []
    assert len(re.findall(r"`\w+\(", api)) >= 15  # the tables were found


def test_section_2_names_the_two_conditions_scaled_full_spec_fails() -> None:
    """§2 said ScaledFullSpec fails "the last two" conditions; it fails the first
    (it overrides state_content_size_bytes) and the last (its byte math), while its new
    field holds its default (issue 25). The block after it asserts each condition."""
    section = DOC.read_text().split("## 2.", 1)[1].split("## 3.", 1)[0]
    assert "fails the first and the last" in " ".join(section.split())
    code = python_blocks(section)[0]
    assert "overridden_members(ScaledFullSpec)" in code and "unaccounted_fields" in code


def test_a_refusal_names_the_public_api_never_a_private_module() -> None:
    """Refusals suggested ``kvspec_traits.register_adapter`` and ``-> KVLayoutTraits``
    and named ``_vllm_adapters._builtins._keeps_every_token`` (issue 25); the docs teach
    ``kvspec_traits.extend`` and ``LayoutTraits``."""
    from kvspec_traits import UnsupportedSpecError, traits_of
    from kvspec_traits.catalog import refused_specs

    with pytest.raises(UnsupportedSpecError) as info:
        traits_of(refused_specs()[0].spec)
    text = str(info.value)
    assert "`@register_adapter(KVCacheSpec)` from `kvspec_traits.extend`" in text
    assert "-> LayoutTraits`" in text and "KVLayoutTraits" not in text
    assert info.value.adapter == "the built-in adapter for KVCacheSpec"
    assert "._" not in text.replace("kvspec_traits.extend", "")  # no private module path
