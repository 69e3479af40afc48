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


class PrefixAttention(nn.Module):
    """Multi-head attention from a draft slot's state to the committed prefix (a ReDrafter extension).

    Keys and values are computed once per committed position (`memory`); a zero "sink" slot that every query
    may attend to lets a query read nothing (and keeps rows with no visible position finite). The output
    projection starts at zero, so adding the module to a trained drafter leaves its logits unchanged at first.
    """

    def __init__(self, q_dim: int, k_dim: int, v_dim: int, width: int, heads: int, out_dim: int) -> None:
        super().__init__()
        if heads < 1 or width % heads:
            raise ValueError(f"context attention: width={width} must be a positive multiple of heads={heads}")
        self.heads = heads
        self.q = nn.Linear(q_dim, width)
        self.k = nn.Linear(k_dim, width)
        self.v = nn.Linear(v_dim, width)
        self.out = ZeroInitLinear(width, out_dim)

    def memory(self, k_in: Tensor, v_in: Tensor) -> tuple[Tensor, Tensor]:
        """k_in (..., M, Kd), v_in (..., M, Vd) -> keys, values (..., M, A), A = width."""
        return self.k(k_in), self.v(v_in)

    def forward(
        self,
        q_in: Tensor,
        keys: Tensor,
        values: Tensor,
        mask: Tensor | None = None,
        rows: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """q_in (..., n, Qd); keys/values (..., M, A); mask (..., n, M) bool (True = visible; None: all)
        -> (..., n, out_dim).

        With `rows` = (row (N,), rank (N,)) the queries come flat, q_in (1, N, Qd), and query i attends to
        row `row[i]` of keys/values (B, M, A) under mask[row[i], rank[i]] ((B, n, M)): training batches keep only
        a subset of each row's positions, so only the attention runs in the padded (B, n) layout.
        """
        q = self.q(q_in)  # (..., n, A)
        if rows is not None:
            assert mask is not None  # the padded layout comes with its mask
            pad = q.new_zeros(*mask.shape[:-1], q.shape[-1])  # (B, n, A)
            pad[rows] = q[0]
            q = pad
        sink = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])  # (..., 1, A)
        # (..., 1 + M, A) with the sink first
        keys, values = torch.cat([sink, keys], dim=-2), torch.cat([sink, values.to(keys)], dim=-2)
        if mask is not None:
            # (..., n, M) -> (..., 1, n, 1 + M): the sink always visible, one mask for all heads
            mask = torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)[..., None, :, :]

        def split(x: Tensor) -> Tensor:
            return x.unflatten(-1, (self.heads, -1)).transpose(-3, -2)  # (..., heads, len, A / heads)

        q, k, v = split(q.to(keys.dtype)), split(keys), split(values)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (..., heads, n, A / heads)
        out = out.transpose(-3, -2).flatten(-2)  # (..., n, A)
        if rows is not None:
            out = out[rows][None]  # (1, N, A)
        return self.out(out)  # (..., n, out_dim)
