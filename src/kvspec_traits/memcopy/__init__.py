"""The smallest transfer backend: KV blocks copied between two plans in one process.

It exists to prove the split of the transfer half (``docs/architecture.md``, "Add a
transfer backend"): everything it knows about a layout comes from
:mod:`kvspec_traits.transfer` (the plan, the fingerprint handshake, the peer checks, the
TP reads), and it never imports :mod:`kvspec_traits.nixl`, NIXL, numpy or vLLM
(``tests/test_import_graph.py`` and ``tests/test_memcopy.py`` check it). Host memory
only; the copies are ``ctypes.memmove`` calls, one per block piece.

    consumer = MemcopyBackend(plan_regions(caches_d, config_d))
    consumer.connect([plan_regions(caches_p, config_p)])   # one plan per producer TP rank
    moved = consumer.read_blocks(block_ids)                 # one id list per cache group
"""

from kvspec_traits.memcopy._backend import (
    HOST_MEMORY,
    BlockIdLists,
    MemcopyBackend,
    NotConnectedError,
)

__all__ = ["HOST_MEMORY", "BlockIdLists", "MemcopyBackend", "NotConnectedError"]
