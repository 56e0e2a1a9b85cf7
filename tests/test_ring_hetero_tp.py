"""The ring caches of vLLM 0.34 that are not MLA models' latents, moved between prefill and
decode at different TP sizes (issue 26): which REPLICATE/SPLIT decision gives every decode
rank the bytes its own model would have written?

Three models keep a per-request ring (``CircularBufferSpec``) beside their attention:

- **step5** (``vllm/models/step5/common/csa_tail_ring.py``): the CSA tail ring holds raw
  ``[index_k | index_z]`` rows of 1024 B. The indexer has one K head
  (``sparse_indexer_num_k_heads == 1``, enforced by ``get_step5_sparse_config``), and
  ``Step5FusedQKVIndexerLinear`` loads it on every rank from shard
  ``tp_rank // index_kv_head_replicas == 0``: every rank writes the same rows. But the
  ring is sized to one page of the main attention layer, whose KV heads are split by TP
  (``num_kv_heads=self.num_kv_heads``; ``index_tp_size`` must equal the 4 KV heads), so
  its capacity (``page // 1024`` rows, row ``pos % capacity``) is 128 rows at TP 1 and
  64 at TP 2.
- **qwen4_exp** (``vllm/models/qwen4_exp/common/qsa_indexer.py``): the QSA raw-key ring
  (``QSARawKeyCache``, one row of ``index_head_dim`` bf16 per token, row ``pos %
  capacity``), written from ``index_qk_proj``, a ``ReplicatedLinear`` (its fused form
  loads the indexer shard from rank 0 on every rank): the same rows on every rank, and a
  capacity (``compress_ratio`` rounded) that does not depend on TP.
- **glm5next** (``vllm/models/glm5next/common/attention.py``, ``Glm5NextTailCache``): the
  kpool tail, two head slots [raw K, gate score] of ``index_head_dim`` bf16, row ``pos %
  ring``; K from ``wk_weights_proj`` (``disable_tp=True``) and the gate from the full
  ``index_kpool_compress_gate``: the same rows on every rank, TP-independent. The main
  attention is MLA (``use_mla``).

Each case builds the ring spec with vLLM 0.34's own code (step5 and qwen4_exp: the cache
layer's ``get_kv_cache_spec``; glm5next: its formula, since importing the module needs
torchvision), registers it with real NIXL agents in vLLM 0.34's NIXL workers (upstream's
``NixlPullConnectorWorker`` or ours) for each rank (TP rank and size as vLLM's parallel
state would report them), writes into every prefill rank's ring the rows that rank's
model writes for a prompt, reads two requests' rings through vLLM's own request path
(handshake, ``start_load_kv``, ``get_finished``), and compares every decode rank's rings
with the rows its own model would have written: hand-computed from the model code above
(the last ``capacity`` positions, row ``pos % capacity``, the same row content on every
rank since every rank computes the same replicated projection).

Verdicts (docs/vllm.md, "Ring caches under heterogeneous TP"):

- qwen4_exp: ours (REPLICATE, from traits) moves byte-exact rings at P TP 2 -> D TP 1 and
  P TP 1 -> D TP 2; upstream's SPLIT refuses the pair in its handshake (an
  ``AssertionError`` on the SPLIT block length).
- glm5next: both move byte-exact rings (an MLA model reads every region whole from one
  rank, whatever its flag).
- step5: no byte range of one TP size's ring is the other's ring (the capacity changes
  with TP); ours refuses the pair at the handshake by name, upstream moves rows of the
  wrong positions.

Only on vLLM 0.34 (the models and ``CircularBufferSpec`` of these sizes are 0.34's).
"""

from __future__ import annotations

import importlib
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import TokenScope, TPLayout, traits_of
from kvspec_traits.transfer import HandshakeMismatchError
from kvspec_traits.vllm_connector import UnsupportedRingTPError
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from tests.mla_backends import CPU_MLA
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import DSV2, LLAMA
from tests.nixl_helpers.receive import receive, serving
from tests.test_connector_differential import _vllm_config, distributed, registered_worker

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not vllm.__version__.startswith("0.34"),
        reason=f"vLLM 0.34's ring models (installed: vLLM {vllm.__version__})",
    ),
]

__all__ = ["distributed"]  # a fixture, imported for its name

NB = 6
# Two requests: prefill blocks 2 and 5 hold their rings, read into decode blocks 4 and 1.
REMOTE_BLOCKS, LOCAL_BLOCKS = [2, 5], [4, 1]
SEQ_LENS = {2: 200, 5: 137}  # prompt tokens of the request whose ring a block holds


@dataclass(frozen=True)
class RingModel:
    """A model's ring cache: its spec per TP size, the bytes of one row, the slots per
    row position ([K, gate] for glm5next), the layer name, the tiny model whose config the
    workers read (MLA or not), and the KV-head count of the main attention."""

    name: str
    spec: Callable[[int], Any]
    row_bytes: int
    slots: int
    layer: str
    mla: bool
    kv_heads: int


STEP5_MAIN = "model.layers.0.self_attn.attn"


def step5_main_spec(tp: int) -> Any:
    """Step5's main attention page on a rank: a block of 64 tokens, 4 KV heads of 128
    (DSA needs head_dim 128 or 192, and ``index_tp_size`` (default 4) equal to the KV
    heads) split by TP, bf16."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=64, num_kv_heads=4 // tp, head_size=128, dtype=torch.bfloat16
    )


def _step5_spec(tp: int) -> Any:
    """Step5's tail ring as ``Step5CSATailRing.get_kv_cache_spec`` builds it over its main
    attention layer (:func:`step5_main_spec`)."""
    # vLLM 0.34's model packages (absent from 0.32, which mypy reads): looked up by name.
    ring_module = importlib.import_module("vllm.models.step5.common.csa_tail_ring")

    class Main:  # the main Attention layer: its spec on this rank
        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            del vllm_config
            return step5_main_spec(tp)

    ring = ring_module.Step5CSATailRing(
        prefix="model.layers.0.self_attn.attn.csa_tail_ring",
        main_layer_name="main",
        num_speculative_tokens=0,
        static_forward_context={"main": Main()},
    )
    return ring.get_kv_cache_spec(None)  # the ring reads only its main layer's spec


def _qwen4_spec(tp: int) -> Any:
    """Qwen4Exp's QSA raw-key ring as ``QSARawKeyCache.get_kv_cache_spec`` builds it:
    ``index_head_dim`` 128 with one indexer KV head and a power-of-two compress ratio 4
    (what its fused indexer path requires), no MRoPE, no speculative tokens. TP does not
    enter."""
    del tp
    from types import SimpleNamespace

    from vllm.config import CacheConfig

    qsa = importlib.import_module("vllm.models.qwen4_exp.common.qsa_indexer")
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={}),
        num_speculative_tokens=0,
    )
    cache = qsa.QSARawKeyCache(
        head_size=128,
        dtype=torch.bfloat16,
        cache_rope_positions=False,
        prefix="model.layers.0.self_attn.indexer.raw_key_cache",
        cache_config=CacheConfig(block_size=64),
        compress_ratio=4,
        vllm_config=config,
    )
    return cache.get_kv_cache_spec(config)


def _glm5next_spec(tp: int) -> Any:
    """``Glm5NextTailCache.get_kv_cache_spec``, written out (its module imports
    torchvision): ``ring = kpool * next_power_of_2(cdiv(kpool + num_speculative_tokens,
    kpool))`` slots, two head slots [K, gate] of ``index_head_dim`` (128) bf16, not DCP
    sharded. kpool 4, no speculative tokens: ring 4. TP does not enter."""
    del tp
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    kpool, spec_tokens = 4, 0
    span = kpool + spec_tokens
    ring = kpool * (1 << (-(-span // kpool) - 1).bit_length())
    return CircularBufferSpec(
        block_size=ring,
        num_kv_heads=2,
        head_size=128,
        head_size_v=0,
        dtype=torch.bfloat16,
        dcp_sharded=False,
    )


MODELS = {
    "step5": RingModel(
        "step5", _step5_spec, 1024, 1, "model.layers.0.self_attn.attn.csa_tail_ring", False, 4
    ),
    "qwen4_exp": RingModel(
        "qwen4_exp", _qwen4_spec, 256, 1, "model.layers.0.self_attn.indexer.raw_key_cache", False, 4
    ),
    "glm5next": RingModel(
        "glm5next", _glm5next_spec, 256, 2, "model.layers.0.self_attn.indexer.tail_cache", True, 1
    ),
}


# -- what a rank's model writes -------------------------------------------------------------


def _row(slot: int, pos: int, nbytes: int) -> torch.Tensor:
    """The bytes a model writes for token ``pos`` into head slot ``slot``: the same on every
    rank (each computes the same replicated projection); distinct per (slot, pos)."""
    gen = torch.Generator().manual_seed(1_000_003 * slot + pos)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _capacity(model: RingModel, page: int) -> int:
    return page // (model.slots * model.row_bytes)


def model_ring(model: RingModel, page: int, seq_len: int) -> torch.Tensor:
    """A request's ring page after a prompt of ``seq_len`` tokens, as the model code
    writes it: slot ``s`` (head slot, [K, gate] for glm5next) of row ``pos % capacity``
    for each of the last ``capacity`` positions (step5's slot mapping keeps ``pos >=
    seq_len - CAPACITY``; the others overwrite in place)."""
    capacity = _capacity(model, page)
    ring = torch.zeros(model.slots, capacity, model.row_bytes, dtype=torch.uint8)
    for pos in range(max(0, seq_len - capacity), seq_len):
        for slot in range(model.slots):
            ring[slot, pos % capacity] = _row(slot, pos, model.row_bytes)
    return ring.flatten()


def positions_held(model: RingModel, page: torch.Tensor) -> list[int | None]:
    """Which token position each row (slot 0) of a ring page holds (None: no token's)."""
    capacity = _capacity(model, page.numel())
    rows = page.view(model.slots, capacity, model.row_bytes)[0]
    lookup = {bytes(_row(0, p, model.row_bytes).tolist()): p for p in range(max(SEQ_LENS.values()))}
    return [lookup.get(bytes(row.tolist())) for row in rows]


# -- the workers ----------------------------------------------------------------------------


def _page_view(caches: dict[str, torch.Tensor], layer: str, block: int) -> torch.Tensor:
    return caches[layer][block].view(torch.uint8).flatten()


@pytest.fixture
def rank_worker(
    distributed: None, tiny_models: pathlib.Path
) -> Iterator[Callable[..., tuple[Any, dict[str, torch.Tensor]]]]:
    """``rank_worker(model, cls, engine, tp, rank)``: a NIXL worker of class ``cls`` as TP
    rank ``rank`` of ``tp`` (vLLM's parallel state patched to say so while it is built),
    over its own allocation of the model's ring at that TP size, caches registered."""
    made: list[Any] = []

    def _make(
        model: RingModel, cls: type, engine: str, tp: int, rank: int, shared: bool = False
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        layout = KVCacheLayout.LBHNC  # one layer: every layout lays its pages out alike
        vllm_config = _vllm_config(
            tiny_models / (DSV2 if model.mla else LLAMA), layout, CPU_MLA if model.mla else None
        )
        vllm_config.parallel_config.tensor_parallel_size = tp
        if not model.mla:
            # CPU attention's kernel blocks (multiples of 32) check the worker's block.
            vllm_config.cache_config.block_size = 32
            # The model's KV heads: vLLM refuses CSA-linear pairs on opposite sides of
            # the KV-head count (_validate_csa_linear_tp_layout); the tiny Llama has 2.
            vllm_config.model_config.model_arch_config.total_num_kv_heads = model.kv_heads
        groups = [layouts.group([model.layer], model.spec(tp))]
        if shared:
            groups.insert(0, layouts.group([STEP5_MAIN], step5_main_spec(tp)))
        config = layouts.kv_cache_config(groups, NB, layout)
        caches = layouts.allocate(config, layout)
        worker = registered_worker(
            lambda: cls(vllm_config, engine, config), vllm_config, caches, rank, tp
        )
        made.append(worker)
        return worker, caches

    yield _make
    for worker in made:
        worker.shutdown()


def read_rings(consumer: Any, port: int, remote_tp: int, shared: bool = False) -> None:
    """One request through vLLM's receive path: prefill blocks REMOTE_BLOCKS into
    LOCAL_BLOCKS from a prefill engine of ``remote_tp`` ranks (with ``shared``, the
    ring is the second transfer group; the main attention group moves no block)."""
    local: tuple[list[int], ...] = ([], LOCAL_BLOCKS) if shared else (LOCAL_BLOCKS,)
    remote = [[], REMOTE_BLOCKS] if shared else [REMOTE_BLOCKS]
    # Ours reads another TP size by its planned reads (the planner's tp_reads).
    planned = isinstance(consumer, TraitsNixlConnectorWorker)
    receive(consumer, port=port, local=local, remote=remote, remote_tp=remote_tp, planned=planned)


def _worker_cls(which: str) -> type:
    return TraitsNixlConnectorWorker if which == "traits" else NixlPullConnectorWorker


# -- the ring specs and their traits --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ring_specs_and_traits(name: str) -> None:
    """The specs vLLM 0.34 builds, their pages hand-computed from the model code, and the
    traits: one head slot per ring row position (two for glm5next's [K, gate]), no V
    (``head_size_v=0``): REPLICATED, one shard."""
    model = MODELS[name]
    pages = {tp: traits_of(model.spec(tp)).page_size_bytes for tp in (1, 2)}
    expected = {
        # main page per rank: 64 tokens x (4 / TP) KV heads x 128 x K,V x 2 B
        "step5": {1: 64 * 4 * 128 * 2 * 2, 2: 64 * 2 * 128 * 2 * 2},
        # 4 rows (compress ratio 4, no drafts) x 128 x 2 B
        "qwen4_exp": {1: 4 * 128 * 2, 2: 4 * 128 * 2},
        # ring 4 x [K, gate] x 128 x 2 B
        "glm5next": {1: 4 * 2 * 128 * 2, 2: 4 * 2 * 128 * 2},
    }[name]
    assert pages == expected
    for tp in (1, 2):
        traits = traits_of(model.spec(tp))
        assert traits.token_scope is TokenScope.RING
        assert traits.tp_layout is TPLayout.REPLICATED
        assert traits.tp_shards == 1
        assert traits.num_head_slots == model.slots
    # step5's capacity: 128 rows of 1024 B at TP 1, 64 at TP 2.
    capacities = {tp: _capacity(model, pages[tp]) for tp in (1, 2)}
    assert capacities == ({1: 128, 2: 64} if name == "step5" else {1: 4, 2: 4})


# -- bytes -----------------------------------------------------------------------------------

TP_PAIRS = [(2, 1), (1, 2)]


def _run(
    rank_worker: Callable[..., tuple[Any, dict[str, torch.Tensor]]],
    model: RingModel,
    which: str,
    prefill_tp: int,
    decode_tp: int,
    refusal: tuple[type[BaseException], str] | None = None,
    shared: bool = False,
) -> dict[int, dict[int, torch.Tensor]]:
    """Prefill ranks written as their models write, each decode rank (one at a time) reads
    the two requests' rings; returns decode rank -> local block -> its ring page. With
    ``refusal``, the handshake must raise it (type, message pattern) and leave every
    decode byte as it was."""
    cls = _worker_cls(which)
    producers = []
    for rank in range(prefill_tp):
        worker, caches = rank_worker(model, cls, "prefill", prefill_tp, rank, shared)
        for block, seq_len in SEQ_LENS.items():
            page = _page_view(caches, model.layer, block)
            page.copy_(model_ring(model, page.numel(), seq_len))
        producers.append(worker)
    got: dict[int, dict[int, torch.Tensor]] = {}
    with serving(producers) as port:
        for rank in range(decode_tp):
            consumer, caches = rank_worker(model, cls, f"decode-{rank}", decode_tp, rank, shared)
            if refusal is not None:
                error, match = refusal
                with pytest.raises(error, match=match):
                    consumer._nixl_handshake("127.0.0.1", port, prefill_tp, "prefill")
                assert not caches[model.layer].view(torch.uint8).any()
            else:
                read_rings(consumer, port, prefill_tp, shared)
            got[rank] = {b: _page_view(caches, model.layer, b).clone() for b in LOCAL_BLOCKS}
            consumer.shutdown()
    return got


def _expected(model: RingModel, decode_tp: int) -> dict[int, torch.Tensor]:
    """What a decode rank's own model holds in each local block: the ring of the request
    it received, at the decode TP size's capacity (the same on every decode rank)."""
    page = traits_of(model.spec(decode_tp)).page_size_bytes
    return {
        local: model_ring(model, page, SEQ_LENS[remote])
        for local, remote in zip(LOCAL_BLOCKS, REMOTE_BLOCKS, strict=True)
    }


def _assert_byte_exact(
    model: RingModel, got: dict[int, dict[int, torch.Tensor]], decode_tp: int
) -> None:
    want = _expected(model, decode_tp)
    assert set(got) == set(range(decode_tp))
    for rank, blocks in got.items():
        for block, page in blocks.items():
            assert torch.equal(page, want[block]), (model.name, rank, block)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
@pytest.mark.parametrize("name", ["qwen4_exp", "glm5next"])
def test_ours_moves_byte_exact_rings(
    name: str, prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """The rings are the same bytes on every rank at every TP size: ours reads the whole
    block from one prefill rank (REPLICATE, from traits), and every decode rank holds
    exactly its own model's rings."""
    model = MODELS[name]
    got = _run(rank_worker, model, "traits", prefill_tp, decode_tp)
    _assert_byte_exact(model, got, decode_tp)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
def test_upstream_refuses_qwen4_exp_rings_at_hetero_tp(
    prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """Upstream's SPLIT flag for the QSA ring (``CircularBufferSpec`` is not an MLA class)
    makes its handshake expect the ring page to scale with the KV heads per rank (4 / TP):
    at P TP 2 -> D TP 1 it wants a 512 B remote page for the local 1024 B, at P TP 1 ->
    D TP 2 a 2048 B one, and asserts. The page is 1024 B on every rank: no byte moves.
    (Ours moves them exactly: test_ours_moves_byte_exact_rings.)"""
    model = MODELS["qwen4_exp"]
    page = traits_of(model.spec(1)).page_size_bytes
    local_heads, remote_heads = 4 // decode_tp, 4 // prefill_tp
    match = (
        rf"SPLIT region 0: remote P KV block_len {page} must equal local {page} "
        rf"\* remote_heads {remote_heads} // local_heads {local_heads}"
    )
    _run(rank_worker, model, "upstream", prefill_tp, decode_tp, (AssertionError, match))


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
def test_upstream_moves_byte_exact_glm5next_rings(
    prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """glm5next is an MLA model: upstream's TP mapping reads every attention region whole
    from one prefill rank at offset 0, so its SPLIT flag on the tail ring moves the same
    bytes as REPLICATE (as for DeepSeek-V4's compressor ring)."""
    model = MODELS["glm5next"]
    got = _run(rank_worker, model, "upstream", prefill_tp, decode_tp)
    _assert_byte_exact(model, got, decode_tp)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
def test_ours_refuses_step5_rings_at_hetero_tp(
    prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """Step5's ring holds the same rows on every rank, but as many rows as one main KV
    page holds (128 at TP 1, 64 at TP 2), each token at ``pos % capacity``: no byte range
    of a ring at one TP size is the ring at the other. Ours marks it REPLICATED (its
    traits), whose page must be equal on both sides, and refuses the pair at the
    handshake by name, naming the ring's region and both page sizes; no byte moves."""
    model = MODELS["step5"]
    local = traits_of(model.spec(decode_tp)).page_size_bytes
    remote = traits_of(model.spec(prefill_tp)).page_size_bytes
    match = rf"'{model.layer}'.*block_len: local={local} remote={remote}"
    _run(rank_worker, model, "traits", prefill_tp, decode_tp, (HandshakeMismatchError, match))


def test_upstream_moves_wrong_step5_rows_from_tp2_to_tp1(
    rank_worker: Callable[..., Any],
) -> None:
    """P TP 2 -> D TP 1, upstream (SPLIT): the decode ring (128 rows) is read as two
    halves, rank 0's 64-row ring then rank 1's (the same rows), so row ``r`` holds the
    token at ``pos % 64 == r % 64`` of the last 64 positions. The decode model holds the
    last 128 positions at ``pos % 128``: rows of the older 64 positions hold the newer
    ones instead (hand-computed below)."""
    model = MODELS["step5"]
    got = _run(rank_worker, model, "upstream", 2, 1)
    for local, remote in zip(LOCAL_BLOCKS, REMOTE_BLOCKS, strict=True):
        seq_len = SEQ_LENS[remote]
        held = positions_held(model, got[0][local])
        newest = {p % 64: p for p in range(seq_len - 64, seq_len)}
        assert held == [newest[row % 64] for row in range(128)]
        want = {p % 128: p for p in range(seq_len - 128, seq_len)}
        wrong = [row for row in range(128) if held[row] != want[row]]
        assert len(wrong) == 64  # every row of the older half of the window


def test_upstream_moves_wrong_step5_rows_from_tp1_to_tp2(
    rank_worker: Callable[..., Any],
) -> None:
    """P TP 1 -> D TP 2, upstream (SPLIT): decode rank ``r`` reads rows ``64 r ..`` of the
    prefill ring (128 rows at ``pos % 128``) as its own 64 rows; its model holds the last
    64 positions at ``pos % 64``. For a prompt of 200 tokens rank 0 receives positions
    128..191 where its model holds 136..199 in rows 0..7 (192..199, the newest, which the
    next decode step reads): wrong rows, moved without an error."""
    model = MODELS["step5"]
    got = _run(rank_worker, model, "upstream", 1, 2)
    for rank in range(2):
        for local, remote in zip(LOCAL_BLOCKS, REMOTE_BLOCKS, strict=True):
            seq_len = SEQ_LENS[remote]
            prefill = {p % 128: p for p in range(max(0, seq_len - 128), seq_len)}
            held = positions_held(model, got[rank][local])
            assert held == [prefill.get(64 * rank + row) for row in range(64)]
            want = {p % 64: p for p in range(seq_len - 64, seq_len)}
            assert held != [want[row] for row in range(64)]
    # The newest position of the 200-token request (199, row 199 % 64 = 7) on rank 0:
    assert positions_held(model, got[0][LOCAL_BLOCKS[0]])[7] == 135


# -- step5 as vLLM allocates it: the ring aliases the main attention's page ----------------


def test_step5_ring_shares_the_main_kv_region() -> None:
    """vLLM's hybrid allocation (tests/nixl_helpers/layouts.py, as
    ``get_kv_cache_config_from_groups``) gives the ring's layer and the main attention's
    layer of one index one tensor each at offset 0 of the same size: the same pages, so
    the same NIXL region (0.34 keys regions by base and block length, equal here)."""
    for tp in (1, 2):
        groups = [
            layouts.group([STEP5_MAIN], step5_main_spec(tp)),
            layouts.group([MODELS["step5"].layer], _step5_spec(tp)),
        ]
        config = layouts.kv_cache_config(groups, NB, KVCacheLayout.LBHNC)
        tensors = config.kv_cache_tensors
        assert [t.offset for t in tensors] == [0, 0]
        assert tensors[0].block_stride == tensors[1].block_stride
        assert tensors[0].block_stride == traits_of(_step5_spec(tp)).page_size_bytes


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS)
def test_ours_refuses_step5_ring_in_the_main_kv_region_at_hetero_tp(
    prefill_tp: int, decode_tp: int, rank_worker: Callable[..., Any]
) -> None:
    """The region holding the main KV pages (head-sharded) and the ring (replicated rows)
    is SPLIT (its head-sharded member decides, as upstream's class list does), and its
    page scales with the heads, so the fingerprints agree. Failure mode before
    UnsupportedRingTPError: ours read the ring's block in head slices and moved rows of
    other positions without an error (P TP 1 -> D TP 2: decode rank 0 received the
    prefill rows 0..63, positions 128..191 of the 200-token request, where its model
    holds 136..199, as upstream does in the tests above). Now the handshake refuses the
    pair by name before any NIXL connection; at equal TP the region moves as before
    (tests/test_connector_series_quirks.py)."""
    model = MODELS["step5"]
    match = (
        rf"ring buffer \['{model.layer}'\] between TP {prefill_tp} and TP {decode_tp}.*"
        rf"region '{STEP5_MAIN}'"
    )
    _run(
        rank_worker,
        model,
        "traits",
        prefill_tp,
        decode_tp,
        (UnsupportedRingTPError, match),
        shared=True,
    )


def test_upstream_moves_wrong_rows_of_step5_ring_in_the_main_kv_region(
    rank_worker: Callable[..., Any],
) -> None:
    """Upstream on step5's allocation, P TP 1 -> D TP 2: the shared region is SPLIT, and
    each decode rank receives the prefill ring's rows ``64 r ..``: for the 200-token
    request rank 0's row 7 holds position 135 where its model holds 199 (the newest)."""
    model = MODELS["step5"]
    got = _run(rank_worker, model, "upstream", 1, 2, shared=True)
    assert positions_held(model, got[0][LOCAL_BLOCKS[0]])[:9] == list(range(128, 137))
    assert positions_held(model, got[1][LOCAL_BLOCKS[0]])[:9] == [*range(192, 200), 72]
