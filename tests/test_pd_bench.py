"""``benchmarks/pd_bench.py`` without servers: how it judges ours/upstream, and the freeze
it puts on the pairs it is not measuring.

The benchmark itself starts twelve vLLM servers and takes minutes, too long for the suite
(its ``--quick`` mode alone starts three pairs); these tests cover what decides its exit
code and what keeps an idle pair off the measured one's cores. Expected ratios are
computed by hand from the requests given (req/s = answered requests / batch seconds,
TTFT percentiles nearest-rank, as ``tests/e2e/pd_soak.py`` computes them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.pd_bench import (
    LIKE_FOR_LIKE,
    SLEEP_PROOF,
    Contender,
    Group,
    Pair,
    Verdict,
    contenders,
    judge,
    overlay_proofs,
    pool,
    read_profile,
    same_code_line,
    tail_split,
)
from tests.e2e.patched_vllm import overlay_environment
from tests.e2e.pd_harness import ServerPair, VllmServer
from tests.e2e.pd_soak import LoadResult, Outcome


def _batch(requests: int, wall_s: float, ttft_s: float) -> LoadResult:
    """``requests`` answered requests in ``wall_s`` seconds, each with TTFT ``ttft_s``."""
    outcomes = [Outcome(i, "ok", (1, 2), ttft_s, ttft_s) for i in range(requests)]
    return LoadResult("batch", outcomes, wall_s)


def test_a_ratio_outside_its_target_and_outside_the_spread_is_missed() -> None:
    # upstream: 3 runs of 10 requests in 1 s (10 req/s); ours: 10 requests in 1.03,
    # 1.04, 1.02 s. Pooled: 30 / 3.09 s = 9.709 req/s, ratio 0.9709; per run 1/1.03 =
    # 0.9709, 1/1.04 = 0.9615, 1/1.02 = 0.9804: spread (0.9804 - 0.9615) / 2 = 0.0094,
    # narrower than the difference 0.029, so the miss of 0.98 stands.
    upstream = [_batch(10, 1.0, 0.1) for _ in range(3)]
    ours = [_batch(10, wall, 0.1) for wall in (1.03, 1.04, 1.02)]
    rps, p50, p99 = judge(ours, upstream)
    assert rps.metric == "req/s"
    assert rps.ratio == pytest.approx(30 / 3.09 / 10)
    assert rps.spread == pytest.approx((1 / 1.02 - 1 / 1.04) / 2)
    assert not rps.met and not rps.within_spread and rps.missed
    assert "MISSED" in rps.describe()
    assert p50.ratio == pytest.approx(1.0) and p50.met and not p50.missed
    assert p99.ratio == pytest.approx(1.0) and p99.met


def test_a_miss_smaller_than_the_spread_of_the_runs_is_said_so_and_not_failed() -> None:
    # TTFT p50: upstream 100 ms in every run; ours 90, 120 and 104 ms. Pooled (30
    # requests: ten each of 90, 104, 120 ms) the nearest-rank median is the 15th, 104 ms:
    # ratio 1.04 is met; p99 (the 30th) 120 ms: ratio 1.20, per run 0.90, 1.20,
    # 1.04: spread 0.15, narrower than 0.20: missed.
    upstream = [_batch(10, 1.0, 0.100) for _ in range(3)]
    ours = [_batch(10, 1.0, t) for t in (0.090, 0.120, 0.104)]
    _rps, p50, p99 = judge(ours, upstream)
    assert p50.ratio == pytest.approx(1.04) and p50.met
    assert p99.ratio == pytest.approx(1.20) and p99.missed
    # A run set whose ratios range 0.80-1.10 around a pooled 1.08: the spread 0.15 is
    # wider than the difference 0.08, so the miss of 1.05 is "within spread".
    wide = Verdict("TTFT p50", 1.08, (0.80, 1.10, 1.08), 1.05, higher_is_better=False)
    assert wide.spread == pytest.approx(0.15)
    assert not wide.met and wide.within_spread and not wide.missed
    assert "within spread" in wide.describe()


def test_a_p99_miss_is_weighed_against_the_same_codes_two_pairs() -> None:
    # TTFT p99: upstream 100 ms in 3 runs of 10; ours 130 ms in every run: ratio 1.30, per
    # run 1.30 each, spread 0: a miss on its own. The same code's other pair (ours with
    # the keys) at 95 ms: A/A ratio 95 / 130 = 0.731, a factor 1/0.731 = 1.368 from 1, at
    # least ours/upstream's 1.30: within noise, not failed. At 120 ms the A/A ratio 0.923
    # (a factor 1.083) is nearer 1 than 1.30: the miss stands.
    upstream = [_batch(10, 1.0, 0.100) for _ in range(3)]
    ours = [_batch(10, 1.0, 0.130) for _ in range(3)]
    noisy = [_batch(10, 1.0, 0.095) for _ in range(3)]
    _rps, p50, p99 = judge(ours, upstream, noisy)
    assert p99.ratio == pytest.approx(1.30) and p99.spread == pytest.approx(0.0)
    assert p99.same_code == pytest.approx(95 / 130)
    assert p99.within_noise and not p99.missed
    assert "within noise" in p99.describe() and "same code 0.73x" in p99.describe()
    # Only the tail is weighed so: the median of every request keeps the per-run spread.
    assert p50.same_code is None and p50.missed
    steady = [_batch(10, 1.0, 0.120) for _ in range(3)]
    _rps, _p50, p99 = judge(ours, upstream, steady)
    assert p99.same_code == pytest.approx(120 / 130)
    assert not p99.within_noise and p99.missed
    # Without the other pair (the keyed row not run) nothing changes.
    assert judge(ours, upstream)[2].missed


def _timed(start: float, prefill_s: float, decode_s: float) -> Outcome:
    """A disaggregated answer started at ``start``: TTFT = prefill + decode request."""
    ttft = prefill_s + decode_s
    return Outcome(0, "ok", (1,), ttft, ttft, finished_at=start + ttft, decode_ttft=decode_s)


def test_the_tail_split_says_which_server_held_the_slowest_requests() -> None:
    # 100 requests: 97 of 100 ms (prefill 60, decode 40), three of 600 ms (prefill 500,
    # decode 100), two of them started 50 ms apart, the third 2 s later. Nearest-rank p99
    # is the 99th: 600 ms, so the tail is the three; their means 500 and 100 ms; two
    # started within 100 ms of another.
    fast = [_timed(i * 0.01, 0.060, 0.040) for i in range(97)]
    slow = [_timed(1.00, 0.5, 0.1), _timed(1.05, 0.5, 0.1), _timed(3.05, 0.5, 0.1)]
    split = tail_split([LoadResult("b", fast + slow, 5.0)])
    assert split is not None
    assert split.requests == 3
    assert split.prefill_ms == pytest.approx(500) and split.decode_ms == pytest.approx(100)
    assert split.clustered == 2
    assert "2 of them started within 100 ms of another" in split.describe()
    # Answers of one server alone (no decode request) have no split.
    alone = [Outcome(0, "ok", (1,), 0.1, 0.1, finished_at=1.0)]
    assert tail_split([LoadResult("b", alone, 1.0)]) is None


def test_the_same_codes_two_pairs_show_the_runs_resolution(tmp_path: Path) -> None:
    # Ours without the keys: 3 runs of 10 requests in 1 s at 100 ms; ours with the keys: 10
    # in 1.05 s at 116 ms. Keyed over plain: req/s (30 / 3.15) / 30 = 0.952 (below 0.98),
    # TTFT p50 and p99 1.16 (above 1.05): the same code outside all three targets.
    servers = ServerPair(
        *(
            VllmServer(name=n, model=tmp_path, served_model_name="x", core=0, workdir=tmp_path)
            for n in ("prefill", "decode")
        )
    )
    plain = Pair(Contender(LIKE_FOR_LIKE, "TraitsNixlConnector", None, {}), servers)
    keyed = Pair(Contender("ours+keys", "TraitsNixlConnector", None, {}), servers)
    plain.results = [_batch(10, 1.0, 0.100) for _ in range(3)]
    keyed.results = [_batch(10, 1.05, 0.116) for _ in range(3)]
    line = same_code_line(Group("llama", "pull", [plain, keyed]))
    assert line == (
        "req/s 0.95x, TTFT p50 1.16x, TTFT p99 1.16x; outside the targets: req/s, "
        "TTFT p50, TTFT p99"
    )
    keyed.results = [_batch(10, 1.0, 0.102) for _ in range(3)]  # 1.02x: within 1.05
    line = same_code_line(Group("llama", "pull", [plain, keyed]))
    assert line.endswith("TTFT p99 1.02x; within the targets")
    keyed.results = []
    assert same_code_line(Group("llama", "pull", [plain, keyed])) == "not measured"


def test_an_unanswered_upstream_is_a_miss_not_a_pass() -> None:
    nothing = Verdict("req/s", float("nan"), (float("nan"),), 0.98, higher_is_better=True)
    assert nothing.missed


def test_pooled_runs_count_every_request_over_the_summed_batch_time() -> None:
    merged = pool("x", [_batch(10, 1.0, 0.1), _batch(6, 2.0, 0.3)])
    assert len(merged.outcomes) == 16
    assert merged.requests_per_s == pytest.approx(16 / 3.0)
    assert merged.ttft(50) == pytest.approx(0.1)  # the 8th of 16 (ten at 0.1 s first)
    assert merged.ttft(99) == pytest.approx(0.3)


def test_the_like_for_like_row_has_upstreams_settings_and_no_kvspec_key() -> None:
    for mode in ("pull", "push"):
        upstream, ours, keyed = contenders(mode, 100, "sleep")
        assert ours.key == LIKE_FOR_LIKE
        assert dict(ours.extra) == dict(upstream.extra)
        assert not any(
            k.startswith("kvspec_") for k in ours.kv("kv_consumer")["kv_connector_extra_config"]
        )
        assert {k for k in keyed.extra if k.startswith("kvspec_")} == {
            "kvspec_nixl_progress_delay_us",
            "kvspec_shm_wait",
        }
        assert upstream.module is None and ours.module == keyed.module
        # vLLM's queue wait: the same environment for both like-for-like pairs (the
        # overlay's switch, which neither connector reads), none for the keyed pair.
        assert dict(ours.env) == dict(upstream.env)
        assert ours.env["KVSPEC_OVERLAY_SHM_SLEEP"] == "1"
        assert ours.env["PYTHONPATH"].split(":")[0].endswith("tests/e2e/overlay")
        assert not keyed.env
        assert overlay_proofs(ours.env) == [SLEEP_PROOF]
        yielding = contenders(mode, 100, "sleep", vllm_wait="yield")
        assert not any(c.env for c in yielding)
        # NIXL's progress delay for both, by the overlay too (the default run's setting).
        up, mine, keyed = contenders(mode, 100, "sleep", delay_both_us=100)
        assert dict(mine.env) == dict(up.env) and not keyed.env
        assert mine.env["KVSPEC_OVERLAY_NIXL_PROGRESS_DELAY_US"] == "100"
        assert overlay_proofs(mine.env) == [
            SLEEP_PROOF,
            "kvspec-overlay: NIXL progress delay 100 us",
        ]


_AGENT = """
import sys, time
import nixl._api as api
config = api.nixlBind.nixlAgentConfig()
config.pthrDelay = 0  # what nixl_agent sets
print(config.pthrDelay)
agent = api.nixl_agent("idle", api.nixl_agent_config())  # UCX, a progress thread
start = time.process_time()
time.sleep(1.0)
print(time.process_time() - start)
"""


def test_the_overlay_gives_every_nixl_agent_the_delay_and_says_so(tmp_path: Path) -> None:
    """A process started with the overlay's NIXL switch: the agent config NIXL builds keeps
    the floor where NIXL writes 0, the process prints the line pd-bench requires, and an
    idle agent's progress thread no longer spins a core (NIXL's own: 1.00 of a core idle,
    0.03 at 100 us, benchmarks/bench_nixl_progress.py)."""
    quiet = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    env = {**quiet, **overlay_environment(shm_sleep=False, nixl_progress_delay_us=100)}
    run = subprocess.run(
        [sys.executable, "-c", _AGENT], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    floor, cpu = run.stdout.split()
    assert int(floor) == 100
    assert "kvspec-overlay: NIXL progress delay 100 us (nixl_cu12._api;" in run.stderr
    assert float(cpu) < 0.5, f"an idle agent took {cpu} s of CPU in 1 s"
    # Without the switch the overlay leaves NIXL alone: its zero stands.
    env = {**quiet, **overlay_environment(shm_sleep=False)}
    plain = subprocess.run(
        [sys.executable, "-c", _AGENT.split("agent =")[0]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["0"] and "kvspec-overlay" not in plain.stderr


def test_an_unknown_vllm_wait_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"queue wait 'spin': give one of \('sleep', 'yield'\)"):
        contenders("pull", 100, "sleep", vllm_wait="spin")


class _Spinner(VllmServer):
    """A "server" that only burns CPU: what an idle pair's NIXL progress thread does."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "while True: pass"]


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()[0]


def test_a_frozen_pair_takes_no_cpu_and_runs_again_when_thawed(tmp_path: Path) -> None:
    servers = ServerPair(
        *(
            _Spinner(name=n, model=tmp_path, served_model_name="x", core=0, workdir=tmp_path)
            for n in ("prefill", "decode")
        )
    )
    pair = Pair(Contender("ours", "TraitsNixlConnector", None, {}), servers)
    for server in servers.servers():
        server.start()
    try:
        time.sleep(0.5)
        pair.freeze()
        time.sleep(0.2)  # the signal is delivered asynchronously
        pids = [s.proc.pid for s in servers.servers() if s.proc is not None]
        assert [_state(pid) for pid in pids] == ["T", "T"]
        before = pair.cpu_seconds()
        time.sleep(1.0)
        assert pair.cpu_seconds() - before < 0.02
        pair.thaw()
        time.sleep(1.0)
        assert pair.cpu_seconds() - before > 0.2  # two spinners, on whatever cores are free
    finally:
        pair.thaw()
        for server in servers.servers():
            server.stop()


def test_a_profile_counts_the_samples_inside_the_connector_and_inside_ours() -> None:
    # py-spy's raw format: a stack per line, then its sample count. 7 + 2 + 1 + 4 = 14
    # samples; inside the connector: the 2 in vLLM's kv_transfer, the 1 in ours, and the
    # 4 in vLLM's read called from ours' lease check (7). Ours' own: only the 1 whose
    # innermost connector frame is ours (it called logging, outside the connector).
    # With --subprocesses each stack starts with its process's command line, which names
    # our module for every sample of ours: it must not count.
    ours = 'process 7:"python -m vllm.entrypoints.openai.api_server --kv-transfer-config '
    ours += '{\\"kv_connector_module_path\\": \\"kvspec_traits.vllm_connector\\"}";'
    lease = "read_blocks_for_req (kvspec_traits/vllm_connector/_lease_worker.py:90)"
    raw = "\n".join(
        (
            ours + "run (vllm/v1/engine/core.py:10);step (vllm/v1/engine/core.py:20) 7",
            "step (core.py:20);start_load_kv (vllm/distributed/kv_transfer/nixl.py:5) 2",
            f"step (core.py:20);{lease};warning (logging/__init__.py:1) 1",
            f"{ours}step (core.py:20);{lease};_read_blocks (vllm/distributed/kv_transfer/w.py:5) 4",
            "",
        )
    )
    profile = read_profile("ours decode", raw)
    assert (profile.samples, profile.connector, profile.traits) == (14, 7, 1)
    assert "50.0% in the connector, 7.1% in kvspec_traits" in profile.describe()
