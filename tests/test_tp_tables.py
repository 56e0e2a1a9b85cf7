"""The connector's prepared descriptor lists between TP sizes (``nixl/_tp_tables.py``)
against the shim's per-request rows (``transfer_items``), over every layout and TP pair
of ``tests/test_tp_matrix.py``: the same (local range, remote range) pairs for a request.

Both come from the planner's ``tp_reads``; what is checked here is the layout of the
prepared lists (block ``b`` of (region, read) ``j`` at id ``start_j + b`` on each side)
and the ids a request names into them. A push producer's writes (``tp_writes``, planned
from each consumer rank's side) must be exactly the rows that consumer rank reads from
that producer rank, turned around. The bytes these rows move are compared with hand-
computed shares in ``tests/test_tp_matrix.py``; here no NIXL is needed.
"""

from __future__ import annotations

import pytest

from kvspec_traits.nixl import transfer_items
from kvspec_traits.nixl._checked import checked_request
from kvspec_traits.nixl._descs import Request
from kvspec_traits.nixl._items import ReadCache, ReadTable
from kvspec_traits.nixl._tp_tables import tp_table, tp_table_ids, tp_writes
from kvspec_traits.transfer import peer_regions
from tests.nixl_helpers import checks
from tests.test_tp_matrix import LAYOUTS, PAIRS, _ds_conv_layout, _rank

__all__ = ["_ds_conv_layout"]  # an autouse fixture (the GDN state's DS conv layout)

CELLS = [(name, p, d) for name in LAYOUTS for p, d in PAIRS if p != d]

Pair = tuple[int, int, int, int, int]
"""(remote rank, local address, remote address, length, consumer rank)."""


@pytest.mark.parametrize(
    ("name", "producer_tp", "consumer_tp"), CELLS, ids=[f"{n}-P{p}D{d}" for n, p, d in CELLS]
)
def test_prepared_lists_name_the_rows_of_the_shims_reads_and_writes(
    name: str, producer_tp: int, consumer_tp: int
) -> None:
    producers = [_rank(name, producer_tp, q) for q in range(producer_tp)]
    remotes = {q: peer_regions(p.plan) for q, p in enumerate(producers)}
    ids = checks.request_blocks(producers[0].config, per_group=2)
    reads: set[Pair] = set()
    tabled: set[Pair] = set()
    written: set[Pair] = set()
    for r in range(consumer_tp):
        plan = _rank(name, consumer_tp, r).plan
        for item in transfer_items(plan, remotes, producer_tp, ids, ids):
            reads |= {
                (item.remote_rank, int(lo[0]), int(re[0]), int(lo[1]), r)
                for lo, re in zip(item.local, item.remote, strict=True)
            }
        cache = ReadCache(plan, producer_tp, remotes[0])
        _, groups = checked_request(
            plan, remotes, Request(ids, plan.num_groups), Request(ids, plan.num_groups), cache
        )
        tables = [
            tp_table(plan, ReadTable(plan, {q: remotes[q]}, cache), q, remotes[q])
            for q in range(producer_tp)
        ]
        for table in tables:
            got = tp_table_ids([table], groups).get(table.rank)
            for lid, rid in zip(*got, strict=True) if got is not None else ():
                lo, re = table.local[lid], table.remote[rid]
                assert lo[1] == re[1]  # one length on both sides
                tabled.add((table.rank, int(lo[0]), int(re[0]), int(lo[1]), r))
        theirs = peer_regions(plan)
        for q, producer in enumerate(producers):
            writes = tp_writes(producer.plan, consumer_tp, r, theirs)
            got = writes.ids(ids, ids)
            for their, our in zip(*got, strict=True) if got is not None else ():
                at, length = writes.table.local[their], int(writes.table.local[their][1])
                written.add((q, int(at[0]), int(writes.table.remote[our][0]), length, r))
    assert reads  # every cell moves some byte (test_tp_matrix: none is refused)
    assert tabled == reads
    assert written == reads
