"""A plan as a peer receives it: the fingerprint, each region's address geometry and
each registered memory range with the layers it holds, as JSON-able fields; and their
decoding from untrusted input.

Pure (no NIXL, Mooncake, numpy or vLLM). Every backend's handshake carries these fields
in its own envelope (the NIXL shim beside its agent metadata, the Mooncake backend
beside its RPC port), so a forged or malformed plan is refused by the same checks with
the same messages whichever backend carried it: :func:`decode_plan_record` bounds the
geometry by the peer's own fingerprint (:func:`~kvspec_traits.transfer.check_peer_geometry`)
before anything else reads it, and :func:`~kvspec_traits.transfer.check_peer` then binds
it to our plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvspec_traits.transfer._errors import MalformedMetadataError
from kvspec_traits.transfer._fingerprint import PlanFingerprint
from kvspec_traits.transfer._peer import PeerRegion, PeerRegistration, check_peer_geometry

if TYPE_CHECKING:
    from kvspec_traits.transfer._region_plan import RegionPlan

__all__ = ["PlanRecord", "decode_plan_record", "int_field", "plan_record"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRecord:
    """A peer's plan, decoded and checked against its own fingerprint."""

    tp_rank: int
    tp_size: int
    num_blocks: int
    fingerprint: PlanFingerprint
    regions: tuple[PeerRegion, ...]
    registrations: tuple[PeerRegistration, ...]


def plan_record(plan: RegionPlan) -> dict[str, Any]:
    """The fields of ``plan`` a peer needs, as JSON-able values (the inverse of
    :func:`decode_plan_record`)."""
    return {
        "tp_rank": plan.tp_rank,
        "tp_size": plan.tp_size,
        "num_blocks": plan.num_blocks,
        "fingerprint": plan.fingerprint().payload(),
        "regions": [
            [r.base_addr, r.block_len, r.block_stride, r.num_blocks, r.device_id, r.mem_type]
            for r in plan.regions
        ],
        "registrations": [
            [m.base, m.length, m.device_id, m.mem_type, [list(span) for span in m.layers]]
            for m in plan.registrations
        ],
    }


def int_field(header: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    """``header[key]``, an integer (not ``bool``) of at least ``minimum``, or
    :class:`MalformedMetadataError`."""
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MalformedMetadataError(f"header field {key!r} is not an integer >= {minimum}")
    return value


def _region_field(row: object, index: int) -> PeerRegion:
    if (
        not isinstance(row, list)
        or len(row) != 6
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row[:5])
        or not isinstance(row[5], str)
    ):
        raise MalformedMetadataError(
            f"region {index} is not [base, block_len, block_stride, num_blocks, "
            f"device_id, mem_type]"
        )
    return PeerRegion(
        base_addr=row[0],
        block_len=row[1],
        block_stride=row[2],
        num_blocks=row[3],
        device_id=row[4],
        mem_type=row[5],
    )


def _registration_field(row: object, index: int) -> PeerRegistration:
    if (
        not isinstance(row, list)
        or len(row) != 5
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row[:3])
        or not isinstance(row[3], str)
        or not isinstance(row[4], list)
        or not all(
            isinstance(span, list)
            and len(span) == 3
            and isinstance(span[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in span[1:])
            for span in row[4]
        )
    ):
        raise MalformedMetadataError(
            f"registration {index} is not [base, length, device_id, mem_type, "
            f"[[layer, first byte, bytes spanned], ...]]"
        )
    return PeerRegistration(
        base=row[0],
        length=row[1],
        device_id=row[2],
        mem_type=row[3],
        layers=tuple((span[0], span[1], span[2]) for span in row[4]),
    )


def decode_plan_record(header: Mapping[str, Any]) -> PlanRecord:
    """A peer's plan from a decoded JSON object (:func:`plan_record`'s fields; other keys
    are the envelope's). :class:`MalformedMetadataError` for a missing or mistyped
    field, a rank outside its TP size, region geometry its own fingerprint contradicts
    (:func:`~kvspec_traits.transfer.check_peer_geometry`) or no registered memory."""
    tp_size = int_field(header, "tp_size", 1)
    tp_rank = int_field(header, "tp_rank")
    if tp_rank >= tp_size:
        raise MalformedMetadataError(f"tp_rank {tp_rank} >= tp_size {tp_size}")
    rows = header.get("regions")
    if not isinstance(rows, list):
        raise MalformedMetadataError("header field 'regions' is not a list")
    regions = tuple(_region_field(row, i) for i, row in enumerate(rows))
    fingerprint = PlanFingerprint.from_payload(header.get("fingerprint"))
    if len(fingerprint.regions) != len(regions):
        raise MalformedMetadataError(
            f"{len(regions)} regions but {len(fingerprint.regions)} fingerprint records"
        )
    check_peer_geometry(fingerprint, regions, tp_size)
    reg_rows = header.get("registrations")
    if not isinstance(reg_rows, list) or not reg_rows:
        raise MalformedMetadataError("header field 'registrations' is not a non-empty list")
    return PlanRecord(
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_blocks=int_field(header, "num_blocks", 1),
        fingerprint=fingerprint,
        regions=regions,
        registrations=tuple(_registration_field(row, i) for i, row in enumerate(reg_rows)),
    )
