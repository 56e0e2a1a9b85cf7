"""The seam to vLLM's NIXL worker: where the connector's own layout answers are handed
to the vLLM code it runs, in the vocabulary that code reads.

vLLM's descriptor code (``_compute_desc_ids``, ``_build_fa_remote``, the TP mapping, the
read planning) classifies each transfer group by a per-group type, ``_group_spec_types``,
through ``tp_mapping._is_attention_spec`` / ``_is_ssm_spec`` and, in 0.32/0.33,
``is CircularBufferSpec``. The connector decides each group's kind from traits
(:class:`~kvspec_traits.vllm_connector._facts.GroupKind`) and gives vLLM's code the one
vLLM class that stands for that kind (:func:`group_spec_types`): a group of a spec class
vLLM has never seen is addressed as its traits say, not refused as "Unknown spec
type". The state split (vLLM's ``_conv_decomp``) is the traits' too
(:func:`conv_split_info`). Imports vLLM when called, never at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec_traits.vllm_connector._facts import GroupKind, StateSplit

__all__ = ["conv_split_info", "group_spec_types", "kind_tag"]


def kind_tag(kind: GroupKind) -> type[Any]:
    """The vLLM class that vLLM's NIXL worker reads as ``kind``: ``AttentionSpec`` for
    paged groups (``_is_attention_spec``), ``CircularBufferSpec`` for rings (an
    ``AttentionSpec`` too, picked out by identity for its scratch regions),
    ``MambaSpec`` for states (``_is_ssm_spec``). A tag only: never instantiated."""
    from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec, MambaSpec

    tags: dict[GroupKind, type[Any]] = {
        GroupKind.PAGED: AttentionSpec,
        GroupKind.RING: CircularBufferSpec,
        GroupKind.STATE: MambaSpec,
    }
    return tags[kind]


def group_spec_types(kinds: Sequence[GroupKind]) -> tuple[type[Any], ...]:
    """vLLM's ``_group_spec_types`` for transfer groups of these kinds."""
    return tuple(kind_tag(kind) for kind in kinds)


def conv_split_info(split: StateSplit) -> Any:
    """vLLM's ``MambaConvSplitInfo`` (its descriptor code's state split) of ``split``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        MambaConvSplitInfo,
    )

    return MambaConvSplitInfo(
        conv_rows=split.conv_rows,
        local_proj_dims=split.local_proj_dims,
        conv_dtype_size=split.conv_dtype_size,
        ssm_sizes=split.sizes,
    )
