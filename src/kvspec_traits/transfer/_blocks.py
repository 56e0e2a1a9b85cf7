"""A request's block ids, as every transfer backend takes them: one list per cache
group, each list Python ints (not ``bool``) or a 1-D integer array, checked against the
blocks a region holds.

Pure (no numpy import: an array is recognised by its ``dtype`` and ``ndim``): the NIXL
shim converts the lists this module accepts to numpy, the Mooncake backend to Python
lists; both ask these functions, so both take and refuse the same ids with the same
errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final, Protocol, TypeAlias

from kvspec_traits.transfer._errors import BlockIdError, BlockIdShapeError, BlockIdTypeError

__all__ = [
    "INT64_MAX",
    "IdArray",
    "IdLists",
    "check_block_range",
    "check_id_list",
    "check_paired",
    "group_lists",
    "is_id_array",
    "place_tail",
]

INT64_MAX: Final = (1 << 63) - 1
_LISTS: Final = (list, tuple, range)


class IdArray(Protocol):
    """What this module reads of an integer array (numpy's ``ndarray`` is one)."""

    @property
    def ndim(self) -> int: ...

    @property
    def dtype(self) -> Any: ...

    def tolist(self) -> Any: ...


IdLists: TypeAlias = Sequence[Sequence[int] | IdArray] | Sequence[int] | IdArray
"""A request's block ids as every backend takes them: one list (Python ints or a 1-D
integer array) per cache group, a 2-D integer array of one row per group, or, for a
plan of one group, that group's list alone."""


def is_id_array(value: object) -> bool:
    """Whether ``value`` is an array (numpy's, or one that quacks like it: ``dtype``
    with a ``kind``, ``ndim``)."""
    return hasattr(value, "ndim") and hasattr(getattr(value, "dtype", None), "kind")


def check_id_list(value: object, side: str) -> bool:
    """Refuse one group's ids unless they are Python ints (not ``bool``) or a 1-D
    integer array whose values fit in int64 (:class:`BlockIdTypeError`). Returns
    whether ``value`` is an array (the caller converts it its own way)."""
    if type(value) is list:  # vLLM's form; an exact list has no ndim or dtype
        _check_ints(value, side)
        return False
    if is_id_array(value):
        array: Any = value
        if array.dtype.kind not in "iu":
            raise BlockIdTypeError(
                side, array.dtype, f"an array of dtype {array.dtype} is not block ids"
            )
        if array.ndim != 1:
            raise BlockIdTypeError(
                side, array.shape, f"an array of shape {array.shape} is not one list of ids"
            )
        if array.dtype.kind == "u" and array.size and int(array.max()) > INT64_MAX:
            raise BlockIdTypeError(
                side, int(array.max()), f"id {int(array.max())} does not fit in int64"
            )
        return True
    if isinstance(value, _LISTS):
        _check_ints(value, side)
        return False
    raise BlockIdTypeError(side, value, f"a {type(value).__name__} is not a list of ids")


def _check_ints(value: Sequence[object], side: str) -> None:
    """Every id a Python int, exactly (``bool``, numpy scalars and other ``int``
    subclasses refused): one pass of ``type`` and a count by identity (10 ns an id,
    against 18 for a set of the types)."""
    if list(map(type, value)).count(int) != len(value):
        bad = next(v for v in value if type(v) is not int)
        raise BlockIdTypeError(side, bad, f"{bad!r} is a {type(bad).__name__}, not an int")


def group_lists(block_ids: object, num_groups: int, side: str) -> list[Any]:
    """A request's ids split into one list per cache group, unchecked inside: one list
    (or 1-D integer array) per group, a 2-D integer array of one row per group, or, for
    a plan of one group, that group's list alone. :class:`BlockIdShapeError` for
    another count of lists, :class:`BlockIdTypeError` for what is no list of lists."""
    groups: list[Any]
    if is_id_array(block_ids) and getattr(block_ids, "ndim", 0) == 2:
        array: Any = block_ids
        if array.dtype.kind not in "iu":
            raise BlockIdTypeError(
                side, array.dtype, f"an array of dtype {array.dtype} is not block ids"
            )
        groups = list(array)
    elif (
        isinstance(block_ids, _LISTS)
        and block_ids
        and (isinstance(block_ids[0], _LISTS) or is_id_array(block_ids[0]))
    ):
        groups = list(block_ids)
    elif isinstance(block_ids, _LISTS) or is_id_array(block_ids):
        if num_groups != 1:
            raise BlockIdShapeError(
                side,
                num_groups,
                1,
                f"one flat list for a plan of {num_groups} cache groups; pass one list "
                f"per group (vLLM's block_ids[group])",
            )
        groups = [block_ids]
    else:
        raise BlockIdTypeError(side, block_ids, f"a {type(block_ids).__name__} is not block ids")
    if len(groups) != num_groups:
        raise BlockIdShapeError(
            side,
            num_groups,
            len(groups),
            f"{len(groups)} lists for a plan of {num_groups} cache groups; pass exactly "
            f"one list per group (an empty one for a group with no blocks)",
        )
    return groups


def check_block_range(
    bounds: tuple[int, int] | None,
    limit: int,
    regions: Iterable[tuple[str, int]],
    side: str,
) -> None:
    """Refuse ids outside the regions they land in: ``bounds`` is ``(min, max)`` of
    the ids (``None`` for none), ``limit`` the smallest block count among
    ``regions``, given as ``(name, num_blocks)`` pairs (read only on a refusal).
    :class:`BlockIdError` names the first region an id is outside of."""
    if bounds is None:
        return
    low, high = bounds
    if low >= 0 and high < limit:
        return
    bad = low if low < 0 else high
    for name, count in regions:
        if bad < 0 or bad >= count:
            raise BlockIdError(name, bad, count, side)
    raise BlockIdError("(every region)", bad, limit, side)


def check_paired(local_sizes: Sequence[int], remote_sizes: Sequence[int]) -> None:
    """Local and remote ids pair up: the same count in every cache group
    (:class:`BlockIdShapeError` naming the first group that differs)."""
    for group, (local, remote) in enumerate(zip(local_sizes, remote_sizes, strict=True)):
        if local != remote:
            raise BlockIdShapeError(
                "both",
                local,
                remote,
                f"cache group {group} has {local} local but {remote} remote ids; each "
                f"local block is filled from the remote block at the same position",
            )


def place_tail(
    where: str,
    reader_tokens: int,
    source_tokens: int,
    start: int,
    count: int,
    sources: int,
    request_tokens: int | None,
    window: int | None = None,
    *,
    may_be_tail: bool = False,
) -> tuple[int, int]:
    """Where a reader's ``count`` blocks of ``reader_tokens`` tokens (from its
    ``start``-th on) lie in a request of ``request_tokens`` tokens, and how many of the
    source's blocks of ``source_tokens`` precede its list of ``sources``: ``(start, 0)``
    for a source list from the request's first block and a reader's that reaches its
    last (or where ``request_tokens`` is not known: lists are then taken as placed);
    otherwise both end-aligned, their last blocks holding the request's last token, as
    vLLM clips a sliding-window group's list to its last ``cdiv(window, block) + 1``
    blocks at each side's block size. A source's tail must hold every token the reader
    needs: each of its blocks' (``window`` ``None``), or a window's, from
    ``request_tokens - window`` on; tokens before it are left unread.
    :class:`BlockIdShapeError` (``where`` begins its message) names the tokens a
    source's tail lacks, or lists longer than the request. A group that keeps a window
    (``window`` given, or ``may_be_tail``: a region whose pages keep fewer than all of a
    request's tokens) is refused without ``request_tokens``: its lists may be a tail
    that covers ours from the wrong first block, and nothing here could tell."""
    if request_tokens is None:
        if window is not None or may_be_tail:
            raise BlockIdShapeError(
                "both",
                count,
                sources,
                f"{where}: a sliding window's lists may be its tail, which only the "
                f"request's token count places between block sizes {reader_tokens} and "
                f"{source_tokens}; none was given (pass the request's token count)",
            )
        return start, 0
    whole = -(-request_tokens // source_tokens)
    ours = -(-request_tokens // reader_tokens)
    if sources == whole and start + count >= ours:
        return start, 0  # whole lists (a reader's past the end: its pairing check names it)
    if sources > whole or start + count > ours:
        raise BlockIdShapeError(
            "both",
            whole,
            sources,
            f"{where}: {request_tokens} tokens are {whole} blocks of {source_tokens} at the "
            f"source and {ours} of {reader_tokens} at the reader; the lists name {sources} "
            f"there and blocks {start}..{start + count - 1} here",
        )
    first, skipped = ours - count, whole - sources
    # The first token the reader needs: each of its blocks' without a window; with one,
    # the window's first (one more than a decode step at request_tokens attends to).
    need = first * reader_tokens
    if window is not None:
        need = max(need, request_tokens - window)
    held = skipped * source_tokens
    if held > need:
        why = "the reader's blocks" if window is None else f"a window of {window} tokens"
        raise BlockIdShapeError(
            "remote",
            need,
            held,
            f"{where}: {why} needs tokens from {need} on, the source's tail (a window's "
            f"tail in blocks of {source_tokens}) holds them only from {held} on; tokens "
            f"{need}..{held - 1} are gone from the source, so the request cannot be moved "
            f"between block sizes {reader_tokens} and {source_tokens}",
        )
    return first, skipped
