"""Named errors of planning, of the layout handshake, of a request's block ids and of a
transfer (backend-neutral). Each carries the region or message it is about.

:class:`MissingPeerError` and :class:`TransferFailedError` are defined here once and
re-exported by each backend (:mod:`kvspec_traits.nixl`, :mod:`kvspec_traits.mooncake`):
one class per failure, so ``except kvspec_traits.nixl.TransferFailedError`` also catches
the Mooncake backend's failure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvspec_traits._errors import KVSpecTraitsError

__all__ = [
    "BlockIdError",
    "BlockIdShapeError",
    "BlockIdTypeError",
    "DuplicateBlockIdError",
    "HandshakeMismatchError",
    "MalformedMetadataError",
    "MemoryTypeMismatchError",
    "MissingLayerError",
    "MissingPeerError",
    "RegionConflictError",
    "StageLayersError",
    "TraitDiff",
    "TransferFailedError",
    "UnsupportedLayoutError",
]

TraitDiff = tuple[str, object, object]
"""``(trait, local value, remote value)``."""


class RegionConflictError(KVSpecTraitsError, ValueError):
    """Layers that share one storage region disagree on a fact the region needs.

    ``.region`` is the region name, ``.layers`` its member layers, ``.trait`` the fact
    and ``.values`` each layer's value.
    """

    def __init__(
        self, region: str, layers: Sequence[str], trait: str, values: Mapping[str, object]
    ) -> None:
        self.region = region
        self.layers = tuple(layers)
        self.trait = trait
        self.values = dict(values)
        shown = ", ".join(f"{layer}={value!r}" for layer, value in self.values.items())
        super().__init__(
            f"region {region!r} (layers {list(self.layers)}) cannot be transferred as one "
            f"region: its layers disagree on {trait} ({shown})"
        )


class MissingLayerError(KVSpecTraitsError, KeyError):
    """Layers with a transferable KV cache spec that lack another per-layer input of
    :func:`plan_regions`: a tensor in ``kv_caches`` or an entry in ``group_ids``.

    ``.layers`` names them, ``.missing_from`` the input (``"kv_caches"`` or
    ``"group_ids"``).
    """

    def __init__(self, layers: Sequence[str], missing_from: str, fix: str) -> None:
        self.layers = tuple(layers)
        self.missing_from = missing_from
        self.message = (
            f"layers {list(self.layers)} have a KV cache spec but no entry in {missing_from}; {fix}"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would show the message as a quoted repr
        return self.message


class UnsupportedLayoutError(KVSpecTraitsError, ValueError):
    """A cache tensor's shape or strides cannot be described as NIXL regions.

    ``.layer`` names the layer.
    """

    def __init__(self, layer: str, reason: str) -> None:
        self.layer = layer
        super().__init__(f"layer {layer!r}: {reason}")


class HandshakeMismatchError(KVSpecTraitsError, ValueError):
    """Producer and consumer disagree on a region: no transfer may start.

    ``.region`` is the region index (``None`` when the region count or plan-wide facts
    differ), ``.region_name`` and ``.layers`` name it, ``.diffs`` lists
    ``(trait, local, remote)`` for every differing trait.
    """

    def __init__(
        self,
        region: int | None,
        region_name: str,
        layers: Sequence[str],
        diffs: Sequence[TraitDiff],
    ) -> None:
        self.region = region
        self.region_name = region_name
        self.layers = tuple(layers)
        self.diffs = tuple(diffs)
        where = (
            f"region {region} {region_name!r} (layers {list(self.layers)})"
            if region is not None
            else f"the plan ({region_name})"
        )
        what = "; ".join(
            f"{trait}: local={local!r} remote={remote!r}" for trait, local, remote in self.diffs
        )
        super().__init__(
            f"KV layout handshake refused: producer and consumer differ on {where}: "
            f"{what}{_fix(self.diffs)}"
        )


def _fix(diffs: Sequence[TraitDiff]) -> str:
    """What to change, for the differences an operator sets by hand."""
    for trait, local, remote in diffs:
        if trait == "block_sizes" and local and remote:
            return (
                f". Prefill and decode run different block sizes (tokens per block: here "
                f"{_listed(local)}, the peer {_listed(remote)}); KV moves only between equal "
                f"block sizes: start both servers with the same --block-size (e.g. "
                f"--block-size {_listed(remote)} here)"
            )
    return ""


def _listed(value: object) -> str:
    return "/".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


class StageLayersError(KVSpecTraitsError, ValueError):
    """A pipeline-parallel stage and its peer cannot be paired by the layers they hold:
    the stage holds layers the peer lacks (another model, or another layer split), or
    both sides are stages (a stage pairs with a peer that holds every layer).

    ``.layers`` are the stage's layers the peer lacks (empty when both are stages),
    ``.stage`` and ``.peer_stage`` each side's ``(pp_rank, pp_size)``, local first.
    """

    def __init__(
        self, layers: Sequence[str], stage: tuple[int, int], peer_stage: tuple[int, int]
    ) -> None:
        self.layers = tuple(layers)
        self.stage = stage
        self.peer_stage = peer_stage
        sides = f"PP stage {stage[0]} of {stage[1]} here, {peer_stage[0]} of {peer_stage[1]} there"
        if self.layers:
            what = (
                f"the stage holds KV cache layers {list(self.layers)[:8]} that its peer "
                f"lacks ({sides}); pair engines of the same model, with the peer holding "
                f"every layer of the stage"
            )
        else:
            what = (
                f"both sides are pipeline stages ({sides}); a stage pairs with a peer of "
                f"pipeline-parallel size 1, which holds every layer"
            )
        super().__init__(f"KV layout handshake refused: {what}")


class MalformedMetadataError(KVSpecTraitsError, ValueError):
    """Handshake metadata that cannot be decoded or cannot be trusted (truncated, wrong
    magic or version, invalid or hostile JSON, missing fields, region geometry that
    contradicts the peer's own fingerprint). ``.reason`` says which."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"malformed kvspec-traits NIXL metadata: {reason}")


class MemoryTypeMismatchError(KVSpecTraitsError, ValueError):
    """Memory types a transfer cannot pair: a plan whose regions span several memory
    types (a NIXL agent registers and describes one), or a peer region on another
    memory type than the local region it would fill (only like to like is moved:
    host to host for Mooncake over TCP; a pair of types is refused rather than guessed at).

    ``.region`` is the region name (``None`` for a plan-wide mix), ``.mem_types`` the
    types involved (local first for a peer).
    """

    def __init__(self, region: str | None, mem_types: Sequence[str], fix: str) -> None:
        self.region = region
        self.mem_types = tuple(mem_types)
        where = "the plan's regions span" if region is None else f"region {region!r}:"
        super().__init__(f"{where} memory types {list(self.mem_types)}; {fix}")


class BlockIdError(KVSpecTraitsError, IndexError):
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


class BlockIdTypeError(KVSpecTraitsError, TypeError):
    """Block ids of a type no transfer backend takes: anything but Python ints (``bool``
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


class BlockIdShapeError(KVSpecTraitsError, ValueError):
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


class DuplicateBlockIdError(KVSpecTraitsError, ValueError):
    """A destination block named twice in one request: two reads would write one block
    (which source wins is up to the network). ``.block_id`` is a repeated id,
    ``.group`` its cache group (``None`` for a flat list or a region every group
    shares), ``.side`` the side the blocks are written on (``"local"`` for a read,
    ``"remote"`` for a write)."""

    def __init__(self, block_id: int, group: int | None, side: str = "local") -> None:
        self.block_id = block_id
        self.group = group
        self.side = side
        where = "the request" if group is None else f"cache group {group}"
        super().__init__(
            f"{side} block id {block_id} appears more than once in {where}; every "
            f"destination block of a request must be distinct (one read per block)"
        )


class MissingPeerError(KVSpecTraitsError, KeyError):
    """A transfer needs a remote TP rank whose regions (or peer) were not given, or a
    peer was passed under another rank's key (either backend).

    ``.region`` is the region that needs it (``None``: the request as a whole, e.g. a
    peer passed under another rank's key), ``.remote_rank`` the rank, ``.given`` the
    remote ranks of the peers that were passed.
    """

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
    """A transfer ended in error or did not finish in time: its blocks were not moved
    whole, so none counts as moved.

    ``.state`` is the last NIXL state (``"ERR"``, ``"PROC"`` on timeout, or an error
    text; ``None`` from the Mooncake backend); ``.code`` what Mooncake's engine returned
    (``None`` from the NIXL shim).
    """

    def __init__(self, message: str, state: str | None = None, *, code: int | None = None) -> None:
        self.state = state
        self.code = code
        super().__init__(message)
