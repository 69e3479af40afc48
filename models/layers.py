"""Small building blocks shared by drafter families."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class ZeroInitLinear(nn.Linear):
    """A Linear that a drafter's `_init_weights` starts at zero (so a residual block starts as the identity)."""


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W, b zero-initialised: the identity at the start (Medusa / ReDrafter)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = ZeroInitLinear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., dim) -> (..., dim)."""
        return x + F.silu(self.linear(x))
