"""The NIXL shim's transfer errors. Both are the backend-neutral classes of
:mod:`kvspec_traits.transfer._errors`, defined once and re-exported by each backend, so
one ``except`` catches a failure whichever backend raised it; planning, handshake,
memory-type and block-id errors are imported from :mod:`kvspec_traits.transfer`."""

from __future__ import annotations

from kvspec_traits.transfer._errors import MissingPeerError, TransferFailedError

__all__ = [
    "MissingPeerError",
    "TransferFailedError",
]
