"""Where vLLM series differ: the one place the connector branches on the installed
vLLM series (every other decision comes from traits and the planner's region facts)."""

from __future__ import annotations

import dataclasses

__all__ = ["SeriesQuirks", "series_quirks"]


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
    row (``packed_member_layouts``); 0.32 does so for push workers only."""


def series_quirks(version: str | None = None) -> SeriesQuirks:
    """The :class:`SeriesQuirks` of vLLM ``version`` (default: the imported vLLM)."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "0"))
    major_minor = tuple(int(p) for p in version.split("+", 1)[0].split(".")[:2] if p.isdigit())
    return SeriesQuirks(
        series=".".join(str(p) for p in major_minor),
        regions_keyed_by_block_len=major_minor >= (0, 34),
        packed_mla_rows=major_minor >= (0, 33),
    )
