"""The e2e harness's overlay for servers of a *patched* vLLM (issue 35): every Python
process a server starts (API server, engine core, workers: ``PYTHONPATH`` and the
environment are inherited) imports ``vllm.distributed.kv_transfer`` from the patched copy
at ``KVSPEC_MIGRATED_ROOT`` (the folder holding ``kv_transfer/``: the installed tree with
``make vllm-patch``'s patch applied), the rest of vLLM from its installation. Python runs
this module at start-up because its folder is on ``PYTHONPATH``; without
``KVSPEC_MIGRATED_ROOT`` it does nothing.

The package's import prints one line to stderr, ``kvspec-migrated: ... from <file>``, which
the e2e tests read in each server's log: the proof that the server ran the patched tree.

``KVSPEC_OVERLAY_SHM_SLEEP=1`` also makes vLLM's shared-memory queue readers wait with
``time.sleep(0)`` (``vllm.distributed.utils.USE_SCHED_YIELD`` false, set as that module
loads; each process says so on stderr, ``kvspec-overlay: ... USE_SCHED_YIELD False``): what
``kvspec_shm_wait: "sleep"`` does in the traits connector's processes, so a patched pair
waits as the traits pairs do (docs/vllm.md, "Push end to end"), and ``make pd-bench``'s
like-for-like pairs, upstream's and ours, wait alike (benchmarks/pd_bench.py).

``KVSPEC_OVERLAY_NIXL_PROGRESS_DELAY_US=N`` gives every NIXL agent built in the process a
progress thread that waits at least N microseconds between polls (what
``kvspec_nixl_progress_delay_us`` does for the traits connector's agents: NIXL 1.5.1's
Python API leaves the delay at zero, so each agent's thread spins a core), once NIXL's
``_api`` module has loaded (its bindings' ``nixlAgentConfig`` replaced by
``kvspec_traits.nixl._progress.delayed_agent_config``'s subclass); each process says so on
stderr, ``kvspec-overlay: NIXL progress delay N us``. ``make pd-bench``'s like-for-like
pairs, upstream's and ours, run with it alike.

``KVSPEC_OVERLAY_MOONCAKE_CPU_DEVICE=1`` (the MooncakeConnector pairs only, patched and
unpatched alike) is a CPU-only shim for vLLM's Mooncake connector:
``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()``,
which raises on a CPU-only torch ("Cannot access accelerator device when none is
available"). When ``vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector``
loads in a process whose torch has no accelerator, ``current_device_index`` answers 0 (the
one device a CPU process has, which vLLM's ``CpuPlatform.set_device`` then accepts) and the
process prints ``kvspec-overlay: torch.accelerator.current_device_index -> 0 ...`` to
stderr, which the tests read in the worker's log. Nothing else changes, and a process with
an accelerator is left alone. The conformance harness carries the same shim for vLLM's
Mooncake unit tests (tools/kvspec_workbench/conformance/kvspec_conformance.py).

Test harness only: the library never loads it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

_PACKAGE = "vllm.distributed.kv_transfer"
_UTILS = "vllm.distributed.utils"
_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
_ROOT = os.environ.get("KVSPEC_MIGRATED_ROOT", "")
_SHM_SLEEP = os.environ.get("KVSPEC_OVERLAY_SHM_SLEEP") == "1"
_MOONCAKE_CPU_DEVICE = os.environ.get("KVSPEC_OVERLAY_MOONCAKE_CPU_DEVICE") == "1"
_NIXL_DELAY_US = os.environ.get("KVSPEC_OVERLAY_NIXL_PROGRESS_DELAY_US", "")
# NIXL's real API module per build (``nixl._api`` is an alias its __init__ puts in sys.modules).
_NIXL_APIS = frozenset(f"{p}._api" for p in ("nixl_cu12", "nixl_cu13", "nixl_rocm"))


class _AfterLoad(importlib.abc.Loader):
    """A module's own loader, then :meth:`after` on the loaded module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self.after(module)

    def after(self, module: ModuleType) -> None:
        raise NotImplementedError


class _SleepingUtils(_AfterLoad):
    """vLLM's ``vllm.distributed.utils`` as it is, with ``USE_SCHED_YIELD`` false."""

    def after(self, module: ModuleType) -> None:
        module.USE_SCHED_YIELD = False  # type: ignore[attr-defined]
        print(
            f"kvspec-overlay: vllm.distributed.utils.USE_SCHED_YIELD False (pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )


def _cpu_device_index() -> int:
    """``torch.accelerator.current_device_index()`` of a CPU-only process: device 0."""
    return 0


class _MooncakeOnCpu(_AfterLoad):
    """vLLM's Mooncake connector module as it is; once it has loaded, a torch without an
    accelerator answers device 0 to ``torch.accelerator.current_device_index()``."""

    def after(self, module: ModuleType) -> None:
        import torch

        if not torch.accelerator.is_available():
            torch.accelerator.current_device_index = _cpu_device_index
            print(
                f"kvspec-overlay: torch.accelerator.current_device_index -> 0 for "
                f"{_MOONCAKE} (CPU-only torch; pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )


class _DelayedNixl(_AfterLoad):
    """NIXL's API module as it is; once it has loaded, every agent config it builds keeps
    a progress-thread delay of at least ``KVSPEC_OVERLAY_NIXL_PROGRESS_DELAY_US``."""

    def after(self, module: ModuleType) -> None:
        from kvspec_traits.nixl._progress import check_delay, delayed_agent_config

        floor = check_delay(int(_NIXL_DELAY_US), "KVSPEC_OVERLAY_NIXL_PROGRESS_DELAY_US")
        bindings = module.nixlBind
        bindings.nixlAgentConfig = delayed_agent_config(bindings.nixlAgentConfig, floor)
        print(
            f"kvspec-overlay: NIXL progress delay {floor} us ({module.__name__}; "
            f"pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )


def _wrappers() -> dict[str, type[_AfterLoad]]:
    """The modules this process's switches wrap, and the wrapper of each."""
    out: dict[str, type[_AfterLoad]] = {}
    if _SHM_SLEEP:
        out[_UTILS] = _SleepingUtils
    if _MOONCAKE_CPU_DEVICE:
        out[_MOONCAKE] = _MooncakeOnCpu
    if _NIXL_DELAY_US:
        out |= dict.fromkeys(_NIXL_APIS, _DelayedNixl)
    return out


_WRAPPERS = _wrappers()


class _Overlay(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == _PACKAGE and _ROOT:
            spec = importlib.machinery.PathFinder.find_spec(fullname, [_ROOT])
            if spec is None:
                raise ImportError(f"kvspec-migrated: no kv_transfer package in {_ROOT}")
            print(
                f"kvspec-migrated: {_PACKAGE} from {spec.origin} (pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )
            return spec
        wrapper = _WRAPPERS.get(fullname)
        if wrapper is not None:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = wrapper(spec.loader)
            return spec
        return None


if _ROOT or _WRAPPERS:
    sys.meta_path.insert(0, _Overlay())
