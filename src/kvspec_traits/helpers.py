"""Building blocks for adapter authors: the built-in adapters' own math, public.

An adapter for an attention-like spec is then a few lines::

    @register_adapter(ScaledFullSpec, reads=(*ATTENTION_READS, "scale_bytes"),
                      ignores=ATTENTION_IGNORES)
    def adapt(spec: ScaledFullSpec) -> LayoutTraits:
        return attention_traits(spec)

Importing this module imports vLLM and torch (as ``kvspec_traits.catalog`` does);
``import kvspec_traits`` alone imports neither. See ``docs/extending.md``.
"""

from __future__ import annotations

from kvspec_traits._vllm_adapters import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    BASE_IGNORES,
    attention_traits,
    dtype_name,
    mamba_traits,
    positive_int,
)

__all__ = [
    "ATTENTION_IGNORES",
    "ATTENTION_READS",
    "BASE_IGNORES",
    "attention_traits",
    "dtype_name",
    "mamba_traits",
    "positive_int",
]
