"""NIXL shim: plan KV cache regions from layout traits, register them, move blocks.

The planner (:func:`plan_regions`), the descriptor builders and the handshake are pure
and import neither NIXL nor vLLM; :class:`TraitsNixlAgent` imports ``nixl._api`` when
it is constructed. See ``docs/nixl.md``. The shim needs numpy (``pip install
'kvspec-traits[nixl]'``) and, for an agent, NIXL's Python package; a missing one is a
:class:`~kvspec_traits.MissingDependencyError` saying what to install.
"""

from kvspec_traits._deps import needs

with needs("kvspec_traits.nixl (the NIXL shim)"):
    import numpy  # noqa: F401  # imported here to name it when missing, used by the modules below

from kvspec_traits.nixl._agent import (
    DescMode,
    RemotePeer,
    TraitsNixlAgent,
    TransferResult,
    prepped_desc_ids,
)
from kvspec_traits.nixl._descs import (
    BlockIds,
    Read,
    TransferItems,
    block_desc_ids,
    build_block_descs,
    build_state_descs,
    merge_runs,
    peer_regions,
    tp_reads,
    transfer_items,
)
from kvspec_traits.nixl._errors import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    DuplicateBlockIdError,
    HandshakeMismatchError,
    MalformedMetadataError,
    MemoryTypeMismatchError,
    MissingLayerError,
    MissingPeerError,
    RegionConflictError,
    TransferFailedError,
    UnsupportedLayoutError,
)
from kvspec_traits.nixl._handshake import (
    FINGERPRINT_VERSION,
    WIRE_VERSION,
    PeerMetadata,
    PeerRegion,
    PlanFingerprint,
    check_handshake,
    check_peer_geometry,
    check_peer_layout,
    check_region_bounds,
    decode_fingerprint,
    decode_metadata,
    encode_metadata,
)
from kvspec_traits.nixl._plan import (
    SHARED_REGION_GROUP_ID,
    MemoryRange,
    Region,
    RegionPlan,
    StateComponent,
    plan_regions,
    region_sort_key,
    shard_count,
)

__all__ = [
    "FINGERPRINT_VERSION",
    "SHARED_REGION_GROUP_ID",
    "WIRE_VERSION",
    "BlockIdError",
    "BlockIdShapeError",
    "BlockIdTypeError",
    "BlockIds",
    "DescMode",
    "DuplicateBlockIdError",
    "HandshakeMismatchError",
    "MalformedMetadataError",
    "MemoryRange",
    "MemoryTypeMismatchError",
    "MissingLayerError",
    "MissingPeerError",
    "PeerMetadata",
    "PeerRegion",
    "PlanFingerprint",
    "Read",
    "Region",
    "RegionConflictError",
    "RegionPlan",
    "RemotePeer",
    "StateComponent",
    "TraitsNixlAgent",
    "TransferFailedError",
    "TransferItems",
    "TransferResult",
    "UnsupportedLayoutError",
    "block_desc_ids",
    "build_block_descs",
    "build_state_descs",
    "check_handshake",
    "check_peer_geometry",
    "check_peer_layout",
    "check_region_bounds",
    "decode_fingerprint",
    "decode_metadata",
    "encode_metadata",
    "merge_runs",
    "peer_regions",
    "plan_regions",
    "prepped_desc_ids",
    "region_sort_key",
    "shard_count",
    "tp_reads",
    "transfer_items",
]
