"""How push mode is turned on: the same switch as upstream's on each series.

vLLM 0.32 and 0.33 run push as ``"kv_connector": "NixlPushConnector"``; ours is
``"TraitsNixlPushConnector"`` (by the plugin, or the module path). vLLM 0.34 also turns
``"NixlConnector"`` into its push connector under ``kv_connector_extra_config:
{"transfer_mode": "push"}`` (its factory); ``"TraitsNixlConnector"`` with the same key then
builds ours. Each answer is compared with upstream's factory on the installed series, not
with a hard-coded table.
"""

from __future__ import annotations

import pathlib
from typing import Any, cast

import pytest
from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
    NixlPushConnector,
)

from kvspec_traits.vllm_connector import (
    MODULE_PATH,
    PUSH_CONNECTOR_NAME,
    TraitsNixlConnector,
    TraitsNixlPushConnector,
    UnsupportedTransferModeError,
    register_with_vllm,
)
from kvspec_traits.vllm_connector._options import connector_options
from kvspec_traits.vllm_connector._push import TraitsNixlPushConnectorWorker
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA
from tests.test_connector_differential import LBHNC, _gqa, _vllm_config


def _upstream_class(extra: dict[str, Any]) -> type:
    """The class upstream's factory builds for ``"NixlConnector"`` with ``extra``."""
    config = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_producer",
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra,
    )
    cls: type = KVConnectorFactory.get_connector_class(config)
    return cls


def test_the_plugin_and_the_module_path_find_the_push_connector() -> None:
    register_with_vllm()
    assert KVConnectorFactory.get_connector_class_by_name(PUSH_CONNECTOR_NAME) is (
        TraitsNixlPushConnector
    )
    config = KVTransferConfig(
        kv_connector=PUSH_CONNECTOR_NAME,
        kv_connector_module_path=MODULE_PATH,
        kv_role="kv_consumer",
        kv_buffer_device="cpu",
    )
    assert KVConnectorFactory.get_connector_class(config) is TraitsNixlPushConnector
    assert issubclass(TraitsNixlPushConnector, NixlPushConnector)


@pytest.mark.parametrize("mode", [None, "pull", "push"])
def test_transfer_mode_is_read_where_upstreams_factory_reads_it(
    mode: str | None, tiny_models: pathlib.Path
) -> None:
    """The scheduler-side connector (no NIXL agent) that ``TraitsNixlConnector`` builds is
    push exactly where upstream's factory makes ``NixlConnector`` its push connector."""
    extra = {} if mode is None else {"transfer_mode": mode}
    upstream = _upstream_class(extra)
    assert upstream in (NixlPullConnector, NixlPushConnector)
    vllm_config = _vllm_config(tiny_models / LLAMA, LBHNC, None)
    assert vllm_config.kv_transfer_config is not None
    vllm_config.kv_transfer_config.kv_connector_extra_config.update(extra)
    expected = "push" if upstream is NixlPushConnector else "pull"
    assert connector_options(vllm_config).transfer_mode == expected
    kv_cache_config = layouts.kv_cache_config(_gqa(1), 4, LBHNC)
    with set_current_vllm_config(vllm_config):
        # __new__ answers the mode: the instance's class is not always the one called.
        connector: Any = TraitsNixlConnector(
            vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
        )
    try:
        if expected == "push":
            assert type(connector) is TraitsNixlPushConnector
        else:
            assert type(connector) is TraitsNixlConnector
        assert isinstance(connector, upstream)
    finally:
        cast(Any, connector).shutdown()


def test_an_invalid_transfer_mode_is_refused_where_upstream_refuses_it(
    tiny_models: pathlib.Path,
) -> None:
    extra = {"transfer_mode": "write"}
    vllm_config = _vllm_config(tiny_models / LLAMA, LBHNC, None)
    assert vllm_config.kv_transfer_config is not None
    vllm_config.kv_transfer_config.kv_connector_extra_config.update(extra)
    refusal = ""
    try:
        _upstream_class(extra)
    except ValueError as err:
        refusal = str(err)
    upstream_refuses = "transfer_mode" in refusal
    if upstream_refuses:  # vLLM 0.34
        with pytest.raises(UnsupportedTransferModeError, match="'write'") as info:
            connector_options(vllm_config)
        assert info.value.mode == "write"
        assert isinstance(info.value, ValueError)
    else:  # 0.32, 0.33: the key means nothing to NixlConnector
        assert connector_options(vllm_config).transfer_mode == "pull"


def test_push_worker_is_the_pull_workers_traits_half() -> None:
    """One planning code path: the push worker's register_kv_caches, handshake checks
    and layout facts are the pull worker's (TraitsWorkerBase), below upstream's push
    worker, whose register_kv_caches calls them and starts its writer thread."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    from kvspec_traits.vllm_connector._connector import (
        TraitsNixlConnectorWorker,
        TraitsWorkerBase,
    )

    mro = TraitsNixlPushConnectorWorker.__mro__
    assert mro.index(NixlPushConnectorWorker) < mro.index(TraitsWorkerBase)
    # (_validate_remote_parallel_config is the push worker's own: it orders upstream's
    # checks before the fingerprint, tests/test_push_connector.py shows it.)
    for name in ("plan", "_apply_plan", "_sync_block_size_with_kernel", "_nixl_handshake"):
        assert getattr(TraitsNixlPushConnectorWorker, name) is getattr(TraitsWorkerBase, name)
        assert getattr(TraitsNixlConnectorWorker, name) is getattr(TraitsWorkerBase, name)
    # Upstream's push register_kv_caches (writer thread) wraps ours.
    assert "register_kv_caches" in vars(NixlPushConnectorWorker)
    assert "register_kv_caches" in vars(TraitsWorkerBase)
