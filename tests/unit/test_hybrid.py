"""Prompt lookup merged into any family's tree (eval/hybrid.py): the union, its ranking, and lossless decoding."""

from __future__ import annotations

import pytest
import torch

from specdraft.eval.hybrid import LookupBranch, LookupCalibration, merge_trees
from specdraft.eval.tree import DraftTree, ProposerSpec


def _tree(tokens: list[int], parents: list[int], scores: list[float] | None = None) -> DraftTree:
    s = None if scores is None else torch.tensor(scores)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), scores=s)


def _is_tree_at_every_cut(tree: DraftTree) -> bool:
    """Every prefix of the node list is a tree: each node's parent comes before it."""
    return all(p < i for i, p in enumerate(tree.parents.tolist()) if i) and int(tree.parents[0]) == -1


def test_merge_shares_prefixes_and_ranks_nodes_by_score():
    drafter = _tree([5, 1, 2, 3], [-1, 0, 1, 0], [1.0, 0.6, 0.3, 0.2])  # 5 -> 1 -> 2, 5 -> 3
    chain = _tree([5, 1, 7, 8], [-1, 0, 1, 2], [1.0, 0.5, 0.5, 0.25])  # 5 -> 1 -> 7 -> 8
    m = merge_trees(drafter, chain)
    # 1 is shared (best of 0.6 and 0.5); ranked: 5, 1 (.6), 7 (.5), 2 (.3), 8 (.25), 3 (.2)
    assert m.tokens.tolist() == [5, 1, 7, 2, 8, 3]
    assert m.parents.tolist() == [-1, 0, 1, 1, 2, 0]
    assert m.depth.tolist() == [0, 1, 2, 2, 3, 1]
    assert m.scores.tolist() == pytest.approx([1.0, 0.6, 0.5, 0.3, 0.25, 0.2])
    assert _is_tree_at_every_cut(m)
    assert m.truncated(3).tokens.tolist() == [5, 1, 7]  # the budget's cut keeps the best of both sources


def test_merge_uses_effective_scores_and_ties_put_parents_first():
    # a drafter child scored above its parent counts at its parent's score; equal scores: shallower first
    drafter = _tree([4, 9, 6], [-1, 0, 1], [1.0, 0.4, 0.9])
    chain = _tree([4, 2, 3], [-1, 0, 1], [1.0, 0.4, 0.4])
    m = merge_trees(drafter, chain)
    assert m.tokens.tolist() == [4, 9, 2, 6, 3]
    assert m.parents.tolist() == [-1, 0, 0, 1, 2]
    assert _is_tree_at_every_cut(m)


def test_merge_without_scores_appends_the_new_nodes_in_order():
    first = _tree([5, 1, 2], [-1, 0, 0])
    chain = _tree([5, 2, 9], [-1, 0, 1], [1.0, 0.5, 0.5])
    m = merge_trees(first, chain)
    assert m.tokens.tolist() == [5, 1, 2, 9] and m.parents.tolist() == [-1, 0, 0, 2] and m.scores is None


def test_merge_rejects_trees_with_different_roots():
    with pytest.raises(ValueError, match="roots differ"):
        merge_trees(_tree([5, 1], [-1, 0]), _tree([6, 1], [-1, 0]))


class _FixedChain:
    """A stand-in family: always drafts the chain [root, 1, 2, 3] with scores 0.9, 0.8, 0.7."""

    last_compression = 1.0

    def __init__(self) -> None:
        self.spec = ProposerSpec(feature_layers=(2,), keep_last_hidden=True, max_depth=3, node_budget=4)
        self.caps: list[int] = []
        self.calls = 0
        self.seen: list[tuple[int, list[int]]] = []  # (positions, tokens) of every call

    def reset(self) -> None:
        self.calls = 0

    def fit_budget(self, nodes: int) -> None:
        self.caps.append(nodes)

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        self.calls += 1
        self.seen.append((hidden.shape[0], tokens.tolist()))
        return _tree([int(tokens[-1]), 1, 2, 3], [-1, 0, 1, 2], [1.0, 0.9, 0.8, 0.7])


def test_lookup_branch_declares_the_inner_contract_and_forwards_budget_and_reset():
    inner = _FixedChain()
    branch = LookupBranch(inner, 6, lookup_alone=False)  # always the union
    assert branch.spec == ProposerSpec(
        feature_layers=(2,), keep_last_hidden=True, max_depth=6, node_budget=10
    )
    branch.fit_budget(3)
    assert inner.caps == [3] and branch.lookup.draft_len == 2
    # no match in the context: the inner tree as it is
    tree = branch.propose(torch.zeros(3, 4), torch.tensor([10, 11, 12]))
    assert tree.tokens.tolist() == [12, 1, 2, 3]
    # "12 40 41 ..." seen before: the chain joins, cut to the fitted length
    tree = branch.propose(torch.zeros(4, 4), torch.tensor([40, 41, 42, 12]))
    assert sorted(tree.tokens.tolist()) == [1, 2, 3, 12, 40, 41]
    # lookup right on every recent step: its chain now outranks the drafter's (0.9, 0.8, 0.7)
    branch.calibration.right, branch.calibration.tested = [50.0] * 6, [50.0] * 6
    tree = branch.propose(torch.zeros(1, 4), torch.tensor([40]))  # "... 12 40": the chain 41, 42 joins
    assert tree.tokens.tolist()[:3] == [40, 41, 42] and tree.scores[1] > 0.95
    branch.reset()
    assert inner.calls == 0 and branch.lookup.index is None and branch.calibration.tested == [0.0] * 6
    with pytest.raises(ValueError, match="num_tokens"):
        LookupBranch(inner, 0)


def test_lookup_calibration_counts_tested_and_right_depths():
    cal = LookupCalibration(3, decay=1.0)
    assert cal.scores(3) == pytest.approx([0.5, 0.25, 0.125])  # the prior
    cal.observe([7, 8, 9], [7, 8, 9, 4])  # all three right: each rate (1 + 0.5) / (1 + 1)
    assert cal.scores(3) == pytest.approx([0.75, 0.75**2, 0.75**3])
    cal.observe([7, 8, 9], [7, 5])  # depth 1 right, depth 2 wrong, depth 3 untested
    r1, r2, r3 = 2.5 / 3, 1.5 / 3, 0.75
    assert cal.scores(3) == pytest.approx([r1, r1 * r2, r1 * r2 * r3])
    cal.observe([7], [])  # nothing committed yet: nothing tested
    assert cal.scores(3) == pytest.approx([r1, r1 * r2, r1 * r2 * r3])
    fading = LookupCalibration(1, decay=0.5)
    for _ in range(20):
        fading.observe([1], [1])
    fading.observe([1], [2])  # one miss after a long run of hits weighs half of all of them
    assert fading.scores(1)[0] == pytest.approx((1.0 + 0.5) / (2.0 + 1.0), abs=1e-4)


def test_lookup_alone_where_it_beats_the_drafter_and_the_drafter_gets_the_skipped_positions():
    inner = _FixedChain()
    branch = LookupBranch(inner, 4)
    branch.propose(torch.zeros(3, 4), torch.tensor([5, 6, 7]))  # no match: the drafter's tree
    # the drafter's chain 1, 2, 3 after 7 was wrong (8 came): mean 0 accepted; "5 6" matched: lookup alone
    tree = branch.propose(torch.zeros(3, 4), torch.tensor([8, 5, 6]))
    assert tree.tokens.tolist() == [6, 7, 8, 5, 6] and branch.alone_steps == 1 and inner.calls == 1
    # no match: the drafter drafts again, handed every position since its last tree
    tree = branch.propose(torch.ones(1, 4), torch.tensor([9]))
    assert tree.tokens.tolist() == [9, 1, 2, 3] and inner.seen[-1] == (4, [8, 5, 6, 9])
    assert branch.lookup.index is not None and branch.lookup.index.ids == [
        5,
        6,
        7,
        8,
        5,
        6,
        9,
    ]  # lookup saw each position once
    assert branch.inner_mean == 0.0


def test_a_priced_drafter_idles_where_it_does_not_pay_and_is_probed_again():
    """With a verify cost curve, the drafter drafts only while (1 + its mean accepted) / (verify of its nodes +
    its draft time) beats the step without it; priced out, the step is lookup's chain or the root alone, and the
    drafter drafts again as a probe after `min_probe` idle steps, the gap doubling up to `max_probe`.

    A fake clock makes every draft take 0.1 ms, so the prices do not depend on the machine's load (a busy CI
    host once timed this chain's draft above the 0.75 ms the flat curve leaves it, and the test failed)."""
    inner = _FixedChain()
    steep = lambda n: float(n)  # noqa: E731  (ms per n verified nodes: a 4-node tree costs 4 plain steps)
    ticks = iter(range(10_000))  # each read of the clock is 0.1 ms after the previous one
    clock = lambda: next(ticks) * 1e-4  # noqa: E731  (seconds)
    branch = LookupBranch(inner, 4, cost=steep, min_probe=2, max_probe=4, clock=clock)
    assert branch.propose(torch.zeros(3, 4), torch.tensor([5, 6, 7])).num_nodes == 4  # unmeasured: it drafts
    assert branch.draft_ms == pytest.approx(0.1)  # one step's positions: timed (by the fake clock)
    # its first token was right (mean 1 accepted): (1 + 1) / (4 + draft) < 1 / 1 for a plain step
    assert branch.propose(torch.zeros(1, 4), torch.tensor([1])).tokens.tolist() == [1]
    assert branch.propose(torch.zeros(1, 4), torch.tensor([9])).tokens.tolist() == [9]
    assert inner.calls == 1 and branch.priced_out == 2 and branch.inner_mean == 1.0
    # two idle steps: a probe drafts, handed every position since its last tree
    assert branch.propose(torch.ones(1, 4), torch.tensor([10])).num_nodes == 4
    assert inner.calls == 2 and inner.seen[-1] == (3, [1, 9, 10])
    for tok in range(11, 15):  # the probe lost (mean 0.75): four idle steps now
        assert branch.propose(torch.zeros(1, 4), torch.tensor([tok])).num_nodes == 1
    assert inner.calls == 2 and branch.priced_out == 6
    branch.propose(torch.zeros(1, 4), torch.tensor([15]))
    assert inner.calls == 3 and branch._probe == 4  # probed again; the gap stays at max_probe
    # on a flat curve the same drafter pays: it drafts every step and the gap is back at min_probe
    branch.cost = lambda n: 1.0
    for tok in range(16, 19):
        assert branch.propose(torch.zeros(1, 4), torch.tensor([tok])).num_nodes == 4
    assert inner.calls == 6 and branch._probe == 2
    with pytest.raises(ValueError, match="min_probe"):
        LookupBranch(inner, 4, min_probe=0)
