"""Which MLA attention backends this machine offers, as vLLM itself decides.

vLLM-CPU serves DeepSeek-style MLA with one of two backends (``get_attn_backend_cls`` in
``vllm/platforms/cpu.py``): ``AMX_MLA`` where the CPU has AMX tiles (chosen by default
there), and the reference ``CPU_MLA`` everywhere else, or anywhere when requested. They
want different settings: AMX_MLA takes bfloat16 only and a block size that is a multiple
of 32; CPU_MLA any float dtype and block size 16. The KV pages a server produces, and so
what the connector moves, follow them.

The MLA tests are parametrized over :data:`MLA_BACKENDS`. Whether a case can run here is
asked of vLLM's own backend selection with the case's settings (never guessed from
/proc/cpuinfo): a case whose backend vLLM would not select is skipped, with that reason.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch
    from vllm.config import AttentionConfig

    from tests.e2e.pd_harness import Serving

__all__ = [
    "AMX_MLA",
    "CPU_MLA",
    "MLA_BACKENDS",
    "MLA_HEAD_SIZE",
    "MLABackend",
    "amx_detection_forced",
    "amx_tiles",
    "mla_backend_params",
    "mla_backends_header",
    "selected_mla_backend",
    "skip_unless_offered",
]

# kv_lora_rank 512 + qk_rope_head_dim 64: the one latent size both CPU MLA kernels take,
# and the tiny DeepSeek-V2's (scripts/make_tiny_models.py).
MLA_HEAD_SIZE = 576


@dataclass(frozen=True)
class MLABackend:
    """One way of serving an MLA model on CPU: the backend, and the settings it needs.

    ``requested``: the case asks for the backend by name (``--attention-backend``, or the
    attention config); otherwise it relies on vLLM's default pick, as a user who passes no
    flag does.
    """

    name: str  # an AttentionBackendEnum member (and the backend's get_name())
    dtype: str  # --dtype: the weights, and the KV cache ("auto" follows them)
    block_size: int
    requested: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype = getattr(torch, self.dtype)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{self.dtype!r} is not a torch dtype")
        return dtype

    @property
    def label(self) -> str:
        """What failure messages name: backend, dtype, block size."""
        how = "requested" if self.requested else "vLLM's default pick"
        return f"{self.name} ({how}; {self.dtype}, block {self.block_size})"

    def server_args(self) -> tuple[str, ...]:
        """The ``vllm serve`` flags of this case."""
        args = ("--dtype", self.dtype, "--block-size", str(self.block_size))
        return (("--attention-backend", self.name) if self.requested else ()) + args

    def serving(self) -> Serving:
        """How the e2e harness serves an MLA model with this backend; the servers must log
        vLLM's "Using <backend> backend" line."""
        from tests.e2e.pd_harness import Serving

        return Serving(
            backend=self.name,
            dtype=self.dtype,
            flags=self.server_args(),
            backend_log=f"Using {self.name} backend",
        )

    def attention_config(self) -> AttentionConfig:
        """The attention config of a ``VllmConfig`` that serves this case."""
        from vllm.config import AttentionConfig
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        if not self.requested:
            return AttentionConfig()
        return AttentionConfig(backend=AttentionBackendEnum[self.name])

    def unavailable_reason(self) -> str | None:
        """None if vLLM selects this backend here for these settings, else why not."""
        chosen = selected_mla_backend(
            self.name if self.requested else None, self.dtype, self.block_size
        )
        if chosen == self.name:
            return None
        asked = f"asked for {self.name}" if self.requested else "asked for no backend"
        return (
            f"this machine does not offer {self.name}: vLLM's CPU platform, {asked} "
            f"({self.dtype}, block {self.block_size}), selects {chosen} "
            f"(torch.cpu._is_amx_tile_supported() is {amx_tiles()})"
        )


# AMX_MLA: vLLM's default wherever the CPU has AMX, so the case requests nothing (the path
# a user on such a server runs). bfloat16: AMXMLABackend.supported_dtypes; 32: its
# MultipleOf(32) kernel block size.
AMX_MLA = MLABackend(name="AMX_MLA", dtype="bfloat16", block_size=32, requested=False)
# CPU_MLA requested by name: it runs on every CPU; float32 keeps the tiny model's greedy
# decoding free of near-ties; 16 is its only kernel block size.
CPU_MLA = MLABackend(name="CPU_MLA", dtype="float32", block_size=16, requested=True)
MLA_BACKENDS: tuple[MLABackend, ...] = (AMX_MLA, CPU_MLA)


def amx_tiles() -> bool:
    """What vLLM's CPU platform asks torch before it prefers AMX_MLA."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def _clear_selection_caches() -> None:
    from vllm.v1.attention.selector import _cached_get_attn_backend

    selected_mla_backend.cache_clear()
    _cached_get_attn_backend.cache_clear()  # keyed by the request, not by the CPU


@contextmanager
def amx_detection_forced(present: bool) -> Iterator[None]:
    """Make vLLM's CPU platform see an x86 CPU with (or without) AMX tiles: it asks
    ``torch.cpu._is_amx_tile_supported()`` and ``get_cpu_architecture()`` at each
    selection. Only the selection changes, not the kernels: this proves what vLLM
    decides and checks for the AMX settings on any CPU, never that AMX kernels run."""
    import torch
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum

    platform = type(current_platform)
    saved_amx = torch.cpu._is_amx_tile_supported
    saved_arch = platform.__dict__.get("get_cpu_architecture")
    _clear_selection_caches()
    torch.cpu._is_amx_tile_supported = lambda: present
    platform.get_cpu_architecture = classmethod(  # type: ignore[method-assign, assignment]
        lambda cls: CpuArchEnum.X86
    )
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = saved_amx
        if saved_arch is None:
            del platform.get_cpu_architecture
        else:
            platform.get_cpu_architecture = saved_arch  # type: ignore[method-assign]
        _clear_selection_caches()


@contextmanager
def _quiet_selection() -> Iterator[None]:
    # get_attn_backend_cls logs "Using X backend." at INFO; the answer is ours to report.
    logger = logging.getLogger("vllm.platforms.cpu")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@functools.cache
def selected_mla_backend(requested: str | None, dtype: str, block_size: int) -> str:
    """The MLA backend vLLM's platform selects for a 576-wide latent with these settings,
    ``requested`` by name or not (vLLM's default pick)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(
        head_size=MLA_HEAD_SIZE,
        dtype=getattr(torch, dtype),
        kv_cache_dtype="auto",
        block_size=block_size,
        use_mla=True,
    )
    backend = AttentionBackendEnum[requested] if requested is not None else None
    with _quiet_selection():
        # None is what vLLM's selector passes when nothing is requested.
        path = current_platform.get_attn_backend_cls(backend, config)  # type: ignore[arg-type]
    name: str = resolve_obj_by_qualname(path).get_name()
    return name


def skip_unless_offered(backend: MLABackend) -> list[pytest.MarkDecorator]:
    """A skip mark, with vLLM's reason, where this machine does not offer ``backend``."""
    reason = backend.unavailable_reason()
    return [] if reason is None else [pytest.mark.skip(reason=reason)]


def mla_backend_params() -> list[object]:
    """``pytest.param`` per backend (id = its name), skipped where vLLM would not run it."""
    return [
        pytest.param(backend, id=backend.name, marks=skip_unless_offered(backend))
        for backend in MLA_BACKENDS
    ]


def mla_backends_header() -> str:
    """One line for the suite's header: what this machine offers, and vLLM's default."""
    parts = []
    for backend in MLA_BACKENDS:
        reason = backend.unavailable_reason()
        parts.append(f"{backend.label}: {'runs' if reason is None else 'not offered'}")
    default = selected_mla_backend(None, CPU_MLA.dtype, CPU_MLA.block_size)
    return (
        f"MLA backends: {'; '.join(parts)}; vLLM's default MLA pick here: {default}; "
        f"AMX tiles: {amx_tiles()}"
    )
