"""The audit on the installed vLLM's own connectors (0.32, 0.33 and 0.34 in the later passes).

The site counts were checked by hand: a line grep for ``isinstance``/``issubclass``/
``type(...) is``/``get_representative_spec_type(...)``/``case X()`` with a spec class name
finds 85 lines in 0.32 and 96 in 0.33, every one of them inside a site of the audit. The audit's
extra sites (7 in 0.32, 8 in 0.33) were each read in the source: checks split over several
lines (``isinstance(\\n spec,\\n MambaSpec)``) or wrapped in an unwrap call. One pair of
grep lines is one site (offloading/config.py: ``isinstance(s, FullAttentionSpec) and not
isinstance(s, MLAAttentionSpec)`` asks about one set of classes): 85 + 7 - 1 = 91 and
96 + 8 - 1 = 103. One more is a class compared by identity (nixl/base_worker.py:
``spec_type is CircularBufferSpec``, with ``spec_type`` read from the group's spec types
earlier): 92 and 104.

vLLM 0.34 (third pass): the grep finds 98 lines in 22 files. One is no check (nixl/utils.py:
``def get_representative_spec_type(spec: KVCacheSpec)``), and one pair is one site
(moriio_connector.py: ``isinstance(g.kv_cache_spec, SlidingWindowSpec) and not
isinstance(g.kv_cache_spec, SlidingWindowMLASpec)``): 96. The audit's 8 sites on no grep
line were read in the source: six checks split over lines, a ``not in (MambaSpec,
CircularBufferSpec)`` on the line after its call, and a dict keyed by classes
(mooncake/store/worker.py ``_STORE_SPEC_FAMILIES``): 104. Of the deliberate exact checks,
0.34's mooncake store no longer has one.

Of the three exact-check misses the audit reported before it read the code around a
check, two are deliberate: offloading/config.py's ``type(spec) is MLAAttentionSpec``
lines are followed by ``if isinstance(spec, (SlidingWindowMLASpec, MLAAttentionSpec)):
return False`` in the same function. The one miss left (canonical_mapping.py) is real:
its MLA branch is the only one that treats the latent as TP-replicated, and
SlidingWindowMLASpec, a latent too, goes to the head-sharded path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm

from kvspec_traits.audit import AuditResult, Universe, audit_paths, load_universe
from kvspec_traits.audit._universe import installed_vllm_dir

VERSION = ".".join(vllm.__version__.split(".")[:2])

# Sites under vllm/distributed/kv_transfer, per vLLM version.
SITES = {"0.32": 92, "0.33": 104, "0.34": 105}  # 0.34: moriio_connector.py:655, a local class set
FILES_WITH_SITES = {"0.32": 19, "0.33": 21, "0.34": 22}
_OFFLOAD = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/"
MISSES = {
    "0.32": {(_OFFLOAD + "canonical_mapping.py", 282, ("SlidingWindowMLASpec",))},
    "0.33": {(_OFFLOAD + "canonical_mapping.py", 282, ("SlidingWindowMLASpec",))},
    "0.34": {(_OFFLOAD + "canonical_mapping.py", 282, ("SlidingWindowMLASpec",))},
}
DELIBERATE = {
    "0.32": {
        (_OFFLOAD + "config.py", 203),
        (_OFFLOAD + "config.py", 235),
        ("vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py", 1552),
    },
    "0.33": {
        (_OFFLOAD + "config.py", 241),
        (_OFFLOAD + "config.py", 273),
        ("vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py", 1552),
    },
    "0.34": {(_OFFLOAD + "config.py", 223), (_OFFLOAD + "config.py", 255)},
}
# The one check negated inside an and-chain, per series: what it asks about together.
_MORIIO = "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
_OFFLOAD_CHAIN = (
    _OFFLOAD + "config.py",
    ("FullAttentionSpec",),
    ("MLAAttentionSpec",),
    ("FullAttentionSpec", "RSWASpec", "SinkFullAttentionSpec"),
)
NEGATED_IN_CHAIN = {
    "0.32": _OFFLOAD_CHAIN,
    "0.33": _OFFLOAD_CHAIN,
    # moriio_connector.py: `isinstance(g.kv_cache_spec, SlidingWindowSpec) and not
    # isinstance(g.kv_cache_spec, SlidingWindowMLASpec)`; 0.34's offloading config
    # no longer negates.
    "0.34": (_MORIIO, ("SlidingWindowSpec",), ("SlidingWindowMLASpec",), ("SlidingWindowSpec",)),
}
NIXL_WORKER = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"
FIXED_LINE = "isinstance(layer_spec, (MLAAttentionSpec, SlidingWindowMLASpec))"


@pytest.fixture(scope="module")
def universe(tmp_path_factory: pytest.TempPathFactory) -> Universe:
    # vLLM's classes alone: the pinned sets do not depend on the installed extensions
    # (tests/test_audit_extensions.py covers those).
    return load_universe(cache_dir=tmp_path_factory.mktemp("audit-cache"), extensions=False)


@pytest.fixture(scope="module")
def kv_transfer(universe: Universe) -> AuditResult:
    root = installed_vllm_dir()
    assert root is not None
    return audit_paths([root / "distributed" / "kv_transfer"], universe, display_root=root.parent)


def test_class_sets_come_from_the_vllm_under_test(universe: Universe) -> None:
    assert universe.vllm_version == vllm.__version__
    assert universe.vllm_path == str(Path(vllm.__file__).resolve().parent)


def test_site_count_under_kv_transfer_is_pinned(kv_transfer: AuditResult) -> None:
    assert kv_transfer.errors == ()
    assert len(kv_transfer.sites) == SITES[VERSION]
    assert len({s.path for s in kv_transfer.sites}) == FILES_WITH_SITES[VERSION]


def test_misses_under_kv_transfer_are_pinned(kv_transfer: AuditResult) -> None:
    found = {(s.path, s.raw.line, s.missing) for s in kv_transfer.misses}
    assert found == MISSES[VERSION]


def test_deliberate_exact_checks_are_not_misses(kv_transfer: AuditResult) -> None:
    found = {(s.path, s.raw.line) for s in kv_transfer.sites if s.verdict == "deliberate"}
    assert found == DELIBERATE[VERSION]


def test_a_negated_class_in_an_and_chain_is_no_miss(kv_transfer: AuditResult) -> None:
    # `isinstance(s, FullAttentionSpec) and not isinstance(s, MLAAttentionSpec)`: read
    # alone, the second check would miss SlidingWindowMLASpec; together they ask about
    # {FullAttentionSpec, RSWASpec, SinkFullAttentionSpec}, which no trait value is.
    (site,) = [s for s in kv_transfer.sites if s.raw.excluded]
    path, classes, excluded, branch = NEGATED_IN_CHAIN[VERSION]
    assert site.path == path
    assert (site.raw.classes, site.raw.excluded, site.branch_classes, site.missing) == (
        classes,
        excluded,
        branch,
        (),
    )


def test_fixed_nixl_mla_line_is_not_a_miss(kv_transfer: AuditResult) -> None:
    (site,) = [s for s in kv_transfer.sites if s.path == NIXL_WORKER and s.raw.text == FIXED_LINE]
    assert site.raw.function == "NixlBaseConnectorWorker.register_kv_caches"
    assert site.answer is not None
    assert (site.answer.trait, site.answer.match) == ("is_mla", "exact")
    assert site.missing == ()


def test_offloading_group_bytes_wrapper_check_is_reported(kv_transfer: AuditResult) -> None:
    (site,) = [s for s in kv_transfer.sites if s.wrapper_not_unwrapped]
    assert (site.path, site.raw.function, site.raw.text) == (
        _OFFLOAD + "config.py",
        "_group_kv_bytes_per_block",
        "isinstance(spec, UniformTypeKVCacheSpecs)",
    )


def test_the_audit_package_names_no_spec_class_and_imports_no_vllm() -> None:
    # The audit works on class names and the catalog's answers; it must not branch on vLLM
    # spec classes itself, nor import vLLM outside the class-set build (which goes
    # through kvspec_traits.catalog).
    import ast

    from kvspec_traits.catalog import spec_classes

    names = {cls.__qualname__ for cls in spec_classes()}
    package = Path(__file__).parents[1] / "src" / "kvspec_traits" / "audit"
    offenders = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                if name in names:
                    offenders.append(f"{path.name}:{node.lineno} {name}")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                modules = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                offenders += [
                    f"{path.name}:{node.lineno} import {m}"
                    for m in modules
                    if m.split(".")[0] == "vllm"
                ]
    assert offenders == []
