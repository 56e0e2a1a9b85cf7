"""Importing vllm-ascend's real spec classes, on an NPU machine or off one.

``vllm_ascend.core.kv_cache_interface`` (0.23.0.post1) imports ``AscendDeviceType`` and
``get_ascend_device_type`` from ``vllm_ascend.utils``, whose first lines import
``torch_npu`` (the NPU runtime; it needs the CANN toolkit and its own torch build). The
spec module asks that function one thing: which Ascend chip this is (A5 stores its C8
caches as float8/float32, the others as int8/float16: the defaults of two fields). So
where ``torch_npu`` is missing, that one query is answered by a named stand-in,
:data:`STANDIN_MODULE`, in ``sys.modules`` only while the spec module is imported and
removed after (the spec module keeps the two names it bound). The stand-in's enum is
vllm-ascend's own ``AscendDeviceType``, compiled from its class statement in the real
``vllm_ascend/utils.py``; its device is ``KVSPEC_ASCEND_DEVICE`` (default ``A3``). Later
trees (0.27.1rc1) no longer import ``vllm_ascend.utils`` from the spec module, and where
``torch_npu`` is installed the first import succeeds: then nothing is stood in for.
"""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Final

__all__ = ["DEVICE_ENV", "STANDIN_MODULE", "load_spec_module", "vllm_ascend_present"]

SPEC_MODULE: Final = "vllm_ascend.core.kv_cache_interface"
STANDIN_MODULE: Final = "vllm_ascend.utils"
DEVICE_ENV: Final = "KVSPEC_ASCEND_DEVICE"


class AscendImportError(ImportError):
    """vllm-ascend is on the path but its spec module cannot be imported."""


def vllm_ascend_present() -> bool:
    """Whether a ``vllm_ascend`` package is importable (installed, or on the path)."""
    return importlib.util.find_spec("vllm_ascend") is not None


def _standin(package_dir: Path) -> types.ModuleType:
    """A ``vllm_ascend.utils`` holding vllm-ascend's own ``AscendDeviceType`` and a
    ``get_ascend_device_type()`` that answers ``KVSPEC_ASCEND_DEVICE``."""
    source_path = package_dir / "utils.py"
    tree = ast.parse(source_path.read_text(), filename=str(source_path))
    found: list[ast.stmt] = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AscendDeviceType"
    ]
    if len(found) != 1:
        raise AscendImportError(f"{source_path} defines no class AscendDeviceType")
    module = types.ModuleType(
        STANDIN_MODULE, f"stand-in for {STANDIN_MODULE} (kvspec_traits_ascend)"
    )
    namespace = module.__dict__
    namespace["Enum"] = enum.Enum
    exec(compile(ast.Module(body=found, type_ignores=[]), str(source_path), "exec"), namespace)
    device_type = namespace["AscendDeviceType"]
    device = os.environ.get(DEVICE_ENV, "A3")
    try:
        chosen = device_type[device]
    except KeyError:
        names = ", ".join(device_type.__members__)
        raise AscendImportError(f"{DEVICE_ENV}={device!r} is none of {names}") from None

    def get_ascend_device_type() -> enum.Enum:
        return chosen  # type: ignore[no-any-return]  # an AscendDeviceType member

    namespace["get_ascend_device_type"] = get_ascend_device_type
    return module


def load_spec_module() -> types.ModuleType:
    """``vllm_ascend.core.kv_cache_interface``, imported (see the module docstring):
    as it is, and again with the stand-in if that failed for want of ``torch_npu``."""
    try:
        return importlib.import_module(SPEC_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != "torch_npu":
            raise
    package = importlib.import_module("vllm_ascend")  # its __init__ imports nothing
    package_dir = Path(next(iter(package.__path__)))
    sys.modules[STANDIN_MODULE] = _standin(package_dir)
    try:
        return importlib.import_module(SPEC_MODULE)
    finally:
        del sys.modules[STANDIN_MODULE]
