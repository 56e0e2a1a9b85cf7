"""``kvspec_traits.blocks_to_transfer`` against vLLM's own NIXL scheduler, per
``TokenScope``, on the series under test (issue 40).

vLLM decides at every exchange which of a request's blocks each cache group sends
(``get_exchange_clipped_blocks`` in ``nixl/base_scheduler.py``): from spec classes, the
last ``cdiv(sliding_window, block_size) + 1`` blocks of a ``SlidingWindowSpec`` group,
the state slot before ``num_speculative_blocks`` scratch slots of a ``MambaSpec`` group,
every block otherwise, and nothing of a group its config leaves out of the transfer
(``enable_kv_transfer=False``). For every real spec of the catalog, upstream's
scheduler is built over a config holding it (beside a Llama full-attention group, as in
a hybrid model), as tests/test_connector_scheduler.py builds them, and asked for a
request's blocks; the public rule must give the same positions, and so must the traits
connector's scheduler, which reads the same rule (``scheduler_facts``).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

from kvspec_traits import TokenScope, TPLayout, blocks_to_transfer, traits_of
from kvspec_traits import _families as families
from kvspec_traits._transfer_rule import transfer_rule
from kvspec_traits.catalog import representative_specs
from kvspec_traits.extend import default_registry
from kvspec_traits.transfer._config import config_facts
from kvspec_traits.vllm_connector._scheduler import TraitsNixlConnectorScheduler
from tests.nixl_helpers.layouts import LLAMA
from tests.test_connector_differential import LBHNC, TINY, _vllm_config

MOVED = (
    TokenScope.FULL,
    TokenScope.SLIDING_WINDOW,
    TokenScope.CHUNKED,
    TokenScope.PROMPT_AND_WINDOW,
    TokenScope.RING,
    TokenScope.RECURRENT_STATE,
)
NOT_MOVED = tuple(s for s in TokenScope if s not in MOVED)
FULL_GROUP = ["model.layers.0.attn"]
LAYER = "model.layers.1.cache"


def _by_scope() -> dict[TokenScope, list[KVCacheSpec]]:
    """The catalog's real one-layer specs of this series, by scope."""
    found: dict[TokenScope, list[KVCacheSpec]] = {}
    for entry in representative_specs():
        traits = traits_of(entry.spec)
        if not traits.grouped:
            found.setdefault(traits.token_scope, []).append(entry.spec)
    return found


SPECS = _by_scope()


@pytest.fixture(scope="module")
def vllm_config(tiny_models: pathlib.Path) -> Any:
    return _vllm_config(tiny_models / LLAMA, LBHNC, None)


def _config(spec: KVCacheSpec, *, enable_kv_transfer: bool = True) -> KVCacheConfig:
    groups = [
        KVCacheGroupSpec(layer_names=FULL_GROUP, kv_cache_spec=families.llama_gqa(**TINY)),
        KVCacheGroupSpec(
            layer_names=[LAYER], kv_cache_spec=spec, enable_kv_transfer=enable_kv_transfer
        ),
    ]
    # The scheduler reads the groups only (no tensors are allocated on its side).
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _cases(scope: TokenScope) -> Iterator[tuple[KVCacheSpec, int]]:
    """Each real spec of ``scope`` with each scratch count it can hold (a state: 0, and
    2 speculative slots as MTP drafts allocate)."""
    for spec in SPECS[scope]:
        if scope is TokenScope.RECURRENT_STATE:
            state: Any = spec  # vLLM's state specs (MambaSpec) hold num_speculative_blocks
            for scratch in (0, 2):
                yield dataclasses.replace(state, num_speculative_blocks=scratch), scratch
        else:
            yield spec, 0


def test_every_token_scope_has_a_real_spec_on_this_series() -> None:
    assert set(SPECS) == set(TokenScope)


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 20])
@pytest.mark.parametrize("scope", MOVED, ids=lambda s: s.name)
def test_the_rule_is_vllms_scheduler_answer(
    scope: TokenScope, num_blocks: int, vllm_config: Any
) -> None:
    """20 blocks: more than any window of the catalog holds at its block size except
    the 8192-token chunk (cdiv(128, 64) + 1 = 3, cdiv(128, 16) + 1 = 9, cdiv(8, 4) + 1 =
    3); 1-3 blocks: fewer than a window, and a state before its scratch slots exist."""
    for spec, scratch in _cases(scope):
        config = _config(spec)
        upstream = NixlPullConnectorScheduler(vllm_config, "upstream", config)
        request = ([1, 2, 3], list(range(100, 100 + num_blocks)))
        sent = upstream.get_exchange_clipped_blocks(request)
        traits = traits_of(spec)
        rule = blocks_to_transfer(traits, num_blocks, num_speculative_blocks=scratch)
        assert sent[1] == [request[1][i] for i in rule], (type(spec).__qualname__, scratch)
        assert sent[0] == request[0]
        if traits.token_scope is TokenScope.RECURRENT_STATE and (
            traits.tp_layout is TPLayout.REPLICATED
        ):
            continue  # the connector moves a replicated state only beside a ring (vllm.md)
        ours = TraitsNixlConnectorScheduler(vllm_config, "traits", config)
        assert ours.get_exchange_clipped_blocks(request) == sent


def test_hand_computed_positions_of_vllms_own_specs() -> None:
    """The formulas by hand, on the catalog's specs: DeepSeek-V4's sparse SWA cache keeps
    a 128-token window over 64-token blocks, cdiv(128, 64) + 1 = 3 blocks; a Mamba state
    with 2 scratch slots keeps position 20 - 2 - 1 = 17."""
    swa = next(s for s in SPECS[TokenScope.SLIDING_WINDOW] if traits_of(s).block_size == 64)
    assert (traits_of(swa).window_tokens, blocks_to_transfer(traits_of(swa), 20)) == (
        128,
        range(17, 20),
    )
    state = traits_of(SPECS[TokenScope.RECURRENT_STATE][0])
    assert blocks_to_transfer(state, 20, num_speculative_blocks=2) == range(17, 18)


@pytest.mark.parametrize("scope", NOT_MOVED, ids=lambda s: s.name)
def test_a_scope_that_does_not_move_sends_no_block(scope: TokenScope, vllm_config: Any) -> None:
    """vLLM's scheduler does not read these specs: it leaves a group out when its config
    says ``enable_kv_transfer=False``, as vLLM builds HiSparse's hot and resident groups
    (``vllm/v1/hisparse/layout.py``), and otherwise lists every block, as the rule's
    numbers say (no window, no state). The layers of such a group are then left out of
    the registered regions (``transferable`` False): no block of theirs moves."""
    for spec, _ in _cases(scope):
        traits = traits_of(spec)
        assert blocks_to_transfer(traits, 20) == range(0)
        rule = transfer_rule(traits)
        assert (rule.window_blocks, rule.state_scratch_blocks) == (0, None)
        for enabled in (True, False):
            config = _config(spec, enable_kv_transfer=enabled)
            upstream = NixlPullConnectorScheduler(vllm_config, "upstream", config)
            request = ([1, 2, 3], list(range(100, 120)))
            listed = upstream.get_exchange_clipped_blocks(request)
            assert listed == ((request[0], request[1]) if enabled else (request[0],))
            _, _, _, _, skipped = config_facts({}, config, None, None, None, default_registry)
            assert LAYER in skipped and FULL_GROUP[0] not in skipped
