"""Pipeline parallelism: a prefill engine of PP 2 pushes into a decode engine of PP 1,
each stage writing its own layers, its regions paired with the decode side's by the
layers both hold; what vLLM's NIXL connector does not run is refused by name.

vLLM 0.32, 0.33 and 0.34 run PP on the prefill side, in push mode only (each stage's
worker holds a contiguous slice of the layers and WRITEs them into the decode engine's
regions; the decode engine counts one completion per stage). They refuse PP on the
decode side in the worker's constructor, and their pull worker reads every layer from
stage 0. Pairing: 0.34 pairs regions by the layers both sides hold (add_remote_agent),
0.32/0.33 by position from the stage's first layer (``_remote_region_offset``) or, for
hybrid and packed layouts, by layer name. The traits handshake pairs the stage's
fingerprint records with the decode side's by layers on every series, and on 0.32/0.33
checks that its pairs are vLLM's positions.

Real workers (``TraitsNixlPushConnectorWorker``, real NIXL agents) over vLLM's
kernel-block views (tests/test_connector_kernel_blocks.py: manager block 64, kernel
block 16), each stage with the layers vLLM places on it: the tiny Llama has 2 layers,
``get_pp_indices(2, r, 2)`` = ``(r, r + 1)``, so stage ``r`` holds
``model.layers.r.self_attn.attn``. Before this module's change every case was refused
(``UnsupportedPipelineParallelError`` at the handshake) and on 0.34 a stage's
``register_kv_caches`` stopped on ``AttributeError`` (a 0.33-only method). Runs on every
series.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import vllm

from kvspec_traits.transfer import HandshakeMismatchError, StageLayersError
from kvspec_traits.vllm_connector import UnsupportedPipelineParallelError
from kvspec_traits.vllm_connector._gate import vllm_series
from kvspec_traits.vllm_connector._push import TraitsNixlPushConnectorWorker
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import Family
from tests.test_connector_differential import _serve_handshake, distributed
from tests.test_connector_kernel_blocks import FAMILIES, assert_moved_exactly, make, request_blocks
from tests.test_connector_series_quirks import PACKED_MLA
from tests.test_push_connector import REQ, WIDE_HEADS, _push

pytestmark = pytest.mark.timeout(600)
__all__ = ["distributed", "make"]  # fixtures, imported for their names

PUSH = TraitsNixlPushConnectorWorker
LAYER = "model.layers.{}.self_attn.attn"
SERIES = vllm_series(vllm.__version__)


def _stages(
    make: Callable[..., Any], family: str | Family, **kw: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The two PP stages of a prefill engine (one engine id), and their caches by layer."""
    built = [make(family, PUSH, "producer", stage=(rank, 2), **kw) for rank in range(2)]
    caches = {layer: view for _, stage_caches in built for layer, view in stage_caches.items()}
    return tuple(worker for worker, _ in built), caches


def test_pp2_prefill_pushes_each_stage_layers_into_a_pp1_decode(
    make: Callable[..., Any],
) -> None:
    """Each stage's fingerprint names its stage and its layer; the decode side accepts
    both stages, each stage accepts the decode side, and after the WRITEs the decode
    side's blocks hold, layer by layer, the bytes of the stage holding that layer, no
    other byte of it changed, and the request is done on every side."""
    stages, p_caches = _stages(make, "attention")
    consumer, d_caches = make("attention", PUSH, "consumer")
    for rank, stage in enumerate(stages):
        assert stage.traits_fingerprint.pp == (rank, 2)
        assert stage.traits_fingerprint.layers == (LAYER.format(rank),)
        assert stage.region_plan.region_names == [LAYER.format(rank)]
    assert consumer.traits_fingerprint.layers == (LAYER.format(0), LAYER.format(1))
    layouts.fill_pattern(p_caches, seed=13)
    before = layouts.backing(d_caches).clone()
    groups = FAMILIES["attention"].groups(1)
    local, remote = request_blocks(groups)
    sent, received = _push(stages, consumer, local, remote)
    assert REQ in received and REQ in sent
    assert consumer.get_block_ids_with_load_errors() == set()
    assert_moved_exactly(groups, local, remote, p_caches, d_caches, before)


def test_pp2_stages_push_their_pages_into_the_rows_of_a_packed_pp1_decode(
    make: Callable[..., Any],
) -> None:
    """DeepSeek-V2 MLA in BLHNC (a block's pages of both layers in one row, CPU_MLA
    block 16). The PP 1 push decode registers the row whole (one region, both layers,
    each page's place advertised: vLLM 0.33+, and 0.32's push worker); each stage its
    layer's page of its own rows. The decode side's stage view (its pages as a stage
    lays them out: a region per layer, 36864 B = 16 tokens x 576 x 4 B, at the row's
    stride) pairs with each stage's page; the bytes land at the page's place in the
    decode side's rows, nothing else of the decode cache changes. Before the stage
    view, the decode side's row (layers 0 and 1) and a stage's page (layer r) were
    refused as laid out otherwise."""
    stages, p_caches = _stages(make, PACKED_MLA, kernels=False)
    consumer, d_caches = make(PACKED_MLA, PUSH, "consumer", kernels=False)
    both = (LAYER.format(0), LAYER.format(1))
    (row,) = consumer.region_plan.regions
    assert row.layers == both and row.block_len == 2 * 36864
    assert [r.layers for r in consumer.stage_view.regions] == [both[:1], both[1:]]
    assert [r.block_len for r in consumer.stage_view.regions] == [36864, 36864]
    for rank, stage in enumerate(stages):
        assert stage.stage_view is None
        assert [r.layers for r in stage.region_plan.regions] == [both[rank : rank + 1]]
    layouts.fill_pattern(p_caches, seed=17)
    before = layouts.backing(d_caches).clone()
    groups = PACKED_MLA.groups(1)
    local, remote = request_blocks(groups)
    sent, received = _push(stages, consumer, local, remote)
    assert REQ in received and REQ in sent
    assert_moved_exactly(groups, local, remote, p_caches, d_caches, before)


def test_a_decode_engine_with_pipeline_parallelism_is_refused_by_name(
    make: Callable[..., Any],
) -> None:
    """Prefill PP 1 into decode PP 2 (the reverse pair): vLLM refuses a consumer with
    PP > 1 in its worker's constructor (a bare NotImplementedError); ours refuses it
    first, naming the series and what to run, before a NIXL agent exists."""
    with pytest.raises(UnsupportedPipelineParallelError, match="decode engine with") as info:
        make("attention", PUSH, "consumer", stage=(1, 2), kv_role="kv_consumer")
    assert info.value.decode_side and info.value.local_pp == 2
    assert f"on vLLM {SERIES} " in str(info.value)
    assert "--pipeline-parallel-size 1" in str(info.value)


# The decode side of each refusal: the attention family with one layer (the stage
# holding layer 1 has no counterpart), and with KV heads of 64 (every page twice as long).
ONE_LAYER = Family(
    lambda tp: layouts.stage_groups(FAMILIES["attention"].groups(tp), range(1)),
    FAMILIES["attention"].layout,
    FAMILIES["attention"].model,
)


@pytest.mark.parametrize(
    ("decode", "error", "named"),
    [
        (ONE_LAYER, StageLayersError, LAYER.format(1)),
        (WIDE_HEADS, HandshakeMismatchError, "block_len"),
    ],
    ids=["layer-the-decode-lacks", "layer-laid-out-otherwise"],
)
def test_a_stage_the_decode_side_cannot_pair_is_refused_before_any_byte(
    decode: Family, error: type[Exception], named: str, make: Callable[..., Any]
) -> None:
    """Through vLLM's own handshakes, both ways: the decode side's (notif-only, with
    every stage of the PP 2 engine, before it sends its block registration) and stage
    1's (before its first WRITE). vLLM's compatibility hash passes (same model and
    backend) and 0.32/0.33 would pair by position; the fingerprint refuses, naming the
    layer or the trait. No block registration is sent and no WRITE is posted, so the
    decode cache is untouched."""
    stages, _ = _stages(make, "attention")
    consumer, d_caches = make(decode, PUSH, "consumer")
    before = layouts.backing(d_caches).clone()
    p_port, stop_p = _serve_handshake(stages[0], stages=stages)
    d_port, stop_d = _serve_handshake(consumer)
    try:
        with pytest.raises(error, match=named):
            # (host, port, remote TP, engine, remote DCP, remote PP, notif agents only)
            consumer._nixl_handshake("127.0.0.1", p_port, 1, "producer", 1, 2, True)
        with pytest.raises(error, match=named):
            stages[1]._nixl_handshake("127.0.0.1", d_port, 1, "consumer")
    finally:
        stop_p.set()
        stop_d.set()
    assert not stages[1]._sending_transfers
    assert torch.equal(layouts.backing(d_caches), before)


@pytest.mark.parametrize(
    ("pairs", "remote_regions", "offset"),
    [
        # Stage 1 of 2 of the tiny Llama (one region per layer): its layer 1 pairs with
        # the PP 1 peer's region 1 of 2, so vLLM must slice the peer's regions from 1.
        ([(0, 1)], 2, 1),
        # Two regions per layer, stage 1 of 2 of a 2-layer model: peer regions 2 and 3.
        ([(0, 2), (1, 3)], 4, 2),
        # As many regions on both sides (vLLM does not slice): the peer's from 0.
        ([(0, 0), (1, 1)], 2, None),
    ],
)
def test_a_stage_sets_vllms_region_offset_from_its_pairs_by_layers(
    pairs: list[tuple[int, int]], remote_regions: int, offset: int | None
) -> None:
    """On 0.32/0.33 (pairing by position) the connector decides the offset vLLM slices
    a PP 1 peer's regions from: the first peer region the stage's layers pair with
    (hand-listed above), whatever vLLM's ``regions per layer x first layer`` said."""
    from kvspec_traits.vllm_connector._handshake import PipelineStage, _check_positions

    kept: list[int] = []
    stage = PipelineStage(rank=1, size=2, push=True, series="0.33", region_offset=99)
    _check_positions(stage, pairs, remote_regions, kept.append)
    assert kept == ([] if offset is None else [offset])


@pytest.mark.parametrize(
    ("pairs", "remote_regions"),
    [([(0, 1), (1, 0)], 3), ([(0, 0), (1, 2)], 4), ([(0, 1), (1, 0)], 2)],
)
def test_a_stage_whose_pairs_are_no_run_of_the_peers_regions_is_refused(
    pairs: list[tuple[int, int]], remote_regions: int
) -> None:
    """Pairs by layers that vLLM 0.32/0.33's slice of the peer's regions cannot address
    (out of order, a gap, or a reordering with as many regions on both sides): refused
    by name, naming the stage and the pairs; no offset is set. On 0.34 (pairing by
    layers, ``region_offset`` None) nothing is asked."""
    from kvspec_traits.vllm_connector import UnsupportedStagePairingError
    from kvspec_traits.vllm_connector._handshake import PipelineStage, _check_positions

    kept: list[int] = []
    stage = PipelineStage(rank=1, size=2, push=True, series="0.32", region_offset=0)
    with pytest.raises(UnsupportedStagePairingError, match="PP stage 1 of 2") as raised:
        _check_positions(stage, pairs, remote_regions, kept.append)
    assert raised.value.peer_regions == [remote for _, remote in pairs]
    assert (raised.value.stage, raised.value.series, kept) == ((1, 2), "0.32", [])
    by_layers = PipelineStage(rank=1, size=2, push=True, series="0.34", region_offset=None)
    _check_positions(by_layers, pairs, remote_regions, kept.append)
    assert kept == []
