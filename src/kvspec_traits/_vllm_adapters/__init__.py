"""Built-in adapters: one per KV cache spec class of vLLM 0.32, 0.33 and 0.34.

This package is the only part of the library that names vLLM spec classes. Each adapter
derives its traits from the spec's own fields; class identity decides only what the fields
cannot (the token scope a class stands for, and the HiSparse pages, which carry no layout
fields). They register through the public :func:`register_adapter` into ``BUILTINS``,
which every :class:`Registry` copies on first use.

Each registration declares the fields its adapter reads and the fields it knows do not
affect the layout (``reads=``/``ignores=``); a field of a later vLLM that is in neither
is refused whenever it leaves its default (see ``Registry.register``). A field named here
but absent from the installed vLLM is simply never seen, and so is a class: the classes
are looked up one by one (:mod:`._builtins`), so a class a vLLM release lacks has no
adapter and the others still load (``ABSENT`` names them).

- :mod:`._common`: ``BUILTINS``, the field lists, validation, :func:`attention_traits`;
- :mod:`._recurrent`: :func:`mamba_traits` and the HiSparse pages;
- :mod:`._builtins`: the registrations, class by class.
"""

from __future__ import annotations

from kvspec_traits._vllm_adapters._builtins import ABSENT, REGISTERED
from kvspec_traits._vllm_adapters._common import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    BASE_IGNORES,
    BUILTINS,
    attention_traits,
    dtype_name,
    positive_int,
)
from kvspec_traits._vllm_adapters._recurrent import mamba_traits

__all__ = [
    "ABSENT",
    "ATTENTION_IGNORES",
    "ATTENTION_READS",
    "BASE_IGNORES",
    "BUILTINS",
    "REGISTERED",
    "attention_traits",
    "dtype_name",
    "mamba_traits",
    "positive_int",
]
