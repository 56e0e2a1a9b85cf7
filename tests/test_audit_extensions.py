"""``kvspec-traits audit`` and installed extensions (the ``kvspec_traits.adapters`` entry
points): their spec classes join the class tree, answered from the representatives the
extension provides (``representative_specs()`` next to its entry point) or listed under
``no_representative``; installing one changes the class-set cache key.

The in-repo example extension (examples/kvspec_traits_example) is installed in the test
environment; a second one, without representatives, is installed as a dist-info on
``sys.path`` of a subprocess, so its class never joins this process's class tree.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvspec_traits.audit import main
from tests import fresh

EXAMPLE = "kvspec-traits-example 0.1.0"

CONNECTOR = """\
from kvspec_traits_example import ScaledLatentSpec
from vllm.v1.kv_cache_interface import MLAAttentionSpec


def latent(spec):
    return isinstance(spec, ScaledLatentSpec)


def exact(spec):
    return type(spec) is MLAAttentionSpec
"""


def _audit(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    status = main(["--json", *argv])
    out, err = capsys.readouterr()
    assert (status, err) == (0, "")
    doc: dict[str, Any] = json.loads(out)
    return doc


def test_an_installed_extensions_classes_are_sites_with_their_representatives_answers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVSPEC_TRAITS_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "connector.py").write_text(CONNECTOR)
    doc = _audit(capsys, str(tmp_path / "connector.py"))
    assert EXAMPLE in doc["extensions"]
    by_check = {s["check"]: s for s in doc["sites"]}
    latent = by_check["isinstance(spec, ScaledLatentSpec)"]
    exact = by_check["type(spec) is MLAAttentionSpec"]
    # ScaledLatentSpec is a spec class of this audit: a site, answered from the example's
    # representative_specs() (a ScaledLatentSpec resolves through the example's adapter).
    assert (latent["branch_classes"], latent["no_representative"]) == (["ScaledLatentSpec"], [])
    assert latent["verdict"] == "ok"
    # It derives from MLAAttentionSpec and its adapter says is_mla = True (attention_traits
    # of an MLA spec), so an exact check on MLAAttentionSpec skips and misses it, with the
    # other MLA classes of vLLM 0.32: HiddenStateCacheSpec (a subclass), and
    # SlidingWindowMLASpec (same page kind, is_mla = True).
    assert exact["skipped_subclasses"] == ["HiddenStateCacheSpec", "ScaledLatentSpec"]
    assert exact["missing"] == ["HiddenStateCacheSpec", "ScaledLatentSpec", "SlidingWindowMLASpec"]
    assert exact["answer"]["value_classes"] == [
        "HiddenStateCacheSpec",
        "MLAAttentionSpec",
        "ScaledLatentSpec",
        "SlidingWindowMLASpec",
    ]

    # --no-extensions: vLLM's classes alone; the example's class is no spec class then.
    alone = _audit(capsys, "--no-extensions", str(tmp_path / "connector.py"))
    assert alone["extensions"] == []
    assert [s["check"] for s in alone["sites"]] == ["type(spec) is MLAAttentionSpec"]
    assert alone["sites"][0]["missing"] == ["HiddenStateCacheSpec", "SlidingWindowMLASpec"]
    # Two class-set builds, two cache files: the extension set is part of the key.
    assert len(list((tmp_path / "cache").glob("audit-classes-*.json"))) == 2


PLUGIN = """\
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvspec_traits.extend import (
    ATTENTION_IGNORES,
    ATTENTION_READS,
    LayoutTraits,
    Registry,
    attention_traits,
)


@dataclass(frozen=True, kw_only=True)
class PaddedFullSpec(FullAttentionSpec):
    pad: int = 64

    @property
    def page_size_bytes(self) -> int:
        return super().page_size_bytes + self.pad


def adapt(spec: PaddedFullSpec) -> LayoutTraits:
    traits = attention_traits(spec)
    return attention_traits(spec, page_size_bytes=traits.page_size_bytes + spec.pad)


def register(registry: Registry) -> None:
    registry.register(PaddedFullSpec, adapt, reads=(*ATTENTION_READS, "pad"),
                      ignores=ATTENTION_IGNORES)
"""

PLUGIN_USER = """\
from padded_ext import PaddedFullSpec


def padded(spec):
    if isinstance(spec, PaddedFullSpec):
        return spec.pad
    return 0
"""


def _install(site: Path, package: str, source: str) -> None:
    """A package on ``site`` with an entry point in the adapters group, as pip leaves it."""
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(source)
    info = site / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[kvspec_traits.adapters]\n{package} = {package}:register\n"
    )


def test_an_extension_without_representatives_is_listed_and_changes_the_cache_key(
    tmp_path: Path,
) -> None:
    from kvspec_traits.audit import load_universe

    cache = tmp_path / "cache"
    here = load_universe(cache_dir=cache)  # the extensions of this process
    assert "padded_ext 0.1" not in here.extensions
    (before,) = cache.glob("audit-classes-*.json")

    site = tmp_path / "site"
    _install(site, "padded_ext", PLUGIN)
    (tmp_path / "user.py").write_text(PLUGIN_USER)
    code = (
        "import sys\n"
        "from kvspec_traits.audit import main\n"
        "sys.exit(main(['--json', '-o', 'report.json', 'user.py']))\n"
    )
    env = dict(
        os.environ,
        KVSPEC_TRAITS_CACHE_DIR=str(cache),
        PYTHONPATH=os.pathsep.join([str(site), *sys.path]),
    )
    done = fresh.run([sys.executable, "-c", code], timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads((tmp_path / "report.json").read_text())
    assert "padded_ext 0.1" in doc["extensions"]
    (found,) = doc["sites"]
    # A spec class of the audit, in its class tree, but with no instance to answer from:
    # reported, with the class under no_representative, and no trait claimed.
    assert (found["check"], found["no_representative"], found["answer"]) == (
        "isinstance(spec, PaddedFullSpec)",
        ["PaddedFullSpec"],
        None,
    )
    assert "PaddedFullSpec has no representative" in found["reason"]
    after = set(cache.glob("audit-classes-*.json")) - {before}
    assert len(after) == 1  # installing the extension changed the key: a new build
    built = json.loads(after.pop().read_text())
    assert built["classes"]["PaddedFullSpec"]["mro"][:2] == ["PaddedFullSpec", "FullAttentionSpec"]
    assert built["classes"]["PaddedFullSpec"]["representatives"] == 0


def test_an_extension_that_does_not_load_stops_the_audit_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Installed, but its module fails to import (so no class of it ever exists here).
    _install(tmp_path / "site", "broken_ext", "raise ImportError('no such backend')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVSPEC_TRAITS_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "user.py").write_text("X = 1\n")
    assert main([str(tmp_path / "user.py")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(
        "kvspec-traits audit: no class sets: an installed extension does "
        "not load (entry point 'broken_ext' = 'broken_ext:register'"
    )
    assert "no such backend" in err and "--no-extensions" in err
    # vLLM's classes alone still work.
    assert main(["--no-extensions", str(tmp_path / "user.py")]) == 0
