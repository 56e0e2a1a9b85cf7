"""The MLA backend cases (tests/mla_backends.py) checked on any CPU, against vLLM's own rules.

The AMX_MLA cases run only where the CPU has AMX. Whatever this machine has, these tests
prove, with vLLM's code: the settings each case serves with pass its backend's own
validation (``validate_configuration``) and the kernel block-size check the NIXL worker
runs (``select_common_block_size``); the settings the suite used before fail them with
the errors seen on AMX machines; and the helper's "offered" answer follows vLLM's CPU
detection rather than a guess.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from tests.e2e.pd_harness import Serving, VllmServer
from tests.mla_backends import (
    AMX_MLA,
    CPU_MLA,
    MLA_BACKENDS,
    MLA_HEAD_SIZE,
    MLABackend,
    amx_detection_forced,
    amx_tiles,
    mla_backends_header,
    selected_mla_backend,
)

# What the DeepSeek-V2 servers were started with before AMX machines were considered.
OLD_SERVING = Serving(backend="(vLLM's pick)", dtype="float32", flags=("--dtype", "float32"))


def _reasons(
    backend: type[AttentionBackend],
    *,
    dtype: torch.dtype,
    block_size: int | None,
    kv_cache_dtype: str = "auto",
) -> list[str]:
    """vLLM's own list of what ``backend`` cannot serve, for a DeepSeek-V2 decoder layer
    under a KV connector."""
    reasons: list[str] = backend.validate_configuration(
        head_size=MLA_HEAD_SIZE,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        block_size=block_size,
        use_mla=True,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=current_platform.get_device_capability(),  # type: ignore[arg-type]
        attn_type="decoder",
        use_kv_connector=True,
    )
    return reasons


def _parsed(serving: Serving, tiny_models: Path, tmp_path: Path) -> EngineArgs:
    """The engine arguments of the e2e harness's prefill server, as vLLM parses them."""
    server = VllmServer(
        name="prefill",
        model=tiny_models / "deepseek-v2",
        served_model_name="tiny",
        core=0,
        workdir=tmp_path,
        serving=serving,
        kv_transfer_config={
            "kv_connector": "TraitsNixlConnector",
            "kv_role": "kv_producer",
            "kv_buffer_device": "cpu",
        },
    )
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())  # type: ignore[no-untyped-call]
    args: EngineArgs = EngineArgs.from_cli_args(parser.parse_args(server.engine_args()))
    return args


def _served_dtype(args: EngineArgs) -> torch.dtype:
    """The dtype vLLM resolves for the model from these arguments."""
    dtype = args.create_model_config().dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"vLLM resolved the model dtype to {dtype!r}, not a torch dtype")
    return dtype


def _kernel_block_size(backend: type[AttentionBackend], block_size: int, dtype: torch.dtype) -> int:
    # Imported here: vllm.v1.worker.utils takes seconds to import.
    from vllm.v1.worker.utils import select_common_block_size

    spec = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=MLA_HEAD_SIZE, dtype=dtype
    )
    return select_common_block_size(block_size, [backend], [spec])


@pytest.mark.parametrize("backend", MLA_BACKENDS, ids=lambda b: b.name)
def test_server_arguments_pass_the_backends_own_validation(
    backend: MLABackend, tiny_models: Path, tmp_path: Path
) -> None:
    """Runs on every CPU, AMX or not: the e2e servers' flags for each case, parsed by
    vLLM, give the dtype, block size and request the case claims, and the backend's own
    validation accepts them."""
    args = _parsed(backend.serving(), tiny_models, tmp_path)
    model = args.create_model_config()
    assert (model.use_mla, model.get_head_size()) == (True, MLA_HEAD_SIZE)
    dtype = _served_dtype(args)
    assert dtype == backend.torch_dtype, backend.label
    assert args.block_size == backend.block_size, backend.label
    # The flag's value as parsed (a name; vLLM's AttentionConfig turns it into the enum).
    requested = getattr(args.attention_backend, "name", args.attention_backend)
    assert requested == (backend.name if backend.requested else None), backend.label

    cls = AttentionBackendEnum[backend.name].get_class()
    assert cls.get_name() == backend.name
    assert (
        _reasons(cls, dtype=dtype, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
        == []
    ), backend.label
    # The check vLLM's NIXL worker runs on the KV pages (it failed on AMX machines).
    assert _kernel_block_size(cls, backend.block_size, dtype) == backend.block_size


def test_the_old_settings_fail_amx_mla_as_seen_on_amx_machines(
    tiny_models: Path, tmp_path: Path
) -> None:
    """A negative control for the test above: the float32, block-16 settings the suite
    served DeepSeek-V2 with are what AMX_MLA refuses, with the error of the bug report."""
    args = _parsed(OLD_SERVING, tiny_models, tmp_path)
    dtype = _served_dtype(args)
    assert (dtype, args.block_size, args.attention_backend) == (torch.float32, None, None)
    amx = AttentionBackendEnum.AMX_MLA.get_class()
    assert _reasons(amx, dtype=dtype, block_size=16) == [
        "dtype not supported",
        "block_size not supported",
    ]
    with pytest.raises(
        ValueError,
        match=r"No common block size for 16 \(AMX_MLA: "
        r"\[MultipleOf\(32\)\]\)",
    ):
        _kernel_block_size(amx, 16, dtype)
    # CPU_MLA takes them (and only block 16: vLLM-CPU forces it for the reference kernel).
    cpu = AttentionBackendEnum.CPU_MLA.get_class()
    assert _reasons(cpu, dtype=dtype, block_size=16) == []
    assert _reasons(cpu, dtype=dtype, block_size=32) == ["block_size not supported"]


@pytest.mark.parametrize("present", [True, False], ids=["amx", "no-amx"])
def test_offered_backends_follow_vllms_cpu_detection(present: bool) -> None:
    """The helper asks vLLM's selection, so what it offers changes with what vLLM sees."""
    with amx_detection_forced(present):
        assert amx_tiles() is present
        assert selected_mla_backend(None, "bfloat16", 32) == ("AMX_MLA" if present else "CPU_MLA")
        assert CPU_MLA.unavailable_reason() is None  # requested by name: every CPU
        reason = AMX_MLA.unavailable_reason()
        if present:
            assert reason is None
        else:
            assert reason is not None
            assert "selects CPU_MLA" in reason
            assert "_is_amx_tile_supported() is False" in reason
    # Back to what this machine has.
    assert amx_tiles() is bool(torch.cpu._is_amx_tile_supported())


def test_vllms_default_pick_is_a_case_that_runs_here() -> None:
    """What a user gets with no flag is among the MLA cases this run executes, and the
    header says so."""
    default = selected_mla_backend(None, "bfloat16", 32)
    runnable = {b.name for b in MLA_BACKENDS if b.unavailable_reason() is None}
    assert CPU_MLA.name in runnable
    assert default in runnable
    header = mla_backends_header()
    assert f"vLLM's default MLA pick here: {default}" in header
    for backend in MLA_BACKENDS:
        assert backend.label in header
