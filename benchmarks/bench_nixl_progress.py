"""What NIXL's progress-thread delay costs and saves (``kvspec_nixl_progress_delay_us``).

For each delay (0 is NIXL 1.5.1's own, the baseline of this run), in a fresh process:

- idle: one agent with a progress thread (UCX), nothing to do for 3 s; the process's CPU
  time over wall time (1.0 = a whole core);
- reads: two agents in one process, the reader built with the delay, 300 READs of 64 KiB
  each waited for (``check_xfer_state`` polled), the median time per read, and the
  process's CPU over wall time while reading.

Printed as ratios against delay 0 measured in the same run. Run:
``.venv/bin/python benchmarks/bench_nixl_progress.py [--delays 0 100 1000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._results import run as record_run  # noqa: E402


def _measure(delay: int) -> dict[str, float]:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from kvspec_traits.nixl._progress import progress_delay

    with progress_delay(delay):
        idle = nixl_agent(f"idle-{delay}", nixl_agent_config(backends=["UCX"]))
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(3.0)
    idle_share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    del idle

    with progress_delay(delay):
        reader = nixl_agent(f"reader-{delay}", nixl_agent_config(backends=["UCX"]))
    target = nixl_agent(f"target-{delay}", nixl_agent_config(backends=["UCX"]))
    src = torch.arange(16384, dtype=torch.float32)
    dst = torch.zeros_like(src)
    nbytes = src.numel() * src.element_size()
    target.register_memory([(src.data_ptr(), nbytes, 0, "")], "DRAM")
    reader.register_memory([(dst.data_ptr(), nbytes, 0, "")], "DRAM")
    peer = reader.add_remote_agent(target.get_agent_metadata())
    local = reader.get_xfer_descs([(dst.data_ptr(), nbytes, 0)], "DRAM")
    remote = reader.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")
    times: list[float] = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    for _ in range(300):
        start = time.perf_counter()
        handle = reader.initialize_xfer("READ", local, remote, peer)
        state = reader.transfer(handle)
        while state == "PROC":
            state = reader.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"read ended {state}")
        reader.release_xfer_handle(handle)
        times.append(time.perf_counter() - start)
    read_share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    if not torch.equal(dst, src):
        raise RuntimeError("the bytes read differ from the source")
    return {
        "idle_cpu": idle_share,
        "read_us": statistics.median(times) * 1e6,
        "read_cpu": read_share,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", type=int, nargs="+", default=[0, 100, 1000])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_measure(args.child)))
        return 0
    delays = [0, *[d for d in args.delays if d != 0]]
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    rows: dict[int, dict[str, float]] = {}
    for delay in delays:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(delay)],
            check=True,
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
        ).stdout
        rows[delay] = json.loads(out.strip().splitlines()[-1])
    load = os.getloadavg()[0]
    print(f"NIXL progress-thread delay, {os.cpu_count()} CPUs, load average {load:.1f}")
    print(
        f"{'delay us':>9} {'idle CPU':>9} {'x base':>7} {'read us':>8} {'x base':>7} "
        f"{'read CPU':>9} {'x base':>7}"
    )
    base = rows[0]
    for delay, row in rows.items():
        print(
            f"{delay:>9} {row['idle_cpu']:>9.3f} {row['idle_cpu'] / base['idle_cpu']:>7.2f} "
            f"{row['read_us']:>8.1f} {row['read_us'] / base['read_us']:>7.2f} "
            f"{row['read_cpu']:>9.3f} {row['read_cpu'] / base['read_cpu']:>7.2f}"
        )
    chosen = rows.get(100)
    if chosen is not None:
        saved = chosen["idle_cpu"] <= 0.1 * base["idle_cpu"]
        print(f"target: idle CPU at 100 us <= 0.1x NIXL's own: {'met' if saved else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    child = "--child" in sys.argv  # one measurement, for the parent
    raise SystemExit(record_run("bench_nixl_progress", main, record=not child))
