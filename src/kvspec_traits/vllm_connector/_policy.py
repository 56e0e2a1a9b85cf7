"""vLLM's layout policy: how one vLLM series registers a KV cache, as the
:class:`~kvspec_traits.transfer.PlanLayout` its NIXL worker plans with. The planner
knows layouts only; every registration habit of vLLM's worker (which rows go whole,
which order, kernel-block granularity, what a series keys regions by) is decided here,
from the series' :class:`~kvspec_traits.vllm_connector._quirks.SeriesQuirks` and the
worker's facts. Pure: no vLLM import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvspec_traits.transfer import PlanLayout, Rows
from kvspec_traits.vllm_connector import _quirks as quirks
from kvspec_traits.vllm_connector._facts import LayoutFacts

__all__ = ["VllmLayoutPolicy", "layout_policy"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmLayoutPolicy:
    """The registration habits of one vLLM series' NIXL worker."""

    quirks: quirks.SeriesQuirks

    def layout(
        self,
        facts: LayoutFacts,
        *,
        ring: bool,
        state: bool,
        kernel_ratio: int,
        packed_cache: bool,
        pp_size: int,
    ) -> PlanLayout:
        """The plan layout of a worker: ``ring`` and ``state`` as the worker keeps them
        (``_is_csa_linear``, ``_has_mamba``), ``kernel_ratio`` its kernel blocks per
        block (``_physical_blocks_per_logical_kv_block``), ``packed_cache`` whether its
        cache is block-outermost (``_has_packed_cache``), ``pp_size`` its pipeline
        parallel size.

        - vLLM's descriptor ids count kernel blocks: regions are planned in them.
        - CSA-linear (ring-buffer) models: regions in the order the caches come (the
          worker's descriptor code relies on those indices), and shared rows registered
          per owner, as for models with a recurrent state; other models: model-layer
          order, and a page that is not one dense run registered as its whole row.
        - 0.33+: a block-outermost MLA cache without state, PP 1, registers its latent
          pages as whole rows, each layer's place in the row advertised.
        - 0.34: regions keyed by base and block length (overlaid pages of other sizes
          are separate regions).
        """
        rows = Rows.NONE if ring or state else Rows.SCATTERED
        if (
            self.quirks.packed_mla_rows
            and facts.mla
            and not facts.has_state
            and packed_cache
            and pp_size == 1
        ):
            rows |= Rows.LATENT
        return PlanLayout(
            sub_blocks=kernel_ratio,
            order="given" if ring else "model",
            rows=rows,
            separate_page_sizes=self.quirks.regions_keyed_by_block_len,
        )

    def worker_layout(self, worker: Any, facts: LayoutFacts) -> PlanLayout:
        """:meth:`layout` of a vLLM NIXL worker, from the attributes it keeps."""
        return self.layout(
            facts,
            ring=bool(worker._is_csa_linear),
            state=bool(worker._has_mamba),
            kernel_ratio=worker._physical_blocks_per_logical_kv_block,
            packed_cache=quirks.has_packed_cache(worker),
            pp_size=worker.pp_size,
        )


def layout_policy(version: str | None = None) -> VllmLayoutPolicy:
    """The layout policy of vLLM ``version`` (default: the imported vLLM)."""
    return VllmLayoutPolicy(quirks=quirks.series_quirks(version))
