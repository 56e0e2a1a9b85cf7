"""A Mooncake peer in its own process, for the transfer tests: it builds TP ranks' KV
caches (seeded or zero), registers each with its own TraitsMooncakeEngine on 127.0.0.1,
serves each record on the backend's side channel, and answers commands.

    python peer.py            # commands on stdin, one JSON object a line

Commands (each answered by one JSON line on stdout):

- ``{"op": "build", "key", "family", "nb", "tp", "rank", "seed", "whole"}`` -> ``{"port"}`` (the
  side channel's port; ``seed`` null: zeros);
- ``{"op": "build_matrix", "key", "name", "tp", "rank", "block_ids"}`` -> ``{"port"}``: a
  producer rank of a ``tests/test_tp_matrix.py`` layout, filled with its share of that
  module's truth (vLLM's DS conv layout switched on, as there);
- ``{"op": "build_ratio", "key", "name", "tp", "rank", "block"}`` -> ``{"port"}``: a producer
  rank of a ``tests/test_block_ratio.py`` model at ``block`` tokens a block, the request
  written token by token;
- ``{"op": "dump", "key", "path"}``: the rank's whole backing allocation into ``path``;
- ``{"op": "modules"}`` -> ``{"nixl"}``: the NIXL modules this process has loaded;
- ``{"op": "close", "key"}``: unregister its memory and stop its side channel;
- ``{"op": "quit"}``.

Every wait is bounded: the process exits when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
# The repository root, so `tests.*` imports as it does under pytest.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    from kvspec_traits.mooncake import TraitsMooncakeEngine
    from kvspec_traits.transfer import plan_regions
    from tests.mooncake_helpers.ranks import rank_caches
    from tests.nixl_helpers import layouts

    held: dict[str, tuple[Any, dict[str, Any]]] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict[str, Any] = {"ok": True}
        try:
            if op == "build":
                tp, rank = cmd["tp"], cmd["rank"]
                config, caches = rank_caches(
                    cmd["family"], cmd["nb"], tp, rank, cmd["seed"], whole=cmd["whole"]
                )
                engine = TraitsMooncakeEngine("127.0.0.1")
                engine.register_plan(plan_regions(caches, config, tp_size=tp, tp_rank=rank))
                reply["port"] = engine.serve_record().port
                held[cmd["key"]] = (engine, caches)
            elif op == "build_matrix":
                os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
                from tests import test_tp_matrix as matrix

                tp, rank = cmd["tp"], cmd["rank"]
                built = matrix._rank(cmd["name"], tp, rank)
                truth = matrix._truth(cmd["name"])
                matrix._fill(cmd["name"], truth, built, tp, rank, cmd["block_ids"], only=False)
                engine = TraitsMooncakeEngine("127.0.0.1")
                engine.register_plan(built.plan)
                reply["port"] = engine.serve_record().port
                held[cmd["key"]] = (engine, built.caches)
            elif op == "build_ratio":
                from tests import test_block_ratio as ratio

                built = ratio.build_producer(cmd["name"], cmd["tp"], cmd["rank"], cmd["block"])
                engine = TraitsMooncakeEngine("127.0.0.1")
                engine.register_plan(built.plan)
                reply["port"] = engine.serve_record().port
                held[cmd["key"]] = (engine, built.caches)
            elif op == "dump":
                with open(cmd["path"], "wb") as out:
                    out.write(layouts.backing(held[cmd["key"]][1]).numpy().tobytes())
            elif op == "modules":
                reply["nixl"] = sorted(
                    m
                    for m in sys.modules
                    if m.split(".")[0] == "nixl" or m.startswith("kvspec_traits.nixl")
                )
            elif op == "close":
                held.pop(cmd["key"])[0].close()
        except Exception as exc:  # reported to the test, which fails on it
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
        if op == "quit":
            break
    for engine, _ in held.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
