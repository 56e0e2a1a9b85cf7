"""The per-region traits fingerprint and the layout handshake check.

Pure (no NIXL, numpy or vLLM): a consumer decodes the producer's fingerprint and calls
:func:`check_handshake` before it adds the peer or builds a single descriptor, so a
mismatch refuses the transfer while nothing has been written. The record of a region
is derived from :class:`~kvspec_traits.transfer.Region`'s fields (every field is in it
unless :data:`NOT_FINGERPRINTED` says why not).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, Protocol

from kvspec_traits._traits import TPLayout
from kvspec_traits.transfer._errors import (
    HandshakeMismatchError,
    MalformedMetadataError,
    StageLayersError,
    TraitDiff,
)
from kvspec_traits.transfer._region import Region
from kvspec_traits.transfer._tp import shard_count, state_content

__all__ = [
    "FINGERPRINT_VERSION",
    "LOCAL_KEYS",
    "NOT_FINGERPRINTED",
    "RECORD_KEYS",
    "PlanFingerprint",
    "Regions",
    "canonical_json",
    "check_handshake",
    "decode_fingerprint",
    "fingerprint_of",
    "load_json",
    "pair_stages",
    "record_page",
    "traits_record",
]

FINGERPRINT_VERSION: Final = 6
"""Version of :func:`traits_record` and the payload around it; 2 added ``head_major``
(the H/N/C order inside a page), 3 ``kv_head_contiguous`` (the order of head slots
inside a page), 4 the pipeline stage (``pp``: rank and size) of the regions, so that a
stage pairs with its peer by the layers both hold (:func:`pair_stages`), 5 the model's
KV head count as a head-sharded region's ``tp_shards`` (replicated heads), each state
component's TP runs, the ``state_group_ids`` and the ``block_sizes`` (tokens per block),
6 a TP-sharded state page's padding apart from its content (:data:`LOCAL_KEYS`). A
change to the record's keys (a new :class:`Region` field) needs a new version."""

LOCAL_KEYS: Final[Mapping[str, str]] = {
    "state_pad": "a state page's padding to a hybrid's unified page (the attention page, "
    "which need not shrink with TP, as replicated KV heads do not): between TP sizes "
    "only the state's components move, so it is compared between equal TP sizes alone, "
    "where whole pages move",
}
"""Record keys that are facts of one rank's page, not of the model's layout: compared
only when both sides have the same TP size (:func:`check_handshake`). Derived, not
:class:`Region` fields."""

NOT_FINGERPRINTED: Final[Mapping[str, str]] = {
    "index": "its position: records are compared in region order",
    "base_addr": "an address, different per process (check_peer_layout compares placement)",
    "block_stride": "an address step, different per allocation (check_peer_geometry bounds it)",
    "num_blocks": "a pool size: producer and consumer pools may differ",
    "mem_type": "where the bytes live, not their layout (the agent and vLLM check it)",
    "device_id": "which device, not the layout",
    "group_ids": "group_id says it (SHARED_REGION_GROUP_ID for several groups)",
    "packed_members": "where each page sits in a whole row that moves whole",
}
"""Fields of :class:`Region` left out of the record, and why."""

RECORD_KEYS: Final[Mapping[str, str]] = {
    "token_scopes": "scope",
    "dtypes": "dtype",
    "kv_quant_modes": "kv_quant_mode",
}
"""Record keys of the :class:`Region` fields whose key is not the field name (the
names of fingerprint version 1)."""

# Bounds on decoded JSON: a peer's header is small and flat, so anything deeper or any
# integer outside 64 bits is hostile or corrupt (and would otherwise surface later as
# RecursionError or OverflowError).
_MAX_DEPTH: Final = 16
_INT_MIN: Final = -(1 << 63)
_U64_END: Final = 1 << 64


def _no_constant(name: str) -> object:
    raise MalformedMetadataError(f"JSON constant {name} is not allowed")


def load_json(data: str | bytes | bytearray | memoryview, what: str) -> object:
    """Decode untrusted JSON: :class:`MalformedMetadataError` for anything that is not
    UTF-8 JSON nested at most 16 deep with integers in 64 bits (never a
    ``RecursionError``, ``UnicodeDecodeError``, ``ValueError`` or ``TypeError``)."""
    try:
        raw = bytes(data) if isinstance(data, (bytearray, memoryview)) else data
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        if not isinstance(raw, str):
            raise TypeError(f"a {type(data).__name__} is not JSON text")
        value = json.loads(raw, parse_constant=_no_constant)
    except MalformedMetadataError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError, TypeError) as exc:
        raise MalformedMetadataError(
            f"{what} is not JSON ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    _check_json(value, what)
    return value


def _check_json(value: object, what: str) -> None:
    """Depth and integer bounds of decoded JSON, without recursion."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            if (
                isinstance(item, int)
                and not isinstance(item, bool)
                and not _INT_MIN <= item < _U64_END
            ):
                raise MalformedMetadataError(
                    f"{what} holds an integer outside 64 bits ({str(item)[:40]}...)"
                )
            continue
        if depth >= _MAX_DEPTH:
            raise MalformedMetadataError(f"{what} is nested deeper than {_MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


def canonical_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _plain(value: object) -> object:
    """A field value as JSON-able data: enums as their values, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def traits_record(region: Region, tp_size: int) -> dict[str, Any]:
    """The canonical, TP-independent facts of ``region`` (for the fingerprint): every
    field of :class:`Region` but :data:`NOT_FINGERPRINTED`, keyed by name (or
    :data:`RECORD_KEYS`).

    Sizes of a split region are scaled to the whole TP group, so producer and
    consumer with different TP sizes compare equal when their layouts agree. The order
    of data inside a page (``head_major``: LBHNC against LBNHC) and of head slots
    (``kv_head_contiguous``, vLLM 0.34's kv_head_major_slots) are in it: equal sizes in
    another order would move every byte to the wrong place. A TP-sharded state-only
    page's ``block_len`` is its content (its components, scaled like them); the
    padding past them is ``state_pad``, a fact of this rank's page (:data:`LOCAL_KEYS`),
    ``None`` for any other region.
    """
    shards = shard_count(region.tp_layout, region.tp_shards, tp_size)
    state_shards = (
        shard_count(region.state_tp_layout, None, tp_size)
        if region.state_tp_layout is not None
        else 1
    )
    scale = 1 if region.replicated or not region.paged else shards
    # A TP-sharded state page is its components, then padding (to an alignment, to a
    # hybrid's unified page): the components scale with TP, the padding need not (issue
    # 47: two KV heads replicate at TP 4, so the attention page, and the state page
    # padded to it, is as large at TP 4 as at TP 2). No byte of it moves between TP
    # sizes (tp_reads), so it is left out, and a state-only page's is state_pad.
    components = list(region.state_components)
    pad = None
    page = region.block_len
    if region.sharded_state:
        while components and components[-1].runs is None and components[-1].name.startswith("pad"):
            components.pop()
        if not region.paged:
            content = state_content(region)
            pad, page = region.block_len - content, content
    scaled: dict[str, object] = {
        "block_len": page * (scale if region.paged else state_shards),
        "state_components": [
            [
                c.name,
                c.nbytes * state_shards,
                None if c.runs is None else [r * state_shards for r in c.runs],
            ]
            for c in components
        ],
        "num_head_slots": None if region.num_head_slots is None else region.num_head_slots * scale,
        "page_head_slots": [n * scale for n in region.page_head_slots],
    }
    record: dict[str, Any] = {}
    for f in fields(region):
        if f.name in NOT_FINGERPRINTED:
            continue
        value = scaled[f.name] if f.name in scaled else _plain(getattr(region, f.name))
        record[RECORD_KEYS.get(f.name, f.name)] = value
    record["state_pad"] = pad
    return record


@dataclass(frozen=True, slots=True)
class PlanFingerprint:
    """Canonical traits of every region, in region order, for one TP group size, and
    the pipeline stage that holds them (``pp``: ``(pp_rank, pp_size)``; ``(0, 1)``
    without pipeline parallelism, every layer of the model)."""

    version: int
    tp_size: int
    regions: tuple[Mapping[str, Any], ...]
    pp: tuple[int, int] = (0, 1)

    @property
    def layers(self) -> tuple[str, ...]:
        """The layers the regions hold, in region order (each once)."""
        held = (str(layer) for r in self.regions for layer in r.get("layers") or ())
        return tuple(dict.fromkeys(held))

    def payload(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "tp_size": self.tp_size,
            "pp": list(self.pp),
            "regions": [dict(r) for r in self.regions],
        }

    def canonical(self) -> bytes:
        """Sorted-key compact JSON: equal layouts give equal bytes."""
        return canonical_json(self.payload())

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    @classmethod
    def from_payload(cls, payload: object) -> PlanFingerprint:
        """Validate a decoded payload; :class:`MalformedMetadataError` if not one."""
        if not isinstance(payload, dict):
            raise MalformedMetadataError("fingerprint is not a JSON object")
        version, tp_size, regions = (
            payload.get("v"),
            payload.get("tp_size"),
            payload.get("regions"),
        )
        if not isinstance(version, int) or isinstance(version, bool):
            raise MalformedMetadataError("fingerprint has no integer version 'v'")
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise MalformedMetadataError("fingerprint has no positive 'tp_size'")
        if not isinstance(regions, list) or not all(isinstance(r, dict) for r in regions):
            raise MalformedMetadataError("fingerprint 'regions' is not a list of objects")
        pp = payload.get("pp", [0, 1])  # before version 4 (refused by the version check)
        if not (
            isinstance(pp, list)
            and len(pp) == 2
            and all(isinstance(p, int) and not isinstance(p, bool) for p in pp)
            and 0 <= pp[0] < pp[1]
        ):
            raise MalformedMetadataError(f"fingerprint 'pp' {str(pp)[:40]} is not [rank, size]")
        return cls(version=version, tp_size=tp_size, regions=tuple(regions), pp=(pp[0], pp[1]))


def decode_fingerprint(data: str | bytes | bytearray | memoryview) -> PlanFingerprint:
    """A peer's fingerprint from its JSON text (as vLLM's connector carries it);
    :class:`MalformedMetadataError` for anything hostile or malformed."""
    return PlanFingerprint.from_payload(load_json(data, "layout fingerprint"))


class Regions(Protocol):
    """What a fingerprint is taken of: a plan's regions and its TP size (a
    :class:`~kvspec_traits.transfer.RegionPlan`)."""

    @property
    def regions(self) -> tuple[Region, ...]: ...
    @property
    def tp_size(self) -> int: ...


def fingerprint_of(plan: Regions, *, pp: tuple[int, int] = (0, 1)) -> PlanFingerprint:
    """The fingerprint of a plan (what :meth:`RegionPlan.fingerprint` returns), held by
    pipeline stage ``pp`` (``(pp_rank, pp_size)``)."""
    records = tuple(traits_record(r, plan.tp_size) for r in plan.regions)
    # Round-trip through JSON so local and decoded remote values compare alike
    # (tuples become lists, enums their values).
    return PlanFingerprint(
        version=FINGERPRINT_VERSION,
        tp_size=plan.tp_size,
        regions=tuple(json.loads(canonical_json(list(records)))),
        pp=pp,
    )


def check_handshake(
    local: PlanFingerprint | Regions, remote: PlanFingerprint, *, block_ratio: bool = False
) -> None:
    """Refuse a peer whose layout differs from ours.

    ``block_ratio``: the backend reads between other block sizes
    (:func:`~kvspec_traits.transfer.block_reads`), so token-paged regions are compared
    per token (``block_len`` over ``block_sizes``) and may differ in tokens per block.

    Raises :class:`HandshakeMismatchError` naming the first differing region (its index,
    name and layers) and every trait that differs there, with both values; or, with
    ``region=None``, a differing fingerprint version or region count. TP sizes may
    differ: split sizes are normalised to the whole TP group.
    """
    mine = local if isinstance(local, PlanFingerprint) else fingerprint_of(local)
    if mine.version != remote.version:
        raise HandshakeMismatchError(
            None, "fingerprint version", (), [("version", mine.version, remote.version)]
        )
    if len(mine.regions) != len(remote.regions):
        diffs: list[TraitDiff] = [("region count", len(mine.regions), len(remote.regions))]
        for i, (a, b) in enumerate(zip(mine.regions, remote.regions, strict=False)):
            if a.get("name") != b.get("name"):
                diffs.append((f"region {i} name", a.get("name"), b.get("name")))
                break
        mine_names = {str(r.get("name")) for r in mine.regions}
        theirs = {str(r.get("name")) for r in remote.regions}
        if mine_names - theirs:
            diffs.append(("regions only local", sorted(mine_names - theirs), None))
        if theirs - mine_names:
            diffs.append(("regions only remote", None, sorted(theirs - mine_names)))
        raise HandshakeMismatchError(None, "region count", (), diffs)
    local_facts = mine.tp_size == remote.tp_size
    for index, (a, b) in enumerate(zip(mine.regions, remote.regions, strict=True)):
        _check_record(index, a, b, block_ratio=block_ratio, local_facts=local_facts)


def _check_record(
    index: int,
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    *,
    block_ratio: bool = False,
    local_facts: bool = True,
) -> None:
    """Refuse local record ``a`` (region ``index``) unless remote ``b`` equals it (per
    token, with ``block_ratio``; :data:`LOCAL_KEYS` only with ``local_facts``: equal TP
    sizes)."""
    if block_ratio:
        a, b = _per_token(a), _per_token(b)
    if not local_facts:
        a, b = _without_local(a), _without_local(b)
    if not _same(a, b):
        raise _mismatch(index, a, b)


def _without_local(record: Mapping[str, Any]) -> Mapping[str, Any]:
    return {k: v for k, v in record.items() if k not in LOCAL_KEYS}


def _per_token(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """A token-paged region's record with its block length per token and no block size
    (what two sides of other block sizes share); any other record as it is."""
    sizes, whole = record.get("block_sizes"), record.get("block_len")
    if (
        record.get("paged") is not True
        or record.get("state") is not False
        or not isinstance(sizes, list)
        or len(sizes) != 1
        or not isinstance(sizes[0], int)
        or isinstance(sizes[0], bool)
        or sizes[0] < 1
        or not isinstance(whole, int)
        or isinstance(whole, bool)
        or whole % sizes[0]
    ):
        return record
    normal = {k: v for k, v in record.items() if k != "block_sizes"}
    normal["block_len"] = whole // sizes[0]
    return normal


def _mismatch(index: int, a: Mapping[str, Any], b: Mapping[str, Any]) -> HandshakeMismatchError:
    """The refusal of local record ``a`` (region ``index``) against remote ``b``."""
    region_diffs: list[TraitDiff] = [
        (key, a.get(key), b.get(key))
        for key in sorted(set(a) | set(b))
        if not _same(a.get(key), b.get(key))
    ]
    return HandshakeMismatchError(index, str(a.get("name")), _held(a), region_diffs)


def _held(record: Mapping[str, Any]) -> tuple[str, ...]:
    layers = record.get("layers")
    return tuple(str(x) for x in layers) if isinstance(layers, list) else ()


def pair_stages(
    local: PlanFingerprint | Regions, remote: PlanFingerprint, *, block_ratio: bool = False
) -> tuple[tuple[int, int], ...]:
    """Pair our regions with a peer's, as ``(local index, remote index)``, refusing a
    peer whose layout differs from ours on any region both move.

    Without pipeline parallelism on either side (both ``pp`` sizes 1) this is
    :func:`check_handshake` (every region, by position). When one side is a pipeline
    stage, it holds a slice of the layers and its peer (PP size 1) every layer: each
    region of the stage pairs with the peer's region of exactly the same layers (the
    n-th of the stage's regions of a layer set with the peer's n-th, as many on both
    sides), and the two records must be equal. :class:`HandshakeMismatchError` names
    the region and each differing trait (a peer that holds a layer in a region with
    other layers, as a whole row of several layers, differs in ``layers``); a stage
    layer the peer lacks, or two stages, raise :class:`StageLayersError`. The pairs
    are in the stage's region order.
    """
    mine = local if isinstance(local, PlanFingerprint) else fingerprint_of(local)
    if mine.pp[1] == 1 and remote.pp[1] == 1:
        check_handshake(mine, remote, block_ratio=block_ratio)
        return tuple((i, i) for i in range(len(mine.regions)))
    if mine.version != remote.version:
        raise HandshakeMismatchError(
            None, "fingerprint version", (), [("version", mine.version, remote.version)]
        )
    if mine.pp[1] > 1 and remote.pp[1] > 1:
        raise StageLayersError((), mine.pp, remote.pp)
    stage_is_local = mine.pp[1] > 1
    stage, whole = (mine, remote) if stage_is_local else (remote, mine)
    whole_layers = set(whole.layers)
    missing = [layer for layer in stage.layers if layer not in whole_layers]
    if missing:
        raise StageLayersError(missing, mine.pp, remote.pp)

    def by_layers(fingerprint: PlanFingerprint) -> dict[tuple[str, ...], list[int]]:
        found: dict[tuple[str, ...], list[int]] = {}
        for index, record in enumerate(fingerprint.regions):
            found.setdefault(_held(record), []).append(index)
        return found

    def local_first(stage_index: int, whole_index: int) -> tuple[int, int]:
        return (stage_index, whole_index) if stage_is_local else (whole_index, stage_index)

    partners = by_layers(whole)
    counts = by_layers(stage)
    pairs: list[tuple[int, int]] = []
    for index, record in enumerate(stage.regions):
        held = _held(record)
        theirs = partners.get(held)
        if theirs is None:
            # Every layer is there, in regions grouped otherwise: the whole side's
            # region of one of them differs at least in its layers.
            other = next((i for i, r in enumerate(whole.regions) if set(held) & set(_held(r))), -1)
            if other < 0:
                raise MalformedMetadataError(f"fingerprint record {index} names no layers")
            local_i, remote_i = local_first(index, other)
            raise _mismatch(local_i, mine.regions[local_i], remote.regions[remote_i])
        if len(theirs) != len(counts[held]):
            local_n, remote_n = local_first(len(counts[held]), len(theirs))
            raise HandshakeMismatchError(
                None, "region count", held, [(f"regions of layers {list(held)}", local_n, remote_n)]
            )
        local_i, remote_i = local_first(index, theirs[counts[held].index(index)])
        _check_record(
            local_i,
            mine.regions[local_i],
            remote.regions[remote_i],
            block_ratio=block_ratio,
            local_facts=mine.tp_size == remote.tp_size,
        )
        pairs.append((local_i, remote_i))
    return tuple(pairs)


def _same(a: object, b: object) -> bool:
    """Equal values of equal JSON types: ``true`` is not ``1``, ``65536.0`` not
    ``65536``, ``0`` not ``false`` (Python's ``==`` says they are)."""
    return a == b and canonical_json(a) == canonical_json(b)


def record_page(record: Mapping[str, Any], index: int, tp_size: int) -> int:
    """The block length a rank of ``tp_size`` holds for a region whose fingerprint
    record is ``record`` (the inverse of :func:`traits_record`'s scaling, its
    ``state_pad`` added)."""

    def layout(key: str) -> TPLayout | None:
        value = record.get(key)
        if value is None:
            return None
        try:
            return TPLayout(value)
        except ValueError:
            raise MalformedMetadataError(
                f"fingerprint record {index}: {key} {value!r} is not a TP layout"
            ) from None

    whole, shards_field = record.get("block_len"), record.get("tp_shards")
    flags = [record.get(k) for k in ("replicated", "paged")]
    if (
        not isinstance(whole, int)
        or isinstance(whole, bool)
        or whole < 1
        or not (
            shards_field is None
            or (
                isinstance(shards_field, int)
                and not isinstance(shards_field, bool)
                and shards_field >= 1
            )
        )
        or not all(isinstance(f, bool) for f in flags)
    ):
        raise MalformedMetadataError(
            f"fingerprint record {index} lacks block_len / tp_shards / replicated / paged"
        )
    tp_layout, state_layout = layout("tp_layout"), layout("state_tp_layout")
    if tp_layout is None:
        raise MalformedMetadataError(f"fingerprint record {index} has no tp_layout")
    replicated, paged = flags
    pad = record.get("state_pad")
    if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or pad < 0):
        raise MalformedMetadataError(
            f"fingerprint record {index}: state_pad {str(pad)[:40]} is not a byte count"
        )
    shards = shard_count(tp_layout, shards_field, tp_size)
    state_shards = 1 if state_layout is None else shard_count(state_layout, None, tp_size)
    scale = (1 if replicated else shards) if paged else state_shards
    if whole % scale:
        raise MalformedMetadataError(
            f"fingerprint record {index}: block_len {whole} does not split into {scale} TP shards"
        )
    return whole // scale + (pad or 0)
