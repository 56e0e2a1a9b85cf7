"""The adapter building blocks under their former name: the same objects as in
:mod:`kvspec_traits.extend`, where new code imports them from.

Importing this module imports vLLM and torch (as ``kvspec_traits.catalog`` does);
``import kvspec_traits`` alone imports neither. See ``docs/extending.md``.
"""

from __future__ import annotations

from kvspec_traits.extend import (
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
