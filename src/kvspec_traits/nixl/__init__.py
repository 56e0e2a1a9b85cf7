"""NIXL shim: register a :class:`~kvspec_traits.transfer.RegionPlan` with NIXL, exchange
the handshake, move a request's blocks.

Planning, the fingerprint, the peer checks (``peer_regions`` too) and their errors (block
ids, memory types) are backend-neutral: :mod:`kvspec_traits.transfer`. This package holds
what is NIXL's: descriptors, the handshake wire format and the agent. The descriptor
builders and the wire format are pure (no NIXL); :class:`TraitsNixlAgent` imports
``nixl._api`` when it is constructed. See ``docs/nixl.md``. The shim needs numpy (the
``[nixl]`` extra) and, for an agent, NIXL's Python package; a missing one is a
:class:`~kvspec_traits.MissingDependencyError` saying what to install.
"""

from kvspec_traits._deps import needs

with needs("kvspec_traits.nixl (the NIXL shim)"):
    import numpy  # noqa: F401  # imported here to name it when missing, used by the modules below

from kvspec_traits.nixl._agent import TraitsNixlAgent
from kvspec_traits.nixl._checked import transfer_items
from kvspec_traits.nixl._descs import BlockIds, block_desc_ids, build_block_descs, build_state_descs
from kvspec_traits.nixl._errors import MissingPeerError, TransferFailedError
from kvspec_traits.nixl._items import TransferItems, merge_runs
from kvspec_traits.nixl._peer import DescMode, RemotePeer, TransferResult, prepped_desc_ids
from kvspec_traits.nixl._wire import (
    PeerMetadata,
    check_peer_layout,
    decode_metadata,
    encode_metadata,
)

__all__ = [
    "BlockIds",
    "DescMode",
    "MissingPeerError",
    "PeerMetadata",
    "RemotePeer",
    "TraitsNixlAgent",
    "TransferFailedError",
    "TransferItems",
    "TransferResult",
    "block_desc_ids",
    "build_block_descs",
    "build_state_descs",
    "check_peer_layout",
    "decode_metadata",
    "encode_metadata",
    "merge_runs",
    "prepped_desc_ids",
    "transfer_items",
]
