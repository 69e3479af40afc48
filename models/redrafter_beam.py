"""ReDrafter beam search at decode time (arXiv 2403.09919, s3.2): W beams of D tokens from one position.

One implementation, bound as the method `ReDrafter.beam_search`; the proposer (`eval/proposers.py`) may
swap in an int8 vocabulary head and prunes with the cumulative log-probs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specdraft.data.ngrams import NgramIndex
    from specdraft.models.redrafter import ReDrafter


@torch.no_grad()  # not inference_mode: the beams may feed a later forward under autograd
def beam_search(
    drafter: ReDrafter,
    hidden: Tensor,
    root: int,
    beam_width: int,
    draft_len: int,
    context: tuple[Tensor, Tensor] | None = None,
    head: Callable[[Tensor], Tensor] | None = None,
    copy: NgramIndex | None = None,
    min_logp: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Beam search over the drafter's slots from the newest committed position (`beam_search_rows`, one row).

    Args:
        drafter: the ReDrafter (`features`, `init_state`, `next_state`, `state_logits`, `to_target_ids`).
        hidden: (F,) target features at the newest committed position (see `ReDrafter.features`).
        root: the token the target just committed (beams[:, 0]).
        beam_width: W beams kept.
        draft_len: D tokens drafted after the root.
        context: prefix attention only: keys, values (1 + M, A), the sink first (`ReDrafter.context_memory`).
        head: (W, X) -> (W, Vd) draft-vocabulary logits (None: the drafter's head; e.g. an `Int8Linear`).
        copy: copy gate only (`copy_ngram` > 0): the committed tokens before the root; each beam's candidate is
            looked up on them + the beam (root and drafted tokens), as in training.
        min_logp: stop early once every beam's log-prob is below this (`beam_search_rows`).

    Returns:
        beams (W', 1 + D) long target ids sorted by score (W' = W unless fewer distinct beams exist); cum
        (W', 1 + D) float32, the cumulative drafter log-prob of each beam prefix (cum[:, 0] = 0, cum[:, -1] =
        the beam's score).
    """
    dev = drafter.head.weight.device
    roots = torch.tensor([root], dtype=torch.long, device=dev)  # (1,)
    copies = None if copy is None else [copy]
    beams, cum = beam_search_rows(
        drafter, hidden.reshape(1, -1), roots, beam_width, draft_len, head, copies, context, min_logp
    )
    return beams[0], cum[0]


@torch.no_grad()
def beam_search_rows(
    drafter: ReDrafter,
    hidden: Tensor,
    roots: Tensor,
    beam_width: int,
    draft_len: int,
    head: Callable[[Tensor], Tensor] | None = None,
    copies: Sequence[NgramIndex] | None = None,
    context: tuple[Tensor, Tensor] | None = None,
    min_logp: float | None = None,
) -> tuple[Tensor, Tensor]:
    """`beam_search` for R rows at once: one drafter forward per slot over all R * W beams (the batched
    decoder drafts every row in one call instead of R). Step 1 expands only each row's root, so its top-W
    tokens become that row's W beams (no filler rows); each row keeps its own top W afterwards.

    Args:
        drafter: the ReDrafter.
        hidden: (R, F) target features at each row's newest committed position.
        roots: (R,) long, the token each row's target just committed (beams[r, :, 0]).
        beam_width: W beams kept per row.
        draft_len: D tokens drafted after the root.
        head: (..., X) -> (..., Vd) draft-vocabulary logits (None: the drafter's head).
        copies: copy gate only: each row's index of its committed tokens before the root (R of them).
        context: prefix attention only, R = 1: keys, values (1 + M, A), the sink first.
        min_logp: a caller that prunes beam positions below this log-prob (the proposer's `min_prob`): the
            search stops after the first slot where every row's every beam is below it (one host sync per
            slot), since a beam's log-prob only falls as it grows; the slots not searched repeat the last
            token with log-prob -inf, so the pruned tree is the full search's exactly. None: all D slots.

    Returns:
        beams (R, W', 1 + D) long target ids, each row's sorted by score (W' = min(W, Vd)); cum (R, W', 1 + D)
        float32 cumulative drafter log-probs (cum[..., 0] = 0).
    """
    dev = drafter.head.weight.device
    r = hidden.shape[0]
    if context is not None and r != 1:
        raise ValueError(f"beam_search_rows: prefix attention searches one row at a time, got {r}")
    h = drafter.features(hidden)[:, None]  # (R, 1, F), prepared once for every step
    beams = roots.to(dev)[:, None, None]  # (R, 1, 1)
    state = drafter.init_state(beams[..., 0])  # (R, 1, E)
    scores = torch.zeros(r, 1, dtype=torch.float32, device=dev)  # (R, W)
    cum = scores[..., None]  # (R, 1, 1)
    ctx = None if context is None else (*context, None)  # every beam sees the whole memory
    for k in range(draft_len):
        if k > 0:
            state = drafter.next_state(state, beams[..., -1])  # (R, W, E)
        w = state.shape[1]
        cands = None
        if copies is not None:  # (R, W) candidates and match lengths, each row's beams on its own text
            looked = [c.lookup_beams(b) for c, b in zip(copies, beams, strict=True)]
            cands = (torch.stack([c for c, _ in looked]), torch.stack([m for _, m in looked]))
        if ctx is not None:  # the prefix attention reads (n, X) states: one row
            one = None if cands is None else (cands[0][0], cands[1][0])  # (W,) each
            one_row = drafter.state_logits(state[0], h[0].expand(w, -1), head, ctx, one, log_probs=True)
            logp = one_row[None]  # (1, W, Vd)
        else:
            logp = drafter.state_logits(state, h.expand(-1, w, -1), head, None, cands, True)  # (R, W, Vd)
        scores, parent, draft = _best(scores, logp, beam_width)  # (R, W') each
        token = drafter.to_target_ids(draft)  # (R, W') target ids
        beams = torch.cat([_rows(beams, parent), token[..., None]], dim=-1)  # (R, W, k + 2)
        cum = torch.cat([_rows(cum, parent), scores[..., None]], dim=-1)  # (R, W, k + 2)
        if min_logp is not None and k + 1 < draft_len and bool((scores < min_logp).all()):
            rest = draft_len - k - 1  # slots left: every node there would be pruned
            beams = torch.cat([beams, beams[..., -1:].expand(-1, -1, rest)], dim=-1)  # (R, W, 1 + D)
            cum = torch.cat([cum, cum.new_full((*cum.shape[:2], rest), float("-inf"))], dim=-1)
            break
        state = _rows(state, parent)  # (R, W, E)
    return beams, cum


def _best(scores: Tensor, logp: Tensor, beam_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The `beam_width` best extensions of each row's beams: scores (..., W) beam log-probs, logp (..., W, Vd)
    -> (scores, parent beam, draft id), each (..., W'), W' = min(beam_width, W * Vd), best first.

    Two stages: each beam's best min(beam_width, Vd) tokens, then the best of those W * min(beam_width, Vd)
    (the global best `beam_width` take at most `beam_width` tokens from any one beam, so they are all there);
    a top-k over (W, k) candidates instead of over all W * Vd (4x cheaper at W = 8, Vd = 16,384 on a CPU)."""
    k = min(beam_width, logp.shape[-1])
    top, ids = logp.topk(k, dim=-1)  # (..., W, k) each
    cand = (scores[..., None] + top).flatten(-2)  # (..., W * k)
    best, pick = cand.topk(min(beam_width, cand.shape[-1]), dim=-1)  # (..., W')
    return best, pick // k, ids.flatten(-2).gather(-1, pick)


def _rows(x: Tensor, parent: Tensor) -> Tensor:
    """x (R, W, ...) -> (R, W', ...): each row's entries at `parent` (R, W') (its beams' parents)."""
    return x.gather(
        1, parent.reshape(*parent.shape, *[1] * (x.dim() - 2)).expand(*parent.shape, *x.shape[2:])
    )


@torch.no_grad()
def beam_search_fixed_rows(
    drafter: ReDrafter,
    hidden: Tensor,
    roots: Tensor,
    beam_width: int,
    draft_len: int,
    head: Callable[[Tensor], Tensor] | None = None,
    copy: tuple[Tensor, Tensor, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """`beam_search_rows` with fixed shapes and no host sync: S rows, one drafter forward per slot over all
    S * W beams, the form one CUDA graph captures for a whole batch.

    All W beams of a row exist from the first slot: the W - 1 copies of the root beam start at log-prob -inf
    (dead, as apple/ml-recurrent-drafter does), so step 1 still expands the root only and the beams equal
    `beam_search`'s (when the draft vocabulary has >= W tokens). Every step has the shapes of the last.
    Prefix attention reads growing state and keeps the dynamic `beam_search`; the copy gate looks its
    candidates up on the device (`copy_lookup.lookup_fixed_rows`) in committed-token buffers of fixed capacity.

    Args:
        drafter: the ReDrafter.
        hidden: (S, F) target features at each row's newest committed position.
        roots: (S,) long, each row's committed root token, on the drafter's device.
        beam_width: W.
        draft_len: D.
        head: (..., X) -> (..., Vd) logits (None: the drafter's head).
        copy: copy gate only: (each row's committed tokens before its root (S, C) long, their counts (S,) long,
            the gate's n-gram length).

    Returns:
        beams (S, W, 1 + D) long, each row's sorted by score; cum (S, W, 1 + D) float32 cumulative log-probs.
    """
    from specdraft.models.copy_lookup import lookup_fixed_rows

    s, w, dev = hidden.shape[0], beam_width, roots.device
    h = drafter.features(hidden)[:, None].expand(s, w, -1)  # (S, W, F')
    state = drafter.init_state(roots[:, None].expand(s, w))  # (S, W, E)
    beams = roots[:, None, None].expand(s, w, 1 + draft_len).clone()  # (S, W, 1 + D), column 0 = root
    cum = torch.zeros(s, w, 1 + draft_len, dtype=torch.float32, device=dev)  # (S, W, 1 + D)
    scores = torch.full((s, w), float("-inf"), device=dev)  # (S, W)
    # only the root beam is alive (fill_: an item assignment is a host-to-device copy, which a capture refuses)
    scores[:, :1].fill_(0.0)
    for k in range(draft_len):
        if k > 0:
            state = drafter.next_state(state, beams[..., k])  # (S, W, E)
        cands = (
            None if copy is None else lookup_fixed_rows(copy[0], copy[1], beams[..., : k + 1], copy[2])
        )  # (S, W) x2
        logp = drafter.state_logits(state, h, head, None, cands, log_probs=True)  # (S, W, Vd) float32
        scores, parent, draft = _best(scores, logp, w)  # (S, W) each
        beams, cum, state = _rows(beams, parent), _rows(cum, parent), _rows(state, parent)
        beams[..., k + 1] = drafter.to_target_ids(draft)
        cum[..., k + 1] = scores
    return beams, cum
