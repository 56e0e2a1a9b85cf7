"""Where vLLM series register the same layout differently (the connector's
``SeriesQuirks``), on the real workers and real NIXL agents of the series under test.

- 0.34 keys a region by (base address, block length): a compressor ring overlaying a
  sliding-window MLA page at one base is two regions, each moving its own page
  (0.32/0.33: one region).
- 0.33+ pull workers register a block-outermost (BLHNC) MLA cache as whole block rows,
  one descriptor per block, and advertise each layer's page in the row
  (``packed_member_layouts``); 0.32 keeps one region per layer page.

Each case compares ours with upstream's worker field by field, then moves a request's
blocks through vLLM's own receive path between two of our workers and checks every byte.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import vllm
from vllm.config import set_current_vllm_config
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

from kvspec_traits import traits_of
from kvspec_traits.transfer import PlanLayout, Rows, plan_regions
from kvspec_traits.vllm_connector._connector import TraitsNixlConnectorWorker
from kvspec_traits.vllm_connector._facts import layout_facts
from kvspec_traits.vllm_connector._policy import layout_policy
from kvspec_traits.vllm_connector._quirks import SeriesQuirks, series_quirks
from tests.mla_backends import CPU_MLA
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import DSV2, Family
from tests.test_connector_differential import (
    BLHNC,
    DSV4_CACHES,
    RING_SWA_MLA,
    Built,
    _construct,
    _mla,
    _vllm_config,
    build,
    by_base,
    compared_fields,
    distributed,
)
from tests.test_connector_kernel_blocks import _read

pytestmark = pytest.mark.timeout(600)
__all__ = ["build", "distributed"]  # fixtures, imported for their names

NB = 6
SERIES = ".".join(vllm.__version__.split(".")[:2])
PACKED_MLA = Family(lambda tp: _mla(CPU_MLA), BLHNC, DSV2, CPU_MLA)


def test_series_quirks_per_series() -> None:
    assert series_quirks("0.32.0") == SeriesQuirks(
        series="0.32",
        regions_keyed_by_block_len=False,
        packed_mla_rows=False,
        transfer_mode_key=False,
    )
    assert series_quirks("0.33.0+cpu") == SeriesQuirks(
        series="0.33",
        regions_keyed_by_block_len=False,
        packed_mla_rows=True,
        transfer_mode_key=False,
    )
    assert series_quirks("0.34.0") == SeriesQuirks(
        series="0.34", regions_keyed_by_block_len=True, packed_mla_rows=True, transfer_mode_key=True
    )
    # By order: a later series keeps every quirk 0.34 has (issue 49 item 8).
    assert series_quirks("0.35.0") == SeriesQuirks(
        series="0.35", regions_keyed_by_block_len=True, packed_mla_rows=True, transfer_mode_key=True
    )
    assert series_quirks().series == SERIES


def test_layout_policy_per_series() -> None:
    """The plan layout each series' worker registers with, for a two-layer BLHNC MLA
    cache (MLA, no state): kernel blocks always; model order and scattered pages as rows
    unless a ring (or a state) is present; latent rows on 0.33+ for a block-outermost
    cache at PP 1; regions keyed by page size on 0.34. On the same tensors, 0.32's layout
    gives a region per layer page, 0.33's one region of whole rows (2 pages of 36864 B,
    as test_packed_mla_rows computes) with each page's place in it."""
    config = layouts.kv_cache_config(PACKED_MLA.groups(1), NB, PACKED_MLA.layout)
    caches = layouts.allocate(config, PACKED_MLA.layout)
    facts = layout_facts(config)

    def layout(
        version: str,
        *,
        ring: bool = False,
        ratio: int = 1,
        packed: bool = True,
        pp: int = 1,
        push: bool = False,
    ) -> PlanLayout:
        return layout_policy(version).layout(
            facts,
            ring=ring,
            state=False,
            kernel_ratio=ratio,
            packed_cache=packed,
            pp_size=pp,
            push=push,
        )

    expected = {
        "0.32.1": PlanLayout(sub_blocks=1, rows=Rows.SCATTERED),
        "0.33.0+cpu": PlanLayout(sub_blocks=1, rows=Rows.SCATTERED | Rows.LATENT),
        "0.34.0": PlanLayout(
            sub_blocks=1, rows=Rows.SCATTERED | Rows.LATENT, separate_page_sizes=True
        ),
    }
    for version, want in expected.items():
        assert layout(version) == want
    assert layout("0.34.0", ring=True, ratio=4) == PlanLayout(
        sub_blocks=4, order="given", rows=Rows.LATENT, separate_page_sizes=True
    )
    assert layout("0.34.0", pp=2).rows == Rows.SCATTERED
    assert layout("0.34.0", packed=False).rows == Rows.SCATTERED
    # vLLM 0.32's push worker registers whole rows too (its _tracks_region_layers), and a
    # push stage of PP > 1 each layer's page apart, overlaid pages of other sizes too (the
    # pages of its rows are not the decode side's rows: _requires_layer_name_routing).
    assert layout("0.32.1", push=True) == expected["0.33.0+cpu"]
    stage = PlanLayout(sub_blocks=1, rows=Rows.SCATTERED, separate_page_sizes=True)
    assert layout("0.32.1", push=True, pp=2) == stage
    assert layout("0.33.0+cpu", push=True, pp=2) == stage

    page = traits_of(config.kv_cache_groups[0].kv_cache_spec).page_size_bytes
    names = list(config.kv_cache_groups[0].layer_names)
    pages = plan_regions(caches, config, layout=expected["0.32.1"])
    assert [(r.block_len, r.packed_members) for r in pages.regions] == [(page, ())] * 2
    (row,) = plan_regions(caches, config, layout=expected["0.33.0+cpu"]).regions
    assert (row.block_len, row.block_stride) == (2 * page, 2 * page)
    assert row.packed_members == ((names[0], 0, page), (names[1], page, page))


@pytest.fixture
def pair(distributed: None, tiny_models: pathlib.Path) -> Iterator[Callable[..., Any]]:
    """``pair(family)``: a producer and a consumer TraitsNixlConnectorWorker, each over its
    own allocation of the family's layout, caches registered; shut down afterwards."""
    made: list[Any] = []

    def _pair(
        family: Family,
    ) -> tuple[Any, dict[str, torch.Tensor], Any, dict[str, torch.Tensor], list[KVCacheGroupSpec]]:
        out: list[Any] = []
        groups = family.groups(1)
        for engine in ("producer", "consumer"):
            vllm_config = _vllm_config(
                tiny_models / family.model, family.layout, family.mla_backend
            )
            config = layouts.kv_cache_config(groups, NB, family.layout)
            caches = layouts.allocate(config, family.layout)
            with set_current_vllm_config(vllm_config):
                worker = _construct(lambda: TraitsNixlConnectorWorker(vllm_config, engine, config))  # noqa: B023
                made.append(worker)
                worker.register_kv_caches(caches)
            out += [worker, caches]
        return (*out, groups)

    yield _pair
    for worker in made:
        worker.shutdown()


def _same_as_upstream(built: Built) -> None:
    up, ours = built.upstream, built.traits
    diff = {
        name: (getattr(up, name), getattr(ours, name))
        for name in compared_fields()
        if getattr(up, name) != getattr(ours, name)
    }
    assert diff == {}
    assert by_base(up) == by_base(ours)
    assert getattr(up, "_packed_member_layouts", {}) == getattr(ours, "_packed_member_layouts", {})


def _read_and_check(pair: Callable[..., Any], family: Family) -> None:
    """Read blocks [2, 5] of every group of P into [4, 1] of D: exactly those blocks'
    bytes of every layer arrive, nothing else of D changes."""
    producer, p_caches, consumer, d_caches, groups = pair(family)
    layouts.fill_pattern(p_caches, seed=11)
    before = layouts.backing(d_caches).clone()
    local = tuple([4, 1] for _ in groups)
    _read(consumer, producer, local, [[2, 5] for _ in groups])
    after = layouts.backing(d_caches)
    changed = torch.zeros(after.numel(), dtype=torch.bool)
    base = after.data_ptr()
    for group in groups:
        for layer in group.layer_names:
            p_view, d_view = p_caches[layer], d_caches[layer]
            for dst, src in ((4, 2), (1, 5)):
                got = d_view[dst].contiguous().view(torch.uint8).flatten()
                want = p_view[src].contiguous().view(torch.uint8).flatten()
                assert torch.equal(got, want), (layer, dst, src)
                start = d_view[dst].data_ptr() - base
                changed[start : start + got.numel()] = True
    assert torch.equal(after[~changed], before[~changed])


def test_ring_over_swa_mla_matches_upstream_and_moves_every_byte(
    build: Callable[..., Built], pair: Callable[..., Any]
) -> None:
    """A ring (32768 B page, traits_of below) and an SWA-MLA cache at one base in BLHNC
    rows of 32768 B: on 0.34 (regions keyed by base and block length) ours registers
    what upstream does, and a read moves every page of both (the planner test
    test_separate_page_sizes_keep_overlaid_pages_of_other_sizes_apart covers pages of
    other lengths at one base)."""
    ring_page = traits_of(DSV4_CACHES.ring).page_size_bytes
    built = build(RING_SWA_MLA)
    ours = built.traits
    assert max(ours.block_len_per_layer) == ring_page
    if series_quirks().regions_keyed_by_block_len:
        up = built.upstream
        for name in (
            "block_len_per_layer",
            "block_stride_per_layer",
            "region_num_blocks",
            "region_group_ids",
            "region_names",
            "num_regions",
            "num_descs",
        ):
            assert getattr(up, name) == getattr(ours, name), name
    _read_and_check(pair, RING_SWA_MLA)


def test_packed_mla_rows(build: Callable[..., Built], pair: Callable[..., Any]) -> None:
    """Two MLA layers, BLHNC: a block row is layer 0's page then layer 1's
    (page = block 16 x 576 x 4 B float32 = 36864 B, vLLM's MLA page_size_bytes with
    CPU_MLA's block and dtype; the row 2 pages). On 0.33+ one region of whole rows,
    each layer's page advertised at offset 0 and 36864; on 0.32 a region per page."""
    built = build(PACKED_MLA)
    names = list(built.config.kv_cache_groups[0].layer_names)
    page = traits_of(built.config.kv_cache_groups[0].kv_cache_spec).page_size_bytes
    assert (
        page
        == CPU_MLA.block_size * 576 * torch.tensor([], dtype=CPU_MLA.torch_dtype).element_size()
    )
    ours = built.traits
    if series_quirks().packed_mla_rows:
        assert ours.num_regions == 1
        assert ours.block_len_per_layer == [2 * page]
        assert ours.num_descs == built.config.num_blocks
        layouts = getattr(ours, "_packed_member_layouts", {})
        assert layouts == {names[0]: (0, page), names[1]: (page, page)}
    else:
        assert ours.num_regions == 2
        assert ours.block_len_per_layer == [page, page]
    _same_as_upstream(built)
    _read_and_check(pair, PACKED_MLA)
