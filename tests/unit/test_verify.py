"""Acceptance rules on stub logits: greedy always/never/partial, and exactness of rejection sampling."""

from collections import Counter

import pytest
import torch

from specdraft.eval.tree import DraftTree
from specdraft.eval.verify import greedy_verify, sample_verify, warp_probs
from specdraft.testing import chi_square_pvalue

V = 6


def _onehot_logits(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits  # (N, V)


CHAIN = DraftTree(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 1, 2]))
#        root 0 ─ 1 ─ 2            nodes: 0:r  1:'1'  2:'2'  3:'3'  4:'4'  5:'5'
#               ├ 3                 (node 3 is a second child of the root, node 5 a child of node 3)
#               └ 4 ─ ...
BRANCHY = DraftTree(torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([-1, 0, 1, 0, 0, 3]))


def test_greedy_always_accepts():
    path, bonus = greedy_verify(CHAIN, _onehot_logits([1, 2, 3, 5]))
    assert path.tolist() == [0, 1, 2, 3] and bonus == 5


def test_greedy_never_accepts():
    path, bonus = greedy_verify(CHAIN, _onehot_logits([4, 2, 3, 5]))
    assert path.tolist() == [0] and bonus == 4


def test_greedy_partial_acceptance():
    path, bonus = greedy_verify(CHAIN, _onehot_logits([1, 2, 0, 5]))
    assert path.tolist() == [0, 1, 2] and bonus == 0


def test_greedy_picks_the_matching_branch():
    # root's argmax is '3' -> node 3; node 3's argmax is '5' -> node 5; bonus from node 5
    path, bonus = greedy_verify(BRANCHY, _onehot_logits([3, 2, 0, 5, 0, 1]))
    assert path.tolist() == [0, 3, 5] and bonus == 1
    # a mismatch deep in the first branch does not leak acceptance into it
    path, bonus = greedy_verify(BRANCHY, _onehot_logits([1, 4, 0, 5, 0, 1]))
    assert path.tolist() == [0, 1] and bonus == 4


def test_sampling_at_near_zero_temperature_is_greedy():
    g = torch.Generator().manual_seed(0)
    logits = _onehot_logits([3, 2, 0, 5, 0, 1]) * 10
    path, bonus = sample_verify(BRANCHY, logits, temperature=0.01, generator=g)
    assert path.tolist() == [0, 3, 5] and bonus == 1


# ---- exactness of the sampling rule ------------------------------------------------------------------
# Tree with a duplicate sibling (node 3 repeats node 1's token) and a leaf-only branch.
SAMPLE_TREE = DraftTree(torch.tensor([0, 1, 2, 1, 3, 0, 4]), torch.tensor([-1, 0, 0, 0, 1, 1, 2]))


def _target_outcomes(tree: DraftTree, probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """The target's law of the emitted sequence: at node u draw x ~ p_u; descend if x is a child token."""
    out: dict[tuple[int, ...], float] = {}

    def walk(node: int, prefix: tuple[int, ...], prob: float) -> None:
        children = {}
        for c in (tree.parents == node).nonzero().squeeze(1).tolist():
            children.setdefault(int(tree.tokens[c]), c)  # first sibling wins for duplicates
        for x in range(probs.shape[1]):
            q = prob * float(probs[node, x])
            if x in children:
                walk(children[x], (*prefix, x), q)
            else:
                out[(*prefix, x)] = q

    walk(0, (), 1.0)
    return out


def _broken_residual(tree, logits, temperature, top_k=0, top_p=1.0, generator=None):
    """BROKEN: correct acceptance, but the bonus is drawn from p_u instead of the residual."""
    path, _ = sample_verify(tree, logits, temperature, top_k, top_p, generator)
    probs = warp_probs(logits[path[-1]], temperature, top_k, top_p)
    return path, int(torch.multinomial(probs, 1, generator=generator))


def _broken_no_renorm(tree, logits, temperature, top_k=0, top_p=1.0, generator=None):
    """BROKEN: each child accepted with p_u(c) without renormalising after earlier rejections."""
    probs = warp_probs(logits, temperature, top_k, top_p)
    node, path = 0, [0]
    while True:
        children = (tree.parents == node).nonzero().squeeze(1).tolist()
        nxt = next(
            (c for c in children if torch.rand(1, generator=generator) < probs[node, tree.tokens[c]]), None
        )
        if nxt is None:
            residual = probs[node].clone()
            residual[tree.tokens[children]] = 0
            return torch.tensor(path), int(torch.multinomial(residual, 1, generator=generator))
        node = nxt
        path.append(node)


def _sample_outcomes(rule, logits, n, temperature, top_k=0, top_p=1.0):
    g = torch.Generator().manual_seed(1234)
    counts: Counter = Counter()
    for _ in range(n):
        path, bonus = rule(SAMPLE_TREE, logits, temperature, top_k, top_p, g)
        counts[(*SAMPLE_TREE.tokens[path[1:]].tolist(), bonus)] += 1
    return counts


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_sampling_rule_matches_target_distribution(temperature, top_k, top_p):
    logits = torch.randn(SAMPLE_TREE.num_nodes, V, generator=torch.Generator().manual_seed(3)) * 1.5
    expected = _target_outcomes(SAMPLE_TREE, warp_probs(logits, temperature, top_k, top_p))
    n = 4000
    counts = _sample_outcomes(sample_verify, logits, n, temperature, top_k, top_p)
    assert chi_square_pvalue(counts, expected, n) > 1e-3


@pytest.mark.parametrize("broken", [_broken_residual, _broken_no_renorm])
def test_chi_square_detects_broken_rules(broken):
    logits = torch.randn(SAMPLE_TREE.num_nodes, V, generator=torch.Generator().manual_seed(3)) * 1.5
    expected = _target_outcomes(SAMPLE_TREE, warp_probs(logits, 1.0))
    n = 4000
    counts = _sample_outcomes(broken, logits, n, 1.0)
    assert chi_square_pvalue(counts, expected, n) < 1e-6


def test_warp_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert (warp_probs(logits, 1.0, top_k=2)[0, 2:] == 0).all()
    p = warp_probs(logits, 1.0, top_p=0.5)  # the top token alone has mass ~0.64 >= 0.5
    assert p[0, 0] == 1.0


def test_greedy_verify_rows_is_the_reference_rule_per_row():
    """B random trees padded to one width (padding never accepted, tiny vocabulary so many drafts match):
    every row's [a, bonus, path, path tokens] is `greedy_verify` on its real nodes, the padded path is the
    identity past a, and the gain curve is the accepted count of each truncated tree."""
    from specdraft.eval.batch_decode import _pack_trees
    from specdraft.eval.verify import greedy_verify_rows

    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        B, vocab = int(torch.randint(1, 6, (1,), generator=g)), 3
        trees = {}
        for r in range(B):
            n = int(torch.randint(1, 10, (1,), generator=g))
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
            trees[r] = DraftTree(torch.randint(0, vocab, (n,), generator=g), torch.tensor(parents))
        b = max(t.num_nodes for t in trees.values()) + int(torch.randint(0, 3, (1,), generator=g))
        roots = [int(trees[r].tokens[0]) for r in range(B)]
        tokens, parents, anc, depth, valid = _pack_trees(trees, roots, b, torch.device("cpu"))
        logits = torch.randn(B, b, vocab, generator=g, dtype=torch.float64)
        packed = greedy_verify_rows(tokens, parents, anc, depth, logits, valid, prefix_accept=True)
        assert packed.shape == (B, 3 * b + 2)
        for r, tree in trees.items():
            n = tree.num_nodes
            path, bonus = greedy_verify(tree, logits[r, :n])
            a = path.shape[0]
            row = packed[r].tolist()
            assert row[0] == a and row[1] == bonus
            assert row[2 : 2 + b] == path.tolist() + list(range(a, b))  # identity past a
            assert row[2 + b : 2 + b + a] == tree.tokens[path].tolist()
            gains = [greedy_verify(tree.truncated(k), logits[r, :k])[0].shape[0] for k in range(1, n + 1)]
            assert row[2 + 2 * b : 2 + 2 * b + n] == gains


def test_pack_trees_of_one_size_equal_row_by_row():
    """Trees of one size (the fixed-shape proposers) are packed for all rows at once; each row equals the row
    packed alone (the per-row loop), idle rows keep the root-only layout."""
    from specdraft.eval.batch_decode import _pack_trees

    g = torch.Generator().manual_seed(1)
    cpu = torch.device("cpu")
    for n in (1, 5, 9):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        trees = {
            r: DraftTree(torch.randint(0, 50, (n,), generator=g), torch.tensor(parents)) for r in (0, 2, 3)
        }
        roots = [int(trees[r].tokens[0]) if r in trees else 7 for r in range(5)]
        b = n + 3
        got = _pack_trees(trees, roots, b, cpu)
        for r in range(5):
            ref = _pack_trees({r: trees[r]} if r in trees else {}, roots, b, cpu)
            for x, y in zip(got, ref, strict=True):
                assert torch.equal(x[r], y[r]), r
