"""Where vLLM series differ: the one place the connector branches on the installed
vLLM series (every other decision comes from traits and the planner's region facts;
what a series keeps under private names is probed in :mod:`._seam`). Pure: no vLLM
import at import time.
"""

from __future__ import annotations

import dataclasses

from kvspec_traits.vllm_connector._gate import installed_vllm, vllm_series

__all__ = ["SeriesQuirks", "metadata_has_layer_group_ids", "series_quirks"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeriesQuirks:
    """Where vLLM series register the same layout differently: the one place the
    connector branches on the installed vLLM series (every other decision comes from
    traits and the planner's region facts)."""

    series: str
    regions_keyed_by_block_len: bool
    """vLLM 0.34 keys a region by (base address, block length): overlaid groups paging
    the same bytes with different page sizes are separate regions. 0.32/0.33 key by
    base address only (one region, moving the longest page)."""
    packed_mla_rows: bool
    """vLLM 0.33+ pull workers register a block-outermost (``*B*`` first) MLA cache as
    whole block rows, one descriptor per block, and advertise each layer's page in the
    row (the metadata's ``packed_member_layouts``); 0.32 does so for push workers only."""
    transfer_mode_key: bool
    """vLLM 0.34+'s ``KVConnectorFactory`` makes ``"NixlConnector"`` its push connector
    under ``kv_connector_extra_config`` ``{"transfer_mode": "push"}``, and
    ``TraitsNixlConnector`` reads the key there too (``ConnectorOptions.transfer_mode``);
    0.32 and 0.33 ignore the key (push is ``"NixlPushConnector"`` by name), and so does
    ours on them. By order, so a later series keeps push a push connector."""


def series_quirks(version: str | None = None) -> SeriesQuirks:
    """The :class:`SeriesQuirks` of vLLM ``version`` (default: the imported vLLM)."""
    series = vllm_series(installed_vllm() if version is None else version)
    # "0.34" -> (0, 34); a series that is not numbers has no quirk (the gate refuses it).
    numbers = tuple(int(p) if p.isdigit() else -1 for p in series.split("."))
    return SeriesQuirks(
        series=series,
        regions_keyed_by_block_len=numbers >= (0, 34),
        packed_mla_rows=numbers >= (0, 33),
        transfer_mode_key=numbers >= (0, 34),
    )


# -- what a vLLM series' classes declare -----------------------------------------------
# What only some series keep on a worker is probed on the worker itself, by the seam
# (vLLM's private names: ._seam.SeamWorker); public fields are probed here.


def metadata_has_layer_group_ids(metadata_class: type) -> bool:
    """vLLM 0.34's agent metadata names each region member's transfer group."""
    return "layer_group_ids" in {f.name for f in dataclasses.fields(metadata_class)}
