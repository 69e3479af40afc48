"""Confidence-adaptive drafting (LLMCad, arXiv 2309.04255): a wrapper that prunes any scored draft tree.

`NodeBudget` (`eval/budget.py`) fits one node cap per machine and drafter; this is its per-step refinement.
Each step the wrapped proposer drafts its usual tree with per-node cumulative draft probabilities
(`DraftTree.scores`: the product of the drafter's probabilities along the root path), and

  1. confidence: only nodes whose probability is >= `threshold` are kept (the root and its most likely
     child always), so a confident step drafts a deep chain and an unsure one a few short branches;
  2. fixed budgets: the kept set is cut to the largest of `budgets` (powers of two) it fills, by score, so
     every verify is one of a few shapes (no padding on the static path, one CUDA graph per budget);
  3. self-adaptive fallback: `AcceptanceController` tracks the recent acceptance and shrinks the depth and
     budget while drafts keep failing, down to plain target steps (a one-node tree) for a few steps before
     probing again (the gap doubles while probes keep failing).

Pruning keeps a valid tree: scores are made non-increasing along every path (a node's score is the minimum
over its root path), ties go to the shallower node, so the kept set is closed under ancestors and sorting
by score lists parents before children. Which nodes are verified never changes the output (the target
decides every token), so decoding stays lossless on both decode paths.

No decoder coupling: the decoder hands `propose` every position committed since the last call, which begin
with the accepted drafts, so the wrapper reads the accepted length by walking its previous tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.eval.decode import Proposer
from specdraft.eval.tree import DraftTree, ProposerSpec, reorder_tree

BUDGETS = (1, 2, 4, 8, 16, 32, 64)  # node counts a pruned tree is cut to (powers of two: static shapes)


def effective_scores(tree: DraftTree) -> Tensor:
    """Scores made non-increasing along every root path: the minimum over each node's ancestors.

    Without reported scores, the node order stands in (proposers list nodes best first).

    Returns:
        (N,) float, root = its own score (1.0 for a probability).
    """
    assert tree.ancestors is not None
    n = tree.num_nodes
    if tree.scores is None:
        return torch.linspace(1.0, 0.0, n + 1, device=tree.tokens.device)[:n]  # (N,) decreasing by index
    s = tree.scores.to(tree.tokens.device).float()  # (N,)
    inf = torch.full_like(s, float("inf"))
    return torch.where(tree.ancestors, s[None, :], inf[None, :]).amin(1)  # (N,)


def prune_tree(tree: DraftTree, threshold: float, max_nodes: int, max_depth: int) -> DraftTree:
    """The confident subtree of `tree`, cut to a fixed budget (see module docstring).

    Args:
        tree: N nodes, `scores` (N,) cumulative draft probabilities (None: order = confidence, no threshold).
        threshold: keep nodes whose effective score is >= this (0: all).
        max_nodes: node cap (root included), cut down further to the largest `BUDGETS` entry it fills.
        max_depth: deepest node kept (0: root only).

    Returns:
        b nodes, b the largest `BUDGETS` entry <= min(kept, max_nodes) (a power of two; 1: the root alone),
        sorted by score (parents before children), with the kept nodes' `scores`.
    """
    assert tree.depth is not None
    eff = effective_scores(tree)  # (N,)
    keep = tree.depth <= max_depth  # (N,) a depth cut is closed under ancestors
    if tree.scores is not None:
        keep &= eff >= threshold
    keep[0] = True
    if max_depth >= 1 and tree.num_nodes > 1:  # always the most likely child of the root
        first = torch.where(tree.parents == 0, eff, float("-inf"))  # (N,)
        keep[int(first.argmax())] = True
    k = int(keep.sum())
    b = max(x for x in BUDGETS if x <= min(k, max(max_nodes, 1)))
    # rank: score desc, then depth asc (a parent ties before its child), then index asc
    eff_l, depth_l = eff.tolist(), tree.depth.tolist()
    order = sorted(keep.nonzero().squeeze(1).tolist(), key=lambda i: (-eff_l[i], depth_l[i], i))[:b]
    return reorder_tree(tree, order)


def accepted_length(tree: DraftTree, tokens: list[int]) -> int:
    """Drafts of `tree` the target accepted: the longest root path spelled by the start of `tokens` (the
    positions committed since, which begin with the accepted drafts; the bonus never extends the path)."""
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        children.setdefault((p, t), i)
    node, a = 0, 0
    for t in tokens:
        nxt = children.get((node, t))
        if nxt is None:
            break
        node, a = nxt, a + 1
    return a


@dataclass
class AcceptanceController:
    """Draft depth and node budget from the recent acceptance (LLMCad's self-adaptive fallback).

    depth = ceil(EMA(accepted) + 1) (one more than recently accepted, within [1, max_depth]); the budget
    halves after a step with nothing accepted and doubles after one whose whole depth was accepted; after
    `patience` failed steps in a row, `probe` plain target steps (a one-node tree), then one drafted probe;
    a failed probe doubles the gap (up to `max_probe`), an accepted draft resets it.
    """

    max_depth: int
    max_nodes: int
    ema: float = 0.5  # weight of the newest step in EMA(accepted)
    patience: int = 3  # failed drafted steps in a row before falling back
    min_probe: int = 2  # target steps of the first fallback
    max_probe: int = 32  # longest fallback while probes keep failing
    fallback: bool = True  # False: only shrink depth and budget, never switch drafting off

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Optimistic start: full depth and budget, no fallback."""
        self.mean = float(self.max_depth)  # EMA of accepted drafts per drafted step
        self.nodes = self.max_nodes
        self.fails, self.probe, self.countdown = 0, self.min_probe, 0
        self.fallbacks = 0  # how often drafting was switched off (reported)

    @property
    def depth(self) -> int:
        """Depth cap of the next drafted tree."""
        return max(1, min(self.max_depth, math.ceil(self.mean + 1)))

    def should_draft(self) -> bool:
        """False while falling back (counts the step down)."""
        if self.countdown > 0:
            self.countdown -= 1
            return False
        return True

    def observe(self, accepted: int, depth: int) -> None:
        """A drafted step: `accepted` drafts of a tree `depth` deep were accepted."""
        self.mean = (1 - self.ema) * self.mean + self.ema * accepted
        if accepted == 0:
            self.fails += 1
            self.nodes = max(min(2, self.max_nodes), self.nodes // 2)  # keep the root's best child
        else:
            self.fails, self.probe = 0, self.min_probe
            if accepted >= depth:
                self.nodes = min(self.max_nodes, 2 * self.nodes)
        if self.fallback and self.fails >= self.patience:
            self.countdown, self.fails = self.probe, self.patience - 1  # a failed probe falls back again
            self.probe = min(2 * self.probe, self.max_probe)
            self.fallbacks += 1


class AdaptiveProposer:
    """Confidence-adaptive drafting around any proposer whose trees carry `scores` (see module docstring).

    Args:
        inner: the family proposer (ReDrafter, prompt lookup, EAGLE, ...); drafts the full tree.
        threshold: cumulative draft probability a node needs to be verified (LLMCad branches below ~0.3).
        max_nodes: largest budget (None: the inner proposer's `spec.node_budget`, else 64).
        controller: depth/budget/fallback policy (None: `AcceptanceController` with its defaults).
        fallback: with the default controller, fall back to plain target steps while drafts keep failing.
    """

    def __init__(
        self,
        inner: Proposer,
        threshold: float = 0.1,
        max_nodes: int | None = None,
        controller: AcceptanceController | None = None,
        fallback: bool = True,
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"AdaptiveProposer: threshold={threshold} must be in [0, 1]")
        self.inner, self.threshold = inner, float(threshold)
        spec = inner.spec
        cap = max_nodes or spec.node_budget or BUDGETS[-1]
        self.max_nodes = max(x for x in BUDGETS if x <= max(cap, 1))
        self._full_nodes = self.max_nodes  # the budget `fit_budget` caps (and restores)
        depth = spec.max_depth or self.max_nodes - 1
        self.controller = controller or AcceptanceController(depth, self.max_nodes, fallback=fallback)
        self.spec = ProposerSpec(spec.feature_layers, spec.keep_last_hidden, spec.max_depth, spec.node_budget)
        self.last_compression: float | None = None  # a pruned tree is not a beam packing
        self._last: DraftTree | None = None  # the previous drafted tree (None: last step not drafted)
        self._pending: tuple[Tensor, Tensor] | None = None  # positions the inner proposer has not seen

    def reset(self) -> None:
        """A new prompt: forget the acceptance history too (each call decodes the same way on any path)."""
        self.inner.reset()
        self.controller.reset()
        self._last, self._pending, self.last_compression = None, None, None

    def fit_budget(self, nodes: int) -> None:
        """A decoder-wide cap (`NodeBudget`): the inner proposer drafts less, and so do we (a larger cap, as
        a refit's `budget.FULL`, restores the full budget)."""
        self.inner.fit_budget(nodes)
        self.max_nodes = max(x for x in BUDGETS if x <= max(min(nodes, self._full_nodes), 1))
        self.controller.max_nodes = self.max_nodes
        self.controller.nodes = min(self.controller.nodes, self.max_nodes)

    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """The pruned tree of the inner proposer, or the root alone while falling back.

        Args:
            hidden: (n, F) target features of the positions committed since the last call.
            tokens: (n,) the token each predicts; tokens[-1] is the root.

        Returns:
            b nodes, b a power of two <= `max_nodes` (1: a plain target step).
        """
        ctl = self.controller
        if self._last is not None:
            assert self._last.depth is not None
            ctl.observe(accepted_length(self._last, tokens.tolist()), int(self._last.depth.max()))
        if self._pending is not None:  # positions committed during a fallback: the inner proposer needs them
            hidden = torch.cat([self._pending[0], hidden])
            tokens = torch.cat([self._pending[1], tokens])
        if not ctl.should_draft():
            self._last, self._pending = None, (hidden, tokens)
            return DraftTree(
                tokens[-1:].clone(), torch.full((1,), -1, dtype=torch.long, device=tokens.device)
            )
        self._pending = None
        full = self.inner.propose(hidden, tokens)
        tree = prune_tree(full, self.threshold, ctl.nodes, ctl.depth)
        self._last = tree if tree.num_nodes > 1 else None
        return tree
