"""Small building blocks shared by drafter families."""

from __future__ import annotations

import torch
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


def check_target_layers(layers: list[int], n_layers: int, distinct: bool = False) -> None:
    """Refuse `drafter.target_layers` (HF `hidden_states` indices, 0 = embeddings) outside [0, n_layers], and
    repeated indices when `distinct` (ReDrafter concatenates each once; EAGLE-3 accepts repeats)."""
    if any(not 0 <= i <= n_layers for i in layers) or (distinct and len(set(layers)) != len(layers)):
        what = "indices must be distinct and in" if distinct else "every index must be in"
        raise ValueError(f"drafter.target_layers={layers}: {what} [0, {n_layers}] (0 = embeddings)")


def draft_vocab_ids(draft_vocab_size: int | None, vocab_size: int, token_counts: Tensor | None) -> Tensor:
    """The target ids of a reduced draft vocabulary (ReDrafter, EAGLE-3): the most frequent training labels.

    Args:
        draft_vocab_size: Vd (`drafter.draft_vocab_size`; None or 0: the full vocabulary).
        vocab_size: V of the target.
        token_counts: (V,) training-label frequencies; required when Vd < V.

    Returns:
        (Vd,) long, ascending (arange(V) for the full vocabulary).
    """
    vd = int(draft_vocab_size or vocab_size)
    if not 0 < vd <= vocab_size:
        raise ValueError(f"drafter.draft_vocab_size={vd} must be in [1, vocab_size={vocab_size}]")
    if vd == vocab_size:
        return torch.arange(vocab_size)
    if token_counts is None:
        raise ValueError(
            f"drafter.draft_vocab_size={vd} < vocab_size={vocab_size} needs training token counts"
        )
    return token_counts.topk(vd).indices.sort().values


def scatter_to_vocab(logits: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    """Draft-vocabulary logits (..., Vd) -> (..., V) for metrics in target ids: tokens outside the draft
    vocabulary are never drafted, so they get the row minimum - 20 (never a top-k hit, finite CE)."""
    full = (logits.min(-1, keepdim=True).values - 20.0).expand(*logits.shape[:-1], vocab_size).clone()
    full[..., ids.to(logits.device)] = logits
    return full
