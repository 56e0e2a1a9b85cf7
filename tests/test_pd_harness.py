"""The e2e harness's own failure path (tests/e2e/pd_harness.py), without vLLM: a server
that runs but never answers ``/health`` fails with :class:`ServerNotReadyError`, whose
message says how long it waited and what the machine and the server's processes were
doing. Once in CI a restarted producer printed nothing for 600 s and its log alone could
not say why; this is what the next such failure will carry."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.e2e.pd_harness import ServerFailedError, ServerNotReadyError, VllmServer


class _Sleeper(VllmServer):
    """A "server" that starts, prints nothing, and never listens: a stuck start."""

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-u",
            "-c",
            "import time\nprint('looping')\nwhile True: time.sleep(0.2)",
        ]


class _Quitter(VllmServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"]


def _server(cls: type[VllmServer], tmp_path: Path) -> VllmServer:
    return cls(name="stuck", model=tmp_path, served_model_name="none", core=0, workdir=tmp_path)


def test_a_server_that_never_answers_fails_with_the_machine_and_its_stacks(
    tmp_path: Path,
) -> None:
    server = _server(_Sleeper, tmp_path)
    server.start()
    try:
        if server.proc is None:
            raise AssertionError("start() left no process")
        pid = server.proc.pid
        deadline = time.monotonic() + 60  # past the interpreter's start-up, into the loop
        while "looping" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(ServerNotReadyError) as failed:
            server.wait_ready(time.monotonic() + 1.5)
    finally:
        server.stop()
    text = str(failed.value)
    waited = int(text.split("not ready after ")[1].split(" s")[0])
    assert 1 <= waited <= 10, text
    assert "memory: " in text and " MiB available of " in text, text
    assert "busiest processes over 1 s" in text, text
    # The sleeper is the group's only process (its pid is the group id): named with its
    # kernel state and wait channel, then its Python stack if py-spy could attach.
    assert f"this server's process group: {pid}" in text, text
    assert f"group member {pid} python" in text, text
    assert f"py-spy dump {pid}:" in text, text
    dump = text.split(f"py-spy dump {pid}:")[1]
    if "Thread" in dump:  # py-spy attached (a machine may forbid ptrace): the loop's line
        assert "<module> (<string>:3)" in dump, dump


def test_a_server_that_exits_fails_at_once_without_a_snapshot(tmp_path: Path) -> None:
    server = _server(_Quitter, tmp_path)
    server.start()
    started = time.monotonic()
    try:
        with pytest.raises(ServerFailedError) as failed:
            server.wait_ready(time.monotonic() + 60)
    finally:
        server.stop()
    assert not isinstance(failed.value, ServerNotReadyError)
    assert time.monotonic() - started < 30
    assert "exited with code 3 while starting" in str(failed.value)
    assert "bad flag" in str(failed.value)  # the log's tail
    assert "busiest processes" not in str(failed.value)
