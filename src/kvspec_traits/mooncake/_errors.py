"""Named errors of the Mooncake backend. Planning, handshake and block-id errors are
backend-neutral: :mod:`kvspec_traits.transfer`'s."""

from __future__ import annotations

from collections.abc import Sequence

from kvspec_traits._errors import KVSpecTraitsError

__all__ = ["MissingPeerError", "TransferFailedError"]


class MissingPeerError(KVSpecTraitsError, KeyError):
    """A transfer needs a remote TP rank that was not given (or a peer was passed under
    another rank's key). ``.region`` is the region that needs it (``None``: the request
    as a whole), ``.remote_rank`` the rank, ``.given`` the ranks passed."""

    def __init__(
        self, region: str | None, remote_rank: int, given: Sequence[int], detail: str = ""
    ) -> None:
        self.region = region
        self.remote_rank = remote_rank
        self.given = tuple(given)
        who = "the transfer" if region is None else f"region {region!r}"
        self.message = (
            f"{who} needs remote TP rank {remote_rank}, which was not given "
            f"(remote ranks given: {list(self.given)}){detail}; connect() that rank and "
            f"pass {{tp_rank: peer}} for every rank the transfer needs"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would show the message as a quoted repr
        return self.message


class TransferFailedError(KVSpecTraitsError, RuntimeError):
    """Mooncake's engine refused a call or a transfer failed (a peer gone, an address
    outside the memory the target registered): the blocks were not moved whole, so
    none counts as moved. ``.code`` is what the engine returned."""

    def __init__(self, message: str, code: int) -> None:
        self.code = code
        super().__init__(message)
