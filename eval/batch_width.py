"""What a batched step verifies, chosen for the whole batch every step from calibrated drafter confidence
(LLMCad's confidence-adaptive drafting, arXiv 2309.04255, for a batch).

A per-row probability threshold (ReDrafter's `min_prob`) verifies what each row's drafter is sure of, whatever
the batch pays for it: the threshold is the drafter's probability, not the target's acceptance (session 43:
too high at batch 16), and on the fixed-shape (GPU) path every tree is padded to the widest, so every row
pays for the most confident one. At batch 16 on a 2-core CPU, p = 0.5 verified 1.44 nodes a row for 1.29
tokens at 1.43x the verify of a plain step (session 44). Instead, one width w for the batch each step:

    E_r(w) = 1 + sum of c(s_i) over row r's w - 1 most confident drafted nodes   (expected tokens of row r)
    w*     = argmax_w  sum_r E_r(w) / (rows * cost(w) + draft ms)                  (cost: the per-row curve)

s_i is a node's effective drafter score (its cumulative probability, made non-increasing along paths:
`adaptive.effective_scores`) and c a calibration learnt from the verified steps: the share of verified nodes
in each score bin that the target accepted. Under greedy verification a row accepts at most one node per
depth, so its accepted length is the number of its accepted nodes and E_r is its expected accepted length
plus the bonus token. The calibration's prior is the score itself (`prior` pseudo-counts), so an unseen bin starts
optimistic, gets verified and is learnt. Trees without scores (Medusa, prompt lookup) are calibrated per node
rank instead, which makes w* a per-step node cap.

Each row keeps its w* most confident nodes (ancestor-closed: ties go to the shallower node), best first.
Where the verify computes only the real nodes (the eager CPU path leaves padding out of its products,
`fast_target.Packing`), its cost follows the step's total node count T instead (rows x cost(T / rows)),
so the batch keeps its K most likely nodes wherever they are (each row a best-first prefix: probabilities
are made non-increasing along each row's ranking), K chosen by the same rate.
Self-adaptive fallback: when the chosen width's modelled rate averages below plain steps'
(rows / (rows * cost(1))) over `window` drafted steps, drafting stops for `gap` steps (doubling while
probes keep failing, up to `max_gap`), then `window` drafted steps decide again.
Drafting follows what is kept: after each window the proposers are told to draft at most `draft_nodes` =
the next power of two >= twice the most nodes a row kept in it (at least 4; `Proposer.fit_budget`), so a
ReDrafter whose rows keep 1-2 nodes searches one beam of 3 tokens, not the full beams it would throw away,
and a window that keeps whole trees doubles it again. The output never changes: the target decides every
token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdraft.eval.adaptive import effective_scores
from specdraft.eval.budget import CostCurve
from specdraft.eval.tree import DraftTree, reorder_tree


def ranked(tree: DraftTree, bins: int, ranks: int) -> tuple[DraftTree, Tensor]:
    """`tree` with its nodes best first, and each node's calibration key.

    Args:
        tree: N nodes; `scores` (N,) cumulative draft probabilities, or None (node order = confidence).
        bins: score bins on [0, 1] (keys 0 .. bins - 1).
        ranks: rank keys for unscored trees (keys bins .. bins + ranks - 1; the last takes every deeper rank).

    Returns:
        the reordered tree (scored: by effective score desc, then depth asc, then index: parents first) and
        keys (N,) long, on the tree's device (the root's key is never read); no host read.
    """
    dev = tree.tokens.device
    if tree.scores is None:
        return tree, bins + (torch.arange(tree.num_nodes, device=dev) - 1).clamp(0, ranks - 1)
    assert tree.depth is not None
    eff = effective_scores(tree)  # (N,)
    by_depth = torch.sort(tree.depth.to(dev), stable=True).indices  # (N,) depth asc, then index
    order = by_depth[torch.sort(-eff[by_depth], stable=True).indices]  # (N,) score desc, then depth, index
    keys = (eff[order] * bins).long().clamp(0, bins - 1)  # (N,)
    return reorder_tree(tree, order), keys


@dataclass
class WidthPolicy:
    """Chooses one verify width per batched step and falls back to plain steps (see module docstring).

    Args:
        cost: per-row ms of a verify at each width (`BatchDecoder.row_cost_curve` of this batch size).
        bins: score bins of the calibration.
        ranks: node-rank keys of the calibration (unscored trees).
        prior: pseudo-counts of each key's prior (scored bins: the bin's mid score; ranks: 1/2).
        window: drafted steps whose modelled gain over plain steps is averaged before a fallback decision.
        gap: plain steps of the first fallback.
        max_gap: longest fallback: the gap doubles after each probe that fails.
    """

    cost: CostCurve
    bins: int = 20
    ranks: int = 16
    prior: float = 2.0
    window: int = 8
    gap: int = 16
    max_gap: int = 256
    hits: Tensor = field(init=False)  # (bins + ranks,) accepted verified nodes per key
    seen: Tensor = field(init=False)  # (bins + ranks,) verified nodes per key
    base: Tensor = field(init=False)  # (bins + ranks,) each key's prior: the bin's mid score, 1/2 for ranks
    widths: list[int] = field(default_factory=list)  # the width of every drafted step
    off_steps: int = 0  # steps not drafted (fallback)
    fallbacks: int = 0  # fallbacks started
    draft_nodes: int = (
        0  # node cap the proposers draft at (`Proposer.fit_budget`; 0: not set yet, full trees)
    )
    _off: int = 0  # plain steps left in the current fallback
    _next_gap: int = 0  # the next fallback's length (0: `gap`)
    _ratios: list[float] = field(default_factory=list)  # drafted steps: modelled rate / plain-step rate
    _kept: int = 0  # the most nodes a row kept in the current window
    _keys: dict[int, Tensor] = field(default_factory=dict)  # per row: keys of the nodes it verifies

    def __post_init__(self) -> None:
        for name, v, lo in (("bins", self.bins, 1), ("ranks", self.ranks, 1), ("window", self.window, 1)):
            if v < lo:
                raise ValueError(f"WidthPolicy: {name}={v} must be >= {lo}")
        if self.prior <= 0 or self.gap < 1 or self.max_gap < self.gap:
            raise ValueError(
                f"WidthPolicy: prior={self.prior} must be > 0 and 1 <= gap={self.gap} <= max_gap={self.max_gap}"
            )
        self.hits = torch.zeros(self.bins + self.ranks, dtype=torch.float64)
        self.seen = torch.zeros(self.bins + self.ranks, dtype=torch.float64)
        self.base = torch.cat(
            [
                (torch.arange(self.bins, dtype=torch.float64) + 0.5) / self.bins,
                torch.full((self.ranks,), 0.5, dtype=torch.float64),
            ]
        )

    def learn_from(self, other: WidthPolicy) -> None:
        """Start from `other`'s calibration (the same drafter at another batch size: which nodes the target
        accepts does not depend on how many rows are verified together, only the cost does)."""
        if other.hits.shape == self.hits.shape:
            self.hits, self.seen = other.hits.clone(), other.seen.clone()

    def calibrated(self, keys: Tensor) -> Tensor:
        """P(a verified node is accepted) per key: (hits + prior * base) / (seen + prior); keys (n,) -> (n,)
        float64, on the keys' device (the counts move there once)."""
        if self.hits.device != keys.device:
            self.hits, self.seen = self.hits.to(keys.device), self.seen.to(keys.device)
            self.base = self.base.to(keys.device)
        return ((self.hits + self.prior * self.base) / (self.seen + self.prior))[keys]

    def drafting(self) -> bool:
        """Call once before each step: False while a fallback runs (this step verifies roots alone)."""
        if self._off > 0:
            self._off -= 1
            self.off_steps += 1
            return False
        return True

    def choose(
        self,
        trees: dict[int, DraftTree],
        draft_ms: float,
        rows: int,
        pad: Callable[[int], int],
        packed: bool = False,
    ) -> dict[int, DraftTree]:
        """The drafted rows' trees cut for this step (each row's best nodes first).

        Args:
            trees: per drafted row its full tree (N_r nodes).
            draft_ms: what drafting them took this step (a fixed cost of the step, whatever is verified).
            rows: rows the verify forward runs (its cost: rows x the per-row curve at their mean width).
            pad: width -> the width the verify really runs (`batch_decode.rows_budget_for` on the fixed-shape
                path, identity on the eager one); a row keeps up to that many nodes.
            packed: the verify computes only the real nodes (the eager CPU path, `fast_target.Packing`):
                its cost follows the total node count, so the batch's best nodes are kept wherever they are
                (the K most likely over all rows, each row's a best-first prefix) instead of one width.

        Returns:
            per row its tree, best first: min(width, N_r) nodes, or its share of the K best (`packed`).
        """
        if not trees:
            return trees
        order = sorted(trees)
        done = [ranked(trees[r], self.bins, self.ranks) for r in order]
        # per row, its non-root nodes' acceptance probabilities in rank order, made non-increasing so that
        # any best-first selection keeps a prefix of the row (ancestors before descendants)
        sizes = [k.shape[0] - 1 for _, k in done]
        every = self.calibrated(torch.cat([k[1:] for _, k in done])).split(sizes)  # one lookup for all rows
        flat = torch.cat([p.cummin(0).values if p.shape[0] else p for p in every]).cpu()  # (M,) one host read
        base = float(len(done))  # every row emits its bonus token
        if packed:
            row_of = torch.repeat_interleave(torch.arange(len(done)), torch.tensor(sizes))  # (M,)
            rank = torch.sort(flat, descending=True, stable=True).indices  # (M,) rows' prefixes stay in order
            gain = [base, *(base + flat[rank].cumsum(0)).tolist()]  # [K]: expected tokens with the K best
            cost = [rows * self.cost(1 + k / rows) + draft_ms for k in range(len(gain))]
            best = max(range(len(gain)), key=lambda k: (gain[k] / cost[k], -k))
            best_rate = gain[best] / cost[best]
            keep = (torch.bincount(row_of[rank[:best]], minlength=len(done)) + 1).tolist()
        else:
            most = max(sizes) + 1
            per_w = torch.zeros(len(done), most, dtype=torch.float64)  # (R, N) expected tokens per node
            per_w[:, 0] = 1.0
            for i, p in enumerate(flat.split(sizes)):
                per_w[i, 1 : 1 + p.shape[0]] = p
            gain = per_w.cumsum(1).sum(0).tolist()  # (N,) [w - 1]: the batch's expected tokens at width w
            best, best_rate = 1, 0.0
            for w in sorted({min(pad(k), most) for k in range(1, most + 1)}):
                rate = gain[w - 1] / (rows * self.cost(pad(w)) + draft_ms)
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate = w, rate
            keep = [best] * len(done)
        self._ratios.append(best_rate / (base / (rows * self.cost(1))))  # against plain steps
        self._kept = max(self._kept, *keep)
        if len(self._ratios) >= self.window:
            self.draft_nodes = max(4, 1 << (2 * self._kept - 1).bit_length())  # >= 2 x kept, a power of two
            self._kept = 0
            if sum(self._ratios) / len(self._ratios) < 1.0:  # drafting does not pay: plain steps for a while
                self._off = self._next_gap or self.gap
                self._next_gap = min(2 * self._off, self.max_gap)
                self.fallbacks += 1
            else:
                self._next_gap = 0
            self._ratios = []
        self.widths.append(max(keep))
        self._keys = {r: k[:n] for r, (_, k), n in zip(order, done, keep, strict=True)}
        return {r: t.truncated(n) for r, (t, _), n in zip(order, done, keep, strict=True)}

    def observe(self, accepted: dict[int, list[int]], verified: dict[int, int]) -> None:
        """Learn from a verified step: per row of the last `choose`, the node indices of its accepted path
        (root first, as `greedy_verify_rows` packs them) and how many of its first nodes were verified (the
        decoder may cut a tree further where the cache is nearly full); the other verified nodes were
        rejected."""
        for r, keys in self._keys.items():
            n = min(keys.shape[0], verified.get(r, 0))
            if n <= 1 or r not in accepted:
                continue
            keys = keys[:n]
            hit = torch.zeros(n, dtype=torch.float64, device=keys.device)
            hit[[i for i in accepted[r] if 0 < i < n]] = 1.0
            self.seen = self.seen.to(keys.device).index_add_(0, keys[1:], torch.ones_like(hit[1:]))
            self.hits = self.hits.to(keys.device).index_add_(0, keys[1:], hit[1:])
        self._keys = {}
