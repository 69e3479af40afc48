"""The per-step batch width (eval/batch_width.py): node ranking and calibration keys, the calibration's golden
values and updates, the chosen width against a brute-force argmax, the fallback's gaps, and lossless batched
decoding with the policy on for scored and unscored families on every decoder shape."""

from __future__ import annotations

import pytest
import torch

from specdraft.eval.batch_decode import BatchDecoder, rows_budget_for
from specdraft.eval.batch_width import WidthPolicy, ranked
from specdraft.eval.budget import FULL, CostCurve, NodeBudget
from specdraft.eval.decode import ar_generate
from specdraft.eval.tree import DraftTree
from specdraft.testing import random_prompts, tiny_proposer, tiny_target

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_cpu_thread")
SHAPES = [
    "eager",
    "fixed",
    pytest.param("graph", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]
LENGTHS = [1, 4, 25, 9, 17, 6, 13]
BUDGETS = [14, 20, 1, 9, 20, 16, 11]


def _tree(scores: list[float] | None, parents: list[int] | None = None) -> DraftTree:
    """root ─ a(1) ─ b(2); root ─ c(3) (default shape), tokens 10 + index."""
    parents = parents or [-1, 0, 1, 0]
    n = len(parents)
    return DraftTree(
        torch.arange(10, 10 + n),
        torch.tensor(parents),
        scores=None if scores is None else torch.tensor(scores),
    )


def test_ranked_orders_by_effective_score_parents_first_and_keys_bins_or_ranks():
    # b's own score 0.9 exceeds its parent's 0.5: its effective score is 0.5, and it ties after its parent
    t, keys = ranked(_tree([1.0, 0.5, 0.9, 0.75]), bins=10, ranks=4)
    assert t.tokens.tolist() == [10, 13, 11, 12]  # root, c (0.75), a (0.5), b (0.5, deeper)
    assert t.parents.tolist() == [-1, 0, 0, 2]
    assert keys.tolist() == [9, 7, 5, 5]  # floor(score * 10), 1.0 clamped to the last bin
    t2, keys2 = ranked(_tree(None), bins=10, ranks=2)  # unscored: order kept, keys by rank
    assert t2.tokens.tolist() == [10, 11, 12, 13] and keys2.tolist() == [10, 10, 11, 11]


def test_calibration_golden_values_and_updates():
    pol = WidthPolicy(CostCurve({1: 1.0, 2: 1.0}), bins=4, ranks=2, prior=2.0)
    keys = torch.tensor([0, 1, 2, 3, 4, 5])
    # prior only: bin mid-points 0.125 .. 0.875, ranks 0.5
    assert pol.calibrated(keys).tolist() == pytest.approx([0.125, 0.375, 0.625, 0.875, 0.5, 0.5])
    tree = _tree([1.0, 0.8, 0.6, 0.3])  # ranked: root, a (0.8, bin 3), b (0.6, bin 2), c (0.3, bin 1)
    out = pol.choose({0: tree}, draft_ms=0.0, rows=1, pad=lambda n: n)  # flat cost: every node verified
    assert out[0].num_nodes == 4
    pol.observe({0: [0, 1]}, {0: 4})  # a accepted, b and c rejected
    assert pol.seen.tolist() == [0, 1, 1, 1, 0, 0] and pol.hits.tolist() == [0, 0, 0, 1, 0, 0]
    # bin 3: (1 + 2 * 0.875) / 3; bin 2: (0 + 2 * 0.625) / 3; bin 1: (0 + 2 * 0.375) / 3
    assert pol.calibrated(torch.tensor([3, 2, 1])).tolist() == pytest.approx([2.75 / 3, 1.25 / 3, 0.75 / 3])
    pol.choose({0: tree}, 0.0, 1, lambda n: n)
    pol.observe({0: [0, 1]}, {0: 2})  # only 2 nodes verified (the cache was full): c and b are not counted
    assert pol.seen.tolist() == [0, 1, 1, 2, 0, 0]


def _learnt_policy_and_trees(
    g: torch.Generator, cost: CostCurve, rows: int, smallest: int, largest: int
) -> tuple[WidthPolicy, dict[int, DraftTree]]:
    """A policy with a random learnt calibration (8 bins, 2 ranks) and `rows` random scored trees of
    `smallest` to `largest` - 1 nodes (root score 1)."""
    pol = WidthPolicy(cost, bins=8, ranks=2)
    pol.seen += torch.rand(10, generator=g, dtype=torch.float64) * 20
    pol.hits += pol.seen * torch.rand(10, generator=g, dtype=torch.float64)
    trees = {}
    for r in range(rows):
        n = int(torch.randint(smallest, largest, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        scores = torch.rand(n, generator=g).tolist()
        scores[0] = 1.0
        trees[r] = _tree(scores, parents)
    return pol, trees


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("draft_ms", [0.0, 3.0])
def test_chosen_width_is_the_brute_force_argmax(static, draft_ms):
    """Random scored trees over 5 rows and a learnt calibration: the width maximises expected tokens (each
    row's calibrated probabilities in rank order, made non-increasing) over rows x cost(padded width) + draft
    time among every width, and each row keeps its best nodes."""
    g = torch.Generator().manual_seed(3)
    cost = CostCurve({1: 1.0, 2: 1.3, 4: 1.9, 8: 3.1, 16: 5.0})
    pad = rows_budget_for if static else (lambda n: n)
    for trial in range(6):
        pol, trees = _learnt_policy_and_trees(g, cost, 5, 2, 14)
        out = pol.choose(trees, draft_ms, rows=5, pad=pad)
        rk = {r: ranked(t, 8, 2) for r, t in trees.items()}
        most = max(t.num_nodes for t in trees.values())

        gains = {
            w: sum(1.0 + float(pol.calibrated(k[1:]).cummin(0).values[: w - 1].sum()) for _, k in rk.values())
            for w in range(1, most + 1)
        }
        rates = {w: gains[w] / (5 * cost(pad(w)) + draft_ms) for w in range(1, most + 1)}
        best = max(rates.values())
        w = pol.widths[-1]
        assert rates[w] == pytest.approx(best), (trial, w, rates)
        for r, t in out.items():
            assert t.num_nodes == min(w, trees[r].num_nodes)
            assert t.tokens.tolist() == rk[r][0].tokens[: t.num_nodes].tolist()


@pytest.mark.parametrize("draft_ms", [0.0, 3.0])
def test_packed_choice_keeps_the_batch_best_nodes_at_the_best_count(draft_ms):
    """`packed` (the eager CPU verify computes real nodes only): the step keeps the K nodes of highest
    calibrated probability over all rows (each row's probabilities made non-increasing in rank order), K
    maximising expected tokens over rows x cost(1 + K / rows) + draft time; each row keeps a best-first prefix."""
    g = torch.Generator().manual_seed(5)
    cost = CostCurve({1: 1.0, 2: 1.4, 4: 2.2, 8: 3.9})
    for trial in range(6):
        pol, trees = _learnt_policy_and_trees(g, cost, 4, 1, 10)
        out = pol.choose(trees, draft_ms, rows=4, pad=lambda n: n, packed=True)
        probs = {}
        for r, t in trees.items():
            rt, k = ranked(t, 8, 2)
            probs[r] = pol.calibrated(k[1:]).cummin(0).values.tolist() if t.num_nodes > 1 else []
            assert out[r].tokens.tolist() == rt.tokens[: out[r].num_nodes].tolist()  # a best-first prefix
        every = sorted((v for vs in probs.values() for v in vs), reverse=True)
        rates = [(4 + sum(every[:k])) / (4 * cost(1 + k / 4) + draft_ms) for k in range(len(every) + 1)]
        kept = sum(t.num_nodes - 1 for t in out.values())
        assert rates[kept] == pytest.approx(max(rates)), (trial, kept, rates)
        taken = [v for r, vs in probs.items() for v in vs[: out[r].num_nodes - 1]]
        left = [v for r, vs in probs.items() for v in vs[out[r].num_nodes - 1 :]]
        assert not taken or not left or min(taken) >= max(left) - 1e-12


def test_fallback_pauses_drafting_and_the_gap_doubles_while_probes_fail():
    steep = CostCurve({1: 1.0, 2: 100.0, 4: 200.0})  # no width pays: the best is 1, below plain by the draft
    pol = WidthPolicy(steep, window=3, gap=4, max_gap=8)
    tree = _tree([1.0, 0.9, 0.8, 0.9])
    pattern = []
    for _ in range(30):
        if pol.drafting():
            pattern.append("d")
            assert pol.choose({0: tree}, draft_ms=0.5, rows=1, pad=lambda n: n)[0].num_nodes == 1
        else:
            pattern.append(".")
    assert "".join(pattern) == "ddd....ddd........ddd........ddd"[:30]
    assert pol.fallbacks == 3 and pol.off_steps == 20
    flat = WidthPolicy(CostCurve({1: 1.0, 2: 1.0}), window=3, gap=4)
    for _ in range(9):  # drafting pays: never paused
        assert flat.drafting()
        flat.choose({0: tree}, draft_ms=0.5, rows=1, pad=lambda n: n)
    assert flat.fallbacks == 0


def test_bad_settings_and_a_fitted_budget_with_width_are_refused():
    with pytest.raises(ValueError, match="window=0"):
        WidthPolicy(CostCurve({1: 1.0}), window=0)
    with pytest.raises(ValueError, match="gap"):
        WidthPolicy(CostCurve({1: 1.0}), gap=8, max_gap=4)
    model = tiny_target("llama", CPU)
    with pytest.raises(ValueError, match="fixed node budget"):
        BatchDecoder(model, 2, 64).generate(
            random_prompts([3]), 4, set(), lambda: tiny_proposer("lookup", model),
            budget=NodeBudget(CostCurve({1: 1.0})), width=WidthPolicy(CostCurve({1: 1.0})),
        )  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["redrafter_copy", "eagle3", "medusa", "lookup"])
def test_batched_with_width_policy_equals_batch1_ar(family, shape):
    """Scored (ReDrafter, EAGLE-3) and unscored (Medusa, prompt lookup) trees, 3 rows, mixed prompts and
    budgets, refills: with the width policy every request's output is its batch-1 AR output, in two calls
    sharing the policy; a cost curve between flat and steep makes the widths vary."""
    dev = torch.device("cuda") if shape == "graph" else CPU
    model = tiny_target("llama", dev)
    prompts = random_prompts(LENGTHS, seed=4)
    free = [ar_generate(model, None, p, m, stop_ids=set())[0] for p, m in zip(prompts, BUDGETS, strict=True)]
    stops = {free[1][7], free[4][11]}
    refs = [ar_generate(model, None, p, m, stop_ids=stops)[0] for p, m in zip(prompts, BUDGETS, strict=True)]
    dec = BatchDecoder(model, 3, 1024, static=shape != "eager", graphs=shape == "graph")
    pol = WidthPolicy(CostCurve({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 2.5, 32: 4.0, 64: 7.0}), window=4, gap=2)
    factory = lambda: tiny_proposer(family, model)  # noqa: E731
    sizes: set[int] = set()
    for _ in range(2):
        res = dec.generate(prompts, BUDGETS, stops, factory, width=pol)
        assert [out for out, _ in res] == refs
        sizes |= {n for _, s in res for n in s.tree_sizes}
    assert pol.seen.sum() > 0 and max(sizes) > 1  # trees were verified and learnt from
    # (random drafters: once learnt, most steps verify the root alone, and the fallback pauses drafting)


def test_width_policy_widens_for_right_drafts_and_narrows_for_wrong_ones():
    """A proposer whose first child is the target's next token (scored 0.93) and whose other nodes are wrong
    (scored 0.63): the calibration learns it, so the widths settle on 2 (root + the right child), and the
    proposers are told to draft 4 nodes."""
    model = tiny_target("llama", CPU)
    prompts = random_prompts([5, 9, 12], seed=2)
    refs = [ar_generate(model, None, p, 24, stop_ids=set())[0] for p in prompts]
    table = {tuple(p): r for p, r in zip(prompts, refs, strict=True)}

    class Half:
        """Root, the right next token (0.93), then three wrong siblings (0.63)."""

        from specdraft.eval.tree import ProposerSpec

        spec = ProposerSpec(max_depth=1, node_budget=5)
        last_compression = None

        def __init__(self) -> None:
            self.seen: list[int] = []

        def reset(self) -> None:
            self.seen = []

        fits: list[int] = []  # every cap the decoder set, all rows

        def fit_budget(self, nodes: int) -> None:
            Half.fits.append(nodes)

        def propose(self, hidden: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
            self.seen += tokens.tolist()  # prompt[1:], then every emitted token (the root last)
            key = max((k for k in table if tuple(self.seen[: len(k) - 1]) == k[1:]), key=len)
            ref, emitted = table[key], len(self.seen) - (len(key) - 1)
            nxt = ref[emitted] if emitted < len(ref) else 0
            wrong = [t for t in range(100, 110) if t != nxt][:3]
            return DraftTree(
                torch.tensor([tokens[-1].item(), nxt, *wrong]),
                torch.tensor([-1, 0, 0, 0, 0]),
                scores=torch.tensor([1.0, 0.93, 0.63, 0.63, 0.63]),
            )

    cost = CostCurve({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0})
    pol = WidthPolicy(cost, prior=1.0)
    dec = BatchDecoder(model, 3, 256)
    for _ in range(3):
        res = dec.generate(prompts, 24, set(), Half, width=pol)
        assert [out for out, _ in res] == refs
    assert pol.calibrated(torch.tensor([18])).item() > 0.9  # 0.93: always accepted
    assert pol.calibrated(torch.tensor([12])).item() < 0.1  # 0.63: never
    late = pol.widths[-10:]
    assert set(late) == {2}, pol.widths
    assert pol.widths[0] == 5  # the first step verified the whole tree: the prior is optimistic
    # rows keep 2 nodes: the proposers are told to draft 4 (twice that), the cap each later call starts at
    assert pol.draft_nodes == 4 and set(Half.fits) <= {4, 16, FULL} and Half.fits[-1] == 4  # 16: first 5 kept


def test_width_policy_chooses_within_a_fixed_cap():
    """With `NodeBudget.fixed(4)` the proposers draft at most 4 nodes and every width stays within them; a flat
    cost curve then verifies every drafted node; outputs equal batch-1 AR."""
    model = tiny_target("llama", CPU)
    prompts = random_prompts(LENGTHS, seed=4)
    refs = [ar_generate(model, None, p, m, stop_ids=set())[0] for p, m in zip(prompts, BUDGETS, strict=True)]
    pol = WidthPolicy(CostCurve({1: 1.0, 2: 1.0}))
    res = BatchDecoder(model, 3, 1024).generate(
        prompts, BUDGETS, set(), lambda: tiny_proposer("redrafter_copy", model),
        budget=NodeBudget.fixed(4), width=pol,
    )  # fmt: skip
    assert [out for out, _ in res] == refs
    assert max(pol.widths) == 4 and set(pol.widths) <= {1, 2, 3, 4}
    assert {n for _, s in res for n in s.tree_sizes} <= {1, 2, 3, 4}
