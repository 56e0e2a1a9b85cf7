"""`kvspec-traits report` checks installed extensions as it checks vLLM (issue 25).

On main an extension whose adapter drops bytes still got "OK" (its representatives were
never resolved), a class registered only by importing its module was invisible, and a
misspelt ``reads=`` name was accepted. Each case here is a package installed the way pip
leaves it (a dist-info with a ``kvspec_traits.adapters`` entry point) and a fresh
``kvspec-traits report`` process, as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import fresh

_WRONG = '''
from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from kvspec_traits.extend import (
    ATTENTION_IGNORES, ATTENTION_READS, LayoutTraits, Registry, attention_traits,
)


@dataclass(frozen=True, kw_only=True)
class DroppedScaleSpec(FullAttentionSpec):
    """4 scale bytes per (head, token) cell that the adapter below forgets."""

    @property
    def state_content_size_bytes(self) -> int:
        return super().state_content_size_bytes + 4


@dataclass(frozen=True, kw_only=True)
class NoAdapterSpec(KVCacheSpec):
    """A class of the extension that it never registers an adapter for."""


def adapt(spec: DroppedScaleSpec) -> LayoutTraits:
    return attention_traits(spec)  # vLLM's K/V cell: 4 bytes per cell short


def register(registry: Registry) -> None:
    registry.register(DroppedScaleSpec, adapt, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES)


def representative_specs() -> list[DroppedScaleSpec]:
    return [DroppedScaleSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)]
'''

_UNPUBLISHED = '''
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvspec_traits.extend import (
    ATTENTION_IGNORES, ATTENTION_READS, LayoutTraits, attention_traits, register_adapter,
)


@dataclass(frozen=True, kw_only=True)
class ForgottenSpec(FullAttentionSpec):
    """Registered by decorator, but its package has no entry point."""


@register_adapter(ForgottenSpec, reads=ATTENTION_READS, ignores=ATTENTION_IGNORES)
def adapt(spec: ForgottenSpec) -> LayoutTraits:
    return attention_traits(spec)
'''

_MISSPELT = """
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvspec_traits.extend import (
    ATTENTION_IGNORES, ATTENTION_READS, LayoutTraits, Registry, attention_traits,
)


@dataclass(frozen=True, kw_only=True)
class ScaledSpec(FullAttentionSpec):
    scale_bytes: int = 0


def adapt(spec: ScaledSpec) -> LayoutTraits:
    return attention_traits(spec)


def register(registry: Registry) -> None:
    registry.register(
        ScaledSpec, adapt, reads=(*ATTENTION_READS, "scael_bytes"), ignores=ATTENTION_IGNORES
    )
"""


def _install(site: Path, package: str, source: str, *, entry_point: bool = True) -> None:
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(source)
    if not entry_point:
        return
    info = site / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[kvspec_traits.adapters]\n{package} = {package}:register\n"
    )


def _report(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *sys.path])
    env["COLUMNS"] = "400"
    return fresh.run(
        [sys.executable, "-m", "kvspec_traits", "report", *args], env=env, timeout=600, cwd=site
    )


def test_a_wrong_a_missing_and_an_unpublished_adapter_fail_the_report(tmp_path: Path) -> None:
    """A wrong adapter (its representative contradicts vLLM's byte math), a class with
    no adapter, and a class registered only when its module is imported (no entry point)
    each make the report NOT OK (exit 1), naming the class and what is wrong. On main
    the report said OK and exit 0 for all three."""
    _install(tmp_path, "wrongext", _WRONG)
    _install(tmp_path, "unpublished", _UNPUBLISHED, entry_point=False)
    proc = _report(tmp_path, "--import", "unpublished")
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    assert out.rstrip().endswith("NOT OK")
    # vLLM's page: 16 tokens * 8 heads * (2 * 128 * 2 B + 4 B of scales) = 66048 B; the
    # adapter forgets the scales and says 16 * 8 * 512 = 65536 B.
    failed = [line for line in out.splitlines() if line.startswith("FAILED DroppedScaleSpec")]
    assert failed, out[-3000:]
    assert "TraitsMismatchError" in failed[0]
    assert "page_size_bytes=65536" in failed[0] and "66048" in failed[0]
    assert "wrongext.NoAdapterSpec (no adapter of its own)" in out
    assert "unpublished.ForgottenSpec (registered only when its module is imported" in out
    assert "'kvspec_traits.adapters' entry-point group" in out


def test_a_misspelt_field_name_fails_the_report_naming_class_and_name(tmp_path: Path) -> None:
    """``reads=(..., "scael_bytes")`` was accepted on main (the report said OK). Now
    the registration is refused with UnknownFieldNameError, so the extension does not
    load: the report says so in one sentence naming the class and the name (exit 2:
    nothing can be reported while an installed extension fails to load)."""
    _install(tmp_path, "misspelt", _MISSPELT)
    proc = _report(tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert "UnknownFieldNameError" in proc.stderr
    assert "misspelt.ScaledSpec names 'scael_bytes'" in proc.stderr
    assert "scale_bytes" in proc.stderr  # the real fields are listed
