"""The command line a user expects, and the inputs that hung or crashed it (issues 24
item 5, and 25 item 5).

On main: ``kvspec-traits audit`` hung on a FIFO given as a PATH or as ``--classes`` (a
normal run takes well under a second), ``/dev/zero`` ended in a MemoryError traceback,
``-o /dev/full`` in an OSError traceback, and a scanned file name that is not valid
UTF-8 in a UnicodeEncodeError traceback with ``-o``; the help texts showed raw reST,
``report --help`` had no description and no exit codes, ``migrate`` lacked
``--classes``/``--no-extensions``/``--version`` and ``python -m kvspec_traits.migrate``,
and ``migrate --write --json`` said ``"written": true`` when nothing was written. Each
is now a clean exit: status 2 and one sentence, or the documented output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvspec_traits.audit import EXIT_USAGE
from kvspec_traits.audit import main as audit_main
from tests import fresh

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "tests" / "fixtures" / "audit" / "seed_before.py"
# A normal run of these refusals takes well under a second: 60 s is "it hangs".
HANG = 60


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSPEC_TRAITS_CACHE_DIR", str(tmp_path_factory.mktemp("audit-cache")))
        yield


def _cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return fresh.run(
        [sys.executable, "-m", "kvspec_traits", *map(str, args)], timeout=HANG, cwd=cwd
    )


def _one_sentence(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == EXIT_USAGE, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("as_classes", [False, True], ids=["path", "--classes"])
def test_a_fifo_is_refused_not_read(tmp_path: Path, as_classes: bool) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = ["--classes", fifo, SEED] if as_classes else [fifo]
    proc = _cli("audit", *args)  # timeout=HANG: on main this never returned
    _one_sentence(proc, f"{fifo} is a FIFO (named pipe)")


@pytest.mark.parametrize("as_classes", [False, True], ids=["path", "--classes"])
def test_dev_zero_is_refused_not_read_into_memory(as_classes: bool) -> None:
    args = ["--classes", "/dev/zero", SEED] if as_classes else ["/dev/zero"]
    proc = _cli("audit", *args)
    _one_sentence(proc, "/dev/zero is a device, not a source file or folder")


def test_a_fifo_is_refused_by_migrate_too(tmp_path: Path) -> None:
    pytest.importorskip("libcst")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _one_sentence(_cli("migrate", fifo), "kvspec-traits migrate:", "FIFO")


def test_a_full_output_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    status = audit_main(["--no-extensions", str(SEED), "-o", "/dev/full"])
    out, err = capsys.readouterr()
    assert (status, out) == (EXIT_USAGE, "")
    assert err == "kvspec-traits audit: cannot write /dev/full: No space left on device\n"


@pytest.mark.parametrize("fmt", [[], ["--json"], ["--sarif"]], ids=["table", "json", "sarif"])
def test_a_file_name_that_is_not_utf8_is_written_escaped(tmp_path: Path, fmt: list[str]) -> None:
    # The file's name is bytes 0xff 0xfe: Python holds them as surrogates, which a UTF-8
    # writer refuses. The report shows them escaped, and the scan's result is unchanged.
    folder = os.fsencode(tmp_path)
    with open(os.path.join(folder, b"seed\xff\xfe.py"), "wb") as f:
        f.write(SEED.read_bytes())
    report = tmp_path / "report.txt"
    proc = _cli("audit", "--no-extensions", "--fail-on-miss", *fmt, "-o", report, ".", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the seed line misses a class
    assert "Traceback" not in proc.stderr
    text = report.read_text(encoding="utf-8")
    if fmt:
        assert "seed\\udcff\\udcfe.py" in text  # JSON's own escape of each surrogate
        json.loads(text)
    else:
        assert "seed\\udcff\\udcfe.py" in text


def test_help_is_plain_text_with_exit_codes() -> None:
    pytest.importorskip("libcst")
    for command in ([], ["report"], ["audit"], ["migrate"]):
        proc = _cli(*command, "--help")
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout
        for rest in ("``", ":func:", ":class:", ":attr:"):
            assert rest not in text, (command, rest)
        assert "exit status" in text, command
    report = _cli("report", "--help").stdout
    assert "verified against\nvLLM's own byte math" in report
    assert "1  NOT OK" in report and "--import MODULE" in report


def test_migrate_has_the_common_options_and_runs_as_a_module(tmp_path: Path) -> None:
    """``--version``, ``--classes FILE`` and ``--no-extensions`` are accepted by both
    commands; ``python -m kvspec_traits.migrate`` failed on main (no __main__)."""
    pytest.importorskip("libcst")
    from kvspec_traits import __version__

    for command in (["audit"], ["migrate"]):
        proc = _cli(*command, "--version")
        assert (proc.returncode, proc.stdout) == (0, f"kvspec-traits {__version__}\n")
    module = subprocess.run(
        [sys.executable, "-m", "kvspec_traits.migrate", "--version"],
        capture_output=True,
        text=True,
        timeout=HANG,
        check=False,
    )
    assert (module.returncode, module.stdout) == (0, f"kvspec-traits {__version__}\n")
    saved = tmp_path / "classes.json"
    assert audit_main(["--no-extensions", "--save-classes", str(saved)]) == 0
    target = tmp_path / "seed.py"
    target.write_text(SEED.read_text())
    proc = _cli("migrate", "--classes", saved, "--json", target)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["edits"], proc.stdout
    missing = _cli("migrate", "--classes", tmp_path / "absent.json", target)
    _one_sentence(missing, "kvspec-traits migrate: no class sets: --classes: no such file")
    assert _cli("migrate", "--no-extensions", "--json", target).returncode == 0


def test_migrate_says_written_only_when_something_was(tmp_path: Path) -> None:
    pytest.importorskip("libcst")
    target = tmp_path / "src" / "seed.py"
    target.parent.mkdir()
    target.write_text(SEED.read_text())
    folder = target.parent
    nothing = _cli("migrate", "--no-extensions", "--write", "--json", "--exclude", "*", folder)
    assert nothing.returncode == 0, nothing.stderr[-2000:]
    assert json.loads(nothing.stdout)["written"] is False  # true on main
    assert target.read_text() == SEED.read_text()
    wrote = _cli("migrate", "--no-extensions", "--write", "--json", folder)
    assert json.loads(wrote.stdout)["written"] is True
    assert "traits_of(layer_spec).is_mla" in target.read_text()


def test_package_metadata_points_to_no_missing_page_and_the_readme_has_every_extra() -> None:
    """Issue 50 item 2: the Documentation URL named a package-index page of a package that
    is on no index. The project has no public page: no URL at all (the docs ship in the
    sdist, which the CLI's help names)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "urls" not in project
    readme = (REPO / "README.md").read_text()
    for extra in project["optional-dependencies"]:
        if extra != "dev":
            assert f"`kvspec-traits[{extra}]`" in readme, extra
