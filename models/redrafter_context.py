"""ReDrafter prefix attention (`context_heads` > 0): an extension around the paper's core (`models/redrafter.py`).

With `context_heads` > 0 the state [s_k; h_t] of every draft slot also queries the committed positions
2 <= j <= t (`layers.PrefixAttention`): keys from [e(x_j); e(x_{j-1})], values from [e(x_{j+1}); h_j], and the
read is added to g after the input projection. It can learn to copy what followed an earlier occurrence of the
current token (prompt lookup, learnt) and to recover context h_t lost. x_{j+1} is the sequence's own next token,
never a label; positions 0 and 1 are never visible (the proposer is never told x_0).

Training passes the batch's rows as `ReDrafter.forward(..., context={last, input_ids, next, mask, row, rank})`
(`training_context` turns them into keys/values); the proposer grows the same memory from every `propose` call
(`ReDrafter.context_memory`) and hands `beam_search(..., context=(keys, values))`. The weights live in the
drafter as `ctx.*` (`prefix_attention`), so exports are unchanged by where this code lives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from specdraft.models.layers import PrefixAttention
from specdraft.models.redrafter_config import ReDrafterConfig

if TYPE_CHECKING:
    from specdraft.models.redrafter import ReDrafter


def prefix_attention(
    config: ReDrafterConfig, embed: int, feats: int, exit_dim: int
) -> PrefixAttention | None:
    """The drafter's `ctx` module (None with `context_heads` == 0).

    Args:
        config: the drafter config (`context_heads`, `context_dim`, `base_hidden_size` H).
        embed: E, the token-embedding width; feats: F, the feature width; exit_dim: X, the width of g.

    Returns:
        queries [s_k; features of t] (E + F), keys [e(x_j); e(x_{j-1})] (2E), values [e(x_{j+1}); h_j] (E + H),
        attention width `context_dim` split over `context_heads`, output (X,) added to g.
    """
    heads = int(config.context_heads or 0)
    if not heads:
        return None
    return PrefixAttention(
        embed + feats,
        2 * embed,
        embed + int(config.base_hidden_size),
        int(config.context_dim),
        heads,
        exit_dim,
    )


def context_memory(
    model: ReDrafter, last: Tensor, prev: Tensor, cur: Tensor, nxt: Tensor, sink: bool = True
) -> tuple[Tensor, Tensor]:
    """Keys and values of committed positions j for the prefix attention.

    Args:
        model: a drafter with `context_heads` > 0.
        last: (..., M, H) the target's last-layer state h_j (post norm: the first H columns of the features).
        prev, cur, nxt: (..., M) long, the tokens x_{j-1}, x_j and x_{j+1} (h_j's prediction).
        sink: prepend the attention's zero sink slot (False: rows to append to a memory that has it).

    Returns:
        keys, values: (..., 1 + M, A), the sink first ((..., M, A) with `sink=False`).
    """
    if model.ctx is None:
        raise RuntimeError("context_memory needs a drafter built with context_heads > 0")
    k_in = torch.cat([model.embed_tokens(cur), model.embed_tokens(prev)], dim=-1)  # (..., M, 2E)
    w = model.head.weight
    last = last.to(device=w.device, dtype=w.dtype)
    v_in = torch.cat([model.embed_tokens(nxt), last], dim=-1)  # (..., M, E + H)
    return model.ctx.memory(k_in, v_in, sink)


def training_context(model: ReDrafter, context: dict[str, Tensor] | None) -> tuple | None:
    """The `context` argument of `state_logits` for teacher-forced training (None without prefix attention).

    Args:
        model: the drafter.
        context: `last` (B', M, H) h_j, `input_ids` (B', M) x_j, `next` (B', M) x_{j+1} of the rows, `mask`
            (B', n, 1 + M) bool (column 0: the sink, always True; column 1 + j: position t sees j when
            2 <= j <= t) and optionally `row`, `rank` (L,) (`PrefixAttention.forward`).

    Returns:
        (keys (B', 1 + M, A), values (B', 1 + M, A), mask, rows or None), or None when `context_heads` == 0.
    """
    if model.ctx is None:
        return None
    if context is None:
        raise ValueError("a drafter with context_heads > 0 needs the prefix `context`")
    ids = context["input_ids"]  # (B, M) x_j
    prev = F.pad(ids[:, :-1], (1, 0))  # (B, M) x_{j-1} (position 0 is never visible)
    rows = (context["row"], context["rank"]) if "row" in context else None
    keys, values = context_memory(model, context["last"], prev, ids, context["next"])
    return keys, values, context["mask"], rows
