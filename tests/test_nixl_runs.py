"""The run-level merge (nixl/_runs.py) and merged mode's choice (nixl/_request.py).

The reference is the scalar path: ``merge_runs`` of the rows ``transfer_items`` writes,
one per block per (region, read). The run-level merge must give the same rows, in the
same order, byte for byte, on the real plans of every layout family (dense pages,
packed DeepSeek-V4 rows, Mamba states, shared regions), with same and heterogeneous TP,
and with block ids that are empty, single, unsorted, in runs, or repeated remotely.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvspec_traits.nixl import PeerMetadata, RemotePeer, _request
from kvspec_traits.nixl._checked import checked_request, transfer_items_of
from kvspec_traits.nixl._descs import Request
from kvspec_traits.nixl._items import (
    ReadCache,
    TransferItems,
    merge_runs,
)
from kvspec_traits.nixl._request import MERGE_MIN_DESCRIPTORS, MERGE_PAYS, request_descs
from kvspec_traits.nixl._runs import merged_rows, request_runs
from kvspec_traits.transfer import (
    BlockIdTypeError,
    DuplicateBlockIdError,
    PeerRegion,
    RegionPlan,
    peer_regions,
    plan_regions,
)
from tests.nixl_helpers import layouts

NB = 16


def _plan(family: str, tp: int = 1, rank: int = 0) -> RegionPlan:
    config, caches = layouts.build(family, NB, tp=tp)
    return plan_regions(caches, config, tp_size=tp, tp_rank=rank)


def _both(
    plan: RegionPlan,
    remotes: dict[int, tuple[PeerRegion, ...]],
    remote_tp: int,
    local: list[list[int]],
    remote: list[list[int]] | None = None,
) -> tuple[list[TransferItems], list[TransferItems]]:
    """(scalar: merge_runs of per-block rows, run-level rows) of one request."""
    reads = ReadCache(plan, remote_tp, next(iter(remotes.values())))
    lreq = Request(local, plan.num_groups, "local")
    rreq = lreq if remote is None else Request(remote, plan.num_groups, "remote")
    scalar = [merge_runs(i) for i in transfer_items_of(plan, remotes, lreq, rreq, reads)]
    runs = request_runs(*checked_request(plan, remotes, lreq, rreq, reads))
    return scalar, merged_rows(runs)


def _assert_same(scalar: list[TransferItems], vector: list[TransferItems]) -> None:
    assert [i.remote_rank for i in vector] == [i.remote_rank for i in scalar]
    for a, b in zip(scalar, vector, strict=True):
        assert b.local.dtype == np.uint64 and b.local.shape == a.local.shape
        assert np.array_equal(a.local, b.local) and np.array_equal(a.remote, b.remote)


def _requests(groups: int, rng: np.random.Generator) -> list[tuple[str, list[list[int]]]]:
    """Request shapes, each id used once (a destination is named once)."""
    per = NB // groups
    shuffled = rng.permutation(NB).tolist()
    return [
        ("empty", [[] for _ in range(groups)]),
        ("one block", [[5]] + [[] for _ in range(groups - 1)]),
        ("one each", [[g] for g in range(groups)]),
        ("runs", [list(range(g * per, (g + 1) * per)) for g in range(groups)]),
        ("every block, one group", [list(range(NB))] + [[] for _ in range(groups - 1)]),
        ("unsorted runs", [list(range((g + 1) * per - 1, g * per - 1, -1)) for g in range(groups)]),
        ("shuffled", [shuffled[g * per : (g + 1) * per] for g in range(groups)]),
    ]


@pytest.mark.parametrize("family", sorted(layouts.FAMILIES))
def test_run_merge_equals_scalar_merge_on_every_family(family: str) -> None:
    plan = _plan(family)
    remotes = {0: peer_regions(plan)}
    rng = np.random.default_rng(7)
    for name, local in _requests(plan.num_groups, rng):
        # Same ids on both sides, other ids remotely (shifted runs and reversed), and
        # remote ids that repeat (allowed: one source block may fill two destinations).
        remote_shapes = [
            None,
            [[(b + 3) % NB for b in g] for g in local],
            [list(reversed(g)) for g in local],
            [[1] * len(g) for g in local],
        ]
        for remote in remote_shapes:
            scalar, vector = _both(plan, remotes, 1, local, remote)
            _assert_same(scalar, vector)
            if name == "empty":
                assert all(i.count == 0 for i in vector), name


def _peer_of(plan: RegionPlan, regions: tuple[PeerRegion, ...], tp: int, rank: int) -> RemotePeer:
    meta = PeerMetadata(
        agent_name=f"producer{rank}",
        tp_rank=rank,
        tp_size=tp,
        num_blocks=NB,
        fingerprint=plan.fingerprint(),
        regions=regions,
        agent_metadata=b"md",
    )
    return RemotePeer(meta)


@pytest.mark.parametrize("family", sorted(layouts.FAMILIES))
def test_request_rows_equal_scalar_merge_on_every_family(family: str) -> None:
    """What read_blocks posts in merged mode (request_descs: the one-class path where
    every bucket is dense or never joins, else the run tables), with no prepared list so
    rows are always written, equals merge_runs of the per-block rows: ids given as lists
    and as arrays, the same or other remote ids."""
    plan = _plan(family)
    regions = peer_regions(plan)
    remotes = {0: regions}
    rng = np.random.default_rng(11)
    for name, local in _requests(plan.num_groups, rng):
        for remote in (
            None,
            [[(b + 3) % NB for b in g] for g in local],
            [[1] * len(g) for g in local],
        ):
            scalar, _ = _both(plan, remotes, 1, local, remote)
            for ids in (local, [np.asarray(g, dtype=np.int64) for g in local]):
                got = request_descs(plan, {0: _peer_of(plan, regions, 1, 0)}, ids, remote, "merged")
                assert got.local_ids is None, name
                _assert_same(scalar, got.items)
                assert got.nbytes == sum(i.nbytes for i in scalar)


def test_rows_merge_across_abutting_regions() -> None:
    """Llama's layers are one tensor, layer after layer: a request of every block is one
    descriptor over every region, as merge_runs gives (the seams between rows are
    tested where their bytes can abut); with the second layer moved elsewhere, the
    rows around it no longer merge."""
    plan = _plan("llama_gqa")
    first, second = plan.regions[0], plan.regions[1]
    far = dataclasses.replace(second, base_addr=second.base_addr + (1 << 40))
    apart = dataclasses.replace(plan, regions=(first, far, *plan.regions[2:]))
    ids = [list(range(NB))]
    counts = []
    for case in (plan, apart):
        regions = peer_regions(case)
        scalar, _ = _both(case, {0: regions}, 1, ids)
        got = request_descs(case, {0: _peer_of(case, regions, 1, 0)}, ids, None, "merged")
        _assert_same(scalar, got.items)
        counts.append(got.descriptors)
    assert counts == [1, 3 if len(plan.regions) > 2 else 2]


@pytest.mark.parametrize("family", ["llama_gqa", "deepseek_v3", "gpt_oss", "llama4"])
@pytest.mark.parametrize(("local_tp", "remote_tp"), [(1, 2), (2, 1), (2, 4)])
def test_run_merge_equals_scalar_merge_across_tp_sizes(
    family: str, local_tp: int, remote_tp: int
) -> None:
    """Head-split reads (a slice of each block: stride > length, nothing merges within
    a region) and gathered ones (two ranks' slices per block)."""
    plan = _plan(family, tp=local_tp, rank=local_tp - 1)
    remotes = {
        rank: peer_regions(_plan(family, tp=remote_tp, rank=rank)) for rank in range(remote_tp)
    }
    rng = np.random.default_rng(3)
    for _, local in _requests(plan.num_groups, rng):
        _assert_same(*_both(plan, remotes, remote_tp, local))


def test_dense_runs_become_one_row_per_run() -> None:
    """Llama (dense pages: block_len == block_stride): runs 1-3 and 5 are two rows per
    layer, each of the run's bytes; an unsorted run does not merge (block 3 then 2 do
    not abut in that order)."""
    plan = _plan("llama_gqa")
    remotes = {0: peer_regions(plan)}
    (merged,) = _both(plan, remotes, 1, [[1, 2, 3, 5]])[1]
    layers = len(plan.regions)
    block_len = plan.regions[0].block_len
    assert merged.count == 2 * layers
    assert merged.local[:, 1].tolist() == [3 * block_len, block_len] * layers
    (unsorted,) = _both(plan, remotes, 1, [[3, 2, 1]])[1]
    assert unsorted.count == 3 * layers


def _peer(plan: RegionPlan, prepped: bool = True) -> RemotePeer:
    meta = PeerMetadata(
        agent_name="producer",
        tp_rank=plan.tp_rank,
        tp_size=plan.tp_size,
        num_blocks=NB,
        fingerprint=plan.fingerprint(),
        regions=peer_regions(plan),
        agent_metadata=b"md",
    )
    return RemotePeer(meta, prepped=object() if prepped else None)


def test_merged_mode_uses_prepared_ids_where_rows_do_not_pay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSeek-V4 rows (a region's blocks never abut) and shuffled ids: merging would
    leave one row per block, so merged mode selects the prepared-list ids, the same
    ones ``mode="prepped"`` gives; the same blocks in runs on a dense layout are rows,
    MERGE_PAYS times fewer or better, from MERGE_MIN_DESCRIPTORS descriptors (here 12
    blocks in 4 regions: 48), and ids below."""
    v4 = _plan("deepseek_v4")
    ids = [[7, 1], [12, 3], [9], [0]]
    merged = request_descs(v4, {0: _peer(v4)}, ids, None, "merged")
    prepped = request_descs(v4, {0: _peer(v4)}, ids, None, "prepped")
    assert merged.items == [] and prepped.items == []
    assert merged.local_ids is not None and prepped.local_ids is not None
    assert merged.remote_ids is not None and prepped.remote_ids is not None
    assert np.array_equal(merged.local_ids, prepped.local_ids)
    assert np.array_equal(merged.remote_ids, prepped.remote_ids)
    assert (merged.per_block, merged.nbytes) == (prepped.per_block, prepped.nbytes)
    dense = _plan("llama_gqa")
    run = [list(range(12))]
    small = request_descs(dense, {0: _peer(dense)}, run, None, "merged")
    same = request_descs(dense, {0: _peer(dense)}, run, None, "prepped")
    assert small.per_block == 48 < MERGE_MIN_DESCRIPTORS and small.local_ids is not None
    assert np.array_equal(small.local_ids, same.local_ids)  # type: ignore[arg-type]
    monkeypatch.setattr(_request, "MERGE_MIN_DESCRIPTORS", 49)
    below = request_descs(dense, {0: _peer(dense)}, run, None, "merged")
    assert below.local_ids is not None  # 48 < 49: ids
    monkeypatch.setattr(_request, "MERGE_MIN_DESCRIPTORS", 48)
    rows = request_descs(dense, {0: _peer(dense)}, run, None, "merged")
    assert rows.local_ids is None and rows.descriptors * MERGE_PAYS <= rows.per_block
    assert rows.nbytes == same.nbytes  # the same bytes either way
    # No prepared list (as for another TP size): rows even where nothing merges.
    unprepped = request_descs(v4, {0: _peer(v4, prepped=False)}, ids, None, "merged")
    assert unprepped.local_ids is None and unprepped.descriptors == merged.per_block


def test_merged_mode_refuses_repeated_destinations_before_building() -> None:
    """A destination named twice is refused whichever way merged mode would go (rows
    or prepared ids), with the repeated id."""
    cases = (("llama_gqa", [[4, 5, 6, 4]], 4), ("deepseek_v4", [[1], [2], [3], [1]], 1))
    for family, ids, repeated in cases:
        plan = _plan(family)
        with pytest.raises(DuplicateBlockIdError) as info:
            request_descs(plan, {0: _peer(plan)}, ids, None, "merged")
        assert info.value.block_id == repeated


@pytest.mark.parametrize("per_side", [20, 150])  # both sides 40 ids (one pass) or 300
def test_tuples_and_ranges_are_ids_as_lists_are(per_side: int) -> None:
    """A request's groups as tuples or ranges give the lists' descriptors, in every mode,
    on both sides of the 64-id conversion split (``array``'s list path above it takes
    lists only: a tuple or range group there raised a bare ``TypeError``), and an id past
    int64 in one is the same ``BlockIdTypeError``."""
    config, caches = layouts.build("llama_gqa", 400)
    plan = plan_regions(caches, config)
    peer = _peer(plan)
    local, remote = list(range(per_side)), list(range(200, 200 + per_side))
    for mode in ("prepped", "merged", "per_block"):
        want = request_descs(plan, {0: peer}, [local], [remote], mode)
        for lform, rform in ((tuple(local), range(200, 200 + per_side)), (local, tuple(remote))):
            got = request_descs(plan, {0: peer}, [lform], [rform], mode)
            assert (got.descriptors, got.per_block, got.nbytes) == (
                want.descriptors,
                want.per_block,
                want.nbytes,
            )
            for a, b in ((got.local_ids, want.local_ids), (got.remote_ids, want.remote_ids)):
                assert (a is None) == (b is None)
                assert a is None or b is None or np.array_equal(a, b)
            for x, y in zip(got.items, want.items, strict=True):
                assert np.array_equal(x.local, y.local) and np.array_equal(x.remote, y.remote)
    with pytest.raises(BlockIdTypeError, match="does not fit in int64") as info:
        request_descs(plan, {0: peer}, [local], [(*remote[:-1], 1 << 63)], "prepped")
    assert info.value.side == "remote"
