"""Backend-neutral KV transfer planning: regions from layout traits, the layout
fingerprint and the checks a peer must pass.

Pure: imports neither NIXL, numpy nor vLLM (``tests/test_import_graph.py`` checks it).
:func:`plan_regions` turns one rank's KV cache tensors into a :class:`RegionPlan`;
:meth:`RegionPlan.fingerprint` is what producer and consumer compare
(:func:`check_handshake`) before any transfer; :func:`tp_reads` says where a rank's
block comes from across TP sizes. ``kvspec_traits.nixl`` moves the bytes with NIXL;
``kvspec_traits.vllm_connector`` feeds the plan to vLLM's NIXL worker. See
``docs/nixl.md``.
"""

from kvspec_traits.transfer._errors import (
    BlockIdError,
    BlockIdShapeError,
    BlockIdTypeError,
    DuplicateBlockIdError,
    HandshakeMismatchError,
    MalformedMetadataError,
    MemoryTypeMismatchError,
    MissingLayerError,
    RegionConflictError,
    StageLayersError,
    UnsupportedLayoutError,
)
from kvspec_traits.transfer._fingerprint import (
    FINGERPRINT_VERSION,
    PlanFingerprint,
    check_handshake,
    decode_fingerprint,
    pair_stages,
)
from kvspec_traits.transfer._peer import (
    PeerRegion,
    PeerRegistration,
    check_peer,
    check_peer_geometry,
    check_peer_mem_types,
    check_peer_placement,
    check_region_bounds,
    peer_regions,
    peer_registrations,
)
from kvspec_traits.transfer._plan import plan_regions
from kvspec_traits.transfer._ratio import BlockRead, block_reads
from kvspec_traits.transfer._region import SHARED_REGION_GROUP_ID, PlanLayout, Region, Rows
from kvspec_traits.transfer._region_plan import RegionPlan
from kvspec_traits.transfer._tp import (
    Read,
    check_tp_pair,
    lanes_of,
    peer_view,
    shard_count,
    tp_reads,
    with_kv_heads,
)

__all__ = [
    "FINGERPRINT_VERSION",
    "SHARED_REGION_GROUP_ID",
    "BlockIdError",
    "BlockIdShapeError",
    "BlockIdTypeError",
    "BlockRead",
    "DuplicateBlockIdError",
    "HandshakeMismatchError",
    "MalformedMetadataError",
    "MemoryTypeMismatchError",
    "MissingLayerError",
    "PeerRegion",
    "PeerRegistration",
    "PlanFingerprint",
    "PlanLayout",
    "Read",
    "Region",
    "RegionConflictError",
    "RegionPlan",
    "Rows",
    "StageLayersError",
    "UnsupportedLayoutError",
    "block_reads",
    "check_handshake",
    "check_peer",
    "check_peer_geometry",
    "check_peer_mem_types",
    "check_peer_placement",
    "check_region_bounds",
    "check_tp_pair",
    "decode_fingerprint",
    "lanes_of",
    "pair_stages",
    "peer_regions",
    "peer_registrations",
    "peer_view",
    "plan_regions",
    "shard_count",
    "tp_reads",
    "with_kv_heads",
]
