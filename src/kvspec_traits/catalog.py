"""Representative real vLLM spec instances, one or more per spec class.

Each entry builds the spec the way a vLLM model's ``get_kv_cache_spec`` builds it (the
model families come from :mod:`kvspec_traits._families`, which the NIXL and connector tests
build their layouts from too; the arguments follow the model code named in ``source``;
sizes are those of the named model at TP 1). The report, the audit's class sets and the
tests all draw from here.
Importing this module imports vLLM.

Installed extensions (packages in the ``kvspec_traits.adapters`` entry-point group) add
their spec classes (:func:`extension_spec_classes`) and, optionally, representatives of
them (:func:`extension_specs`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Final, Literal

from kvspec_traits._deps import needs
from kvspec_traits._errors import AdapterPluginError, KVSpecTraitsError
from kvspec_traits._registry import ENTRY_POINT_GROUP, Registry

with needs("kvspec_traits.catalog (real specs of every vLLM KV cache spec class)"):
    import torch
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

from kvspec_traits import _families as families

__all__ = [
    "EXAMPLE_CONFIGS",
    "REPRESENTATIVES_HOOK",
    "CatalogEntry",
    "ExampleConfig",
    "UnknownExampleConfigError",
    "example_config",
    "example_config_name",
    "extension_spec_classes",
    "extension_specs",
    "refused_specs",
    "representative_specs",
    "spec_classes",
]

REPRESENTATIVES_HOOK: Final = "representative_specs"
"""The optional function an extension's entry-point module defines: called without
arguments, it returns real instances of the extension's spec classes (see
:func:`extension_specs`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CatalogEntry:
    """A labelled real spec: ``model`` is the model family, ``source`` the vLLM code that
    builds it."""

    label: str
    model: str
    source: str
    spec: KVCacheSpec


def spec_classes(*, vllm_only: bool = True) -> list[type[KVCacheSpec]]:
    """Every ``KVCacheSpec`` subclass defined by the installed vLLM (``KVCacheSpec`` itself
    included), in definition order of ``vllm.v1.kv_cache_interface`` first; with
    ``vllm_only=False`` also the subclasses other packages imported so far define."""
    # Walk the subclass tree from the base: every spec class, no class test needed.
    root: type[KVCacheSpec] = KVCacheSpec
    seen: list[type[KVCacheSpec]] = [root]
    stack = [root]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    found = [c for c in seen if not vllm_only or c.__module__.split(".")[0] == "vllm"]
    return sorted(found, key=lambda c: (c.__module__ != kvi.__name__, _line(c), c.__qualname__))


def _line(cls: type[Any]) -> int:
    try:
        return inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return 1 << 30


_Entry = tuple[str, str, str, Callable[[], KVCacheSpec]]
"""A representative: its label, its model family, the vLLM file that builds such a spec
(below ``vllm/``), and how to build it."""
_ATTENTION: Final = "model_executor/layers/attention/attention.py"
_BF16, _F16 = torch.bfloat16, torch.float16


def _paged_entries() -> list[_Entry]:
    # Plain paged attention: grouped-query heads, fp8, the bare base class.
    attention, bf16 = _ATTENTION, _BF16
    return [
        ("Llama-3 8B GQA", "llama", attention, families.llama_gqa),
        (
            "Llama-3 8B GQA, fp8 KV",
            "llama",
            attention,
            lambda: families.llama_gqa(cache_dtype="fp8"),
        ),
        (
            "bare AttentionSpec",
            "generic",
            "v1/kv_cache_interface.py",
            lambda: kvi.AttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=bf16),
        ),
    ]


def _latent_entries() -> list[_Entry]:
    # The DeepSeek latent caches: MLA, its indexers, V4's compressed and windowed pages.
    mla = "model_executor/layers/attention/mla_attention.py"
    dsv4 = "models/deepseek_v4/attention.py"
    return [
        ("DeepSeek-V3 MLA bf16", "deepseek_v3", mla, families.deepseek_v3_mla),
        (
            "DeepSeek-V3 MLA fp8_ds_mla",
            "deepseek_v3",
            mla,
            lambda: families.deepseek_v3_mla(cache_dtype="fp8_ds_mla"),
        ),
        (
            "DeepSeek-V3.2 indexer",
            "deepseek_v32",
            "model_executor/models/deepseek_v2.py",
            families.deepseek_v32_indexer,
        ),
        (
            "DeepSeek-V4 compressed MLA (ratio 4)",
            "deepseek_v4",
            dsv4,
            lambda: families.deepseek_v4().mla,
        ),
        (
            "DeepSeek-V4 indexer (ratio 4)",
            "deepseek_v4",
            dsv4,
            lambda: families.deepseek_v4().indexer,
        ),
        (
            "DeepSeek-V4 SWA-MLA compressor state",
            "deepseek_v4",
            "models/deepseek_v4/compressor.py",
            lambda: families.deepseek_v4().compressor_state,
        ),
        (
            "DeepSeek-V4 sparse SWA cache",
            "deepseek_v4",
            "v1/attention/backends/mla/sparse_swa.py",
            lambda: families.deepseek_v4().swa,
        ),
        (
            "DeepSeek-V4.1 compressor ring",
            "deepseek_v41",
            "models/deepseek_v41/compressor.py",
            lambda: families.deepseek_v4().ring,
        ),
    ]


def _other_attention_entries() -> list[_Entry]:
    # Windows, chunks, sinks, hidden states, cross-attention and encoder-only pages.
    attention = _ATTENTION
    bf16, f16 = _BF16, _F16
    return [
        ("gpt-oss sliding window", "gpt_oss", attention, lambda: families.gpt_oss()[1]),
        (
            "Llama-4 chunked local",
            "llama4",
            "model_executor/layers/attention/chunked_local_attention.py",
            lambda: families.llama4()[0],
        ),
        (
            "R-SWA (reference sliding window)",
            "rswa",
            "model_executor/layers/attention/rswa_attention.py",
            lambda: kvi.RSWASpec(
                block_size=16, num_kv_heads=8, head_size=128, dtype=bf16, rswa_window=1024
            ),
        ),
        (
            "static sink attention",
            "sink",
            "model_executor/layers/attention/static_sink_attention.py",
            lambda: kvi.SinkFullAttentionSpec(
                block_size=16, num_kv_heads=8, head_size=128, dtype=bf16, sink_len=4
            ),
        ),
        (
            "extract_hidden_states",
            "hidden_states",
            "model_executor/models/extract_hidden_states.py",
            lambda: kvi.HiddenStateCacheSpec(
                block_size=16, num_kv_heads=3, head_size=4096, dtype=bf16
            ),
        ),
        (
            "Whisper cross-attention",
            "whisper",
            "model_executor/layers/attention/cross_attention.py",
            lambda: kvi.CrossAttentionSpec(block_size=16, num_kv_heads=20, head_size=64, dtype=f16),
        ),
        (
            "BERT encoder-only",
            "bert",
            "v1/worker/gpu/model_states/encoder_only.py",
            lambda: kvi.EncoderOnlyAttentionSpec(
                block_size=16, num_kv_heads=12, head_size=64, dtype=f16
            ),
        ),
    ]


def _state_entries() -> list[_Entry]:
    # Recurrent states and HiSparse's pages: no per-token attention cache.
    mamba = "model_executor/layers/mamba/abstract.py"
    bf16 = _BF16
    return [
        # conv state (3, 8192) bf16; SSM state (32 heads, 128, 128) fp32
        ("Qwen3.5 GDN state", "qwen3_5", mamba, families.gdn_state),
        ("Jamba Mamba-1 state", "jamba", mamba, families.mamba1_state),
        (
            "replicated PLE conv state",
            "qwen4_exp",
            "models/qwen4_exp/nvidia/model.py",
            lambda: kvi.MambaSpec(
                block_size=1024, shapes=((3, 2048),), dtypes=(bf16,), tp_replicated=True
            ),
        ),
        (
            "HiSparse hot cache",
            "deepseek_v32",
            "v1/hisparse/layout.py",
            # page of a DeepSeek fp8_ds_mla layer: 64 tokens * 656 B
            lambda: kvi.HiSparseHotSpec(block_size=64, page_size=64 * 656, blocks_per_request=32),
        ),
        (
            "HiSparse resident pages",
            "deepseek_v32",
            "v1/hisparse/layout.py",
            lambda: kvi.HiSparseResidentSpec(block_size=64, page_size=64 * 656),
        ),
    ]


def _group() -> KVCacheSpec:
    layers: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.attn": families.deepseek_v3_mla(cache_dtype=None) for i in range(2)
    }
    return kvi.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=layers)


def _entries() -> list[_Entry]:
    return [
        *_paged_entries(),
        *_latent_entries(),
        *_other_attention_entries(),
        *_state_entries(),
        ("group of DeepSeek-V3 MLA layers", "deepseek_v3", "v1/kv_cache_interface.py", _group),
    ]


def representative_specs() -> list[CatalogEntry]:
    """Real spec instances covering every concrete spec class of the installed vLLM."""
    return [
        CatalogEntry(label=label, model=model, source=f"vllm/{source}", spec=build())
        for label, model, source, build in _entries()
    ]


def refused_specs() -> list[CatalogEntry]:
    """Specs that must resolve to :class:`~kvspec_traits.UnsupportedSpecError`: the abstract
    base, which has no layout fields."""
    return [
        CatalogEntry(
            label="abstract KVCacheSpec",
            model="-",
            source="vllm/v1/kv_cache_interface.py",
            spec=KVCacheSpec(block_size=16),
        )
    ]


def extension_spec_classes(registry: Registry | None = None) -> list[type[KVCacheSpec]]:
    """The spec classes installed extensions register adapters for, sorted by module and
    name: those ``registry`` (default: a new ``Registry()``, built-ins and the
    ``kvspec_traits.adapters`` entry points loaded) has an adapter for and the built-ins
    have not. Loads the entry points: :class:`~kvspec_traits.AdapterPluginError` when one
    fails."""
    loaded = (Registry(name="extensions") if registry is None else registry).adapters()
    builtin = Registry(entry_points=False, name="built-ins").adapters()
    found: list[type[KVCacheSpec]] = [c for c in loaded if c not in builtin]
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


def extension_specs() -> list[CatalogEntry]:
    """Representative specs the installed extensions provide, in entry-point order.

    The module of a ``kvspec_traits.adapters`` entry point (``my_package`` for
    ``my_package:register``) may define ``representative_specs()``
    (:data:`REPRESENTATIVES_HOOK`), returning real instances of its spec classes; an
    extension without it provides none. Imports those modules:
    :class:`~kvspec_traits.AdapterPluginError` when one fails to import or its function
    raises.
    """
    out: list[CatalogEntry] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r}"
        try:
            module = importlib.import_module(ep.module)
        except Exception as exc:
            raise AdapterPluginError(ep.name, f"{where} failed to import: {exc!r}") from exc
        hook = getattr(module, REPRESENTATIVES_HOOK, None)
        if not callable(hook):
            continue
        dist = ep.dist.name if ep.dist is not None else ep.name
        try:
            specs = list(hook())
        except Exception as exc:
            raise AdapterPluginError(
                ep.name,
                f"{ep.module}.{REPRESENTATIVES_HOOK}() of {where} raised "
                f"{exc!r}; fix or uninstall that package",
            ) from exc
        out.extend(
            CatalogEntry(
                label=f"{dist} representative {i}",
                model=dist,
                source=f"{ep.module}.{REPRESENTATIVES_HOOK}",
                spec=spec,
            )
            for i, spec in enumerate(specs, 1)
        )
    return out


ExampleConfig = Literal["llama_gqa", "deepseek_v4", "jamba"]
"""The type of a name :func:`example_config` takes; a ``str`` from a command line becomes
one through :func:`example_config_name`."""
EXAMPLE_CONFIGS: Final[tuple[ExampleConfig, ...]] = ("llama_gqa", "deepseek_v4", "jamba")
"""The model families :func:`example_config` builds."""


class UnknownExampleConfigError(KVSpecTraitsError, ValueError):
    """A name that is none of :data:`EXAMPLE_CONFIGS`: ``.name`` is the name given."""

    def __init__(self, name: object) -> None:
        self.name = name
        super().__init__(
            f"example_config takes one of {', '.join(map(repr, EXAMPLE_CONFIGS))}, got {name!r}"
        )


def example_config_name(name: str) -> ExampleConfig:
    """``name`` as an :data:`ExampleConfig` (a model name read from a command line, typed
    ``str``, made acceptable to :func:`example_config` for mypy), or
    :class:`UnknownExampleConfigError` listing the names."""
    for known in EXAMPLE_CONFIGS:
        if name == known:
            return known
    raise UnknownExampleConfigError(name)


def _example_groups(
    name: ExampleConfig, layers: int, tp: int
) -> tuple[list[KVCacheGroupSpec], dict[str, KVCacheSpec]]:
    """The cache groups, and every layer's own spec."""
    specs: dict[str, KVCacheSpec] = {}

    def group(names: list[str], spec: KVCacheSpec) -> KVCacheGroupSpec:
        specs.update(dict.fromkeys(names, spec))
        return kvi.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)

    if name == "llama_gqa":
        # Llama-3 8B: one group of full-attention layers, 8 KV heads split by TP.
        attn = families.llama_gqa(tp=tp)
        return [group([f"model.layers.{i}.self_attn.attn" for i in range(layers)], attn)], specs
    if name == "deepseek_v4":
        # DeepSeek-V4 (fp8_ds_mla, compress ratio 4): per layer the compressed MLA cache
        # and the indexer cache (both full attention at one block size: vLLM groups them
        # as one UniformTypeKVCacheSpecs), the sparse SWA cache and V4.1's compressor ring.
        caches = families.deepseek_v4()
        paged: dict[str, KVCacheSpec] = {
            **{f"model.layers.{i}.attn.mla": caches.mla for i in range(layers)},
            **{f"model.layers.{i}.attn.indexer.k_cache": caches.indexer for i in range(layers)},
        }
        uniform = kvi.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=paged)
        groups = [
            group(list(paged), uniform),
            group([f"model.layers.{i}.attn.compressor.swa" for i in range(layers)], caches.swa),
            group([f"model.layers.{i}.attn.compressor.ring" for i in range(layers)], caches.ring),
        ]
        specs.update(paged)  # each member's own spec, not the group's
        return groups, specs
    # Jamba (small, as the project's tiny hybrid model): Mamba-1 state layers and one
    # attention layer in four. vLLM unifies a hybrid model's page size: it raises the
    # attention block size until a page holds the state, and pads the state page to it.
    f32 = (torch.float32, torch.float32)

    def state(block_size: int = 1024, page_size_padded: int | None = None) -> kvi.MambaSpec:
        return families.mamba1_state(
            d_inner=512,
            dtypes=f32,
            tp=tp,
            conv_layout="DS",
            block_size=block_size,
            page_size_padded=page_size_padded,
        )

    block = 16
    while (attn := families.llama_gqa(block_size=block, tp=tp)).page_size_bytes < (
        state().page_size_bytes
    ):
        block *= 2
    padded = state(block_size=block, page_size_padded=attn.page_size_bytes)
    return [
        group([f"model.layers.{i}.mamba" for i in range(layers) if i % 4 != 1], padded),
        group([f"model.layers.{i}.attn" for i in range(layers) if i % 4 == 1], attn),
    ], specs


def example_config(
    name: ExampleConfig, *, num_blocks: int = 64, layers: int = 4, tp: int = 1
) -> KVCacheConfig:
    """A realistic vLLM ``KVCacheConfig`` of a model family, built from the families'
    real specs (see :data:`EXAMPLE_CONFIGS`): ``"llama_gqa"`` (one full-attention group),
    ``"deepseek_v4"`` (a ``UniformTypeKVCacheSpecs`` group of the compressed MLA and
    indexer caches, then the sparse SWA cache and the compressor ring)
    or ``"jamba"`` (a hybrid: Mamba-1 state groups padded to the attention page).

    ``layers`` layers at TP size ``tp``, ``num_blocks`` blocks per layer. The layers of
    a group that share a spec get one ``KVCacheTensor``, layer-outermost (layer ``i`` at
    ``i * layer_stride``, block ``b`` at ``b * block_stride`` within it), without the
    hybrid allocator's sharing of memory between groups. For docs/connector-guide.md
    and tests; a server's own config comes from vLLM's ``get_kv_cache_configs``.
    Raises :class:`UnknownExampleConfigError` for another name.
    """
    groups, specs = _example_groups(example_config_name(name), layers, tp)
    tensors = []
    for g in groups:
        # One tensor per (group, spec): a group spec's members may differ in page size.
        by_spec: dict[KVCacheSpec, list[str]] = {}
        for layer in g.layer_names:
            by_spec.setdefault(specs[layer], []).append(layer)
        for spec, names in by_spec.items():
            page = spec.page_size_bytes
            tensors.append(
                kvi.KVCacheTensor(
                    size=page * num_blocks * len(names),
                    layers=names,
                    layer_stride=page * num_blocks,
                    block_stride=page,
                )
            )
    return kvi.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )
