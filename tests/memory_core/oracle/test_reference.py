"""The dense oracle's mask is the paper's token table, cell by cell."""

from __future__ import annotations

import torch

from memvit.memory_core.oracle.reference import attention_mask
from tests.conftest import random_adapter


def test_mask_is_the_token_table(engine) -> None:
    # 2 base tokens; adapters p (m=1), c extends p (m=2), q (m=0).
    adapters = [
        random_adapter("p", engine, m=1),
        random_adapter("c", engine, m=2, parent="p"),
        random_adapter("q", engine, m=0),
    ]
    mask = attention_mask(2, adapters)
    # positions: X0 X1 | Cp Cc Cq | Mp Mc Mc
    Y, N = True, False
    expected = torch.tensor(
        [
            # X0 X1 Cp Cc Cq Mp Mc Mc
            [Y, Y, N, N, N, N, N, N],  # X0: base tokens see base tokens only
            [Y, Y, N, N, N, N, N, N],  # X1
            [Y, Y, Y, N, N, Y, N, N],  # Cp: base, itself, its memory
            [Y, Y, Y, Y, N, Y, Y, Y],  # Cc: also its parent's class token and memory (extension)
            [Y, Y, N, N, Y, N, N, N],  # Cq: no memory at all
            [N, N, N, N, N, Y, N, N],  # memory rows are never used as queries: self only, output dropped
            [N, N, N, N, N, N, Y, N],
            [N, N, N, N, N, N, N, Y],
        ]
    )
    assert torch.equal(mask, expected)
