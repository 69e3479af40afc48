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
