"""NIXL's progress-thread delay (``kvspec_traits.nixl._progress``, connector key
``kvspec_nixl_progress_delay_us``).

NIXL 1.5.1's Python agent hard-codes ``pthrDelay = 0``: its progress thread polls
without sleeping. These tests use NIXL's own config class and real agents: the floor
holds inside the block and nowhere else; an agent built under it registers memory and
moves bytes; the connector reads its key and refuses a bad value by name. What the
delay saves in CPU is measured by ``benchmarks/bench_nixl_progress.py``, not here.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import pytest
import torch
from nixl._api import nixl_agent, nixl_agent_config, nixlBind
from vllm.config import set_current_vllm_config

from kvspec_traits import KVSpecTraitsError
from kvspec_traits.nixl._progress import MAX_DELAY_US, ProgressDelayError, progress_delay
from kvspec_traits.vllm_connector import ConnectorOptionError
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from kvspec_traits.vllm_connector._names import NIXL_PROGRESS_DELAY
from kvspec_traits.vllm_connector._options import connector_options
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA
from tests.test_connector_differential import LBHNC, _construct, _vllm_config, distributed

pytestmark = pytest.mark.timeout(300)
__all__ = ["distributed"]  # a fixture, imported for its name


def test_the_floor_holds_inside_the_block_only() -> None:
    native = nixlBind.nixlAgentConfig
    with progress_delay(250):
        config = nixlBind.nixlAgentConfig()
        config.pthrDelay = 0  # what nixl_agent.__init__ writes
        assert config.pthrDelay == 250
        config.pthrDelay = 1000  # a larger delay stays as given
        assert config.pthrDelay == 1000
        assert isinstance(config, native)
    assert nixlBind.nixlAgentConfig is native
    plain = nixlBind.nixlAgentConfig()
    plain.pthrDelay = 0
    assert plain.pthrDelay == 0


def test_zero_changes_nothing() -> None:
    native = nixlBind.nixlAgentConfig
    with progress_delay(0):
        assert nixlBind.nixlAgentConfig is native


def test_the_class_is_restored_when_the_block_raises() -> None:
    native = nixlBind.nixlAgentConfig
    with pytest.raises(RuntimeError, match="inside"), progress_delay(100):
        raise RuntimeError("inside")
    assert nixlBind.nixlAgentConfig is native


@pytest.mark.parametrize("bad", [-1, MAX_DELAY_US + 1, 1.5, math.nan, math.inf, True, "100", None])
def test_a_bad_delay_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(ProgressDelayError) as err, progress_delay(bad):
        pass
    assert isinstance(err.value, KVSpecTraitsError)
    assert "microseconds" in str(err.value) or " us" in str(err.value)


def test_an_agent_built_under_the_floor_moves_bytes() -> None:
    """Two real agents (UCX, DRAM), the reader built with a 200 us floor: a READ of 64
    KiB completes and the bytes are the source's."""
    src = torch.arange(16384, dtype=torch.float32)
    dst = torch.zeros_like(src)
    with progress_delay(200):
        reader = nixl_agent("progress-reader", nixl_agent_config(backends=["UCX"]))
    target = nixl_agent("progress-target", nixl_agent_config(backends=["UCX"]))
    nbytes = src.numel() * src.element_size()
    src_reg = target.register_memory([(src.data_ptr(), nbytes, 0, "")], "DRAM")
    dst_reg = reader.register_memory([(dst.data_ptr(), nbytes, 0, "")], "DRAM")
    try:
        peer = reader.add_remote_agent(target.get_agent_metadata())
        local = reader.get_xfer_descs([(dst.data_ptr(), nbytes, 0)], "DRAM")
        remote = reader.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")
        handle = reader.initialize_xfer("READ", local, remote, peer, b"done")
        state = reader.transfer(handle)
        for _ in range(200_000):
            if state == "DONE":
                break
            if state == "ERR":
                raise AssertionError("the NIXL read failed")
            state = reader.check_xfer_state(handle)
        assert state == "DONE"
        reader.release_xfer_handle(handle)
        assert torch.equal(dst, src)
    finally:
        reader.deregister_memory(dst_reg)
        target.deregister_memory(src_reg)


def _config(tiny_models: pathlib.Path, delay: object) -> Any:
    config = _vllm_config(tiny_models / LLAMA, LBHNC, None)
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config[NIXL_PROGRESS_DELAY] = delay
    return config


def test_the_connector_reads_its_key(tiny_models: pathlib.Path) -> None:
    assert connector_options(_config(tiny_models, 150)).nixl_progress_delay_us == 150
    plain = _vllm_config(tiny_models / LLAMA, LBHNC, None)
    assert plain.kv_transfer_config is not None
    plain.kv_transfer_config.kv_connector_extra_config.pop(NIXL_PROGRESS_DELAY)
    assert connector_options(plain).nixl_progress_delay_us == 0  # not set: NIXL's own
    # The shim's error and the connector's option error at once (either may be caught).
    with pytest.raises(ProgressDelayError, match=NIXL_PROGRESS_DELAY) as err:
        connector_options(_config(tiny_models, "fast"))
    assert isinstance(err.value, ConnectorOptionError)
    assert err.value.key == NIXL_PROGRESS_DELAY and err.value.value == "fast"


def test_the_worker_builds_its_agent_under_the_floor(
    distributed: None, tiny_models: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connector's worker constructs its NIXL agent inside the block: the config
    NIXL's agent receives carries the floor, and the class is NIXL's again afterwards."""
    seen: list[int] = []
    native_agent = nixlBind.nixlAgent

    def recording_agent(name: str, config: Any) -> Any:
        seen.append(config.pthrDelay)
        return native_agent(name, config)

    monkeypatch.setattr(nixlBind, "nixlAgent", recording_agent)
    vllm_config = _config(tiny_models, 120)
    vllm_config.cache_config.block_size = 32  # CPU attention: multiples of 32
    groups = layouts.llama_gqa(1, layers=2, block_size=32, num_kv_heads=2, head_size=32)
    kv_config = layouts.kv_cache_config(groups, 6, LBHNC)
    with set_current_vllm_config(vllm_config):
        worker = _construct(lambda: TraitsNixlConnectorWorker(vllm_config, "delayed", kv_config))
    try:
        assert seen == [120]
        probe = nixlBind.nixlAgentConfig()
        probe.pthrDelay = 0
        assert probe.pthrDelay == 0
    finally:
        worker.shutdown()
