"""Fresh Python processes for tests, without paying vLLM's import in each.

A test that runs ``python -c CODE`` or ``python -m MODULE`` in a fresh process (the report
and audit CLIs as a user runs them, an extension discovered through its entry point, vLLM
classes deleted before the adapters load) spends ~7 s of CPU importing torch and vLLM
before its own first line, on every vLLM series pass. :func:`run` gives the same process
cheaper: a *fork server* started once per test session imports torch and vLLM's KV spec
module, nothing of this project's, and forks a child per call. The child takes the call's
environment, working directory, ``sys.path`` (from its ``PYTHONPATH``, as the interpreter
builds it at start-up) and ``sys.argv``, runs the code or module as ``__main__`` and exits
with the interpreter's exit status; stdout and stderr come back as from ``subprocess.run``.

What the child cannot be is a process that has *not* imported vLLM: tests about what an
import loads (``imports no vLLM``) use ``subprocess`` itself. Where the fork server cannot
serve a call (another interpreter, flags, input, a Python start-up variable that differs,
vLLM hidden in the common pass), :func:`run` starts a real process instead. Set
``KVSPEC_NO_FORK_SERVER=1`` to run every call as a real process (the same tests pass
either way).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["run"]

# What the fork server imports before serving: what every vLLM-using child needs first.
PRELOAD = ("torch", "vllm", "vllm.v1.kv_cache_interface")

_SERVER = r"""
import atexit, builtins, importlib, json, os, runpy, sys, traceback, types
preload = sys.argv[1:]
try:
    for name in preload:
        importlib.import_module(name)
except BaseException as exc:  # e.g. vLLM hidden: the caller falls back to subprocess
    print(json.dumps({"ready": False, "why": repr(exc)}), flush=True)
    raise SystemExit(0)
own_pp = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
base_path = [p for p in sys.path if p and p not in own_pp]
channel_in = os.fdopen(os.dup(0), "r")
channel_out = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
stdout_encoding, stdout_errors = sys.stdout.encoding, sys.stdout.errors
stderr_encoding, stderr_errors = sys.stderr.encoding, sys.stderr.errors
print(json.dumps({"ready": True}), file=channel_out, flush=True)


def child(req):
    channel_in.close()
    channel_out.close()
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", encoding=stdout_encoding, errors=stdout_errors, closefd=False)
    sys.stderr = open(
        2, "w", encoding=stderr_encoding, errors=stderr_errors, closefd=False, buffering=1
    )
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    mode, target, args = req["mode"], req["target"], req["args"]
    first = "" if mode == "-c" else os.getcwd()
    pp = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *pp, *base_path]
    importlib.invalidate_caches()
    code = 0
    try:
        if mode == "-c":
            sys.argv = ["-c", *args]
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = ["-m", *args]
            runpy._run_module_as_main(target, alter_argv=True)
    except SystemExit as done:
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


for line in channel_in:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    print(json.dumps({"pid": pid}), file=channel_out, flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=channel_out,
          flush=True)
"""


class _ForkServer:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, *PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=self.env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        hello = json.loads(self.stdout.readline() or '{"ready": false}')
        self.ready = bool(hello.get("ready"))
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _read(self, timeout: float | None) -> dict[str, int]:
        ready, _, _ = select.select([self.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        answer: dict[str, int] = json.loads(line)
        return answer

    def call(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        timeout: float | None,
    ) -> subprocess.CompletedProcess[str]:
        with self.lock, tempfile.TemporaryDirectory(prefix="kvspec-fresh-") as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            request = {
                "mode": argv[1],
                "target": argv[2],
                "args": list(argv[3:]),
                "env": dict(env),
                "cwd": cwd,
                "stdout": str(out),
                "stderr": str(err),
            }
            self.stdin.write(json.dumps(request) + "\n")
            self.stdin.flush()
            pid = self._read(60)["pid"]
            try:
                code = self._read(timeout)["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._read(60)
                raise subprocess.TimeoutExpired(
                    list(argv), timeout or 0, out.read_text(errors="replace")
                ) from None
            return subprocess.CompletedProcess(
                list(argv),
                code,
                out.read_bytes().decode(errors="replace"),
                err.read_bytes().decode(errors="replace"),
            )


_server: _ForkServer | None = None


def _forkable(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    if os.environ.get("KVSPEC_NO_FORK_SERVER") or os.environ.get("KVSPEC_HIDE_VLLM"):
        return False
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] not in ("-c", "-m"):
        return False
    # Variables the interpreter reads at start-up only (PYTHONPATH is rebuilt per child).
    startup = {k for k in (*env, *os.environ) if k.startswith("PYTHON") and k != "PYTHONPATH"}
    return all(env.get(k) == (_server.env if _server else os.environ).get(k) for k in startup)


def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` for a fresh
    ``python -c``/``python -m`` process, forked from a process that has imported torch
    and vLLM (see the module's docstring)."""
    global _server
    environment = dict(os.environ if env is None else env)
    where = str(cwd) if cwd is not None else os.getcwd()
    done: subprocess.CompletedProcess[str] | None = None
    if _forkable(argv, environment):
        if _server is None:
            _server = _ForkServer()
        if _server.ready and _server.proc.poll() is None:
            done = _server.call(argv, environment, where, timeout)
    if done is None:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            env=environment,
            cwd=where,
            timeout=timeout,
            check=False,
        )
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done
