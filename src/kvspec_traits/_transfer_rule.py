"""Which blocks of a cache group a request moves: the one rule that connectors
(:func:`blocks_to_transfer`, docs/connector-guide.md) and the vLLM connector's
scheduler (``vllm_connector._facts.scheduler_facts``) both read.

Pure: imports neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvspec_traits._errors import InvalidBlockCountError
from kvspec_traits._group import representative_traits
from kvspec_traits._traits import KVLayoutTraits, TokenScope

__all__ = ["TransferRule", "blocks_to_transfer", "transfer_rule"]


def _count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidBlockCountError(name, value)
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferRule:
    """How a group's block list is clipped at a transfer, in the two numbers vLLM's NIXL
    scheduler keeps per group (``blocks_per_sw``, ``_ssm_spec_blocks``)."""

    window_blocks: int
    """The trailing blocks a windowed group sends (``cdiv(window_tokens, block_size) +
    1``: the window may start inside a block); 0 when no window clips the list."""
    state_scratch_blocks: int | None
    """For a recurrent state: the speculative scratch slots trailing the state slot;
    ``None`` for any other scope."""
    transferable: bool
    """Whether the layers move at all (:attr:`KVLayoutTraits.transferable`)."""

    def positions(self, num_blocks: int) -> range:
        """The positions, in a block list of ``num_blocks``, of the blocks that move."""
        n = _count("num_blocks", num_blocks)
        if not self.transferable or n == 0:
            return range(0)
        if self.window_blocks:
            return range(max(0, n - self.window_blocks), n)
        if self.state_scratch_blocks is not None:
            # At least the state slot, even before the scratch slots are allocated.
            scratch = min(self.state_scratch_blocks, n - 1)
            return range(n - scratch - 1, n - scratch)
        return range(n)


def transfer_rule(traits: KVLayoutTraits, *, num_speculative_blocks: int = 0) -> TransferRule:
    """The :class:`TransferRule` of a layer or a group (a group by its representative,
    the kind vLLM's managers keep it as; see :func:`blocks_to_transfer`)."""
    scratch = _count("num_speculative_blocks", num_speculative_blocks)
    kind = representative_traits(traits)
    window = kind.window_tokens if kind.token_scope is TokenScope.SLIDING_WINDOW else None
    return TransferRule(
        window_blocks=-(-window // kind.block_size) + 1 if window else 0,  # cdiv + 1
        state_scratch_blocks=scratch if kind.token_scope is TokenScope.RECURRENT_STATE else None,
        transferable=traits.transferable,
    )


def blocks_to_transfer(
    traits: KVLayoutTraits, num_blocks: int, *, num_speculative_blocks: int = 0
) -> range:
    """Positions in a request's block list for one cache group (``num_blocks`` long,
    as vLLM hands it to a connector) of the blocks a prefill/decode transfer moves:

    - ``SLIDING_WINDOW``: the last ``cdiv(window_tokens, block_size) + 1`` blocks (the
      window may start inside a block; vLLM's manager has freed the ones before);
    - ``RECURRENT_STATE``: one block, the state slot, which comes before the
      ``num_speculative_blocks`` scratch slots vLLM's Mamba manager allocates after it
      for speculative decoding (the spec's ``num_speculative_blocks``; 0 without);
    - ``FULL``, ``PROMPT_AND_WINDOW``, ``CHUNKED``, ``RING``: every block (an R-SWA
      prompt is kept whole, a chunk's blocks and a ring's are all live);
    - a layer that is not ``transferable`` (``ENCODER``, ``NONE``, ``SPARSE_*``): none.

    ``traits`` may be a group's (``traits_of(group.kv_cache_spec)``): its representative
    decides, as for vLLM's managers. This is the rule vLLM's NIXL scheduler applies at
    every exchange (``get_exchange_clipped_blocks``), from traits instead of spec
    classes; the vLLM connector's scheduler reads it too. With vLLM's hybrid KV cache
    manager disabled every layer keeps every block: move them all.

    Raises :class:`InvalidBlockCountError` for a negative count.
    """
    rule = transfer_rule(traits, num_speculative_blocks=num_speculative_blocks)
    return rule.positions(num_blocks)
