"""A transfer touches only the pages its group's own layers use (issue 47, item 5), on
every engine path: ``TraitsNixlConnectorWorker`` with real NIXL agents and vLLM's own
request path, the NIXL shim (``TraitsNixlAgent``), and ``kvspec_traits.mooncake``'s move
lists. Which regions a group's blocks land in is the planner's answer
(``RegionPlan.group_regions``: the regions holding a layer of the group).

vLLM's hybrid allocator shares its tensors by layer index across groups, so where
groups hold other layer counts, some tensors hold no layer of the smaller group:

- Qwen3.5's shape, small (``tests/test_connector_differential.py``'s ``gdn_hybrid``):
  three GDN state layers in group 0, one attention layer in group 1, the state padded
  to the attention page (32768 B: 64 tokens x 2 KV heads x (32 + 32) x 4 B). Tensor 0
  holds state layer 0 and the attention layer, tensors 1 and 2 state layers only.
  vLLM 0.32/0.33's state-aware reads (``_compute_desc_ids`` with Mamba state) read an
  attention-typed group's blocks in every region, so with the state TP-sharded the
  connector wrote the attention blocks into all three tensors (four pages of no layer
  of the group here); with the state TP-replicated (each state a region of its own)
  it did not.
- gpt-oss with five layers, grouped as vLLM groups them: the full-attention layers
  split into [0, 4] and [2] beside the sliding-window [1, 3]; tensor 1 holds layers 4
  and 3, none of group 1. A region shared by some groups took every group's blocks
  (vLLM's ``_SHARED_REGION_GROUP_ID`` rule, and the shim's and Mooncake's).

The decode allocation starts as a sentinel byte everywhere; after the read it must hold
the producer's bytes exactly in each group's requested pages of its own layers (a
state's content, 25600 B: a conv state of 768 x 3 float32 and an SSM state of
4 x 32 x 32 float32; an attention page whole), and the sentinel in every other byte.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvspec_traits import _families as families
from kvspec_traits.nixl import TraitsNixlAgent
from kvspec_traits.transfer import plan_regions
from tests.nixl_helpers import layouts
from tests.nixl_helpers.receive import receive, serving
from tests.test_connector_differential import (
    TINY,
    TINY_GDN,
    _state_hybrid,
    distributed,
    llama_rank_worker,
)
from tests.test_tp_matrix import Rank, move_all

pytestmark = [pytest.mark.timeout(600)]

__all__ = ["distributed"]  # a fixture, imported for its name

NB = 8
LAYOUT = KVCacheLayout.LBHNC
SENTINEL = 0xA5


@dataclasses.dataclass(frozen=True)
class Case:
    groups: Callable[[], list[KVCacheGroupSpec]]
    block: int  # tokens a block (the worker's block size)
    moved: tuple[int, ...]  # bytes moved of a page, per group (a state: its content)
    remote: list[list[int]]  # per group; ids distinct across groups (their pages alias)
    local: list[list[int]]


def _gdn(replicated: bool) -> list[KVCacheGroupSpec]:
    groups = _state_hybrid(functools.partial(families.gdn_state, **TINY_GDN, tp=1), "linear_attn")
    if replicated:
        spec = groups[0].kv_cache_spec
        assert isinstance(spec, MambaSpec)  # gdn_state's
        groups[0] = layouts.group(
            groups[0].layer_names, dataclasses.replace(spec, tp_replicated=True)
        )
    return groups


def _gpt_oss() -> list[KVCacheGroupSpec]:
    full, swa = families.gpt_oss(**TINY)  # 32 tokens x 2 heads x 128 x 4 B = 32768 B
    return [
        layouts.group(layouts.layer_names("model.layers.{}.attn", [0, 4]), full),
        layouts.group(layouts.layer_names("model.layers.{}.attn", [2]), full),
        layouts.group(layouts.layer_names("model.layers.{}.attn", [1, 3]), swa),
    ]


STATE_CONTENT = 768 * 3 * 4 + 4 * 32 * 32 * 4  # 9216 + 16384 = 25600 B
PAGE = 32768
CASES = {
    "sharded-state": Case(
        functools.partial(_gdn, False), 64, (STATE_CONTENT, PAGE), [[2], [1, 4]], [[5], [3, 6]]
    ),
    "replicated-state": Case(
        functools.partial(_gdn, True), 64, (STATE_CONTENT, PAGE), [[2], [1, 4]], [[5], [3, 6]]
    ),
    "gpt-oss-5": Case(_gpt_oss, 32, (PAGE, PAGE, PAGE), [[1], [2], [3]], [[4], [5], [6]]),
}


def _offset(caches: dict[str, torch.Tensor], layer: str, block: int) -> int:
    return caches[layer][block].data_ptr() - layouts.backing(caches).data_ptr()


def expected(
    case: Case, source: dict[str, torch.Tensor], dest: dict[str, torch.Tensor], whole: bool
) -> Any:
    """The sentinel, with each group's requested pages of its own layers copied (their
    moved bytes, or with ``whole`` the whole page: the plan's default layout moves a
    state page whole between equal TP sizes, its padding too)."""
    src, want = layouts.backing(source), torch.full_like(layouts.backing(dest), SENTINEL)
    for g, group in enumerate(case.groups()):
        moved = PAGE if whole else case.moved[g]
        for layer in group.layer_names:
            for remote, local in zip(case.remote[g], case.local[g], strict=True):
                at, frm = _offset(dest, layer, local), _offset(source, layer, remote)
                want[at : at + moved] = src[frm : frm + moved]
    return want


def assert_only_own_pages(
    case: Case,
    source: dict[str, torch.Tensor],
    dest: dict[str, torch.Tensor],
    *,
    whole: bool = False,
) -> None:
    got, want = layouts.backing(dest), expected(case, source, dest, whole)
    wrong = (got != want).nonzero().flatten()
    assert wrong.numel() == 0, f"{wrong.numel()} bytes differ, first at {wrong[:4].tolist()}"


# -- the connector -----------------------------------------------------------------------


@pytest.fixture
def worker(
    distributed: None, tiny_models: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[Any, dict[str, torch.Tensor]]]]:
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # vLLM's Mamba transfer needs it
    made: list[Any] = []
    make = llama_rank_worker(tiny_models, made, NB, LAYOUT)
    yield lambda case, engine: make(case.groups(), engine, 1, 0, case.block, None)
    for w in made:
        w.shutdown()


@pytest.mark.parametrize("name", list(CASES))
def test_the_connector_reads_only_each_groups_own_pages(
    name: str, worker: Callable[..., tuple[Any, dict[str, torch.Tensor]]]
) -> None:
    case = CASES[name]
    producer, source = worker(case, "prefill")
    layouts.fill_pattern(source, 47)
    consumer, dest = worker(case, "decode")
    layouts.backing(dest).fill_(SENTINEL)
    with serving([producer]) as port:
        receive(consumer, port=port, local=case.local, remote=case.remote)
    assert_only_own_pages(case, source, dest)


# -- the planner, the NIXL shim and the Mooncake move lists ------------------------------


def _pair(case: Case) -> tuple[Rank, Rank]:
    config = layouts.kv_cache_config(case.groups(), NB, LAYOUT)
    source, dest = layouts.allocate(config, LAYOUT), layouts.allocate(config, LAYOUT)
    layouts.fill_pattern(source, 11)
    layouts.backing(dest).fill_(SENTINEL)
    return (
        Rank(config, source, plan_regions(source, config)),
        Rank(config, dest, plan_regions(dest, config)),
    )


def test_the_planner_names_each_groups_regions() -> None:
    """Tensor 0 holds a layer of every group; the others only the larger groups'."""
    gdn, _ = _pair(CASES["sharded-state"])
    assert [r.group_ids for r in gdn.plan.regions] == [(0, 1), (0,), (0,)]
    assert gdn.plan.group_regions == ((0, 1, 2), (0,))
    gpt, _ = _pair(CASES["gpt-oss-5"])
    assert [r.group_ids for r in gpt.plan.regions] == [(0, 1, 2), (0, 2)]
    assert gpt.plan.group_regions == ((0, 1), (0,), (0, 1))


@pytest.mark.parametrize("name", list(CASES))
def test_the_nixl_shim_reads_only_each_groups_own_pages(
    name: str, agents: list[TraitsNixlAgent]
) -> None:
    case = CASES[name]
    source, dest = _pair(case)
    producer, consumer = TraitsNixlAgent(), TraitsNixlAgent()
    agents += [producer, consumer]
    producer.register_plan(source.plan)
    consumer.register_plan(dest.plan)
    peer = consumer.connect(producer.metadata())
    for mode in ("prepped", "per_block", "merged"):
        dest.raw.fill_(SENTINEL)
        consumer.read_blocks(
            peer, case.local, case.remote, mode=mode, timeout=20, progress=producer.progress
        )
        assert_only_own_pages(case, source.caches, dest.caches, whole=True)


@pytest.mark.parametrize("name", list(CASES))
def test_the_mooncake_moves_touch_only_each_groups_own_pages(name: str) -> None:
    case = CASES[name]
    source, dest = _pair(case)
    move_all({0: dest}, {0: source}, 1, case.local, case.remote, write=False)
    assert_only_own_pages(case, source.caches, dest.caches, whole=True)
    dest.raw.fill_(SENTINEL)
    move_all({0: source}, {0: dest}, 1, case.remote, case.local, write=True)
    assert_only_own_pages(case, source.caches, dest.caches, whole=True)
