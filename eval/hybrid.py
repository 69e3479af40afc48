"""Prompt lookup merged into any family's draft tree: a proposer composed around another one.

A small target repeats itself and its prompt: on 8 MT-Bench questions (SmolLM2-135M, greedy, docs/experiments.md
"Session 21") prompt lookup through our decoder served more tokens per step than the copy-gate ReDrafter in 7
of 8 categories (extraction 7.56 against 3.14), while the drafter led on math. The two fail on different text,
so `LookupBranch` drafts both every step and verifies their union:

  * the family's proposer drafts its tree as usual (beams, Medusa's static tree, EAGLE-2's tree);
  * prompt lookup adds its chain (`PromptLookupProposer`, ~1 ms): the tokens that followed the newest earlier
    occurrence of the context's last n-gram. Its nodes are scored by `LookupCalibration`: the measured rate at
    which lookup's depth-d token was right when its first d - 1 were, over recent steps (the committed
    tokens tell, whatever branch was verified), multiplied along the chain. So lookup outranks the drafter
    while the text repeats itself (extraction, code edits) and falls behind it on fresh prose;
  * `merge_trees` takes the union (a node is a token under a parent, so a shared prefix is verified once) and
    ranks the nodes best first by score (the drafter's path probability, lookup's agreement rate), parents
    before children. The node budget (`eval/budget.py`) cuts trees to their first b nodes, so at every cap the
    tree holds the best-scored nodes of both sources.

Where lookup is expected to accept more tokens than the drafter does (the sum of its chain's calibrated
scores against the drafter's recent mean accepted length), the step proposes lookup's chain alone and the
drafter does not draft at all: its draft time and its nodes would buy nothing on text that lookup copies
(measured: with both merged on every step, extraction ran at 2.35x against 3.08x for lookup alone). The
positions committed meanwhile are kept and handed to the drafter on its next step, as the decoders do for a
node budget that paused drafting.

With the target's verify cost curve (`cost`: ms per node count, `eval/budget.py`) the branch also prices the
drafter: a step drafts with it only while its modelled rate, (1 + the drafter's mean accepted length) tokens over
its measured draft time plus the verify of the union's nodes, beats the step without it (lookup's chain, or the
root alone when lookup finds nothing: a plain target step), priced the same way. Otherwise the drafter idles
and is probed again after a few steps (doubling up to `max_probe` while it keeps losing). So where drafting does
not pay on a machine (measured, 2-core Zen 5 in fp32: the node budget turned most drafters off, and lookup went
off with them on turns where prompt lookup alone ran 1.2-1.5x over AR), the step keeps lookup's chain, and the
node budget fitted around the branch prices what it really drafts.

The decoder hands `propose` every committed position, whichever branch the target accepted, so neither source
needs to know about the other. Which nodes are verified never changes the output: lossless as any proposer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor

from specdraft.eval.adaptive import accepted_length, effective_scores
from specdraft.eval.budget import FULL
from specdraft.eval.decode import Proposer, RowBatchedProposer, sync_device
from specdraft.eval.proposers import PromptLookupProposer, host_rows
from specdraft.eval.tree import DraftTree, ProposerSpec, reorder_tree


def merge_trees(first: DraftTree, second: DraftTree) -> DraftTree:
    """The union of two draft trees with the same root, ranked best first.

    A node of `second` whose token already sits under the same parent in `first` is shared, not repeated.
    When both trees carry `scores`, every node's score is its best effective score over the trees that hold
    it (`effective_scores`: non-increasing along each path, so the max over trees is too) and the nodes are
    sorted by (score desc, depth asc, index asc): parents before children, and the first b nodes are a tree.
    Otherwise `first`'s nodes keep their order and `second`'s new ones follow; scores are dropped.

    Args:
        first: N1 nodes (e.g. a drafter's tree).
        second: N2 nodes (e.g. a lookup chain), same root token.

    Returns:
        N <= N1 + N2 - 1 nodes.
    """
    toks, pars = first.tokens.tolist(), first.parents.tolist()
    if int(second.tokens[0]) != toks[0]:
        raise ValueError(f"merge_trees: roots differ ({toks[0]} vs {int(second.tokens[0])})")
    scored = first.scores is not None and second.scores is not None
    s1 = effective_scores(first).tolist() if scored else [0.0] * len(toks)
    s2 = effective_scores(second).tolist() if scored else [0.0] * second.num_nodes
    index = {(p, t): i for i, (p, t) in enumerate(zip(pars, toks, strict=True))}
    node_of = [0]  # second's node j -> merged node
    for j, (p, t) in enumerate(zip(second.parents.tolist(), second.tokens.tolist(), strict=True)):
        if j == 0:
            continue
        key = (node_of[p], t)
        i = index.get(key)
        if i is None:
            i = index[key] = len(toks)
            toks.append(t)
            pars.append(key[0])
            s1.append(s2[j])
        else:
            s1[i] = max(s1[i], s2[j])
        node_of.append(i)
    dev = first.tokens.device
    merged = DraftTree(
        torch.tensor(toks, dtype=torch.long, device=dev),
        torch.tensor(pars, dtype=torch.long, device=dev),
        scores=torch.tensor(s1, dtype=torch.float32, device=dev) if scored else None,
    )
    if not scored:
        return merged
    assert merged.depth is not None
    depth = merged.depth.tolist()
    return reorder_tree(merged, sorted(range(len(toks)), key=lambda i: (-s1[i], depth[i], i)))


def _ema(old: float | None, new: float, weight: float) -> float:
    """A running mean: `new` at first, then `weight` of the newest value."""
    return new if old is None else weight * new + (1 - weight) * old


class LookupCalibration:
    """Per-depth acceptance rates of lookup chains, from the tokens committed after each chain was proposed.

    Depth d counts as tested when the chain's first d - 1 tokens were all committed (and a d-th token was
    committed at all), and as right when its d-th was too. Counts decay by `decay` per observed chain, so the
    rates follow the text; each starts at `prior` (weight `prior_weight`).

    Args:
        max_depth: longest chain.
    """

    def __init__(
        self, max_depth: int, decay: float = 0.9, prior: float = 0.5, prior_weight: float = 1.0
    ) -> None:
        self.decay, self.prior, self.prior_weight = decay, prior, prior_weight
        self.tested = [0.0] * max_depth  # (D,) decayed counts per depth
        self.right = [0.0] * max_depth  # (D,)

    def reset(self) -> None:
        """Back to the prior."""
        self.tested = [0.0] * len(self.tested)
        self.right = [0.0] * len(self.right)

    def observe(self, chain: list[int], committed: list[int]) -> None:
        """chain: the proposed lookup tokens after the root; committed: the tokens committed since."""
        self.tested = [x * self.decay for x in self.tested]
        self.right = [x * self.decay for x in self.right]
        for d, (c, t) in enumerate(zip(chain, committed)):
            self.tested[d] += 1.0
            if c != t:
                break
            self.right[d] += 1.0

    def scores(self, k: int) -> list[float]:
        """Cumulative probabilities of a k-token chain, root excluded: prod over depths <= d of the rates."""
        out, cum = [], 1.0
        for d in range(k):
            cum *= (self.right[d] + self.prior * self.prior_weight) / (self.tested[d] + self.prior_weight)
            out.append(cum)
        return out


class LookupBranch:
    """`inner`'s tree with prompt lookup's chain merged in (see module docstring).

    Args:
        inner: any family's proposer (its features, depth and node budget are declared through).
        num_tokens: lookup continuation length.
        max_ngram: longest suffix n-gram matched against the committed tokens.
        lookup_alone: propose lookup's chain alone (the drafter idle) on steps where it is expected to accept
            more than the drafter's recent mean (False: always the union).
        ema: weight of the newest drafted step in the drafter's mean accepted length (and its draft time).
        cost: verify ms of a tree of n nodes on this decode path (`budget.CostCurve`); None: the drafter drafts
            whenever lookup's chain is not expected to beat it (no pricing).
        min_probe, max_probe: steps the drafter idles, once priced out, before it drafts again as a probe; the
            gap doubles (up to `max_probe`) after each probe that still does not pay.
        clock: seconds, read around the drafter's propose to price it (tests pass a fake one, so the pricing
            does not depend on how loaded the machine is).
    """

    def __init__(
        self,
        inner: Proposer,
        num_tokens: int,
        max_ngram: int = 3,
        lookup_alone: bool = True,
        ema: float = 0.25,
        cost: Callable[[float], float] | None = None,
        min_probe: int = 4,
        max_probe: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if num_tokens < 1:
            raise ValueError(f"LookupBranch: num_tokens={num_tokens} must be >= 1")
        if not 1 <= min_probe <= max_probe:
            raise ValueError(f"LookupBranch: need 1 <= min_probe={min_probe} <= max_probe={max_probe}")
        self.cost, self.min_probe, self.max_probe, self.clock = cost, min_probe, max_probe, clock
        self.draft_ms: float | None = None  # EMA of the drafter's propose time (ms), steps without catch-up
        self.inner_nodes = 0  # nodes of the drafter's latest tree
        self._cap = FULL  # the node cap the decoder's budget set (`fit_budget`)
        self._idle = 0  # steps since the drafter last drafted
        self._probe = min_probe  # idle steps before the next probe
        self.priced_out = 0  # steps the drafter idled because it did not pay (reported)
        self._timed = False  # whether this step's draft time is one step's (`_begin`: no prompt, no catch-up)
        self.inner, self.lookup = inner, PromptLookupProposer(num_tokens, max_ngram)
        self.calibration = LookupCalibration(num_tokens)
        self.lookup_alone, self.ema = lookup_alone, ema
        self._chain: list[int] | None = None  # the previous step's lookup tokens (root excluded)
        self._inner_tree: DraftTree | None = None  # the drafter's previous tree (None: it did not draft)
        self.inner_mean: float | None = None  # EMA of the drafter's accepted drafts per step it drafted
        self._pending: tuple[Tensor, Tensor] | None = None  # positions committed while the drafter was idle
        self.alone_steps = 0  # steps that proposed lookup's chain alone (reported)
        s = inner.spec
        self.spec = ProposerSpec(
            feature_layers=s.feature_layers,
            keep_last_hidden=s.keep_last_hidden,
            max_depth=max(s.max_depth, num_tokens),
            node_budget=s.node_budget + num_tokens if s.node_budget else 0,
        )
        self.last_compression: float | None = None

    def reset(self) -> None:
        """Forget the previous prompt (both sources)."""
        self.inner.reset()
        self.lookup.reset()
        self.calibration.reset()
        self._chain, self.last_compression = None, None
        self._inner_tree, self.inner_mean, self._pending = None, None, None
        self._idle = 0  # (the drafter's cost and its probe gap are the machine's: kept)

    def fit_budget(self, nodes: int) -> None:
        """Each source drafts no more than a `nodes`-node tree (the merged tree is cut to its best `nodes`)."""
        self._cap = nodes
        self.inner.fit_budget(nodes)
        self.lookup.fit_budget(nodes)

    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """The inner tree merged with the lookup chain from the same root when lookup finds one, or that chain
        alone where it is expected to accept more than the drafter (which then keeps the positions for later).

        Args:
            hidden: (n, F) target features of the newly committed positions (for the inner proposer).
            tokens: (n,) the token each predicts; tokens[-1] is the root.
        """
        step = self._begin(hidden, tokens)
        if isinstance(step, DraftTree):
            return step
        chain, hidden, tokens = step
        if self._timed:  # the drafter's time as the cost curve's: what the device ran, not what was queued
            sync_device(tokens.device)
        t0 = self.clock()
        tree = self.inner.propose(hidden, tokens)
        if self._timed:
            sync_device(tokens.device)
        return self._end(tree, chain, (self.clock() - t0) * 1e3 if self._timed else None)

    def propose_rows(
        self, rows: Sequence[Proposer], hidden: Sequence[Tensor], tokens: Sequence[Tensor]
    ) -> list[DraftTree] | None:
        """Every row's `propose`, the inner drafter run once for the rows that draft this step when it drafts
        rows together (`RowBatchedProposer`), else row by row. None when a row is not a `LookupBranch`.

        Args:
            rows: R `LookupBranch`es (this one among them); hidden: R (n_i, F); tokens: R (n_i,).
        """
        if not all(isinstance(p, LookupBranch) for p in rows):
            return None
        ps = cast("list[LookupBranch]", list(rows))
        steps = [
            p._begin(h, t, ids) for p, h, t, ids in zip(ps, hidden, tokens, host_rows(tokens), strict=True)
        ]
        drafting = [i for i, st in enumerate(steps) if not isinstance(st, DraftTree)]
        together: dict[int, DraftTree] = {}  # row -> its drafter's tree, when drafted in one call
        lead = ps[drafting[0]].inner if drafting else None
        if isinstance(lead, RowBatchedProposer):
            ins = [cast(tuple[DraftTree, Tensor, Tensor], steps[i]) for i in drafting]
            trees = lead.propose_rows(
                [ps[i].inner for i in drafting], [x[1] for x in ins], [x[2] for x in ins]
            )
            together = dict(zip(drafting, trees, strict=True)) if trees is not None else {}
        out: list[DraftTree] = []
        for i, (p, st) in enumerate(zip(ps, steps, strict=True)):
            if isinstance(st, DraftTree):
                out.append(st)
                continue
            chain, h, t = st
            out.append(p._end(together[i] if i in together else p.inner.propose(h, t), chain))
        return out

    def _begin(
        self, hidden: Tensor, tokens: Tensor, committed: list[int] | None = None
    ) -> DraftTree | tuple[DraftTree, Tensor, Tensor]:
        """A step up to the drafter: score the previous step, look the chain up; returns the chain alone (the
        step's tree: the drafter idles and keeps the positions) or (chain, hidden, tokens) for the drafter.
        `committed`: `tokens` already read on the host (None: read here)."""
        committed = tokens.tolist() if committed is None else committed
        if self._chain:  # how far the previous chain was right: the committed tokens begin with its answer
            self.calibration.observe(self._chain, committed)
        if self._inner_tree is not None:  # and the drafter's previous tree
            self.inner_mean = _ema(self.inner_mean, accepted_length(self._inner_tree, committed), self.ema)
        chain = self.lookup.chain(committed, tokens.device)  # (1 + k,) chain, k = 0 without a match
        # the drafter's time is a step's only when it reads one step's positions (no prompt, no idle steps)
        self._timed = self._pending is None and tokens.shape[0] <= self.spec.max_depth + 1
        if self._pending is not None:  # the drafter idled: it gets every position committed since it drafted
            hidden, tokens = torch.cat([self._pending[0], hidden]), torch.cat([self._pending[1], tokens])
            self._pending = None
        self._chain = list(self.lookup.last_chain)
        rates = self.calibration.scores(len(self._chain))
        chain.scores = torch.tensor(
            [1.0, *rates], dtype=torch.float32, device=chain.tokens.device
        )  # (1 + k,)
        better = (
            self._chain and self.lookup_alone and self.inner_mean is not None and sum(rates) > self.inner_mean
        )
        priced_out = not better and not self._drafter_pays(len(self._chain), sum(rates))
        if better or priced_out:
            self._pending, self._inner_tree = (hidden, tokens), None
            self.alone_steps += bool(self._chain)
            self.priced_out += priced_out
            self._idle += 1
            self.last_compression = 1.0
            return chain  # (1 + k,): the root alone when lookup found nothing (a plain target step)
        return chain, hidden, tokens

    def _drafter_pays(self, k: int, lookup_tokens: float) -> bool:
        """Whether this step drafts with the drafter, priced on the cost curve (always without one, or before its
        accepted length and draft time are measured): the union's modelled tokens per ms, (1 + max(the drafter's
        mean accepted length, lookup's expected tokens)) / (verify of drafter + lookup nodes, cut to the cap,
        + the draft time), against lookup's chain alone, (1 + its expected tokens) / (verify of 1 + k nodes).
        A probe (the drafter idled `_probe` steps) drafts anyway and doubles the gap while it loses.

        Args:
            k: lookup's chain length this step (0: no match); lookup_tokens: its expected accepted tokens.
        """
        if self.cost is None or self.inner_mean is None or self.draft_ms is None:
            return True
        cost, cap = self.cost, self._cap
        alone = (1.0 + lookup_tokens) / cost(min(1 + k, cap))
        union = (1.0 + max(self.inner_mean, lookup_tokens)) / (
            cost(min(self.inner_nodes + k, cap)) + self.draft_ms
        )
        if union >= alone:
            self._probe = self.min_probe
            return True
        if self._idle >= self._probe:  # a probe: the drafter's accepted length may have changed with the text
            self._probe = min(2 * self._probe, self.max_probe)
            return True
        return False

    def _end(self, tree: DraftTree, chain: DraftTree, draft_ms: float | None = None) -> DraftTree:
        """The drafter's tree of this step merged with the lookup chain (when lookup found one); `draft_ms`: the
        drafter's time this step (None: not timed, e.g. drafted with other rows or catching up on idle steps)."""
        self._inner_tree, self.inner_nodes, self._idle = tree, tree.num_nodes, 0
        if draft_ms is not None:
            self.draft_ms = _ema(self.draft_ms, draft_ms, self.ema)
        self.last_compression = self.inner.last_compression  # the inner beams' packing
        return merge_trees(tree, chain) if self._chain else tree
