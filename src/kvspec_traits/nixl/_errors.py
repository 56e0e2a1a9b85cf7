"""Named errors of the NIXL shim (descriptors, agent). Each carries the region or
message it is about. Planning, handshake and block-id errors are backend-neutral:
kvspec_traits.transfer's (the block-id errors are re-exported here, where the NIXL
shim's users have always imported them)."""

from __future__ import annotations

from collections.abc import Sequence

from kvspec_traits.transfer._errors import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    DuplicateBlockIdError,
)

__all__ = [
    "BlockIdError",
    "BlockIdShapeError",
    "BlockIdTypeError",
    "DuplicateBlockIdError",
    "MemoryTypeMismatchError",
    "MissingPeerError",
    "TransferFailedError",
]


class MemoryTypeMismatchError(ValueError):
    """Memory types one agent cannot pair: a plan whose regions span several memory
    types (an agent registers and describes one), or a peer region on another memory
    type than the local region it would fill.

    ``.region`` is the region name (``None`` for a plan-wide mix), ``.mem_types`` the
    types involved (local first for a peer).
    """

    def __init__(self, region: str | None, mem_types: Sequence[str], fix: str) -> None:
        self.region = region
        self.mem_types = tuple(mem_types)
        where = "the plan's regions span" if region is None else f"region {region!r}:"
        super().__init__(f"{where} memory types {list(self.mem_types)}; {fix}")


class MissingPeerError(KeyError):
    """A read needs a remote TP rank whose regions (or peer) were not given.

    ``.region`` is the region that needs it, ``.remote_rank`` the rank, ``.given`` the
    remote ranks that were passed.
    """

    def __init__(
        self, region: str, remote_rank: int, given: Sequence[int], detail: str = ""
    ) -> None:
        self.region = region
        self.remote_rank = remote_rank
        self.given = tuple(given)
        self.message = (
            f"region {region!r} needs remote TP rank {remote_rank}, which was not given "
            f"(remote ranks given: {list(self.given)}){detail}; connect() that producer "
            f"rank and pass {{tp_rank: peer}} for every rank the read needs"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would show the message as a quoted repr
        return self.message


class TransferFailedError(RuntimeError):
    """A NIXL transfer ended in error or did not finish in time; its blocks were not
    received. ``.state`` is the last NIXL state (``"ERR"``, ``"PROC"`` on timeout or an
    error text)."""

    def __init__(self, message: str, state: str) -> None:
        self.state = state
        super().__init__(message)
