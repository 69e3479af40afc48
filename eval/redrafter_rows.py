"""The ReDrafter's fixed-shape draft step for a whole batch: one beam search over every row (the batched
decoder's static path, `eval/batch_decode.py`), captured as ONE CUDA graph per padded row count.

Drafting row by row made a batch step replay one draft graph per row: on an H100 at batch 16 that was
16 x ~2 ms a step against a ~13 ms batched verify, and the ReDrafter fell to 0.38x of batched AR (session
32, docs/gpu.md). Here the R drafting rows' inputs are stacked into persistent buffers of P rows (P = R
rounded up to a power of two under graphs, so a batch captures at most log2(B) + 1 graphs; padding rows
repeat the last row and are dropped), and `beam_search_fixed_rows` runs S = P rows at once:

    rows' copy-gate commits (each its own buffer, eager)  ->  stack (P, F) hidden, (P,) roots, (P, C) ctx
    -> beams (P, W, 1 + D), cum  ->  R trees of the constant topology (root, then W chains of D nodes)

Each row's tree equals its own `ReDrafterProposer.propose` on the static path (same search, same lookups;
fp rounding of batched products aside). The graphs live in a `RowsState` the rows' proposers share, so
they are freed with the proposers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specdraft.eval.copy_context import commit_rows
from specdraft.eval.graphs import CudaGraph, replay_or_run
from specdraft.eval.tree import DraftTree
from specdraft.models.redrafter_beam import beam_search_fixed_rows

if TYPE_CHECKING:
    from collections.abc import Sequence

    from specdraft.eval.proposers import ReDrafterProposer


@dataclass
class RowInputs:
    """Persistent inputs of one padded row count (a captured graph reads these addresses)."""

    hidden: Tensor  # (P, F) features at each row's newest committed position
    roots: Tensor  # (P,) long root tokens
    ctx: Tensor  # (P, C) long committed tokens before each root (copy gate; (P, 1) unused otherwise)
    ctx_len: Tensor  # (P,) long their counts


@dataclass(eq=False)
class RowsState:
    """What the rows of one batch share: input buffers and CUDA graphs per (P, C, F, dtype)."""

    inputs: dict[tuple[Any, ...], RowInputs] = field(default_factory=dict)
    graphs: dict[tuple[Any, ...], CudaGraph[tuple[Tensor, Tensor]] | None] = field(default_factory=dict)


def padded_rows(r: int, graphs: bool) -> int:
    """Rows the step runs for r drafting rows: the next power of two under graphs (few shapes), else r."""
    return 1 << max(r - 1, 0).bit_length() if graphs else r


def propose_fixed_rows(
    rows: Sequence[ReDrafterProposer], hidden: Sequence[Tensor], tokens: Sequence[Tensor]
) -> list[DraftTree]:
    """Every row's static-path `propose` in one fixed-shape beam search (one CUDA graph under `graphs`).

    The rows must share the search (module, W, D, head, copy gate): `ReDrafterProposer.propose_rows` checks.

    Args:
        rows: R static `ReDrafterProposer`s; hidden: R of (n_i, F); tokens: R of (n_i,), tokens[i][-1] the root.

    Returns:
        R trees of 1 + W * D nodes (root, then W chains), each with per-node path probabilities.
    """
    lead, r = rows[0], len(rows)
    state = next((p._rows_state for p in rows if p._rows_state is not None), None) or RowsState()
    for p in rows:
        p._rows_state = state
    if lead.copy_ngram:  # each row's committed tokens into its own buffer, then one capacity for all
        ctxs = [p.copy_ctx for p in rows]
        for p, moved in zip(rows, commit_rows(ctxs, ctxs, tokens), strict=True):
            if moved:  # its own captured step read the old buffer
                p._draft_graph = None
    size = padded_rows(r, lead.graphs)
    pick = list(range(r)) + [r - 1] * (size - r)  # padding repeats the last row
    dev = lead.copy_ctx.buf.device
    feat = hidden[0][-1]
    room = lead.copy_ctx.buf.shape[0]  # the rows' shared buffer capacity: a new one, new inputs and graph
    key = (size, room, feat.shape[-1], feat.dtype)
    if key not in state.inputs:
        state.inputs[key] = RowInputs(
            feat.new_zeros(size, feat.shape[-1], device=dev),
            torch.zeros(size, dtype=torch.long, device=dev),
            torch.zeros(size, room, dtype=torch.long, device=dev),
            torch.zeros(size, dtype=torch.long, device=dev),
        )
    buf = state.inputs[key]
    torch.stack([hidden[i][-1].to(dev) for i in pick], out=buf.hidden)  # (P, F)
    torch.stack([tokens[i][-1].to(dev) for i in pick], out=buf.roots)  # (P,)
    if lead.copy_ngram:
        torch.stack([rows[i].copy_ctx.buf for i in pick], out=buf.ctx)  # (P, C)
        torch.stack([rows[i].copy_ctx.length for i in pick], out=buf.ctx_len)  # (P,)

    def step() -> tuple[Tensor, Tensor]:
        copy = (buf.ctx, buf.ctx_len, lead.copy_ngram) if lead.copy_ngram else None
        return beam_search_fixed_rows(
            lead._search, buf.hidden, buf.roots, lead.beam_width, lead.draft_len, lead.head, copy
        )  # (P, W, 1 + D) each

    if lead.graphs:
        beams, cum = replay_or_run(state.graphs, key, step, dev, f"the ReDrafter draft step of {size} rows")
    else:
        beams, cum = step()
    toks = torch.cat([buf.roots[:r, None], beams[:r, :, 1:].reshape(r, -1)], dim=1)  # (R, 1 + W*D)
    scores = torch.cat([cum.new_ones(r, 1), cum[:r, :, 1:].float().exp().reshape(r, -1)], dim=1)  # (R, N)
    for p in rows:
        p.last_compression = 1.0
    return [
        DraftTree(toks[i], lead._parents, lead._depth, lead._ancestors, scores=scores[i]) for i in range(r)
    ]
