"""NIXL shim benchmark: planning cost, and NIXL reads against a numpy copy, in one run.

1. Planning plus descriptor building for a DeepSeek-V4-shaped cache (MLA, SWA-MLA
   compressor, ring and indexer caches per layer, block-outermost layout) at 15/30/60
   layers and 2,500/5,000/10,000 blocks: time and peak traced memory of
   ``plan_regions``, ``build_block_descs`` (strided Nx5), ``block_desc_ids`` and
   ``transfer_items`` + ``merge_runs`` for a request of every block, with the ratios
   that show linear growth. Page dimensions are shrunk (a real 60-layer row is ~4 MB,
   40 GB at 10,000 blocks); the planner reads only addresses, shapes and strides, so
   its cost depends on layers and blocks, not bytes.
2. A request's blocks read through NIXL (UCX, DRAM, two agents in this process) at
   4 KiB, 64 KiB and 1 MiB blocks, in each mode of ``read_blocks`` (``prepped``,
   ``per_block``, ``merged``), against raw NIXL: NIXL's own API driven directly
   (``make_prepped_xfer`` or ``get_xfer_descs`` + ``initialize_xfer``, ``transfer``, a
   ``check_xfer_state`` loop progressing the producer, ``release_xfer_handle``) on the
   same agents, prepared lists and memory, with the descriptors read_blocks posts
   computed beforehand, so nothing of ours runs; ours and raw alternate, best of the
   repetitions each. Also printed: our descriptor build alone (``request_descs``), and
   numpy copying the same blocks (``dst[ids] = src[ids]``, and one slice copy per run of
   consecutive ids), which shows where the transport stands against a copy here.
   Both spans run from before the descriptors are posted to after the handle is
   released (ours also builds its descriptors inside it, raw posts them ready-made: the
   same arrays, checked to be the same count). Target: ours <= 1.05x raw NIXL from
   64 KiB. ``--profile`` adds a cProfile of one read per mode and block size, ours and
   raw, with the own time spent in kvspec_traits' Python.

Run: ``.venv/bin/python benchmarks/bench_nixl.py`` (add ``--quick`` for a smoke run).
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import cProfile  # NIXL reads its log level at import
import gc
import pstats
import sys
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.nixl_helpers

import numpy as np
import torch
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from benchmarks._results import run as record_run
from kvspec_traits.nixl import (
    DescMode,
    RemotePeer,
    TraitsNixlAgent,
    block_desc_ids,
    build_block_descs,
    merge_runs,
    transfer_items,
)
from kvspec_traits.nixl._request import RequestDescs, request_descs
from kvspec_traits.transfer import peer_regions, plan_regions
from tests.nixl_helpers import layouts

TARGET = 1.05


def _v4_groups(layers: int) -> list[KVCacheGroupSpec]:
    """DeepSeek-V4's four cache kinds with small pages (distinct sizes, as in the model,
    so only the layer-0 caches share a base)."""
    mla = MLAAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=38,
        dtype=torch.bfloat16,
        tokens_per_state=4,
    )  # 4 states x 76 B
    swa = SlidingWindowMLASpec(
        block_size=16,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=13,
        dtype=torch.bfloat16,
        sliding_window=128,
    )  # 416 B
    ring = CircularBufferSpec(
        block_size=8, num_kv_heads=1, head_size=7, head_size_v=0, dtype=torch.float32
    )  # 224 B
    indexer = MLAAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=33,
        dtype=torch.uint8,
        tokens_per_state=4,
    )  # 132 B
    out = []
    for kind, spec in (
        ("mla", mla),
        ("compressor.swa", swa),
        ("compressor.ring", ring),
        ("indexer.k_cache", indexer),
    ):
        names = [f"model.layers.{i}.attn.{kind}" for i in range(layers)]
        out.append(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))
    return out


def _traced(fn: Callable[[], object], reps: int = 3) -> tuple[float, int, object]:
    """(best time of ``reps`` untraced runs, peak traced bytes of one more run, result).
    Best, not median: other processes on a shared machine only ever add time."""
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    gc.collect()
    tracemalloc.start()
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best, peak, result


def bench_planning(points: list[tuple[int, int]]) -> dict[tuple[int, int], dict[str, float]]:
    print("\n## Planning + descriptors, DeepSeek-V4-shaped (4 caches per layer, BLHNC)")
    print(
        f"{'layers':>6} {'blocks':>6} {'regions':>7} | {'plan ms':>8} {'peak KiB':>8} | "
        f"{'Nx5 ms':>7} | {'ids ms':>7} {'ids MiB':>8} | {'items+merge ms':>14} "
        f"{'peak MiB':>8} {'descs':>9} {'merged':>6}"
    )
    return {(layers, blocks): _plan_point(layers, blocks) for layers, blocks in points}


def _plan_point(layers: int, blocks: int) -> dict[str, float]:
    layout = KVCacheLayout.BLHNC
    config = layouts.kv_cache_config(_v4_groups(layers), blocks, layout)
    caches = layouts.allocate(config, layout)
    request = [list(range(g, blocks, 4)) for g in range(4)]  # every block, once
    plan_s, plan_peak, _ = _traced(lambda: plan_regions(caches, config))
    plan = plan_regions(caches, config)
    descs_s, _, _ = _traced(lambda: build_block_descs(plan))
    ids_s, ids_peak, _ = _traced(lambda: block_desc_ids(plan, request))

    def items() -> tuple[int, int]:
        (raw,) = transfer_items(plan, {0: peer_regions(plan)}, 1, request)
        return raw.count, merge_runs(raw).count

    items_s, items_peak, _ = _traced(items)
    per_block, merged = items()
    print(
        f"{layers:>6} {blocks:>6} {len(plan.regions):>7} | {plan_s * 1e3:>8.2f} "
        f"{plan_peak / 1024:>8.0f} | {descs_s * 1e3:>7.3f} | {ids_s * 1e3:>7.2f} "
        f"{ids_peak / 2**20:>8.1f} | {items_s * 1e3:>14.1f} {items_peak / 2**20:>8.1f} "
        f"{per_block:>9} {merged:>6}"
    )
    return {"plan": plan_s, "ids": ids_s, "items": items_s, "peak": items_peak}


def _ratio(
    results: dict[tuple[int, int], dict[str, float]],
    key: str,
    a: tuple[int, int],
    b: tuple[int, int],
) -> str:
    if a not in results or b not in results:
        return "n/a"
    return f"{results[a][key] / results[b][key]:.2f}"


def _request(num_blocks: int) -> list[int]:
    # Runs of 7 consecutive blocks with one-block gaps, as a free list hands them out.
    return [b for b in range(num_blocks) if b % 8 != 7]


MODES: tuple[DescMode, ...] = ("prepped", "per_block", "merged")


def bench_transfer(total_bytes: int, reps: int, profile: bool) -> list[tuple[int, str, float]]:
    print(
        "\n## Request read: ours (read_blocks) vs raw NIXL (its own API on the same agents, "
        "memory and descriptors) vs numpy copies of the same blocks (UCX, DRAM, in-process)"
    )
    print(
        f"{'block':>7} {'blocks':>6} | {'numpy idx':>9} {'numpy runs':>10} | {'mode':>9} "
        f"{'descs':>6} {'per-block':>9} | {'ours cpu':>8} {'build ms':>8} {'raw cpu':>8} "
        f"{'ours/raw':>8} | {'ours wall':>7} {'raw wall':>7} {'wall x':>7} | "
        f"{'x numpy idx':>11} {'x runs':>6}"
    )
    out = []
    for block_len, heads, head_size in ((4096, 1, 64), (65536, 8, 128), (1 << 20, 16, 1024)):
        for mode, ratio in _transfer_point(block_len, heads, head_size, total_bytes, reps, profile):
            out.append((block_len, mode, ratio))
    return out


def _raw_read(
    consumer: TraitsNixlAgent, producer: TraitsNixlAgent, peer: RemotePeer, descs: RequestDescs
) -> tuple[float, float]:
    """One read through NIXL's own API only: the agents, prepared lists and descriptor
    arrays read_blocks would use, posted and waited for as a NIXL user would; (CPU
    seconds of this process, wall seconds)."""
    agent, source = consumer._agent, producer._agent
    cpu, start = time.process_time(), time.perf_counter()
    if descs.local_ids is not None and descs.remote_ids is not None:
        handle = agent.make_prepped_xfer(
            "READ", consumer._local_prepped, descs.local_ids, peer.prepped, descs.remote_ids, b""
        )
    else:
        (items,) = descs.items
        local = agent.get_xfer_descs(items.local, "DRAM")
        remote = agent.get_xfer_descs(items.remote, "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, peer.name, b"")
    if agent.transfer(handle) == "ERR":
        raise RuntimeError("raw NIXL: posting failed")
    while True:
        source.get_new_notifs()  # progress the producer (no progress threads)
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            break
        if state == "ERR":
            raise RuntimeError("raw NIXL: transfer failed")
    agent.release_xfer_handle(handle)  # inside the span, as read_blocks' seconds include it
    return time.process_time() - cpu, time.perf_counter() - start


def _transfer_point(
    block_len: int, heads: int, head_size: int, total_bytes: int, reps: int, profile: bool
) -> list[tuple[str, float]]:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16
    )
    if spec.page_size_bytes != block_len:
        raise RuntimeError(f"page {spec.page_size_bytes} != {block_len}")
    num_blocks = max(16, 8 * (total_bytes // block_len) // 7)
    group = [KVCacheGroupSpec(layer_names=["model.layers.0.attn"], kv_cache_spec=spec)]
    config = layouts.kv_cache_config(group, num_blocks, KVCacheLayout.LBHNC)
    src_caches = layouts.allocate(config, KVCacheLayout.LBHNC)
    dst_caches = layouts.allocate(config, KVCacheLayout.LBHNC)
    layouts.fill_pattern(src_caches, seed=1)
    src = layouts.backing(src_caches).numpy().reshape(num_blocks, block_len)
    dst = layouts.backing(dst_caches).numpy().reshape(num_blocks, block_len)
    ids = _request(num_blocks)
    idx = np.asarray(ids)
    runs = [(r[0], r[-1] + 1) for r in np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1)]

    def numpy_idx() -> None:
        dst[idx] = src[idx]

    def numpy_runs() -> None:
        for lo, hi in runs:
            dst[lo:hi] = src[lo:hi]

    # Best of `reps` for every contender: a shared machine only ever adds time.
    t_idx = min(_timed(numpy_idx) for _ in range(reps))
    t_runs = min(_timed(numpy_runs) for _ in range(reps))
    producer, consumer = TraitsNixlAgent(), TraitsNixlAgent()
    plan = plan_regions(dst_caches, config)
    producer.register_plan(plan_regions(src_caches, config))
    consumer.register_plan(plan)
    peer = consumer.connect(producer.metadata())
    out: list[tuple[str, float]] = []
    for mode in MODES:
        descs = request_descs(plan, {0: peer}, ids, None, mode)

        def build_descs(mode: DescMode = mode) -> None:
            request_descs(plan, {0: peer}, ids, None, mode)

        def read(mode: DescMode = mode) -> None:
            consumer.read_blocks(peer, ids, mode=mode, progress=producer.progress)

        build = min(_timed(build_descs) for _ in range(reps))
        warm = consumer.read_blocks(peer, ids, mode=mode, progress=producer.progress)
        if warm.descriptors != descs.descriptors:  # the raw row posts exactly ours
            raise RuntimeError(f"{mode}: raw NIXL would post other descriptors than ours")
        _raw_read(consumer, producer, peer, descs)
        ours, raw = [], []
        for _ in range(reps):  # interleaved: both see the same load
            dst.fill(0)
            cpu = time.process_time()
            result = consumer.read_blocks(peer, ids, mode=mode, progress=producer.progress)
            ours.append((time.process_time() - cpu, result.seconds))
            if not np.array_equal(dst[idx], src[idx]):
                raise RuntimeError(f"{mode}: bytes differ after our read")
            dst.fill(0)
            raw.append(_raw_read(consumer, producer, peer, descs))
            if not np.array_equal(dst[idx], src[idx]):
                raise RuntimeError(f"{mode}: bytes differ after the raw NIXL read")
        # CPU time of this process (the copy runs inside NIXL's postXferReq, in this
        # thread): other processes on the shared cores add wall time to whichever of
        # the two they interrupt, CPU time to neither. Wall time printed beside it.
        t, t_raw = min(c for c, _ in ours), min(c for c, _ in raw)
        w, w_raw = min(x for _, x in ours), min(x for _, x in raw)
        out.append((mode, t / t_raw))
        print(
            f"{block_len // 1024:>5}Ki {len(ids):>6} | {t_idx * 1e3:>9.2f} {t_runs * 1e3:>10.2f} | "
            f"{mode:>9} {result.descriptors:>6} {result.per_block_descriptors:>9} | "
            f"{t * 1e3:>8.2f} {build * 1e3:>8.3f} {t_raw * 1e3:>8.2f} {t / t_raw:>7.2f}x | "
            f"{w * 1e3:>7.2f} {w_raw * 1e3:>7.2f} {w / w_raw:>6.2f}x | "
            f"{t_idx / w:>11.2f} {t_runs / w:>6.2f}"
        )
        if profile:
            _profile(read, mode)
            _profile(partial(_raw_read, consumer, producer, peer, descs), f"raw NIXL {mode}")
    consumer.close()
    producer.close()
    return out


def _profile(fn: Callable[[], object], mode: str) -> None:
    """Where one read's time goes (cProfile, own time, top entries)."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:6]  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    ours = sum(
        v[2]
        for (path, _, _), v in stats.stats.items()  # type: ignore[attr-defined]
        if "kvspec_traits" in path
    )
    print(
        f"    profile of one {mode} read ({total * 1e3:.2f} ms own time in all, "
        f"{ours * 1e3:.3f} ms in kvspec_traits' Python):"
    )
    for (path, line, name), (_, calls, own, _, _) in rows:
        where = name if path == "~" else f"{Path(path).name}:{line}({name})"
        print(f"      {own * 1e3:>8.2f} ms {own / total:>5.0%} {calls:>6}x {where}")


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    quick = "--quick" in sys.argv
    if quick:
        points = [(8, 1000), (16, 500), (16, 1000)]
        total, reps = 8 << 20, 3
    else:
        points = [(15, 10_000), (30, 10_000), (60, 10_000), (60, 2_500), (60, 5_000)]
        total, reps = 64 << 20, 11
    results = bench_planning(points)
    big, half_layers, half_blocks = (
        ((60, 10_000), (30, 10_000), (60, 5_000))
        if not quick
        else ((16, 1000), (8, 1000), (16, 500))
    )
    print(
        f"\nlinearity (2x layers): plan {_ratio(results, 'plan', big, half_layers)}x, "
        f"ids {_ratio(results, 'ids', big, half_layers)}x, "
        f"items {_ratio(results, 'items', big, half_layers)}x, "
        f"peak {_ratio(results, 'peak', big, half_layers)}x"
    )
    print(
        f"linearity (2x blocks): plan {_ratio(results, 'plan', big, half_blocks)}x, "
        f"ids {_ratio(results, 'ids', big, half_blocks)}x, "
        f"items {_ratio(results, 'items', big, half_blocks)}x, "
        f"peak {_ratio(results, 'peak', big, half_blocks)}x"
    )
    ratios = bench_transfer(total, reps, "--profile" in sys.argv)
    print()
    ok = True
    for block_len, mode, ratio in ratios:
        gated = block_len >= 65536
        verdict = ("met" if ratio <= TARGET else "NOT met") if gated else "info (not gated)"
        ok &= ratio <= TARGET or not gated
        print(
            f"target: ours <= {TARGET}x raw NIXL (CPU time) from 64 KiB; {mode} at "
            f"{block_len // 1024} KiB blocks: {ratio:.2f}x ({verdict})"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(record_run("bench_nixl", main, record="--quick" not in sys.argv))
