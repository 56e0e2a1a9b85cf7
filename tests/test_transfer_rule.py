"""``kvspec_traits.blocks_to_transfer``: which positions of a group's block list a
transfer moves, per ``TokenScope``, by hand (issue 40). Series-independent: traits are
built directly, vLLM is never reached (tests/conftest.py SERIES_INDEPENDENT). The same
rule checked against vLLM's own NIXL scheduler, on each series: tests/test_transfer_rule_vllm.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kvspec_traits import (
    GroupTraits,
    InvalidBlockCountError,
    KVSpecTraitsError,
    TokenScope,
    TPLayout,
    blocks_to_transfer,
)
from kvspec_traits._transfer_rule import TransferRule, transfer_rule
from kvspec_traits.extend import LayoutTraits

if TYPE_CHECKING:
    from typing import assert_type

WINDOWED = {TokenScope.SLIDING_WINDOW, TokenScope.CHUNKED, TokenScope.PROMPT_AND_WINDOW}
NOT_MOVED = {TokenScope.ENCODER, TokenScope.NONE, TokenScope.SPARSE_HOT, TokenScope.SPARSE_RESIDENT}


def _traits(scope: TokenScope, *, block_size: int = 16, window: int | None = None) -> LayoutTraits:
    """One layer's traits of ``scope``: 2 heads of 64 bf16 K and V per token (the numbers
    do not matter to the rule; they only have to be consistent)."""
    state = scope is TokenScope.RECURRENT_STATE
    page = 2 * block_size * 2 * 64 * 2  # heads * tokens * (K + V) * head_size * 2 B
    return LayoutTraits(
        spec_name=f"{scope.name} spec",
        is_mla=False,
        tp_layout=TPLayout.STATE_SHARDED if state else TPLayout.HEAD_SHARDED,
        tp_shards=None,
        token_scope=scope,
        window_tokens=window if scope in WINDOWED or scope is TokenScope.RING else None,
        block_size=block_size,
        num_head_slots=2,
        kv_head_contiguous=True,
        tokens_per_state=None if state else 1,
        states_per_block=1 if state else block_size,
        state_bytes=page // (2 if state else 2 * block_size),
        unpadded_page_size_bytes=page,
        page_size_bytes=page,
        per_token_bytes=None if state else page // block_size,
        dtype="bfloat16",
        kv_quant_mode="NONE",
        prefix_cacheable=not state,
        uses_slot_mapping=True,
        transferable=scope not in NOT_MOVED,
        attention_page=not state,
        token_paged=scope not in (TokenScope.RECURRENT_STATE, TokenScope.RING),
        keeps_prompt=scope in (TokenScope.FULL, TokenScope.PROMPT_AND_WINDOW),
        holds_hidden_states=False,
        grouped=False,
    )


def test_every_token_scope_has_an_answer() -> None:
    """20 blocks of each scope; a window of 128 tokens over 16-token blocks, 2 scratch
    slots behind a state."""
    got = {
        scope: blocks_to_transfer(_traits(scope, window=128), 20, num_speculative_blocks=2)
        for scope in TokenScope
    }
    assert got == {
        TokenScope.FULL: range(20),
        # cdiv(128, 16) + 1 = 9 trailing blocks: positions 11..19
        TokenScope.SLIDING_WINDOW: range(11, 20),
        # vLLM's managers keep a chunk's, an R-SWA prompt's and a ring's blocks live
        TokenScope.CHUNKED: range(20),
        TokenScope.PROMPT_AND_WINDOW: range(20),
        TokenScope.RING: range(20),
        # the state slot before the 2 scratch slots: position 20 - 2 - 1 = 17
        TokenScope.RECURRENT_STATE: range(17, 18),
        TokenScope.ENCODER: range(0),
        TokenScope.SPARSE_HOT: range(0),
        TokenScope.SPARSE_RESIDENT: range(0),
        TokenScope.NONE: range(0),
    }


@pytest.mark.parametrize(
    ("window", "block_size", "num_blocks", "expected"),
    [
        (128, 64, 16, range(13, 16)),  # cdiv(128, 64) + 1 = 3: DeepSeek-V4's SWA cache
        (128, 32, 20, range(15, 20)),  # cdiv(128, 32) + 1 = 5: gpt-oss
        (100, 16, 20, range(12, 20)),  # cdiv(100, 16) + 1 = 7 + 1 = 8
        (128, 16, 5, range(5)),  # fewer blocks than the window's 9: all of them
        (128, 16, 0, range(0)),
    ],
)
def test_a_window_sends_its_trailing_blocks(
    window: int, block_size: int, num_blocks: int, expected: range
) -> None:
    traits = _traits(TokenScope.SLIDING_WINDOW, block_size=block_size, window=window)
    assert blocks_to_transfer(traits, num_blocks) == expected


@pytest.mark.parametrize(
    ("scratch", "num_blocks", "expected"),
    [
        (0, 1, range(0, 1)),  # the one state slot
        (0, 5, range(4, 5)),  # the last block: no scratch slots behind it
        (2, 5, range(2, 3)),  # 5 - 2 - 1 = 2
        (2, 2, range(0, 1)),  # scratch not all allocated yet: min(2, 2 - 1) = 1 -> slot 0
        (2, 1, range(0, 1)),  # only the state slot: min(2, 0) = 0
        (3, 0, range(0)),
    ],
)
def test_a_state_keeps_the_slot_before_its_scratch_slots(
    scratch: int, num_blocks: int, expected: range
) -> None:
    traits = _traits(TokenScope.RECURRENT_STATE)
    assert blocks_to_transfer(traits, num_blocks, num_speculative_blocks=scratch) == expected


def test_scratch_slots_change_nothing_but_a_state() -> None:
    full = _traits(TokenScope.FULL)
    assert blocks_to_transfer(full, 7, num_speculative_blocks=3) == range(7)


def test_a_group_answers_by_its_representative_and_moves_if_every_member_does() -> None:
    window = _traits(TokenScope.SLIDING_WINDOW, window=64)
    group = GroupTraits("UniformTypeKVCacheSpecs", {"a": window, "b": window})
    # cdiv(64, 16) + 1 = 5
    assert blocks_to_transfer(group, 12) == range(7, 12)
    assert transfer_rule(group) == TransferRule(
        window_blocks=5, state_scratch_blocks=None, transferable=True
    )


@pytest.mark.parametrize(
    ("num_blocks", "scratch", "argument", "value"),
    [
        (-1, 0, "num_blocks", -1),
        (True, 0, "num_blocks", True),  # a bool is no count, though an int to Python
        (4, -2, "num_speculative_blocks", -2),
    ],
)
def test_a_count_that_is_not_one_is_refused_by_name(
    num_blocks: int, scratch: int, argument: str, value: object
) -> None:
    traits = _traits(TokenScope.RECURRENT_STATE)
    with pytest.raises(InvalidBlockCountError, match=f"^{argument} must be a count") as raised:
        blocks_to_transfer(traits, num_blocks, num_speculative_blocks=scratch)
    assert (raised.value.argument, raised.value.value) == (argument, value)
    assert isinstance(raised.value, KVSpecTraitsError) and isinstance(raised.value, ValueError)


if TYPE_CHECKING:
    assert_type(blocks_to_transfer(_traits(TokenScope.FULL), 3), range)
    blocks_to_transfer(_traits(TokenScope.FULL), "3")  # type: ignore[arg-type]
