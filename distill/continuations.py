"""T-token greedy continuations `cont[t]` = the target's greedy next T tokens after the prefix x_0..x_t.

On greedy self-distilled sequences they are the sequence's own next tokens (`shift_continuations`, no
compute). For original responses `greedy_continuations` computes them for many positions at once: one
forward over the whole sequence gives `cont[t][0]` for every t, then each of T-1 rounds feeds one token per
position (n positions -> n query tokens) with a 4D mask, so every chain sees only its own prefix and its own
earlier continuation tokens:

    keys ->        x_0 .. x_{L-1} | round 1 (n) | round 2 (n) | ...
    query (t, j)   1 1 .. 1 0 0 0 | 0 .. 1 .. 0 | 0 .. 1 .. 0 |     1 on x_0..x_t and on chain t's tokens

Cost: T forwards per chunk of positions (never one forward per position per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdraft.models.hf_compat import cache_kwargs, returned_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE = -100


def shift_continuations(input_ids: Sequence[int], T: int) -> list[list[int]]:
    """cont[t] = x_{t+1..t+T} of a greedy self-generated sequence; slots past the end are -100. (L, T)."""
    ids = list(input_ids)
    L = len(ids)
    return [[ids[t + k] if t + k < L else IGNORE for k in range(1, T + 1)] for t in range(L)]


def positions_to_compute(loss_mask: Sequence[int]) -> list[int]:
    """Positions t whose next token x_{t+1} is an assistant token (the only ones training uses)."""
    return [t for t in range(len(loss_mask) - 1) if loss_mask[t + 1]]


def _chain_mask(pos: torch.Tensor, L: int, rounds: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask (1, 1, n, L + n*rounds) for round `rounds` (1-based) of the chains at `pos` (n,)."""
    n = pos.shape[0]
    cols = torch.arange(L, device=pos.device)
    base = cols[None, :] <= pos[:, None]  # (n, L) prefix x_0..x_t
    own = torch.eye(n, dtype=torch.bool, device=pos.device).repeat(1, rounds)  # (n, n*rounds) own chain
    allowed = torch.cat([base, own], dim=1)  # (n, L + n*rounds)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def greedy_continuations(
    model: PreTrainedModel,
    input_ids: Sequence[int],
    T: int,
    positions: Sequence[int] | None = None,
    chunk_size: int = 256,
) -> list[list[int]]:
    """Greedy T-token continuations after every prefix in `positions` of one sequence.

    Args:
        model: a HF causal LM (plain `DynamicCache`), eval mode; eager or sdpa attention.
        input_ids: the sequence x_0..x_{L-1}.
        T: continuation length.
        positions: prefixes to continue (default: all 0..L-1); other rows are -100.
        chunk_size: positions per batch of chains (bounds the (n, L + n*T) mask and the cache growth).

    Returns:
        (L, T) nested list: row t = the greedy tokens after x_0..x_t, or -100 where t was not requested.
    """
    L = len(input_ids)
    out = [[IGNORE] * T for _ in range(L)]
    todo = list(range(L)) if positions is None else sorted(set(positions))
    if not todo or T <= 0:
        return out
    if any(p < 0 or p >= L for p in todo):
        raise ValueError(f"positions must lie in [0, {L}), got {todo[0]}..{todo[-1]}")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)  # (1, L)
    base = model(input_ids=ids, use_cache=True)
    first = base.logits[0].argmax(-1)  # (L,) cont[t][0] for every t
    cache = returned_cache(base)
    for start in range(0, len(todo), chunk_size):
        pos = torch.tensor(todo[start : start + chunk_size], device=device)  # (n,)
        n = pos.shape[0]
        chains = [first[pos]]  # list of (n,) tokens per round
        for j in range(1, T):
            mask = _chain_mask(pos, L, j, dtype)  # (1, 1, n, L + n*j)
            step = model(
                input_ids=chains[-1][None],  # (1, n) the newest token of every chain
                attention_mask=mask,
                position_ids=(pos + j)[None],  # (1, n)
                use_cache=True,
                **cache_kwargs(model, cache),
            )
            cache = returned_cache(step)
            chains.append(step.logits[0].argmax(-1))  # (n,)
        if T > 1:
            cache.crop(-(n * (T - 1)))  # drop this chunk's chain tokens, keep the base sequence
        table = torch.stack(chains, dim=1).tolist()  # (n, T)
        for p, row in zip(pos.tolist(), table):
            out[p] = row
    return out
