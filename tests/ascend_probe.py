"""Run in a child process with one vllm-ascend tree on the path (tests/test_ascend_extension.py):
prints, as JSON, what kvspec-traits answers for vllm-ascend's spec classes built as its own
code builds them, and what it refuses, beside each spec's own page math.

Usage: python tests/ascend_probe.py  (PYTHONPATH: vLLM 0.34, a vllm-ascend tree, src, the package)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import kvspec_traits_ascend as ascend
import torch

from kvspec_traits.extend import Registry


def _facts(spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"class": type(spec).__name__}
    for name in ("page_size_bytes", "real_page_size_bytes", "storage_block_size"):
        try:
            out[name] = getattr(spec, name)
        except AttributeError as exc:
            out[name] = f"AttributeError: {exc}"
    return out


def _outcome(registry: Registry, build: Callable[[], Any]) -> dict[str, Any]:
    try:
        spec = build()
    except TypeError as exc:
        return {"built": False, "error": "TypeError", "message": str(exc)}
    out = {"built": True, **_facts(spec)}
    try:
        traits = registry.traits_of(spec)
    except Exception as exc:
        out.update(
            error=type(exc).__name__,
            message=str(exc),
            **{k: str(getattr(exc, k)) for k in ("field", "inherited_from") if hasattr(exc, k)},
        )
        return out
    out["traits"] = dict(
        is_mla=traits.is_mla,
        tp_layout=traits.tp_layout.value,
        token_scope=traits.token_scope.value,
        window_tokens=traits.window_tokens,
        states_per_block=traits.states_per_block,
        page_size_bytes=traits.page_size_bytes,
        unpadded_page_size_bytes=traits.unpadded_page_size_bytes,
        components=[[c.name, list(c.shape), c.dtype, c.nbytes] for c in traits.components],
    )
    return out


def _given(spec: Any) -> Callable[[], Any]:
    return lambda: spec


def main() -> None:
    with_adapters = Registry(entry_points=False)
    ascend.register(with_adapters)
    bare = Registry(entry_points=False)
    classes = ascend.spec_classes()
    mla = classes["AscendMLAAttentionSpec"]
    swa = classes["AscendSlidingWindowMLASpec"]
    indexer = classes.get("AscendSFAIndexerCacheSpec")
    kw: dict[str, Any] = {"block_size": 128, "num_kv_heads": 1, "dtype": torch.bfloat16}
    c8: dict[str, Any] = {"c8_k_cache_dtype": torch.int8, "c8_k_scale_cache_dtype": torch.float16}
    cases: dict[str, Callable[[], Any]] = {
        "mla_plain": lambda: mla(head_size=576, **kw),
        "dsa_li_c8": lambda: mla(
            head_size=704, sparse_head_dim=(512, 64, 128), cache_sparse_li_c8=True, **kw, **c8
        ),
        "dsa_replicated_indexer": lambda: mla(
            head_size=704, sparse_head_dim=(512, 64, 128), sfa_dcp_replicated_indexer_size=2, **kw
        ),
        "dsa_sfa_c8": lambda: mla(
            head_size=784, sparse_head_dim=(656, 0, 128), cache_sparse_sfa_c8=True, **kw, **c8
        ),
        "dsv4_indexer": lambda: mla(
            head_size=128, compress_ratio=4, model_version="deepseek_v4", scale_dim=1, **kw
        ),
        "swa_compress_4": lambda: swa(
            block_size=128,
            num_kv_heads=1,
            head_size=512,
            dtype=torch.bfloat16,
            sliding_window=128,
            compress_ratio=4,
        ),
    }
    if indexer is not None:
        cases["indexer_li_c8"] = lambda: indexer(
            block_size=128, num_kv_heads=1, head_size=128, dtype=torch.int8,
            scale_dim=1, scale_dtype=torch.float16, cache_sparse_li_c8=True,
        )  # fmt: skip
        cases["indexer_replicated"] = lambda: indexer(
            block_size=128, num_kv_heads=1, head_size=128, dtype=torch.bfloat16,
            sfa_dcp_replicated_indexer_size=2,
        )  # fmt: skip
    result = {
        "classes": sorted(classes),
        "representatives": [
            _outcome(with_adapters, _given(s)) for s in ascend.representative_specs()
        ],
        "cases": {name: _outcome(with_adapters, build) for name, build in cases.items()},
        "without_adapter": _outcome(bare, lambda: mla(head_size=576, **kw)),
        # the defaults the device query decides (the release's C8 cache dtypes)
        "c8_defaults": [
            str(getattr(mla(head_size=576, **kw), name, None))
            for name in ("c8_k_cache_dtype", "c8_k_scale_cache_dtype")
        ],
    }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
