"""How the connector is turned on, and the vLLM version gate (both vLLM passes)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from typing import Any, cast

import pytest

from kvspec_traits.vllm_connector import (
    CONNECTOR_NAME,
    MODULE_PATH,
    SUPPORTED_VLLM_SERIES,
    UnsupportedVllmVersionError,
    check_vllm_version,
)


def test_importing_the_plugin_module_imports_neither_vllm_nor_torch() -> None:
    # vLLM loads general plugins in every process it starts; the plugin must be light.
    code = (
        "import sys, kvspec_traits.vllm_connector as c; c.CONNECTOR_NAME; "
        "print(sorted(m for m in ('vllm', 'torch', 'nixl') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3+cpu", "0.33.0", "0.33.1rc1", "0.34.0"])
def test_supported_versions_pass(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "0.3.2"])
def test_other_versions_are_refused_naming_both(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersionError, match="is installed") as info:
        check_vllm_version(version)
    assert info.value.installed == version
    assert info.value.supported == SUPPORTED_VLLM_SERIES
    assert f"vLLM {version} is installed" in str(info.value)
    assert "0.32.x, 0.33.x, 0.34.x" in str(info.value)


def test_installed_vllm_is_supported() -> None:
    import vllm

    assert check_vllm_version() == vllm.__version__
    expected = os.environ.get("KVSPEC_EXPECT_VLLM")  # set by each pass of scripts/test.sh
    if expected:
        assert vllm.__version__.startswith(expected)


def test_connector_refuses_at_construction_on_another_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from kvspec_traits.vllm_connector import TraitsNixlConnector

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    # The check comes first: nothing of the (here absent) configuration is touched.
    with pytest.raises(UnsupportedVllmVersionError, match=r"vLLM 0\.35\.0 is installed"):
        TraitsNixlConnector(cast(Any, None), cast(Any, None), cast(Any, None))


def test_entry_point_registers_the_connector_by_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvspec_traits.vllm_connector import TraitsNixlConnector

    (ep,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.value.startswith(MODULE_PATH)
    ]
    assert ep.value == f"{MODULE_PATH}:register_with_vllm"
    hook = ep.load()
    hook()
    hook()  # vLLM may load plugins more than once per process: a no-op
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is (TraitsNixlConnector)


def test_module_path_finds_the_connector_without_the_plugin() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvspec_traits.vllm_connector import TraitsNixlConnector

    config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=MODULE_PATH,
        kv_role="kv_consumer",
        kv_buffer_device="cpu",
    )
    assert KVConnectorFactory.get_connector_class(config) is TraitsNixlConnector


def test_every_method_of_vllms_pull_connector_is_ours_too() -> None:
    # vLLM 0.33 gave NixlPullConnector sleep mode (unregister_kv_caches,
    # restore_kv_caches); a connector derived from the base class alone silently fell
    # back to the no-op defaults of KVConnectorBase_V1 (vLLM 0.33's
    # test_sleep_unregisters_and_restores_kv_caches caught it). Derived from the pull
    # connector, whatever a series adds is inherited; ours overrides only these.
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    from kvspec_traits.vllm_connector._connector import TraitsNixlConnector

    assert issubclass(TraitsNixlConnector, NixlPullConnector)
    overridden = {
        name
        for name, value in vars(TraitsNixlConnector).items()
        if callable(value) and name in vars(NixlPullConnector)
    }
    assert overridden == {"__init__", "start_load_kv"}
    for name in ("unregister_kv_caches", "restore_kv_caches"):
        if name in vars(NixlPullConnector):  # vLLM 0.33 and later
            assert getattr(TraitsNixlConnector, name) is getattr(NixlPullConnector, name)
