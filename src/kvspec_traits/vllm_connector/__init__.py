"""``TraitsNixlConnector``: vLLM's NIXL connector with every layout decision from traits.

Turn it on with ``--kv-transfer-config '{"kv_connector": "TraitsNixlConnector", ...}'``
(registered by the ``vllm.general_plugins`` entry point :func:`register_with_vllm`), or
without the plugin with ``"kv_connector_module_path": "kvspec_traits.vllm_connector"``.
Push mode (upstream's ``NixlPushConnector``) is ``TraitsNixlPushConnector``, the same way.
See ``docs/vllm.md``.

Importing this module imports neither vLLM nor torch: vLLM loads general plugins in every
process, so the connector classes load only when a connector is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from kvspec_traits._deps import SUPPORTED_VLLM_SERIES, needs
from kvspec_traits.vllm_connector._errors import (
    ConnectorOptionError,
    PeerWithoutTraitsError,
    UnknownConnectorOptionError,
    UnknownStateBlocksError,
    UnsupportedHostBufferError,
    UnsupportedPipelineParallelError,
    UnsupportedRingTPError,
    UnsupportedStagePairingError,
    UnsupportedStateLayoutError,
    UnsupportedStateTPError,
    UnsupportedTransferModeError,
    UnsupportedVllmVersionError,
    VllmHandshakeRefusalError,
)
from kvspec_traits.vllm_connector._gate import check_vllm_version, register_with_vllm
from kvspec_traits.vllm_connector._lease import LeaseMarginError
from kvspec_traits.vllm_connector._names import (
    CONNECTOR_NAME,
    IMPL_MODULE,
    MODULE_PATH,
    NIXL_PROGRESS_DELAY,
    PUSH_CONNECTOR_NAME,
    PUSH_IMPL_MODULE,
    REQUIRE_TRAITS_PEER,
    SHM_WAIT,
)
from kvspec_traits.vllm_connector._shm_wait import ShmWaitError

__all__ = [
    "CONNECTOR_NAME",
    "MODULE_PATH",
    "NIXL_PROGRESS_DELAY",
    "PUSH_CONNECTOR_NAME",
    "REQUIRE_TRAITS_PEER",
    "SHM_WAIT",
    "SUPPORTED_VLLM_SERIES",
    "ConnectorOptionError",
    "ConnectorOptions",
    "LeaseMarginError",
    "PeerWithoutTraitsError",
    "ProgressDelayOptionError",
    "ShmWaitError",
    "TraitsNixlAgentMetadata",
    "TraitsNixlConnector",
    "TraitsNixlConnectorScheduler",
    "TraitsNixlConnectorWorker",
    "TraitsNixlPushConnector",
    "TraitsNixlPushConnectorScheduler",
    "TraitsNixlPushConnectorWorker",
    "UnknownConnectorOptionError",
    "UnknownStateBlocksError",
    "UnsupportedHostBufferError",
    "UnsupportedPipelineParallelError",
    "UnsupportedRingTPError",
    "UnsupportedStagePairingError",
    "UnsupportedStateLayoutError",
    "UnsupportedStateTPError",
    "VllmHandshakeRefusalError",
    "UnsupportedTransferModeError",
    "UnsupportedVllmVersionError",
    "check_vllm_version",
    "connector_options",
    "register_with_vllm",
]

if TYPE_CHECKING:
    from kvspec_traits.vllm_connector._connector import (
        TraitsNixlAgentMetadata,
        TraitsNixlConnector,
        TraitsNixlConnectorWorker,
    )
    from kvspec_traits.vllm_connector._options import (
        ConnectorOptions,
        ProgressDelayOptionError,
        connector_options,
    )
    from kvspec_traits.vllm_connector._push import (
        TraitsNixlPushConnector,
        TraitsNixlPushConnectorWorker,
    )
    from kvspec_traits.vllm_connector._scheduler import (
        TraitsNixlConnectorScheduler,
        TraitsNixlPushConnectorScheduler,
    )

# The classes need vLLM: loaded on first access (vLLM loads general plugins in every
# process; its factory does getattr(import_module(kv_connector_module_path), name)). The
# options need no vLLM, but the NIXL shim (its progress-delay check): loaded so too.
_LAZY: Final = {
    "ConnectorOptions": f"{MODULE_PATH}._options",
    "ProgressDelayOptionError": f"{MODULE_PATH}._options",
    "connector_options": f"{MODULE_PATH}._options",
    "TraitsNixlConnector": IMPL_MODULE,
    "TraitsNixlConnectorWorker": IMPL_MODULE,
    "TraitsNixlAgentMetadata": IMPL_MODULE,
    "TraitsNixlPushConnector": PUSH_IMPL_MODULE,
    "TraitsNixlPushConnectorWorker": PUSH_IMPL_MODULE,
    "TraitsNixlConnectorScheduler": f"{MODULE_PATH}._scheduler",
    "TraitsNixlPushConnectorScheduler": f"{MODULE_PATH}._scheduler",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        with needs(f"{CONNECTOR_NAME} (kvspec_traits.vllm_connector)"):
            module = importlib.import_module(_LAZY[name])
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
