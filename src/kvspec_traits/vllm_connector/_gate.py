"""The vLLM version gate and the vLLM plugin entry point (import no vLLM until called)."""

from __future__ import annotations

import contextlib

from kvspec_traits._deps import SUPPORTED_VLLM_SERIES, needs, vllm_series
from kvspec_traits.vllm_connector._errors import UnsupportedVllmVersionError
from kvspec_traits.vllm_connector._names import (
    CONNECTOR_NAME,
    IMPL_MODULE,
    PUSH_CONNECTOR_NAME,
    PUSH_IMPL_MODULE,
)

__all__ = [
    "check_vllm_version",
    "installed_vllm",
    "register_with_vllm",
    "vllm_series",
]


def installed_vllm() -> str:
    """The imported vLLM's version string (``"unknown"`` if it has none)."""
    with needs(f"{CONNECTOR_NAME} (kvspec_traits.vllm_connector)"):
        import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(installed: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`UnsupportedVllmVersionError`
    naming it and the supported series. ``installed`` overrides the lookup (tests)."""
    if installed is None:
        installed = installed_vllm()
    if vllm_series(installed) not in SUPPORTED_VLLM_SERIES:
        raise UnsupportedVllmVersionError(installed)
    return installed


def register_with_vllm() -> None:
    """vLLM general plugin: make ``"kv_connector": "TraitsNixlConnector"`` (pull, as
    upstream's ``NixlConnector``) and ``"TraitsNixlPushConnector"`` (push, as
    ``NixlPushConnector``) work by name.

    Registers a lazy loader with vLLM's ``KVConnectorFactory``; safe to call more than
    once (vLLM loads plugins once per process, but may start many processes): a name
    registered already is left as it is, by the factory's public refusal (its one
    ``ValueError``, 0.32-0.34: tests/test_vllm_seam.py), not by reading its registry.
    """
    with needs(f"the {CONNECTOR_NAME} vLLM plugin (kvspec_traits.vllm_connector)"):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in ((CONNECTOR_NAME, IMPL_MODULE), (PUSH_CONNECTOR_NAME, PUSH_IMPL_MODULE)):
        with contextlib.suppress(ValueError):  # "Connector '<name>' is already registered."
            KVConnectorFactory.register_connector(name, module, name)
