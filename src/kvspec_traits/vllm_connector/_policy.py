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
        push: bool = False,
    ) -> PlanLayout:
        """The plan layout of a worker: ``ring`` and ``state`` as the worker keeps them
        (CSA-linear, Mamba), ``kernel_ratio`` its kernel blocks per block,
        ``packed_cache`` whether its cache is block-outermost, ``pp_size`` its pipeline
        parallel size, ``push`` whether it is a push worker.

        - vLLM's descriptor ids count kernel blocks: regions are planned in them.
        - CSA-linear (ring-buffer) models: regions in the order the caches come (the
          worker's descriptor code relies on those indices), and shared rows registered
          per owner, as for models with a recurrent state; other models: model-layer
          order, and a page that is not one dense run registered as its whole row.
        - 0.33+ (0.32: push workers): a block-outermost MLA cache without state, PP 1,
          registers its latent pages as whole rows, each layer's place in the row
          advertised. A push stage of PP > 1 registers each layer's page of the rows
          as a region of its own (its rows hold other layers than the decode side's),
          overlaid pages of other sizes apart.
        - 0.34: regions keyed by base and block length (overlaid pages of other sizes
          are separate regions).
        - A TP-replicated state outside a ring model (``facts.replicated_state_layers``)
          is a REPLICATE region of its own, moving its content.
        """
        rows = Rows.NONE if ring or state else Rows.SCATTERED
        packed_mla = facts.mla and not facts.has_state and packed_cache
        if packed_mla and (self.quirks.packed_mla_rows or push) and pp_size == 1:
            rows |= Rows.LATENT
        return PlanLayout(
            sub_blocks=kernel_ratio,
            order="given" if ring else "model",
            rows=rows,
            separate_page_sizes=self.quirks.regions_keyed_by_block_len
            or (packed_mla and push and pp_size > 1),
            replicated_states_apart=facts.replicated_state_layers,
        )

    def worker_layout(
        self, worker: Any, facts: LayoutFacts, *, pp_size: int | None = None
    ) -> PlanLayout:
        """:meth:`layout` of a vLLM NIXL worker, from the attributes it keeps (vLLM's,
        under the names :class:`~._seam.SeamWorker` gives them; with ``pp_size``: as a
        stage of that pipeline-parallel size would lay it out)."""
        return self.layout(
            facts,
            ring=bool(worker.is_csa_linear),
            state=bool(worker.has_mamba),
            kernel_ratio=worker.physical_blocks_per_logical_kv_block,
            packed_cache=bool(worker.has_packed_cache),
            pp_size=worker.pp_size if pp_size is None else pp_size,
            push=worker.transfer_mode == "push",
        )


def layout_policy(version: str | None = None) -> VllmLayoutPolicy:
    """The layout policy of vLLM ``version`` (default: the imported vLLM)."""
    return VllmLayoutPolicy(quirks=quirks.series_quirks(version))
