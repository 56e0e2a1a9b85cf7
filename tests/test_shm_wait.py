"""``kvspec_shm_wait``: how vLLM's shared-memory queues wait, in the processes that build
the connector (docs/vllm.md, "Push end to end").

Checked on vLLM's own code: its ``sched_yield()`` (what every ``MessageQueue`` reader
calls between checks) yields with ``os.sched_yield`` by default and sleeps with
``time.sleep(0)`` once the connector was built with ``"sleep"``; the connector applies
the key in both roles (scheduler: the engine core; worker: each worker process), refuses
any other value by name, and changes nothing without the key.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
from vllm.config import set_current_vllm_config
from vllm.distributed import utils as vllm_utils
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvspec_traits.vllm_connector import (
    ConnectorOptionError,
    ShmWaitError,
    TraitsNixlConnector,
    TraitsNixlPushConnector,
    _connector,
)
from kvspec_traits.vllm_connector._names import SHM_WAIT
from kvspec_traits.vllm_connector._options import connector_options
from kvspec_traits.vllm_connector._shm_wait import apply_shm_wait, release_shm_wait
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA
from tests.test_connector_differential import LBHNC, _gqa, _vllm_config


@pytest.fixture(autouse=True)
def _restore_the_flag() -> Iterator[None]:
    """The switch is process-wide: every test leaves vLLM's flag as it found it."""
    before = vllm_utils.USE_SCHED_YIELD
    yield
    vllm_utils.USE_SCHED_YIELD = before


def _flag() -> bool:
    """vLLM's flag now (a call: read afresh after each step, not narrowed by mypy)."""
    return bool(vllm_utils.USE_SCHED_YIELD)


def _vllm_sched_yield() -> None:
    """vLLM's own ``vllm.distributed.utils.sched_yield`` (untyped upstream)."""
    cast("Callable[[], None]", vllm_utils.sched_yield)()


def _calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts what vLLM's own ``sched_yield()`` calls, without changing what it does."""
    counts = {"yield": 0, "sleep": 0}
    real_yield, real_sleep = os.sched_yield, time.sleep

    def counted_yield() -> None:
        counts["yield"] += 1
        real_yield()

    def counted_sleep(seconds: float) -> None:
        counts["sleep"] += 1
        real_sleep(seconds)

    monkeypatch.setattr(os, "sched_yield", counted_yield)
    monkeypatch.setattr(time, "sleep", counted_sleep)
    return counts


def _config(tiny_models: pathlib.Path, value: object | None) -> Any:
    config = _vllm_config(tiny_models / LLAMA, LBHNC, None)
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config.pop(SHM_WAIT, None)
    if value is not None:
        config.kv_transfer_config.kv_connector_extra_config[SHM_WAIT] = value
    return config


def test_sleep_makes_vllms_wait_sleep_and_yield_leaves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python 3.11.7 here: vLLM's default is os.sched_yield (USE_SCHED_YIELD true).
    assert _flag() is True
    counts = _calls(monkeypatch)
    first, second = object(), object()
    assert apply_shm_wait("yield", first) is False
    _vllm_sched_yield()
    assert counts == {"yield": 1, "sleep": 0}
    assert apply_shm_wait("sleep", first) is True
    _vllm_sched_yield()
    assert counts == {"yield": 1, "sleep": 1}
    assert apply_shm_wait("sleep", second) is True  # two connectors in one process: same
    assert _flag() is False
    # Undone when the last holder lets go, to the value found by the first.
    release_shm_wait(first)
    assert _flag() is False
    release_shm_wait(second)
    assert _flag() is True
    release_shm_wait(second)  # a holder lets go once; one that held nothing changes nothing
    release_shm_wait(object())
    assert _flag() is True
    _vllm_sched_yield()
    assert counts == {"yield": 2, "sleep": 1}


@pytest.mark.parametrize("found", [True, False])
def test_the_flag_returns_to_the_value_found(found: bool) -> None:
    """Whatever vLLM's value was (False: Python < 3.11.1), the last holder puts it back."""
    vllm_utils.USE_SCHED_YIELD = found
    holder = object()
    apply_shm_wait("sleep", holder)
    assert _flag() is False
    release_shm_wait(holder)
    assert _flag() is found


def test_the_key_is_read_and_checked(tiny_models: pathlib.Path) -> None:
    assert connector_options(_config(tiny_models, None)).shm_wait == "yield"
    assert connector_options(_config(tiny_models, "sleep")).shm_wait == "sleep"
    for bad in ("spin", "", "Sleep", 0, True, ["sleep"]):
        with pytest.raises(ShmWaitError) as err:
            connector_options(_config(tiny_models, bad))
        assert err.value.key == SHM_WAIT and err.value.value == bad
        assert isinstance(err.value, ConnectorOptionError) and isinstance(err.value, ValueError)
        assert repr(SHM_WAIT) in str(err.value) and repr(bad) in str(err.value)
        assert '"yield"' in str(err.value) and '"sleep"' in str(err.value)


def test_a_vllm_without_the_flag_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(vllm_utils, "USE_SCHED_YIELD")
    with pytest.raises(ShmWaitError, match="USE_SCHED_YIELD") as err:
        apply_shm_wait("sleep", object())
    assert err.value.key == SHM_WAIT and err.value.value == "sleep"
    assert apply_shm_wait("yield", object()) is False  # the default never needs it


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("value", [None, "sleep", "nap"])
def test_the_connector_applies_the_key_where_it_is_built(
    tiny_models: pathlib.Path, mode: str, value: str | None
) -> None:
    """The scheduler-role connector (the engine core's; no NIXL agent) applies the key
    before anything else: "sleep" turns vLLM's flag off, no key leaves it, a bad value
    fails the construction with the named error."""
    vllm_config = _config(tiny_models, value)
    cls = TraitsNixlPushConnector if mode == "push" else TraitsNixlConnector
    kv_cache_config = layouts.kv_cache_config(_gqa(1), 4, LBHNC)
    with set_current_vllm_config(vllm_config):
        if value == "nap":
            with pytest.raises(ShmWaitError, match=SHM_WAIT):
                cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
            assert _flag() is True
            return
        connector: Any = cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        assert _flag() is (value is None)
    finally:
        cast(Any, connector).shutdown()
    assert _flag() is True  # vLLM's value again


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_last_connector_to_shut_down_puts_vllms_value_back(
    tiny_models: pathlib.Path, mode: str
) -> None:
    """Two connectors of one process hold "sleep": the first shutdown leaves it, the
    second puts back vLLM's value (the one found before the first was built)."""
    vllm_config = _config(tiny_models, "sleep")
    cls = TraitsNixlPushConnector if mode == "push" else TraitsNixlConnector
    kv_cache_config = layouts.kv_cache_config(_gqa(1), 4, LBHNC)
    assert _flag() is True
    with set_current_vllm_config(vllm_config):
        first: Any = cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        second: Any = cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        assert _flag() is False
        first.shutdown()
        assert _flag() is False
    finally:
        second.shutdown()
    assert _flag() is True


def test_a_failed_construction_lets_go(
    tiny_models: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No shutdown follows a constructor that raised: it lets go itself."""
    vllm_config = _config(tiny_models, "sleep")
    kv_cache_config = layouts.kv_cache_config(_gqa(1), 4, LBHNC)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no scheduler today")

    monkeypatch.setattr(_connector, "TraitsNixlConnectorScheduler", refuse)
    with set_current_vllm_config(vllm_config), pytest.raises(RuntimeError, match="today"):
        TraitsNixlConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert _flag() is True
