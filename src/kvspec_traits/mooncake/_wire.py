"""The Mooncake backend's handshake record (its wire format).

Pure (no Mooncake): the consumer decodes a peer's record and checks it
(:func:`~kvspec_traits.transfer.check_peer`) before it names the peer in any transfer.

Wire format (all integers little-endian)::

    magic       8 bytes  b"KVSTMOON"
    version     u16      (WIRE_VERSION)
    header_len  u32
    header      header_len bytes of canonical JSON

Nothing may follow. The header holds the plan record every backend sends
(``transfer/_record.py``: TP rank and size, the fingerprint, each region's geometry,
each registered memory range with the layers it holds) and ``rpc_port``, the port of
the peer's Mooncake engine. The record names no host: the consumer addresses the engine
on the host it fetched the record from (:meth:`TraitsMooncakeEngine.connect`), so a
peer cannot point its transfers at a third machine.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from kvspec_traits.transfer import MalformedMetadataError, RegionPlan
from kvspec_traits.transfer._fingerprint import canonical_json, load_json
from kvspec_traits.transfer._record import PlanRecord, decode_plan_record, plan_record

__all__ = ["MAX_RECORD", "WIRE_VERSION", "PeerRecord", "decode_record", "encode_record"]

WIRE_VERSION: Final = 1
_MAGIC: Final = b"KVSTMOON"
_PREFIX: Final = struct.Struct("<8sHI")
MAX_RECORD: Final = 64 << 20
"""The largest record a reader accepts (a corrupt length cannot make it allocate more)."""
_PORTS: Final = range(1, 1 << 16)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRecord:
    """A peer's decoded record: its plan and its engine's RPC port."""

    plan: PlanRecord
    rpc_port: int


def encode_record(plan: RegionPlan, rpc_port: int) -> bytes:
    """Serialise ``plan``'s handshake for a peer (see the module docstring)."""
    header = canonical_json({"rpc_port": rpc_port, **plan_record(plan)})
    return _PREFIX.pack(_MAGIC, WIRE_VERSION, len(header)) + header


def decode_record(data: bytes | bytearray | memoryview) -> PeerRecord:
    """Parse a peer's record; :class:`MalformedMetadataError` on anything but a
    complete, well-formed record of a known version whose plan passes the checks every
    backend runs on a decoded plan (:func:`~kvspec_traits.transfer._record.decode_plan_record`)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMetadataError(
            f"a {type(data).__name__} is not a handshake record; pass the bytes the "
            f"peer's TraitsMooncakeEngine.record() returned"
        )
    raw = bytes(data)
    if len(raw) < _PREFIX.size:
        raise MalformedMetadataError(
            f"truncated: {len(raw)} bytes, the fixed prefix alone is {_PREFIX.size}"
        )
    magic, version, header_len = _PREFIX.unpack_from(raw)
    if magic != _MAGIC:
        raise MalformedMetadataError(f"bad magic {magic!r} (expected {_MAGIC!r})")
    if version != WIRE_VERSION:
        raise MalformedMetadataError(
            f"wire version {version}, this reader understands {WIRE_VERSION}"
        )
    if header_len > MAX_RECORD:
        raise MalformedMetadataError(f"implausible length (header {header_len})")
    expected = _PREFIX.size + header_len
    if len(raw) != expected:
        raise MalformedMetadataError(
            f"{'truncated' if len(raw) < expected else 'trailing bytes'}: "
            f"{len(raw)} bytes, the prefix announces {expected}"
        )
    header = load_json(raw[_PREFIX.size :], "header")
    if not isinstance(header, dict):
        raise MalformedMetadataError("header is not a JSON object")
    port = header.get("rpc_port")
    if not isinstance(port, int) or isinstance(port, bool) or port not in _PORTS:
        raise MalformedMetadataError("header field 'rpc_port' is not a TCP port (1-65535)")
    return PeerRecord(plan=decode_plan_record(header), rpc_port=port)
