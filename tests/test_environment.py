"""The environment the suite claims to test: which vLLM, and a light `import kvspec_traits`."""

from __future__ import annotations

import os
import subprocess
import sys

import vllm


def test_vllm_version_is_the_one_this_pass_claims() -> None:
    # scripts/test.sh runs the suite twice and says which vLLM each pass must see; a pass
    # that silently fell back to the installed 0.32 would test nothing new.
    expected = os.environ.get("KVSPEC_EXPECT_VLLM", "0.32")
    assert vllm.__version__.startswith(expected), (vllm.__version__, expected)


def test_import_does_not_import_vllm_or_torch() -> None:
    code = (
        "import sys, kvspec_traits\n"
        "from kvspec_traits import traits_of, TokenScope, TPLayout, KVLayoutTraits\n"
        "heavy = sorted(m for m in ('vllm', 'torch') if m in sys.modules)\n"
        "print(','.join(heavy) or 'none')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "none"


def test_vllm_is_imported_when_a_spec_is_first_resolved() -> None:
    code = (
        "import sys, kvspec_traits\n"
        "before = 'vllm' in sys.modules\n"
        "import torch\n"
        "from vllm.v1.kv_cache_interface import FullAttentionSpec\n"
        "spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,\n"
        "                         dtype=torch.float32)\n"
        "print(before, kvspec_traits.traits_of(spec).page_size_bytes)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    # 16 tokens * 1 head * (8 + 8) * 4 bytes = 1024
    assert out.stdout.split()[-2:] == ["False", "1024"]
