"""The traits fingerprint and the metadata wire format (pure: no NIXL agent)."""

from __future__ import annotations

import contextlib
import json
import random
import struct

import pytest
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits.nixl import decode_metadata, encode_metadata
from kvspec_traits.nixl._wire import WIRE_VERSION
from kvspec_traits.transfer import (
    FINGERPRINT_VERSION,
    HandshakeMismatchError,
    MalformedMetadataError,
    PlanFingerprint,
    RegionPlan,
    StageLayersError,
    check_handshake,
    check_peer,
    pair_stages,
    peer_regions,
    plan_regions,
)
from tests.nixl_helpers import layouts


def _plan(
    family: str, num_blocks: int = 8, tp: int = 1, rank: int = 0, layers: int | None = None
) -> RegionPlan:
    fam = layouts.FAMILIES[family]
    groups = fam.groups(tp) if layers is None else getattr(layouts, family)(tp, layers)
    config = layouts.kv_cache_config(groups, num_blocks, fam.layout)
    return plan_regions(layouts.allocate(config, fam.layout), config, tp_size=tp, tp_rank=rank)


def test_fingerprint_ignores_addresses_and_block_counts() -> None:
    (config_a, caches_a), (config_b, caches_b) = (
        layouts.build("deepseek_v4", 8),
        layouts.build("deepseek_v4", 24),
    )
    a, b = plan_regions(caches_a, config_a), plan_regions(caches_b, config_b)
    # Both allocations alive: other addresses.
    assert [r.base_addr for r in a.regions] != [r.base_addr for r in b.regions]
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint().canonical() == b.fingerprint().canonical()
    payload = json.loads(a.fingerprint().canonical())
    assert payload["v"] == FINGERPRINT_VERSION and len(payload["regions"]) == 5
    assert len(a.fingerprint().digest) == 64


def test_fingerprint_is_normalised_across_tp_sizes() -> None:
    one, two = _plan("llama_gqa", tp=1), _plan("llama_gqa", tp=2, rank=1)
    assert [r.block_len for r in one.regions] != [r.block_len for r in two.regions]
    check_handshake(one, two.fingerprint())
    assert one.fingerprint().regions == two.fingerprint().regions


def test_mismatch_names_region_layers_and_each_trait() -> None:
    bf16, fp8 = _plan("deepseek_v3"), _plan("deepseek_v3_fp8")
    with pytest.raises(HandshakeMismatchError) as info:
        check_handshake(bf16, fp8.fingerprint())
    err = info.value
    assert err.region == 0 and err.region_name == "model.layers.0.self_attn.attn"
    assert err.layers == ("model.layers.0.self_attn.attn",)
    diffs = {trait: (mine, theirs) for trait, mine, theirs in err.diffs}
    # bf16 latent 64 x 576 x 2 against fp8_ds_mla 64 x 656.
    assert diffs["block_len"] == (73728, 41984)
    assert diffs["dtype"] == (["bfloat16"], ["uint8"])
    assert "kv_quant_mode" in diffs
    assert "block_len: local=73728 remote=41984" in str(err)


def test_different_block_sizes_are_refused_naming_both_and_the_fix() -> None:
    """Prefill at 32 tokens a block, decode at 16 (issue 48): Llama GQA pages of 8 KV
    heads x tokens x K|V 256 bf16 are 2 x 16 x 128 x 2 x 8 = 65536 B and 131072 B. The
    plans cannot pair block ids one to one, and the refusal says what to set."""
    small = layouts.kv_cache_config(layouts.llama_gqa(1, block_size=16), 8, KVCacheLayout.LBHNC)
    large = layouts.kv_cache_config(layouts.llama_gqa(1, block_size=32), 8, KVCacheLayout.LBHNC)
    here = plan_regions(layouts.allocate(small, KVCacheLayout.LBHNC), small)
    peer = plan_regions(layouts.allocate(large, KVCacheLayout.LBHNC), large)
    with pytest.raises(HandshakeMismatchError) as info:
        check_handshake(here, peer.fingerprint())
    diffs = {trait: (mine, theirs) for trait, mine, theirs in info.value.diffs}
    assert diffs["block_sizes"] == ([16], [32])
    assert diffs["block_len"] == (65536, 131072)
    assert "tokens per block: here 16, the peer 32" in str(info.value)
    assert "--block-size 32 here" in str(info.value)


def test_order_of_data_inside_a_page_is_refused() -> None:
    """Llama GQA in LBHNC (heads outermost in a page) against LBNHC (heads inside each
    token): equal sizes, every byte in another place."""
    config = layouts.kv_cache_config(layouts.llama_gqa(1), 8, KVCacheLayout.LBNHC)
    nhd = plan_regions(layouts.allocate(config, KVCacheLayout.LBNHC), config)
    hnd = _plan("llama_gqa")
    assert [r.block_len for r in nhd.regions] == [r.block_len for r in hnd.regions]
    assert nhd.fingerprint().digest != hnd.fingerprint().digest
    with pytest.raises(HandshakeMismatchError, match="head_major: local=True remote=False"):
        check_handshake(hnd, nhd.fingerprint())
    assert FINGERPRINT_VERSION == 6


def test_replication_difference_is_refused() -> None:
    mla = _plan("deepseek_v3")
    record = dict(mla.fingerprint().regions[1])
    record["replicated"] = False
    theirs = mla.fingerprint()
    forged = type(theirs)(
        theirs.version, theirs.tp_size, (theirs.regions[0], record, theirs.regions[2])
    )
    with pytest.raises(HandshakeMismatchError, match="replicated: local=True remote=False"):
        check_handshake(mla, forged)


def test_region_count_and_version_mismatch() -> None:
    four, three = _plan("llama_gqa"), _plan("llama_gqa", layers=3)
    with pytest.raises(HandshakeMismatchError) as info:
        check_handshake(four, three.fingerprint())
    assert info.value.region is None
    assert ("region count", 4, 3) in info.value.diffs
    assert ("regions only local", ["model.layers.3.self_attn.attn"], None) in info.value.diffs
    fp = four.fingerprint()
    with pytest.raises(HandshakeMismatchError, match="version"):
        check_handshake(four, type(fp)(fp.version + 1, fp.tp_size, fp.regions))


# -- pipeline stages: regions paired by the layers both sides hold --------------------------


def _stage(
    family: str, held: range, layers: int = 4, layout: KVCacheLayout | None = None
) -> RegionPlan:
    """The plan of a pipeline stage holding model layers ``held`` of a ``layers``-layer
    model (its KV cache config has only those layers, as vLLM gives a stage)."""
    fam = layouts.FAMILIES[family]
    layout = layout or fam.layout
    groups = layouts.stage_groups(getattr(layouts, family)(1, layers), held)
    config = layouts.kv_cache_config(groups, 8, layout)
    return plan_regions(layouts.allocate(config, layout), config)


LLAMA_LAYER = "model.layers.{}.self_attn.attn"


def test_a_stage_pairs_with_the_regions_of_its_layers_both_ways() -> None:
    """Layers 2 and 3 of a 4-layer Llama (stage 1 of 2, vLLM's get_pp_indices(4, 1, 2) =
    (2, 4)) against the whole model: one region per layer in model order (the whole
    plan's regions 0-3 are layers 0-3), so the stage's regions 0 and 1 pair with the
    whole plan's 2 and 3, from either side; no region of layers 0-1 is compared."""
    stage, whole = _stage("llama_gqa", range(2, 4)), _plan("llama_gqa")
    assert [r.layers for r in whole.regions] == [(LLAMA_LAYER.format(i),) for i in range(4)]
    staged = stage.fingerprint(pp=(1, 2))
    assert staged.pp == (1, 2) and staged.layers == (LLAMA_LAYER.format(2), LLAMA_LAYER.format(3))
    assert pair_stages(staged, whole.fingerprint()) == ((0, 2), (1, 3))
    assert pair_stages(whole, staged) == ((2, 0), (3, 1))
    # The decoded payload carries the stage; the whole model is stage 0 of 1.
    assert PlanFingerprint.from_payload(json.loads(staged.canonical())) == staged
    assert json.loads(whole.fingerprint().canonical())["pp"] == [0, 1]
    # check_peer runs the geometry, memory-type and placement checks on the pairs.
    pairs = check_peer(whole, staged, peer_regions(stage), 1)
    assert pairs == ((2, 0), (3, 1))


def test_a_stage_layer_the_peer_lacks_is_refused_by_name() -> None:
    """Before: the fingerprint compared whole plans, and PP was refused outright. A
    stage holding layers 2-3 against a 3-layer peer: layer 3 is named."""
    stage = _stage("llama_gqa", range(2, 4)).fingerprint(pp=(1, 2))
    with pytest.raises(StageLayersError, match=r"model\.layers\.3\.self_attn\.attn") as info:
        pair_stages(_plan("llama_gqa", layers=3), stage)
    assert info.value.layers == (LLAMA_LAYER.format(3),)
    assert info.value.stage == (0, 1) and info.value.peer_stage == (1, 2)
    with pytest.raises(StageLayersError, match="both sides are pipeline stages"):
        pair_stages(stage, stage)


def test_a_stage_layer_laid_out_otherwise_is_refused_by_name() -> None:
    """The same layers in LBNHC on the stage and LBHNC on the peer: equal sizes, every
    byte elsewhere in the page; refused on the stage's first region."""
    stage = _stage("llama_gqa", range(2, 4), layout=KVCacheLayout.LBNHC)
    with pytest.raises(HandshakeMismatchError, match="head_major: local=False remote=True") as info:
        pair_stages(stage.fingerprint(pp=(1, 2)), _plan("llama_gqa").fingerprint())
    assert info.value.region == 0 and info.value.layers == (LLAMA_LAYER.format(2),)


def test_a_region_of_other_layers_on_the_peer_is_refused() -> None:
    """A peer holding the stage's layer in a region with another layer (its region
    record names both) is laid out otherwise: refused on ``layers``."""
    stage = _stage("llama_gqa", range(2, 4)).fingerprint(pp=(1, 2))
    whole = _plan("llama_gqa").fingerprint()
    merged = dict(whole.regions[2])
    merged["layers"] = [LLAMA_LAYER.format(2), LLAMA_LAYER.format(3)]
    forged = PlanFingerprint(
        whole.version, whole.tp_size, (whole.regions[0], whole.regions[1], merged)
    )
    with pytest.raises(HandshakeMismatchError, match="layers: local=") as info:
        pair_stages(stage, forged)
    assert info.value.region == 0


@pytest.mark.parametrize("pp", [[2, 2], [0, 0], [True, 2], [0], "0/1"])
def test_a_malformed_stage_is_a_named_error(pp: object) -> None:
    payload = _plan("llama_gqa").fingerprint().payload()
    payload["pp"] = pp
    with pytest.raises(MalformedMetadataError, match="'pp'"):
        PlanFingerprint.from_payload(payload)


# -- wire format -------------------------------------------------------------------------

AGENT_MD = b"nixl-agent-metadata\x00\x01\x02"


def _wire(plan: RegionPlan | None = None) -> bytes:
    return encode_metadata(plan or _plan("llama_gqa"), "producer-1", AGENT_MD)


def test_round_trip() -> None:
    plan = _plan("deepseek_v4")
    meta = decode_metadata(_wire(plan))
    assert meta.agent_name == "producer-1" and meta.agent_metadata == AGENT_MD
    assert meta.fingerprint == plan.fingerprint()
    assert [r.base_addr for r in meta.regions] == [r.base_addr for r in plan.regions]
    assert [r.block_stride for r in meta.regions] == [r.block_stride for r in plan.regions]
    assert meta.num_blocks == 8


def test_every_truncation_is_a_named_error() -> None:
    data = _wire()
    for cut in range(len(data)):
        with pytest.raises(MalformedMetadataError):
            decode_metadata(data[:cut])


def test_random_corruption_never_escapes_as_another_error() -> None:
    data = bytearray(_wire())
    rng = random.Random(0)
    for _ in range(2000):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        with contextlib.suppress(MalformedMetadataError):
            decode_metadata(bytes(mutated))


def _with_header(header: object, md: bytes = AGENT_MD) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<8sHII", b"KVSTNIXL", WIRE_VERSION, len(body), len(md)) + body + md


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"XXXXXXXX" + _wire()[8:], "bad magic"),
        (_wire()[:8] + struct.pack("<H", 99) + _wire()[10:], "wire version 99"),
        (_wire() + b"\x00", "trailing bytes"),
        (struct.pack("<8sHII", b"KVSTNIXL", WIRE_VERSION, 3, 1) + b"{x}" + b"m", "not JSON"),
        (_with_header([1, 2]), "not a JSON object"),
        (_with_header({"agent": ""}), "'agent'"),
        (_with_header({"agent": "a", "tp_size": 1, "tp_rank": 1}), "tp_rank 1 >= tp_size 1"),
        (_with_header({"agent": "a", "tp_size": 1, "tp_rank": 0, "regions": [[1, 2]]}), "region 0"),
        (
            _with_header(
                {
                    "agent": "a",
                    "tp_size": 1,
                    "tp_rank": 0,
                    "regions": [],
                    "fingerprint": {"v": 1, "tp_size": 1, "regions": {}},
                }
            ),
            "fingerprint",
        ),
        (
            _with_header(
                {
                    "agent": "a",
                    "tp_size": 1,
                    "tp_rank": 0,
                    "regions": [],
                    "num_blocks": 1,
                    "fingerprint": {"v": 1, "tp_size": 1, "regions": []},
                },
                b"",
            ),
            "no NIXL agent metadata",
        ),
        (struct.pack("<8sHII", b"KVSTNIXL", WIRE_VERSION, 1 << 30, 0), "implausible"),
    ],
)
def test_malformed_metadata_is_named(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedMetadataError, match=reason):
        decode_metadata(data)
