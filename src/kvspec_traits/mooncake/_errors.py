"""The Mooncake backend's transfer errors: the NIXL shim's too (the backend-neutral
classes of :mod:`kvspec_traits.transfer._errors`, defined once, re-exported by each
backend). A Mooncake failure carries the engine's return value as
``TransferFailedError.code``."""

from __future__ import annotations

from kvspec_traits.transfer._errors import MissingPeerError, TransferFailedError

__all__ = ["MissingPeerError", "TransferFailedError"]
