"""Write the audit's shipped class sets of the vLLM this interpreter imports, to
src/kvspec_traits/audit/class_sets/vllm-<series>.json: vLLM's classes alone, without
this machine's paths. `kvspec-traits audit --vllm SERIES` (and a scanned vLLM tree of a
series that is not installed) judges with them.

`make audit-class-sets` runs it once per supported series (the 0.33 and 0.34 modules
first on PYTHONPATH); tests/test_audit_series.py fails when a file differs from what
the series under test gives.
"""

from __future__ import annotations

import json
import sys

from kvspec_traits._deps import vllm_series
from kvspec_traits.audit._series import shippable, shipped_file
from kvspec_traits.audit._universe import build_universe


def main() -> int:
    universe = build_universe(extensions=False)
    path = shipped_file(vllm_series(universe.vllm_version))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(shippable(universe), indent=1, sort_keys=True) + "\n")
    print(f"{path}: {len(universe.classes)} classes of vLLM {universe.vllm_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
