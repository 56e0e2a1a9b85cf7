"""The connector's names: what vLLM's config refers to it by (pure, no vLLM)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "CONNECTOR_NAME",
    "IMPL_MODULE",
    "MODULE_PATH",
    "PUSH_CONNECTOR_NAME",
    "PUSH_IMPL_MODULE",
    "REQUIRE_TRAITS_PEER",
]

CONNECTOR_NAME: Final = "TraitsNixlConnector"
MODULE_PATH: Final = "kvspec_traits.vllm_connector"
IMPL_MODULE: Final = "kvspec_traits.vllm_connector._connector"
"""The module of the classes that need vLLM (loaded when a connector is built)."""
PUSH_CONNECTOR_NAME: Final = "TraitsNixlPushConnector"
"""Push mode (WRITE from prefill to decode): upstream's ``NixlPushConnector``, with traits."""
PUSH_IMPL_MODULE: Final = "kvspec_traits.vllm_connector._push"
REQUIRE_TRAITS_PEER: Final = "kvspec_require_traits_peer"
"""``kv_connector_extra_config`` key: true refuses NIXL peers that send no kvspec-traits
fingerprint (upstream's ``NixlConnector``) with :class:`PeerWithoutTraitsError`."""
