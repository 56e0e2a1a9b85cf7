"""kvspec-traits adapters for vllm-ascend's KV cache spec classes.

vllm-ascend (``vllm_ascend/core/kv_cache_interface.py``) defines its own spec classes and
registers them with vLLM's ``KVCacheSpecRegistry``. kvspec-traits refuses them without an
adapter (each overrides page math and adds fields), so this package answers each from its
own fields, in the ``kvspec_traits.adapters`` entry-point group:

- ``AscendMLAAttentionSpec(MLAAttentionSpec)``: an MLA latent, optionally followed by an
  indexer scale (``scale_dim`` x ``scale_dtype``); in the 0.23.0.post1 release also the
  DeepSeek sparse-attention (DSA) page of ``sparse_head_dim = (kv_lora, k_rope, index_k)``,
  with its C8 modes (``cache_sparse_sfa_c8``, ``cache_sparse_li_c8``) and the DCP-replicated
  indexer (``sfa_dcp_replicated_indexer_size``).
- ``AscendSlidingWindowMLASpec(SlidingWindowMLASpec)``: DeepSeek-V4's sliding-window KV
  and compressor states; vllm-ascend counts ``storage_block_size`` rows per block.
- ``AscendSFAIndexerCacheSpec(MLAAttentionSpec)`` (later trees, 0.27.1rc1): the SFA
  indexer's key cache (and per-token scale), ``sfa_dcp_replicated_indexer_size`` copies.

Only the classes the importable ``vllm_ascend`` defines are registered; without
``vllm_ascend`` there is no Ascend spec to answer for, and the entry point registers
nothing. How the classes are imported off an NPU machine: :mod:`kvspec_traits_ascend._vendor`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import torch
from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec

from kvspec_traits import InvalidSpecError, TokenScope
from kvspec_traits.extend import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    LayoutTraits,
    Registry,
    attention_traits,
    positive_int,
    register_adapter,
)
from kvspec_traits_ascend._vendor import load_spec_module, vllm_ascend_present

__all__ = [
    "MLA_READS",
    "SFA_INDEXER_READS",
    "SWA_MLA_READS",
    "adapt_ascend_mla",
    "adapt_ascend_swa_mla",
    "adapt_sfa_indexer",
    "register",
    "representative_specs",
    "spec_classes",
]

Cell = list[tuple[str, int, torch.dtype]]

MLA_READS: Final = (
    *ATTENTION_READS,
    "scale_dim",
    "scale_dtype",
    # 0.23.0.post1 only (the DSA page, its C8 modes and the replicated indexer)
    "sparse_head_dim",
    "cache_sparse_sfa_c8",
    "cache_sparse_li_c8",
    "c8_k_cache_dtype",
    "c8_k_scale_cache_dtype",
    "sfa_dcp_replicated_indexer_size",
)
"""What :func:`adapt_ascend_mla` reads (those the installed class has)."""

_ASCEND_IGNORES: Final = (
    *ATTENTION_IGNORES,
    # Later trees: the cache is allocated in host memory for sparse KV offload; where a
    # page lives does not change what it holds.
    "store_on_host",
)

SWA_MLA_READS: Final = (
    *ATTENTION_READS,
    "sliding_window",
    "bounded_replay",
    # Not in 0.23.0.post1's page (storage_block_size is block_size there); later trees
    # divide the block by it, which vLLM 0.34 spells tokens_per_state (read).
    "compress_ratio",
    "storage_block_size",
)
"""What :func:`adapt_ascend_swa_mla` reads."""

SFA_INDEXER_READS: Final = (
    *ATTENTION_READS,
    "scale_dim",
    "scale_dtype",
    "cache_sparse_li_c8",
    "sfa_dcp_replicated_indexer_size",
)
"""What :func:`adapt_sfa_indexer` reads."""


def _get(spec: object, name: str, default: object = None) -> Any:
    return getattr(spec, name, default)


def _dtype(spec: object, name: str) -> torch.dtype:
    value = _get(spec, name)
    if not isinstance(value, torch.dtype):
        raise InvalidSpecError(spec, name, value, "a torch.dtype")
    return value


def _flag(spec: object, name: str) -> bool:
    value = _get(spec, name, False)
    if not isinstance(value, bool):
        raise InvalidSpecError(spec, name, value, "a bool")
    return value


def _scale(spec: object) -> Cell:
    """The per-token scale part vllm-ascend adds to a cell (``scale_dim`` elements)."""
    scale_dim = positive_int(spec, "scale_dim", minimum=0)
    return [("scale", scale_dim, _dtype(spec, "scale_dtype"))] if scale_dim else []


def _sparse_dims(spec: object) -> tuple[int, int, int] | None:
    dims = _get(spec, "sparse_head_dim")
    if dims is None:
        return None
    if (
        not isinstance(dims, tuple)
        or len(dims) != 3
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims)
    ):
        raise InvalidSpecError(
            spec, "sparse_head_dim", dims, "None or three ints >= 0 (kv_lora, k_rope, index_k)"
        )
    return dims[0], dims[1], dims[2]


def _mla_cell(spec: MLAAttentionSpec) -> Cell:
    """The parts of one (head, token) cell, as vllm-ascend's ``page_size_bytes`` counts
    them (0.23.0.post1, ``vllm_ascend/core/kv_cache_interface.py``): its four branches."""
    dtype = _dtype(spec, "dtype")
    dims = _sparse_dims(spec)
    replicas = positive_int(spec, "sfa_dcp_replicated_indexer_size") if dims else 1
    if dims is not None and _flag(spec, "cache_sparse_sfa_c8"):
        # SFA C8: kv_lora, k_rope and their tile scales packed into one C8 vector (so no
        # k_rope part); the indexer key in C8 too when LI C8 is on, with its scale.
        if dims[1] != 0:
            raise InvalidSpecError(
                spec, "sparse_head_dim", dims, "(packed_kv, 0, index_k) with cache_sparse_sfa_c8"
            )
        c8 = _dtype(spec, "c8_k_cache_dtype")
        li_c8 = _flag(spec, "cache_sparse_li_c8")
        cell: Cell = [("packed_kv", dims[0], c8)]
        if dims[2]:
            cell.append(("indexer_k", dims[2] * replicas, c8 if li_c8 else dtype))
            if li_c8:
                cell.append(("indexer_scale", replicas, _dtype(spec, "c8_k_scale_cache_dtype")))
        return cell
    # Without sparse_head_dim (later trees, and the release's MLA layers) the latent is
    # head_size elements of dtype (the packed C8 vector under SFA C8), then any scale.
    if dims is None:
        return [("latent", positive_int(spec, "head_size"), dtype), *_scale(spec)]
    kv_lora, k_rope, index_k = dims
    if _flag(spec, "cache_sparse_li_c8"):
        if not index_k:
            raise InvalidSpecError(spec, "sparse_head_dim", dims, "an index_k > 0 with LI C8")
        return [
            ("kv_lora", kv_lora, dtype),
            ("k_rope", k_rope, dtype),
            ("indexer_k", index_k * replicas, _dtype(spec, "c8_k_cache_dtype")),
            ("indexer_scale", replicas, _dtype(spec, "c8_k_scale_cache_dtype")),
        ]
    if replicas == 1 and spec.head_size != kv_lora + k_rope + index_k:
        # vllm-ascend then counts head_size, not the parts: a spec whose parts disagree
        # with it describes no page.
        raise InvalidSpecError(
            spec, "head_size", spec.head_size, f"the sum of sparse_head_dim {dims}"
        )
    cell = [("kv_lora", kv_lora, dtype), ("k_rope", k_rope, dtype)]
    if index_k:
        cell.append(("indexer_k", index_k * replicas, dtype))
    return [*cell, *_scale(spec)]


def adapt_ascend_mla(spec: MLAAttentionSpec) -> LayoutTraits:
    """An MLA page (one latent per token, no V: replicated across TP) whose cell holds the
    parts vllm-ascend's page math counts (:func:`_mla_cell`), each a component."""
    return attention_traits(spec, cell=_mla_cell(spec))


def adapt_ascend_swa_mla(spec: SlidingWindowMLASpec) -> LayoutTraits:
    """A sliding-window MLA page (DeepSeek-V4's window KV and compressor states): the
    built-in sliding-window answer. vllm-ascend stores ``storage_block_size`` rows per
    block; vLLM 0.34 counts ``block_size / tokens_per_state`` states, so a spec where the
    two differ (``compress_ratio`` > 1 without ``tokens_per_state``) is refused."""
    traits = attention_traits(
        spec,
        token_scope=TokenScope.SLIDING_WINDOW,
        window_tokens=positive_int(spec, "sliding_window"),
    )
    rows = _get(spec, "storage_block_size", traits.states_per_block)
    if rows != traits.states_per_block:
        raise InvalidSpecError(
            spec,
            "compress_ratio",
            _get(spec, "compress_ratio"),
            f"1, or equal to tokens_per_state: vllm-ascend stores {rows} rows per block, "
            f"vLLM {traits.states_per_block} states",
        )
    return traits


def adapt_sfa_indexer(spec: MLAAttentionSpec) -> LayoutTraits:
    """The SFA indexer's key cache: one key (and, with LI C8, one scale) per token, no
    V, so ``is_mla`` (one vector per state) and replicated across TP like the MLA cache it
    shares blocks with; ``sfa_dcp_replicated_indexer_size`` copies of each cell."""
    replicas = positive_int(spec, "sfa_dcp_replicated_indexer_size")
    cell: Cell = [("indexer_k", positive_int(spec, "head_size") * replicas, _dtype(spec, "dtype"))]
    cell += [(name, n * replicas, dt) for name, n, dt in _scale(spec)]
    return attention_traits(spec, cell=cell)


def _declared(cls: type[Any], names: Sequence[str]) -> tuple[str, ...]:
    """``names`` less the fields this tree's class does not have (the field sets of the
    release and of later trees differ); members (properties) are kept."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return tuple(n for n in names if n in fields or hasattr(cls, n))


def spec_classes() -> dict[str, Any]:
    """The Ascend spec classes of the importable ``vllm_ascend``, by name ({} without it).
    Typed ``Any``: they are imported at run time, from a tree mypy does not see."""
    if not vllm_ascend_present():
        return {}
    module = load_spec_module()
    names = ("AscendMLAAttentionSpec", "AscendSlidingWindowMLASpec", "AscendSFAIndexerCacheSpec")
    return {n: getattr(module, n) for n in names if hasattr(module, n)}


def register(registry: Registry) -> None:
    """Entry point of the ``kvspec_traits.adapters`` group: called once per registry."""
    classes = spec_classes()
    plan: list[tuple[str, Any, Sequence[str]]] = [
        ("AscendMLAAttentionSpec", adapt_ascend_mla, MLA_READS),
        ("AscendSlidingWindowMLASpec", adapt_ascend_swa_mla, SWA_MLA_READS),
        ("AscendSFAIndexerCacheSpec", adapt_sfa_indexer, SFA_INDEXER_READS),
    ]
    for name, adapter, reads in plan:
        cls = classes.get(name)
        if cls is None:
            continue
        register_adapter(
            cls,
            adapter,
            registry=registry,
            reads=_declared(cls, reads),
            ignores=_declared(cls, _ASCEND_IGNORES),
        )


def representative_specs() -> list[AttentionSpec]:
    """Real instances of the installed tree's Ascend classes, built with the arguments
    vllm-ascend's own code passes (A2/A3, ``--block-size 128``), for ``kvspec-traits
    report`` and ``audit``. Configurations whose page vllm-ascend's class counts two
    ways (C8, the replicated indexer) are not here: kvspec-traits refuses them, see
    ``docs/extending.md``."""
    classes = spec_classes()
    out: list[AttentionSpec] = []
    bf16, f32 = torch.bfloat16, torch.float32
    mla = classes.get("AscendMLAAttentionSpec")
    # The release's DSA page fields; later trees moved the indexer to its own class and
    # compute the MLA page from MLAAttentionSpec.compress_ratio, which vLLM 0.34 lacks.
    if mla is not None and "sparse_head_dim" in {f.name for f in dataclasses.fields(mla)}:
        kw: dict[str, Any] = {"block_size": 128, "num_kv_heads": 1, "dtype": bf16}
        out += [
            # worker/model_runner_v1.py, MLA layers (DeepSeek-V3: kv_lora 512 + rope 64)
            mla(head_size=576, cache_dtype_str="auto", **kw),
            # ... the fa_quant layers: int8 latent, cache_dtype_str None
            mla(head_size=576, cache_dtype_str=None, **{**kw, "dtype": torch.int8}),
            # ... DSA layers with an indexer (DeepSeek-V3.2: index_head_dim 128)
            mla(head_size=704, sparse_head_dim=(512, 64, 128), cache_dtype_str="auto", **kw),
            # ... DSA layers that reuse another layer's top-k: no indexer part
            mla(head_size=576, sparse_head_dim=(512, 64, 0), cache_dtype_str="auto", **kw),
        ]
    swa = classes.get("AscendSlidingWindowMLASpec")
    if swa is not None:
        window: dict[str, Any] = {"num_kv_heads": 1, "alignment": None}
        out += [
            # models/deepseek_v4.py AscendDeepseekV4SWACache (head_dim 512, window 128)
            swa(block_size=128, head_size=512, dtype=bf16, sliding_window=128,
                cache_dtype_str="auto", model_version="deepseek_v4", **window),
            # ... AscendCompressorStateCache, C4 (state_dim 2*2*512, window 2*4), padded
            # to DSV4_BLOCK_SIZES[128][1][1]
            swa(block_size=8, head_size=2048, dtype=f32, sliding_window=8,
                page_size_padded=131072, **window),
            # ... the C4 indexer's compressor (state_dim 2*2*128), padded to [1][0]
            swa(block_size=8, head_size=512, dtype=f32, sliding_window=8,
                page_size_padded=16640, **window),
            # ... C128 (state_dim 2*512, window 128, block [0][3] = 32)
            swa(block_size=32, head_size=1024, dtype=f32, sliding_window=128,
                page_size_padded=131072, **window),
        ]  # fmt: skip
    indexer = classes.get("AscendSFAIndexerCacheSpec")
    if indexer is not None:
        # worker/model_runner_v1.py, DeepseekV32IndexerCache layers without LI C8
        out.append(
            indexer(block_size=128, num_kv_heads=1, head_size=128, dtype=bf16,
                    cache_dtype_str="auto", scale_dim=0, scale_dtype=torch.int8)
        )  # fmt: skip
    return out
