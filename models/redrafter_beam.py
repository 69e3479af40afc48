"""ReDrafter beam search at decode time (arXiv 2403.09919, s3.2): W beams of D tokens from one position.

One implementation, bound as the method `ReDrafter.beam_search`; the proposer (`eval/proposers.py`) may
swap in an int8 vocabulary head and prunes with the cumulative log-probs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specdraft.models.copy_lookup import NgramIndex
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
) -> tuple[Tensor, Tensor]:
    """Beam search over the drafter's slots from the newest committed position.

    Step 1 expands only the root beam, so its top-W tokens become the W beams (no filler rows).

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

    Returns:
        beams (W', 1 + D) long target ids sorted by score (W' = W unless fewer distinct beams exist); cum
        (W', 1 + D) float32, the cumulative drafter log-prob of each beam prefix (cum[:, 0] = 0, cum[:, -1] =
        the beam's score).
    """
    dev = drafter.head.weight.device
    h = drafter.features(hidden.reshape(1, -1))  # (1, F), prepared once for every step
    root_t = torch.tensor([root], dtype=torch.long, device=dev)
    state = drafter.init_state(root_t)  # (1, E)
    beams = root_t[:, None]  # (1, 1)
    scores = torch.zeros(1, dtype=torch.float32, device=dev)  # (W,)
    cum = scores[:, None]  # (1, 1)
    ctx = None if context is None else (*context, None)  # every beam sees the whole memory
    for k in range(draft_len):
        if k > 0:
            state = drafter.next_state(state, beams[:, -1])  # (W, E)
        cands = None if copy is None else copy.lookup_beams(beams)  # (W,), (W,): candidate, match length
        logits = drafter.state_logits(state, h.expand(state.shape[0], -1), head, ctx, cands)  # (W, Vd)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (W, Vd)
        vocab = logp.shape[-1]
        scores, idx = (scores[:, None] + logp).reshape(-1).topk(min(beam_width, logp.numel()))  # (W,)
        parent, token = idx // vocab, drafter.to_target_ids(idx % vocab)  # (W,), (W,) target ids
        beams = torch.cat([beams[parent], token[:, None]], dim=1)  # (W, k + 2)
        cum = torch.cat([cum[parent], scores[:, None]], dim=1)  # (W, k + 2)
        state = state[parent]  # (W, E)
    return beams, cum


@torch.no_grad()
def beam_search_fixed(
    drafter: ReDrafter,
    hidden: Tensor,
    root: Tensor,
    beam_width: int,
    draft_len: int,
    head: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """`beam_search` with fixed shapes and no host sync, the form a CUDA graph captures.

    All W beams exist from the first slot: the W - 1 copies of the root beam start at log-prob -inf (dead,
    as apple/ml-recurrent-drafter does), so step 1 still expands the root only and the beams equal
    `beam_search`'s (when the draft vocabulary has >= W tokens). Every step has the shapes of the last.
    Prefix attention and the copy gate read growing state and keep the dynamic `beam_search`.

    Args:
        drafter: the ReDrafter.
        hidden: (F,) target features at the newest committed position.
        root: (1,) long, the committed root token, on the drafter's device.
        beam_width: W.
        draft_len: D.
        head: (W, X) -> (W, Vd) logits (None: the drafter's head).

    Returns:
        beams (W, 1 + D) long sorted by score; cum (W, 1 + D) float32 cumulative log-probs.
    """
    w = beam_width
    h = drafter.features(hidden.reshape(1, -1)).expand(w, -1)  # (W, F)
    state = drafter.init_state(root.expand(w))  # (W, E)
    beams = root.expand(w)[:, None].repeat(1, 1 + draft_len)  # (W, 1 + D), column 0 = root
    cum = torch.zeros(w, 1 + draft_len, dtype=torch.float32, device=root.device)  # (W, 1 + D)
    scores = torch.full((w,), float("-inf"), device=root.device)
    scores[0] = 0.0  # only the root beam is alive
    for k in range(draft_len):
        if k > 0:
            state = drafter.next_state(state, beams[:, k])  # (W, E)
        logp = torch.log_softmax(drafter.state_logits(state, h, head, None, None).float(), dim=-1)  # (W, Vd)
        vocab = logp.shape[-1]
        scores, idx = (scores[:, None] + logp).reshape(-1).topk(w)  # (W,)
        parent = idx // vocab  # (W,)
        beams, cum, state = beams[parent], cum[parent], state[parent]
        beams[:, k + 1] = drafter.to_target_ids(idx % vocab)
        cum[:, k + 1] = scores
    return beams, cum
