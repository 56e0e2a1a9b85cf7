"""The enums of the traits: how a cache splits across TP ranks, which tokens a page keeps,
and how a group of layers answers a trait. Re-exported by :mod:`kvspec_traits._traits`."""

from __future__ import annotations

import enum

__all__ = ["GroupRule", "TPLayout", "TokenScope"]


class TPLayout(enum.Enum):
    """How one layer's cache is split across tensor-parallel ranks."""

    REPLICATED = "replicated"
    """Every TP rank holds the same bytes (MLA latent, replicated conv state).
    A connector reads such a region from one remote rank."""
    HEAD_SHARDED = "head_sharded"
    """Each rank holds a slice of the KV heads; ranks are combined by heads."""
    STATE_SHARDED = "state_sharded"
    """Each rank holds a slice of a recurrent state (Mamba/GDN channels)."""


class TokenScope(enum.Enum):
    """Which tokens a page keeps, which is what decides what a transfer must move."""

    FULL = "full"
    """Every token of the request, for its lifetime."""
    SLIDING_WINDOW = "sliding_window"
    """Only the last ``window_tokens`` tokens (blocks behind the window are freed)."""
    CHUNKED = "chunked"
    """Tokens of the current attention chunk of ``window_tokens`` tokens."""
    PROMPT_AND_WINDOW = "prompt_and_window"
    """The whole prompt plus the last ``window_tokens`` generated tokens (R-SWA)."""
    RING = "ring"
    """A fixed ring of ``window_tokens`` rows per request, rewritten in place."""
    RECURRENT_STATE = "recurrent_state"
    """A state that summarises all tokens so far; its size does not grow with tokens."""
    ENCODER = "encoder"
    """Encoder outputs of the request (cross-attention), written once."""
    SPARSE_HOT = "sparse_hot"
    """HiSparse: a fixed per-request working set of device blocks, rebuilt per request."""
    SPARSE_RESIDENT = "sparse_resident"
    """HiSparse: reclaimable device copies of pages whose source of truth is on the host."""
    NONE = "none"
    """Nothing is kept across steps (encoder-only attention)."""


class GroupRule(enum.Enum):
    """How a group of layers allocated as one page (``GroupTraits``) answers a trait,
    declared on the trait's annotation in :class:`LayoutTraits` (``Annotated[int,
    GroupRule.SUM]``); a trait without one is ``COMMON``."""

    COMMON = "common"
    """The members' common value; members that disagree raise ``MixedGroupTraitsError``."""
    SUM = "sum"
    """The members' values added up (a group page is their pages side by side); ``None``
    when every member's is ``None``."""
    ALL = "all"
    """True only if it is true of every member (as vLLM's group ``prefix_cacheable``)."""
    MEMBERS = "members"
    """Built by the group from its members (the components, with layer-prefixed names;
    ``grouped``, True for a group)."""
