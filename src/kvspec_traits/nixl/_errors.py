"""Named errors of the NIXL shim (descriptors, agent). Each carries the region or
message it is about. Planning and handshake errors are kvspec_traits.transfer's."""

from __future__ import annotations

from collections.abc import Sequence

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


class BlockIdError(IndexError):
    """A request names a block a region does not have (negative, or past its end).

    ``.region`` is the region name, ``.block_id`` the offending id, ``.num_blocks`` the
    region's block count and ``.side`` ``"local"`` or ``"remote"``.
    """

    def __init__(self, region: str, block_id: int, num_blocks: int, side: str) -> None:
        self.region = region
        self.block_id = block_id
        self.num_blocks = num_blocks
        self.side = side
        super().__init__(
            f"region {region!r}: {side} block id {block_id} is not in 0..{num_blocks - 1}; "
            f"pass ids of blocks this {side} cache holds ({side} ids are checked against "
            f"the {side} region's num_blocks)"
        )


class BlockIdTypeError(TypeError):
    """Block ids of a type the shim does not take: anything but Python ints (``bool``
    is refused) or a 1-D integer numpy array, per list. Floats would be truncated,
    bools read as blocks 0 and 1, strings parsed.

    ``.side`` is ``"local"`` or ``"remote"``, ``.value`` the offending value (an element,
    or the array's dtype).
    """

    def __init__(self, side: str, value: object, detail: str) -> None:
        self.side = side
        self.value = value
        super().__init__(
            f"{side} block ids: {detail}; pass Python ints (not bool) or a 1-D integer "
            f"numpy array per cache group"
        )


class BlockIdShapeError(ValueError):
    """Block ids that do not fit the plan: not exactly one list per cache group, or
    local and remote lists of different lengths.

    ``.side`` is ``"local"``, ``"remote"`` or ``"both"``, ``.expected`` and ``.got`` the
    counts that differ.
    """

    def __init__(self, side: str, expected: int, got: int, detail: str) -> None:
        self.side = side
        self.expected = expected
        self.got = got
        super().__init__(f"{side} block ids: {detail}")


class DuplicateBlockIdError(ValueError):
    """A destination block named twice in one request: two reads would write one block
    (which source wins is up to the network). ``.block_id`` is a repeated id,
    ``.group`` its cache group (``None`` for a flat list or a region every group
    shares)."""

    def __init__(self, block_id: int, group: int | None) -> None:
        self.block_id = block_id
        self.group = group
        where = "the request" if group is None else f"cache group {group}"
        super().__init__(
            f"local block id {block_id} appears more than once in {where}; every "
            f"destination block of a request must be distinct (one read per block)"
        )


class TransferFailedError(RuntimeError):
    """A NIXL transfer ended in error or did not finish in time; its blocks were not
    received. ``.state`` is the last NIXL state (``"ERR"``, ``"PROC"`` on timeout or an
    error text)."""

    def __init__(self, message: str, state: str) -> None:
        self.state = state
        super().__init__(message)
