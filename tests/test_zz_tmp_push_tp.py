from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tests.test_connector_block_ratio import build, distributed, push, rank_worker  # noqa: F401


@pytest.mark.parametrize(
    ("name", "p_tp", "d_tp"),
    [("gqa", 1, 2), ("gqa", 2, 1), ("mla", 2, 1), ("hybrid_full_swa", 2, 1), ("mla", 1, 2)],
)
def test_push_tp(name: str, p_tp: int, d_tp: int, rank_worker: Callable[..., Any]) -> None:
    for rank, (got, want) in push(rank_worker, name, p_tp, d_tp, 32, 32).items():
        assert torch.equal(got, want), rank
