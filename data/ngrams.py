"""Prompt-lookup candidates over a row's own tokens: the copy gate's inputs (`models/copy_lookup.py`), the same
in training (`ngram_candidates`, `slot_candidates`, computed by `data.collate.Collator`) and at decode time
(`NgramIndex` over the committed tokens, per beam).

Pure token arithmetic, so data/ builds training batches without importing models/.
"""

from __future__ import annotations

import torch
from torch import Tensor

NO_CANDIDATE = -1  # candidate id when no suffix n-gram occurred before


def ngram_candidates(ids: list[int], max_ngram: int) -> tuple[list[int], list[int]]:
    """The lookup candidate after every position of a token sequence.

    Args:
        ids: (L,) the tokens.
        max_ngram: n, the longest suffix n-gram matched.

    Returns:
        cand (L,): cand[p] = ids[q + 1] for the most recent q < p whose m-gram ids[q-m+1 .. q] equals
            ids[p-m+1 .. p], with the largest m <= n that has such a q (`NO_CANDIDATE` when none);
        length (L,): that m (0 when none).
    """
    index, found = NgramIndex(max_ngram), []
    for tok in ids:  # each position is a one-token chain after the tokens before it
        found.append(index.lookup([tok]))
        index.extend([tok])
    return [c for c, _ in found], [m for _, m in found]


class NgramIndex:
    """Incremental m-gram index of the committed tokens, for lookups on committed + a short drafted chain.

    `lookup(chain)` gives the candidate at the chain's last position (as `ngram_candidates(committed + chain, n)`
    does, which is built on it), in O(n * len(chain)) instead of O(L): matches ending inside the chain are
    scanned, older ones come from the index.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = int(max_ngram)
        self.ids: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Commit `tokens` (appended to the context)."""
        for tok in tokens:
            self.ids.append(int(tok))
            p = len(self.ids) - 1
            for m in range(1, min(self.max_ngram, p + 1) + 1):
                self.last[tuple(self.ids[p - m + 1 : p + 1])] = p

    def lookup(self, chain: list[int]) -> tuple[int, int]:
        """(candidate, m) at the end of committed + `chain` (`NO_CANDIDATE`, 0 when nothing matches)."""
        n0, chain = len(self.ids), [int(c) for c in chain]
        start = max(0, n0 - self.max_ngram)  # the committed tokens a match ending inside the chain can touch
        ctx = self.ids[start:] + chain  # ctx[i] is position start + i of committed + chain
        p = n0 + len(chain) - 1  # the newest position
        for m in range(min(self.max_ngram, p + 1), 0, -1):
            gram = ctx[p - m + 1 - start : p + 1 - start]
            for q in range(p - 1, max(n0, m - 1) - 1, -1):  # matches ending inside the chain, newest first
                if ctx[q - m + 1 - start : q + 1 - start] == gram:
                    return ctx[q + 1 - start], m
            q_old = self.last.get(tuple(gram))  # the newest match ending in the committed tokens (< n0 <= p)
            if q_old is not None:
                return (self.ids[q_old + 1] if q_old + 1 < n0 else chain[0]), m
        return NO_CANDIDATE, 0

    def lookup_beams(self, beams: Tensor) -> tuple[Tensor, Tensor]:
        """beams (W, k) long, each a chain after the committed tokens -> candidates (W,) and lengths (W,)."""
        out = [self.lookup(row) for row in beams.tolist()]
        cand = torch.tensor([c for c, _ in out], dtype=torch.long, device=beams.device)
        return cand, torch.tensor([m for _, m in out], dtype=torch.long, device=beams.device)


def follows_own_text(text: Tensor, root: Tensor, targets: Tensor) -> Tensor:
    """Whether each draft slot's inputs so far are the row's own text (labels that are greedy continuations of
    other text, `distill.regenerate=false`, leave it).

    Args:
        text: (..., D) the row's token at t+1+k, the position whose token slot k is fed last.
        root: (...) the root x_{t+1}; targets: (..., D) the labels (slot k is fed root, targets[..., :k]).

    Returns:
        (..., D) bool: text[..., i] == fed[..., i] for every i <= k.
    """
    fed = torch.cat([root[..., None], targets[..., :-1]], dim=-1)  # (..., D) newest input of slot k
    return (text == fed).long().cumprod(-1).bool()


def slot_candidates(
    cand: Tensor, length: Tensor, input_ids: Tensor, root: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor]:
    """The candidate of every draft slot of a row, from the row's own `ngram_candidates`.

    Slot k at position t has seen x_0 .. x_t, root, targets[t, :k]; its candidate is cand[t + 1 + k] while that
    chain is the row's own tokens (x_{t+1} .. x_{t+1+k}), else none (labels that are continuations of other text).

    Args:
        cand, length: (L,) from `ngram_candidates(input_ids)`.
        input_ids: (L,); root: (L,); targets: (L, D) (-100 = ignored).

    Returns:
        copy_ids (L, D) long (`NO_CANDIDATE` = none), copy_len (L, D) long (0 = none).
    """
    n, d = targets.shape
    pos = torch.arange(n)[:, None] + 1 + torch.arange(d)  # (L, D) the newest context position of slot k
    inside = pos < n
    pos = pos.clamp_max(n - 1)
    own = (
        follows_own_text(input_ids[pos], root, targets) & inside
    )  # (L, D) the chain so far is the row's text
    ids = torch.where(own, cand[pos], torch.full_like(pos, NO_CANDIDATE))
    return ids, torch.where(own, length[pos], torch.zeros_like(pos))
