"""Named errors of the NIXL shim (descriptors, agent). Each carries the region or
message it is about. Planning, handshake, memory-type and block-id errors are
backend-neutral: import them from :mod:`kvspec_traits.transfer`."""

from __future__ import annotations

from collections.abc import Sequence

from kvspec_traits._errors import KVSpecTraitsError

__all__ = [
    "MissingPeerError",
    "TransferFailedError",
]


class MissingPeerError(KVSpecTraitsError, KeyError):
    """A read needs a remote TP rank whose regions (or peer) were not given.

    ``.region`` is the region that needs it (``None`` when a peer was passed under
    another rank's key: the read needs that rank, whichever region), ``.remote_rank``
    the rank, ``.given`` the remote ranks of the peers that were passed.
    """

    def __init__(
        self, region: str | None, remote_rank: int, given: Sequence[int], detail: str = ""
    ) -> None:
        self.region = region
        self.remote_rank = remote_rank
        self.given = tuple(given)
        who = "the read" if region is None else f"region {region!r}"
        self.message = (
            f"{who} needs remote TP rank {remote_rank}, which was not given "
            f"(remote ranks given: {list(self.given)}){detail}; connect() that producer "
            f"rank and pass {{tp_rank: peer}} for every rank the read needs"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would show the message as a quoted repr
        return self.message


class TransferFailedError(KVSpecTraitsError, RuntimeError):
    """A NIXL transfer ended in error or did not finish in time; its blocks were not
    received. ``.state`` is the last NIXL state (``"ERR"``, ``"PROC"`` on timeout or an
    error text)."""

    def __init__(self, message: str, state: str) -> None:
        self.state = state
        super().__init__(message)
