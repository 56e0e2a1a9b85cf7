"""``TraitsNixlConnector``: vLLM's NIXL connector with every layout decision from traits.

Turn it on with ``--kv-transfer-config '{"kv_connector": "TraitsNixlConnector", ...}'``
(registered by the ``vllm.general_plugins`` entry point :func:`register_with_vllm`), or
without the plugin with ``"kv_connector_module_path": "kvspec_traits.vllm_connector"``.
See ``docs/vllm.md``.

Importing this module imports neither vLLM nor torch: vLLM loads general plugins in every
process, so the connector classes load only when a connector is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from kvspec_traits._deps import SUPPORTED_VLLM_SERIES, needs

__all__ = [
    "CONNECTOR_NAME",
    "MODULE_PATH",
    "REQUIRE_TRAITS_PEER",
    "SUPPORTED_VLLM_SERIES",
    "PeerWithoutTraitsError",
    "TraitsNixlAgentMetadata",
    "TraitsNixlConnector",
    "TraitsNixlConnectorWorker",
    "UnsupportedPipelineParallelError",
    "UnsupportedVllmVersionError",
    "UpstreamDisagreesError",
    "check_vllm_version",
    "register_with_vllm",
]

CONNECTOR_NAME: Final = "TraitsNixlConnector"
MODULE_PATH: Final = "kvspec_traits.vllm_connector"
_IMPL: Final = "kvspec_traits.vllm_connector._connector"

if TYPE_CHECKING:
    from kvspec_traits.vllm_connector._connector import (
        REQUIRE_TRAITS_PEER,
        PeerWithoutTraitsError,
        TraitsNixlAgentMetadata,
        TraitsNixlConnector,
        TraitsNixlConnectorWorker,
        UnsupportedPipelineParallelError,
        UpstreamDisagreesError,
    )

# Defined beside the worker (they need vLLM); loaded on first access, like the classes.
_LAZY: Final = frozenset(
    {
        "TraitsNixlConnector",
        "TraitsNixlConnectorWorker",
        "TraitsNixlAgentMetadata",
        "PeerWithoutTraitsError",
        "UnsupportedPipelineParallelError",
        "UpstreamDisagreesError",
        "REQUIRE_TRAITS_PEER",
    }
)


class UnsupportedVllmVersionError(RuntimeError):
    """The installed vLLM is not a series the connector supports.

    ``.installed`` is the installed version, ``.supported`` the supported series.
    """

    def __init__(
        self, installed: str, supported: tuple[str, ...] = SUPPORTED_VLLM_SERIES, detail: str = ""
    ) -> None:
        self.installed = installed
        self.supported = supported
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"{CONNECTOR_NAME} supports vLLM {', '.join(s + '.x' for s in supported)}, "
            f"but vLLM {installed} is installed{extra}. Install a supported vLLM, or use "
            f'upstream\'s NixlConnector (kv_connector: "NixlConnector").'
        )


def _series(version: str) -> str:
    parts = version.split("+", 1)[0].split(".")
    return ".".join(parts[:2])


def check_vllm_version(installed: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`UnsupportedVllmVersionError`
    naming it and the supported series. ``installed`` overrides the lookup (tests)."""
    if installed is None:
        with needs(f"{CONNECTOR_NAME} (kvspec_traits.vllm_connector)"):
            import vllm

        installed = str(getattr(vllm, "__version__", "unknown"))
    if _series(installed) not in SUPPORTED_VLLM_SERIES:
        raise UnsupportedVllmVersionError(installed)
    return installed


def register_with_vllm() -> None:
    """vLLM general plugin: make ``"kv_connector": "TraitsNixlConnector"`` work by name.

    Registers a lazy loader with vLLM's ``KVConnectorFactory``; safe to call more than
    once (vLLM loads plugins once per process, but may start many processes).
    """
    with needs(f"the {CONNECTOR_NAME} vLLM plugin (kvspec_traits.vllm_connector)"):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, _IMPL, CONNECTOR_NAME)


def __getattr__(name: str) -> Any:
    # vLLM's factory does getattr(import_module(kv_connector_module_path), kv_connector).
    if name in _LAZY:
        import importlib

        with needs(f"{CONNECTOR_NAME} (kvspec_traits.vllm_connector)"):
            module = importlib.import_module(_IMPL)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
