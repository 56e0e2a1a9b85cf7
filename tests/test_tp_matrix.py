"""Every TP pair of the matrix in issue 47, for every layout, decided once by
``kvspec_traits.transfer`` and moved by the backend-neutral move builder that
``kvspec_traits.mooncake`` runs (``routes_of`` / ``request_moves``, both directions).

Layouts (vLLM's real spec classes, laid out by vLLM's own ``create_kv_cache_views``):
GQA with at least as many KV heads as ranks; one KV head (MQA); two KV heads at TP 4
(replicas); MLA; MLA and GQA in one ``UniformTypeKVCacheSpecs`` group; a GDN state
TP-sharded beside two-head GQA (hybrid groups sharing tensors, vLLM's DS conv layout);
a TP-replicated state beside GQA; DeepSeek-V4's rows. TP pairs (producer -> consumer):
1->1, 2->1, 1->2, 4->1, 4->2, 1->4, 2->4.

What each rank holds is computed here by hand from vLLM's rules, never from the plan:

- attention (``Attention.get_kv_cache_spec``, ``models/llama.py``): a rank of TP ``t``
  holds ``max(1, H // t)`` of the model's ``H`` KV heads; with more heads than ranks,
  rank ``r`` holds heads ``[r * H/t, (r+1) * H/t)``; with fewer, rank ``r`` holds head
  ``r // (t / H)`` (vLLM's ``num_kv_head_replicas``);
- MLA and DeepSeek-V4's caches: the same bytes on every rank;
- the GDN state (vLLM's ``derive_mamba_conv_split`` in the DS layout): the conv state
  ``(conv_dim / t, 3)`` holds ``1 / t`` of each of Q, K and V, rank ``r`` the ``r``-th
  slice of each, in that order; the SSM state ``(value_heads / t, k, v)`` the ``r``-th
  slice of the heads;
- a TP-replicated state: the same bytes on every rank.

Every producer rank is filled with its share of one seeded TP-1 truth (each block with
the share of the group that owns it); a consumer rank starts at zero and, after the
transfer of disjoint block ids per group, must equal its own share in the requested
blocks and zero everywhere else: the whole allocation is compared. The moves are applied
with tensor copies at the addresses the move lists give, so what is checked is exactly
what a Mooncake batch call would be handed. Real Mooncake engines move the cells whose
reads are new (replicated heads, the split state) in ``test_mooncake_tp_matrix``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import _families as families
from kvspec_traits.mooncake import (
    Moves,
    TraitsMooncakeEngine,
    fetch_record,
    request_moves,
    routes_of,
)
from kvspec_traits.nixl import TraitsNixlAgent
from kvspec_traits.transfer import (
    HandshakeMismatchError,
    MalformedMetadataError,
    RegionPlan,
    check_handshake,
    check_peer_geometry,
    check_tp_pair,
    peer_regions,
    plan_regions,
)
from kvspec_traits.transfer._fingerprint import record_page
from kvspec_traits.vllm_connector import TraitsNixlConnectorWorker
from kvspec_traits.vllm_connector._push import TraitsNixlPushConnectorWorker
from tests.mooncake_helpers.remote import Remote
from tests.nixl_helpers import checks, layouts
from tests.nixl_helpers.receive import push_request, receive, serving
from tests.test_connector_differential import distributed, llama_rank_worker

__all__ = ["distributed"]  # a fixture, imported for its name

NB = 12  # DeepSeek-V4's four groups ask 2 disjoint blocks each
PAIRS = [(1, 1), (2, 1), (1, 2), (4, 1), (4, 2), (1, 4), (2, 4)]
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Layout:
    """A model's cache groups per TP size, its layout, its KV head count (what vLLM's
    model config says; ``None`` for an MLA model) and its state layers."""

    groups: Callable[[int], list[KVCacheGroupSpec]]
    layout: KVCacheLayout = KVCacheLayout.LBHNC
    kv_heads: int | None = None
    states: frozenset[str] = frozenset()
    replicated_states: frozenset[str] = frozenset()


def _gqa(heads: int, tp: int, block: int = 16, head_size: int = 64) -> FullAttentionSpec:
    return families.llama_gqa(block_size=block, num_kv_heads=heads, head_size=head_size, tp=tp)


def _attn_only(heads: int) -> Callable[[int], list[KVCacheGroupSpec]]:
    return lambda tp: [
        layouts.group(
            layouts.layer_names("model.layers.{}.self_attn.attn", range(2)), _gqa(heads, tp)
        )
    ]


def _mla_gqa(tp: int) -> list[KVCacheGroupSpec]:
    # One FullAttention-type group of an MLA layer and a two-head GQA layer (vLLM groups
    # specs of one type into a UniformTypeKVCacheSpecs whatever their page sizes).
    specs: dict[str, KVCacheSpec] = {
        "model.layers.0.self_attn.attn": families.deepseek_v3_mla(block_size=16),
        "model.layers.1.self_attn.attn": _gqa(2, tp),
    }
    return [
        layouts.group(list(specs), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs))
    ]


# The GDN state of the hybrid: 4 key and 4 value heads of 32, so the conv state is
# [Q, K, V] = 2 x key_dim + value_dim = 3 x 128 wide (vLLM's GDN conv_dim), the SSM state
# 4 value heads of 32 x 32, bf16; its page padded to the attention page (block 64, two KV
# heads of 64: 32 KiB at TP 1).
GDN = {"conv_dim": 3 * 128, "value_heads": 4, "head_k": 32, "head_v": 32}


def _gdn_gqa(tp: int) -> list[KVCacheGroupSpec]:
    attn = _gqa(2, tp, block=64)
    state = families.gdn_state(
        **GDN,
        dtypes=(BF16, BF16),
        tp=tp,
        conv_layout="DS",
        mamba_type="GDN_ATTN",
        block_size=64,
        page_size_padded=attn.page_size_bytes,
    )
    return [
        layouts.group(["model.layers.0.linear_attn", "model.layers.1.linear_attn"], state),
        layouts.group(["model.layers.2.self_attn.attn"], attn),
    ]


def _replicated_state_gqa(tp: int) -> list[KVCacheGroupSpec]:
    # A state every rank holds whole (vLLM's tp_replicated), beside 8-head GQA.
    attn = _gqa(8, tp, block=64)
    state = families.gdn_state(
        **GDN,
        dtypes=(BF16, BF16),
        tp=1,
        conv_layout="DS",
        mamba_type="GDN_ATTN",
        block_size=64,
        page_size_padded=attn.page_size_bytes,
    )
    state = dataclasses.replace(state, tp_replicated=True)
    return [
        layouts.group(["model.layers.0.ple"], state),
        layouts.group(["model.layers.1.self_attn.attn"], attn),
    ]


LAYOUTS: dict[str, Layout] = {
    "gqa8": Layout(_attn_only(8), kv_heads=8),
    "mqa": Layout(_attn_only(1), kv_heads=1),
    "gqa2": Layout(_attn_only(2), kv_heads=2),
    "mla": Layout(lambda tp: layouts.deepseek_v3(tp, layers=2)),
    "mla_gqa_uniform": Layout(_mla_gqa, kv_heads=2),
    "gdn_state_gqa2": Layout(
        _gdn_gqa,
        kv_heads=2,
        states=frozenset({"model.layers.0.linear_attn", "model.layers.1.linear_attn"}),
    ),
    "replicated_state_gqa": Layout(
        _replicated_state_gqa, kv_heads=8, replicated_states=frozenset({"model.layers.0.ple"})
    ),
    "deepseek_v4": Layout(layouts.deepseek_v4, KVCacheLayout.BLHNC),
}


@dataclass
class Rank:
    config: KVCacheConfig
    caches: dict[str, torch.Tensor]
    plan: RegionPlan

    @property
    def raw(self) -> torch.Tensor:
        return layouts.backing(self.caches)


def _rank(name: str, tp: int, rank: int) -> Rank:
    lay = LAYOUTS[name]
    config = layouts.kv_cache_config(lay.groups(tp), NB, lay.layout)
    caches = layouts.allocate(config, lay.layout)
    plan = plan_regions(caches, config, tp_size=tp, tp_rank=rank, total_kv_heads=lay.kv_heads)
    return Rank(config, caches, plan)


def _truth(name: str) -> dict[str, torch.Tensor]:
    """The TP-1 caches, every byte seeded."""
    lay = LAYOUTS[name]
    config = layouts.kv_cache_config(lay.groups(1), NB, lay.layout)
    caches = layouts.allocate(config, lay.layout)
    layouts.fill_pattern(caches, 47)
    return caches


def _state_share(truth: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """One block's GDN state page of rank ``rank`` at TP ``tp`` (bytes, padding zero),
    from the TP-1 page: vLLM's DS conv split (Q, K, V each 1/tp) and the SSM heads."""
    row = 3 * 2  # a conv row: kernel - 1 = 3 bf16 elements
    qkv = GDN["conv_dim"] // 3  # Q, K and V are equally wide here (key_dim == value_dim)
    conv1 = GDN["conv_dim"] * row
    ssm1 = GDN["value_heads"] * GDN["head_k"] * GDN["head_v"] * 2
    out = torch.zeros_like(truth)
    at = 0
    for part in range(3):
        width = qkv // tp * row
        start = part * qkv * row + rank * width
        out[at : at + width] = truth[start : start + width]
        at += width
    heads = ssm1 // tp
    out[at : at + heads] = truth[conv1 + rank * heads : conv1 + (rank + 1) * heads]
    return out


def _share(
    name: str,
    truth: dict[str, torch.Tensor],
    layer: str,
    tp: int,
    rank: int,
    block: int,
    view: torch.Tensor,
) -> torch.Tensor:
    """Rank ``rank``'s (TP ``tp``) content of ``layer``'s page in ``block``."""
    lay = LAYOUTS[name]
    whole = truth[layer][block]
    if layer in lay.states:
        flat = whole.reshape(-1).view(torch.uint8)
        share = _state_share(flat, tp, rank)
        return (
            share[: view[block].numel() * view.element_size()]
            .view(view.dtype)
            .reshape(view[block].shape)
        )
    if layer in lay.replicated_states:
        flat = whole.reshape(-1).view(torch.uint8).clone()
        state_bytes = (GDN["conv_dim"] * 3 + GDN["value_heads"] * GDN["head_k"] * GDN["head_v"]) * 2
        flat[state_bytes:] = 0  # the padding to the attention page is nobody's
        return flat.view(view.dtype).reshape(view[block].shape)
    heads_total, heads = whole.shape[0], view.shape[1]
    if heads == heads_total:  # replicated: MLA, one KV head, DeepSeek-V4's caches
        return whole
    first = rank * heads if heads_total >= tp else rank // (tp // heads_total)
    return whole[first : first + heads]


def _owner(block_ids: list[list[int]], block: int) -> int:
    """The group whose pages a block holds (requested blocks: the requesting group)."""
    for group, ids in enumerate(block_ids):
        if block in ids:
            return group
    return block % len(block_ids)


def _fill(
    name: str,
    truth: dict[str, torch.Tensor],
    r: Rank,
    tp: int,
    rank: int,
    block_ids: list[list[int]],
    only: bool,
) -> None:
    """Write rank ``rank``'s share into ``r``: every block (a producer), or only the
    requested ones (``only``: what a consumer must hold after the transfer)."""
    requested = {b for ids in block_ids for b in ids}
    for gid, group in enumerate(r.config.kv_cache_groups):
        for layer in group.layer_names:
            view = r.caches[layer]
            for block in range(NB):
                if _owner(block_ids, block) != gid or (only and block not in requested):
                    continue
                view[block].copy_(_share(name, truth, layer, tp, rank, block, view))


def _apply(
    dst: Rank, srcs: dict[int, Rank], moves: list[Moves], *, write: bool, me: Rank | None = None
) -> int:
    """Copy what each move list names (addresses of a real backing allocation)."""
    moved = 0
    for m in moves:
        peer = srcs[m.remote_rank]
        for local, remote, length in zip(m.local, m.remote, m.lengths, strict=True):
            if write:  # local: the producer (me), remote: the consumer (peer)
                assert me is not None
                s, d, s_raw, d_raw = local, remote, me.raw, peer.raw
            else:
                s, d, s_raw, d_raw = remote, local, peer.raw, dst.raw
            so, do = s - s_raw.data_ptr(), d - d_raw.data_ptr()
            assert (
                so >= 0
                and so + length <= s_raw.numel()
                and do >= 0
                and do + length <= d_raw.numel()
            )
            d_raw[do : do + length].copy_(s_raw[so : so + length])
            moved += length
    return moved


def move_all(
    movers: dict[int, Rank],
    peers: dict[int, Rank],
    peer_tp: int,
    ids: list[list[int]],
    peer_ids: list[list[int]] | None,
    *,
    write: bool,
    peer_tokens: list[int | None] | None = None,
    slot_parts: list[tuple[tuple[int, int], ...] | None] | None = None,
    request_tokens: int | None = None,
) -> None:
    """Every mover rank's moves against all peer ranks, as a Mooncake engine would be
    handed them (reads into the movers, or writes from them), applied in memory;
    ``request_tokens``: the request's token count (between block sizes, a window
    group's lists are placed by it)."""
    for me in movers.values():
        regions = {rank: peer_regions(peer.plan) for rank, peer in peers.items()}
        routes = routes_of(
            me.plan,
            peer_tp,
            regions,
            write=write,
            remote_tokens=peer_tokens,
            slot_parts=slot_parts,
        )
        moves = request_moves(
            routes, me.plan.num_groups, ids, peer_ids, write=write, request_tokens=request_tokens
        )
        _apply(me, peers, moves, write=write, me=me)


CELLS = [(name, p, d) for name in LAYOUTS for p, d in PAIRS]

# Cells refused by name before anything moves, and why: none. Some producer rank holds
# every byte each consumer rank needs in every cell. The GDN hybrid at TP 4 and another
# size was refused ("block_len") until the fingerprint compared the state's content
# rather than its padded page (the padding to the two-head attention page stops halving
# at TP 4, where the heads are replicas; it is nobody's bytes and never moves).
REFUSED: dict[tuple[str, int, int], str] = {}


@pytest.fixture(autouse=True)
def _ds_conv_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's NIXL transfer decomposes the conv state only in the DS layout (the one it
    # asserts for heterogeneous TP); the adapter reads the same switch.
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize(
    ("name", "producer_tp", "consumer_tp"), CELLS, ids=[f"{n}-P{p}D{d}" for n, p, d in CELLS]
)
def test_every_cell_moves_each_consumer_ranks_own_share(
    name: str, producer_tp: int, consumer_tp: int, write: bool
) -> None:
    truth = _truth(name)
    producers = {rank: _rank(name, producer_tp, rank) for rank in range(producer_tp)}
    consumers = {rank: _rank(name, consumer_tp, rank) for rank in range(consumer_tp)}
    block_ids = checks.request_blocks(producers[0].config, per_group=2)
    for rank, p in producers.items():
        _fill(name, truth, p, producer_tp, rank, block_ids, only=False)
    # The one TP decision, before anything moves, from either side.
    for side, other, tp in (
        (consumers[0], producer_tp, consumer_tp),
        (producers[0], consumer_tp, producer_tp),
    ):
        check_tp_pair(side.plan.regions, local_tp=tp, remote_tp=other)
    if (name, producer_tp, consumer_tp) in REFUSED:
        with pytest.raises(HandshakeMismatchError, match=REFUSED[name, producer_tp, consumer_tp]):
            check_handshake(consumers[0].plan, producers[0].plan.fingerprint())
        return
    for c in consumers.values():
        for p in producers.values():
            check_handshake(c.plan, p.plan.fingerprint())
    if write:
        move_all(producers, consumers, consumer_tp, block_ids, None, write=True)
    else:
        move_all(consumers, producers, producer_tp, block_ids, None, write=False)
    for rank, c in consumers.items():
        expected = _rank(name, consumer_tp, rank)
        _fill(name, truth, expected, consumer_tp, rank, block_ids, only=True)
        assert torch.equal(c.raw, expected.raw), (
            name,
            producer_tp,
            consumer_tp,
            rank,
            _first_diff(c.raw, expected.raw),
        )
        assert bool(c.raw.any())


def _state_only(tp: int, *, padded: int, value_heads: int = 4) -> RegionPlan:
    """A model of two GDN layers (no attention group), its state page padded to
    ``padded`` bytes at every TP size (what a hybrid's unified page may do)."""
    spec = families.gdn_state(
        **{**GDN, "value_heads": value_heads},
        dtypes=(BF16, BF16),
        tp=tp,
        conv_layout="DS",
        mamba_type="GDN_ATTN",
        block_size=64,
        page_size_padded=padded,
    )
    names = ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]
    config = layouts.kv_cache_config([layouts.group(names, spec)], 4, KVCacheLayout.LBHNC)
    caches = layouts.allocate(config, KVCacheLayout.LBHNC)
    return plan_regions(caches, config, tp_size=tp, tp_rank=0)


def test_a_state_pages_padding_is_compared_between_equal_tp_sizes_only() -> None:
    """The GDN state at TP 2 is 1152 B of conv state ((384 / 2) x 3 x 2 B) and 4096 B of
    SSM state (2 heads x 32 x 32 x 2 B), 5248 B of content; its page padded to 16384 or
    20480 B. Between equal TP sizes whole pages move, so other padding is refused by
    name (``state_pad``); between TP 2 and TP 4 only the components move, and the
    record compares the content scaled to the TP group, 2 x 5248 = 10496 B, on both."""
    two, two_wide = _state_only(2, padded=16384), _state_only(2, padded=20480)
    with pytest.raises(HandshakeMismatchError, match="state_pad: local=11136 remote=15232"):
        check_handshake(two, two_wide.fingerprint())
    four = _state_only(4, padded=16384)
    check_handshake(two, four.fingerprint())
    check_handshake(two_wide, four.fingerprint())
    record = two.fingerprint().regions[0]
    assert (record["block_len"], record["state_pad"]) == (10496, 16384 - 5248)
    # The geometry a peer's own record implies: content per rank plus its padding.
    assert record_page(record, 0, 2) == 16384
    assert record_page(four.fingerprint().regions[0], 0, 4) == 16384


def test_a_genuinely_other_state_is_still_refused_between_tp_sizes() -> None:
    """Twice the SSM heads (8 of 32 x 32, bf16: 16384 B at TP 1) is another model's
    state, whatever the padding: refused between TP 2 and TP 4 with the content
    (4 x 2304 + 8192 = 10496 B against 2304 + 16384 = 18688 B) and components named."""
    two, other = _state_only(2, padded=16384), _state_only(4, padded=16384, value_heads=8)
    with pytest.raises(HandshakeMismatchError) as info:
        check_handshake(two, other.fingerprint())
    diffs = {trait: (mine, theirs) for trait, mine, theirs in info.value.diffs}
    assert diffs["block_len"] == (10496, 18688)
    assert "state_components" in diffs


def test_a_peer_whose_state_page_contradicts_its_record_is_refused() -> None:
    """A peer's region must be the page its record implies (content per rank plus its
    padding); one byte short is refused before any descriptor is built."""
    four = _state_only(4, padded=16384)
    regions = list(peer_regions(four))
    check_peer_geometry(four.fingerprint(), regions, 4)
    short = dataclasses.replace(regions[0], block_len=16383)
    with pytest.raises(MalformedMetadataError, match="implies 16384 bytes per block at TP 4"):
        check_peer_geometry(four.fingerprint(), [short, *regions[1:]], 4)


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).nonzero()[0, 0]) if not torch.equal(a, b) else -1


# -- the same cells through real Mooncake engines (TCP over 127.0.0.1) ------------------


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    """A peer process holding the producer ranks (tests/mooncake_helpers/peer.py)."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    peer = Remote(tmp_path_factory.mktemp("mooncake-matrix"))
    try:
        yield peer
    finally:
        peer.close()


# The cells whose reads are new with issue 47 (replicated KV heads, the state read run by
# run, a state page padded to a page that stops halving at TP 4, a replicated state
# between TP sizes), both directions of TP. Every other cell's
# moves are the same move lists, checked above; each real connection costs about a
# second of Mooncake's handshake, so the whole matrix (44 cells, 190 s) stays out of the
# suite's time budget.
MOVED = [
    ("gqa2", 4, 1),
    ("gqa2", 1, 4),
    ("mqa", 2, 1),
    ("mqa", 1, 2),
    ("gdn_state_gqa2", 2, 1),
    ("gdn_state_gqa2", 1, 2),
    ("gdn_state_gqa2", 4, 2),  # the padded state page: other fractions at TP 4 and 2
    ("replicated_state_gqa", 2, 1),
]


@pytest.mark.vllm032_only
@pytest.mark.parametrize(
    ("name", "producer_tp", "consumer_tp"), MOVED, ids=[f"{n}-P{p}D{d}" for n, p, d in MOVED]
)
def test_mooncake_engines_move_every_heterogeneous_cell(
    name: str, producer_tp: int, consumer_tp: int, remote: Remote
) -> None:
    """Each consumer rank reads with ``TraitsMooncakeEngine.read_blocks`` from the
    producer ranks a peer process serves, and holds exactly its own share afterwards."""
    block_ids = checks.request_blocks(_rank(name, 1, 0).config, per_group=2)
    keys, peers_by_rank = [], {}
    engines: list[TraitsMooncakeEngine] = []
    try:
        for rank in range(producer_tp):
            key = f"{name}-{producer_tp}-{consumer_tp}-{rank}"
            port = remote.command(
                "build_matrix", key=key, name=name, tp=producer_tp, rank=rank, block_ids=block_ids
            )["port"]
            keys.append(key)
            peers_by_rank[rank] = int(port)
        truth = _truth(name)
        for rank in range(consumer_tp):
            c = _rank(name, consumer_tp, rank)
            engine = TraitsMooncakeEngine("127.0.0.1")
            engines.append(engine)
            engine.register_plan(c.plan)
            peers = {
                r: engine.connect(fetch_record("127.0.0.1", port), "127.0.0.1")
                for r, port in peers_by_rank.items()
            }
            result = engine.read_blocks(peers, block_ids)
            expected = _rank(name, consumer_tp, rank)
            _fill(name, truth, expected, consumer_tp, rank, block_ids, only=True)
            assert torch.equal(c.raw, expected.raw), (rank, _first_diff(c.raw, expected.raw))
            assert result.nbytes > 0
    finally:
        for engine in engines:
            engine.close()
        for key in keys:
            remote.command("close", key=key)


# -- the GDN hybrid's TP-4 cells through the NIXL shim (real agents, in process) ---------

NIXL_MOVED = [
    ("gdn_state_gqa2", 2, 1),
    ("gdn_state_gqa2", 4, 2),
    ("gdn_state_gqa2", 2, 4),
    ("gdn_state_gqa2", 4, 1),
]
"""The GDN hybrid between TP sizes (its regions shared by the state group and the
attention group are read per group, ``lanes_of``), the TP-4 cells whose padded state
page was refused among them: the shim reads them with the same ``tp_reads`` as the move
lists above (the other layouts' reads through the shim are ``tests/test_nixl_transfer.py``'s,
through the connector ``tests/test_connector_replica_tp.py``'s)."""


@pytest.mark.parametrize(
    ("name", "producer_tp", "consumer_tp"),
    NIXL_MOVED,
    ids=[f"{n}-P{p}D{d}" for n, p, d in NIXL_MOVED],
)
def test_the_nixl_shim_moves_the_gdn_hybrids_tp4_cells(
    name: str, producer_tp: int, consumer_tp: int, agents: list[TraitsNixlAgent]
) -> None:
    truth = _truth(name)
    producers = {rank: _rank(name, producer_tp, rank) for rank in range(producer_tp)}
    block_ids = checks.request_blocks(producers[0].config, per_group=2)
    served = {}
    for rank, p in producers.items():
        _fill(name, truth, p, producer_tp, rank, block_ids, only=False)
        served[rank] = TraitsNixlAgent()
        agents.append(served[rank])
        served[rank].register_plan(p.plan)

    def progress() -> None:
        for agent in served.values():
            agent.progress()

    for rank in range(consumer_tp):
        c = _rank(name, consumer_tp, rank)
        consumer = TraitsNixlAgent()
        agents.append(consumer)
        consumer.register_plan(c.plan)
        peers = {r: consumer.connect(agent.metadata()) for r, agent in served.items()}
        consumer.read_blocks(peers, block_ids, timeout=20, progress=progress)
        expected = _rank(name, consumer_tp, rank)
        _fill(name, truth, expected, consumer_tp, rank, block_ids, only=True)
        assert torch.equal(c.raw, expected.raw), (rank, _first_diff(c.raw, expected.raw))


# -- the same cells through TraitsNixlConnectorWorker (real NIXL, vLLM's request path) ---

CONNECTOR_MOVED = [("gdn_state_gqa2", 4, 2), ("gdn_state_gqa2", 2, 4)]
"""The padded state page between TP 4 and TP 2 through the connector: its planned reads
(``_tp_peer``: the planner's ``tp_reads``, the state run by run of its DS conv layout,
the replicated KV heads from the first rank holding each), never vLLM's descriptors."""


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    ("name", "producer_tp", "consumer_tp"),
    CONNECTOR_MOVED,
    ids=[f"{n}-P{p}D{d}" for n, p, d in CONNECTOR_MOVED],
)
def test_the_connector_moves_the_gdn_hybrids_tp4_cells(
    mode: str,
    name: str,
    producer_tp: int,
    consumer_tp: int,
    distributed: None,
    tiny_models: pathlib.Path,
) -> None:
    """Each decode rank (a worker of the tiny Llama's config, its model's two KV heads)
    holds exactly its share afterwards, its whole allocation compared, every other byte
    zero: read through vLLM's receive path (pull), or written by each prefill rank with
    what the decode ranks' planned reads take from it through vLLM's push path
    (registration, WRITE, notifications)."""
    made: list[Any] = []
    make = llama_rank_worker(tiny_models, made, NB, LAYOUTS[name].layout)
    truth = _truth(name)
    block_ids = checks.request_blocks(_rank(name, 1, 0).config, per_group=2)
    heads = LAYOUTS[name].kv_heads
    cls = TraitsNixlPushConnectorWorker if mode == "push" else TraitsNixlConnectorWorker

    def worker(engine: str, tp: int, rank: int) -> tuple[Any, dict[str, torch.Tensor]]:
        return make(LAYOUTS[name].groups(tp), engine, tp, rank, 64, heads, cls)

    def check(rank: int, caches: dict[str, torch.Tensor]) -> None:
        expected = _rank(name, consumer_tp, rank)
        _fill(name, truth, expected, consumer_tp, rank, block_ids, only=True)
        got = layouts.backing(caches)
        assert torch.equal(got, expected.raw), (rank, _first_diff(got, expected.raw))

    try:
        producers = []
        for rank in range(producer_tp):
            producer, caches = worker("prefill", producer_tp, rank)
            held = Rank(_rank(name, producer_tp, rank).config, caches, producer.region_plan)
            _fill(name, truth, held, producer_tp, rank, block_ids, only=False)
            producers.append(producer)
        if mode == "push":
            received = [worker("decode", consumer_tp, rank) for rank in range(consumer_tp)]
            consumers = [consumer for consumer, _ in received]
            with serving(producers) as p_port, serving(consumers) as d_port:
                push_request(producers, consumers, (p_port, d_port), block_ids, block_ids)
            # Written by the connector's planned writes (the decode ranks' tp_reads).
            assert all("decode" in producer._tp_consumers() for producer in producers)
            for rank, (_, caches) in enumerate(received):
                check(rank, caches)
            return
        with serving(producers) as port:
            for rank in range(consumer_tp):
                consumer, caches = worker("decode", consumer_tp, rank)
                # Read by the connector's planned reads (the planner's tp_reads).
                receive(
                    consumer, port=port, local=block_ids, remote=block_ids,
                    remote_tp=producer_tp, planned=True,
                )  # fmt: skip
                check(rank, caches)
    finally:
        for made_worker in made:
            made_worker.shutdown()


# -- the table docs/tp-pairs.md shows, generated from the planner ------------------------

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "tp-pairs.md"
BEGIN, END = "<!-- BEGIN generated: tests/test_tp_matrix.py -->", "<!-- END generated -->"
DESCRIBED = {
    "gqa8": "GQA, 8 KV heads (Llama-3 8B)",
    "mqa": "one KV head (MQA)",
    "gqa2": "2 KV heads",
    "mla": "MLA (DeepSeek-V3)",
    "mla_gqa_uniform": "MLA + 2-head GQA in one UniformTypeKVCacheSpecs group",
    "gdn_state_gqa2": "GDN state (TP-sharded, DS conv layout) + 2-head GQA",
    "replicated_state_gqa": "TP-replicated state + 8-head GQA",
    "deepseek_v4": "DeepSeek-V4 rows (compressed MLA, SWA, rings, indexer)",
}


def _verdict(name: str, producer_tp: int, consumer_tp: int) -> str:
    """One cell as the planner decides it: ``moves``, or the named refusal."""
    producer, consumer = _rank(name, producer_tp, 0), _rank(name, consumer_tp, 0)
    try:
        check_tp_pair(consumer.plan.regions, local_tp=consumer_tp, remote_tp=producer_tp)
        check_handshake(consumer.plan, producer.plan.fingerprint())
    except HandshakeMismatchError as err:
        return "refused: " + ", ".join(sorted({trait for trait, _, _ in err.diffs})) + " differs"
    except ValueError as err:
        return f"refused: {type(err).__name__}"
    return "moves"


def render_table() -> str:
    header = "| layout | " + " | ".join(f"P{p}->D{d}" for p, d in PAIRS) + " |"
    lines = [header, "|---" * (len(PAIRS) + 1) + "|"]
    for name in LAYOUTS:
        cells = [_verdict(name, p, d) for p, d in PAIRS]
        lines.append(f"| {DESCRIBED[name]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_the_docs_table_is_the_planners() -> None:
    """docs/tp-pairs.md's table is this module's planner answers; KVSPEC_WRITE_DOCS=1
    rewrites it."""
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    fresh = f"{head}{BEGIN}\n{render_table()}\n{END}{tail}"
    if os.environ.get("KVSPEC_WRITE_DOCS") == "1":
        DOC.write_text(fresh)
    assert text == fresh, "docs/tp-pairs.md is stale: rerun with KVSPEC_WRITE_DOCS=1"
