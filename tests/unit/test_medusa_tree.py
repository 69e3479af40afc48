"""Medusa static trees: construction from accuracies (vs brute force), the proposer, lossless decoding
through the shared decoder, and the (lossy) typical acceptance rule."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.medusa_tree import (
    MedusaProposer,
    build_tree,
    expected_accept_length,
    rank_hits,
    typical_verify,
)
from specdraft.eval.proposers import make_proposer
from specdraft.eval.tree import DraftTree, path_to
from specdraft.eval.verify import sample_verify
from specdraft.models.medusa import build
from specdraft.models.medusa_choices import DEFAULT_TREE, check_tree, prune_tree
from specdraft.testing import tiny_llama


# ---- tree construction ---------------------------------------------------------------------------------------
def simulated_length(paths, acc: torch.Tensor) -> float:
    """E[tokens/step] by enumerating every outcome: head j's right token sits at rank c_j (or nowhere), heads
    independent; greedy verification accepts the longest root path (c_0, .., c_{d-1}) present in the tree."""
    heads, k = acc.shape
    tree = set(map(tuple, paths))
    total = 0.0
    for outcome in itertools.product(range(k + 1), repeat=heads):  # rank k = "not in the top-k"
        prob = 1.0
        for j, c in enumerate(outcome):
            prob *= float(acc[j, c]) if c < k else 1.0 - float(acc[j].sum())
        d = 0
        while d < heads and outcome[d] < k and outcome[: d + 1] in tree:
            d += 1
        total += prob * (1 + d)
    return total


def all_trees(heads: int, k: int, size: int):
    """Every prefix-closed set of `size` rank paths."""
    cands = [p for d in range(1, heads + 1) for p in itertools.product(range(k), repeat=d)]
    for sub in itertools.combinations(cands, size):
        s = set(sub)
        if all(len(p) == 1 or p[:-1] in s for p in sub):
            yield sub


@pytest.mark.parametrize("acc", [
    [[0.6, 0.2], [0.5, 0.3]],
    [[0.3, 0.25], [0.7, 0.1], [0.45, 0.4]],
    [[0.9, 0.05], [0.1, 0.05], [0.8, 0.1]],
])  # fmt: skip
def test_build_tree_matches_brute_force(acc):
    acc = torch.tensor(acc, dtype=torch.float64)
    heads, k = acc.shape
    for budget in range(1, 6):
        paths, claimed = build_tree(acc, budget)
        assert len(paths) == budget - 1  # within budget (the root is node 0)
        assert len(check_tree(paths, heads)) == budget - 1  # valid: every parent present, depth <= heads
        assert claimed == pytest.approx(simulated_length(paths, acc), abs=1e-12)
        assert claimed == pytest.approx(expected_accept_length(paths, acc), abs=1e-12)
        best = max(simulated_length(t, acc) for t in all_trees(heads, k, budget - 1))
        assert claimed == pytest.approx(best, abs=1e-12)
    # the paths come in greedy order, so every prefix is the optimal tree for a smaller budget
    long, _ = build_tree(acc, 6)
    assert long[:3] == build_tree(acc, 4)[0]


def test_build_tree_budget_larger_than_full_tree():
    acc = torch.tensor([[0.5, 0.2]])
    paths, claimed = build_tree(acc, 50)
    assert sorted(paths) == [(0,), (1,)] and claimed == pytest.approx(1.7)
    with pytest.raises(ValueError, match="num_nodes"):
        build_tree(acc, 0)


def test_rank_hits_golden():
    logits = torch.tensor(
        [[[3.0, 2.0, 1.0], [0.0, 1.0, 2.0]], [[1.0, 3.0, 2.0], [5.0, 4.0, 0.0]]]
    )  # (N=2, D=2, V=3)
    targets = torch.tensor([[1, 2], [2, -100]])
    hits, valid = rank_hits(logits, targets, 2)
    assert hits.tolist() == [[0.0, 2.0], [1.0, 0.0]] and valid.tolist() == [2.0, 1.0]


def test_default_tree_check_and_prune():
    paths = check_tree(DEFAULT_TREE, 4)
    assert len(paths) == 63 and max(map(len, paths)) == 4 and max(max(p) for p in paths) == 9
    small = prune_tree(DEFAULT_TREE, num_heads=2, topk=3, max_nodes=8)
    assert len(small) == 7 and check_tree(small, 2) and all(max(p) < 3 for p in small)
    # the given (importance) order is kept: the first nodes are the tree a smaller budget keeps
    assert small == [(0,), (0, 0), (1,), (0, 1), (2,), (1, 0), (0, 2)]
    assert check_tree([(0, 1), (1,), (0,)], 2) == [(0,), (0, 1), (1,)]  # a parent listed later moves up
    for bad, msg in [([[0, 0]], "no parent"), ([[0], [0, 0], [0, 0, 0]], "depth 3"), ([[0], [-1]], ">= 0")]:
        with pytest.raises(ValueError, match=msg):
            check_tree(bad, 2)


# ---- the proposer ----------------------------------------------------------------------------------------------
H, V = 32, 128


@pytest.fixture
def medusa64():
    """Random (non-identity) Medusa heads on the fp64 tiny Llama's sizes."""
    target = tiny_llama(dtype=torch.float64)
    schema = OmegaConf.create(
        {
            "draft_len": 3,
            "num_layers": 1,
            "loss_decay": 0.8,
            "init_from_lm_head": True,
            "topk": 4,
            "tree_choices": None,
        }
    )
    model = build(
        schema, target, {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": ""}
    )
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.double().eval()


def test_proposer_fills_tree_from_head_ranks(medusa64):
    choices = [[0], [1], [0, 0], [0, 2], [1, 0], [0, 0, 3]]
    proposer = MedusaProposer(medusa64, choices)
    assert isinstance(proposer, MedusaProposer) and proposer.num_nodes == 7
    hidden, tokens = torch.randn(3, H, dtype=torch.float64), torch.tensor([5, 6, 42])
    tree = proposer.propose(hidden, tokens)
    top = medusa64.head_logits(hidden[-1]).topk(4, dim=-1).indices  # (K, 4)
    order = list(map(tuple, choices))  # node order: the given (importance) order, parents first
    nodes = {(): 0}
    for i, key in enumerate(order, start=1):  # node i = head len(key)-1's rank key[-1] under node `key[:-1]`
        assert int(tree.parents[i]) == nodes[key[:-1]] and int(tree.depth[i]) == len(key)
        assert int(tree.tokens[i]) == int(top[len(key) - 1, key[-1]])
        nodes[key] = i
    assert int(tree.tokens[0]) == 42 and tree.ancestors.shape == (7, 7)


def test_proposer_defaults_budget_and_export_tree(medusa64):
    p = make_proposer(medusa64)  # default tree pruned to 3 heads x top-4
    assert p.num_nodes == 1 + len(prune_tree(DEFAULT_TREE, 3, 4)) and p.topk <= 4
    assert make_proposer(medusa64, tree_nodes=5).num_nodes == 5
    assert MedusaProposer(medusa64, [[0], [1], [0, 0]]).depth_used == 2  # the third head is never run
    medusa64.config.tree_choices = [[0], [0, 0], [1]]
    assert make_proposer(medusa64).paths == [(0,), (0, 0), (1,)]  # the given (importance) order
    # a tree built from accuracies, then cut by the decoder's node budget (the first b nodes), is the greedy
    # (optimal) tree of that budget: the budget never keeps a sibling over a more valuable chain
    acc = torch.tensor([[0.6, 0.2, 0.1, 0.05], [0.5, 0.2, 0.1, 0.0], [0.4, 0.1, 0.0, 0.0]])
    medusa64.config.tree_choices = [list(q) for q in build_tree(acc, 12)[0]]
    full = make_proposer(medusa64)
    hidden = torch.randn(1, H, dtype=torch.float64)
    tree = full.propose(hidden, torch.tensor([7]))
    calls: list[tuple[int, int]] = []
    topk_tokens = medusa64.topk_tokens
    medusa64.topk_tokens = lambda h, k, heads, **kw: (
        calls.append((k, heads)) or topk_tokens(h, k, heads, **kw)
    )
    for b in range(1, 13):
        cut = tree.truncated(b)
        assert full.paths[: b - 1] == build_tree(acc, b)[0] and cut.num_nodes == b
        assert cut.parents[1:].lt(torch.arange(1, b)).all()  # still a tree
        # `fit_budget(b)` proposes that cut directly, running only the heads (and ranks) it reaches
        full.fit_budget(b)
        small = full.propose(hidden, torch.tensor([7]))
        assert torch.equal(small.tokens, cut.tokens) and torch.equal(small.parents, cut.parents)
        assert torch.equal(small.ancestors, cut.ancestors) and full.num_nodes == b
        if b > 1:
            assert calls[-1] == (int(full.rank[:b].max()) + 1, int(cut.depth.max()))
    full.fit_budget(1 << 30)  # a refit: the whole tree again
    assert full.num_nodes == 12 and torch.equal(full.propose(hidden, torch.tensor([7])).tokens, tree.tokens)
    del medusa64.topk_tokens
    assert make_proposer(medusa64, tree_nodes=3).paths == [(0,), (0, 0)]  # first paths in the given order
    medusa64.config.tree_choices = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="3 heads"):
        make_proposer(medusa64)


# ---- decoding through the shared decoder ---------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [1, 6, 19])
def test_greedy_medusa_equals_ar(tiny_llama64, medusa64, prompt_len):
    prompt = torch.randint(0, V, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    ref, _ = ar_generate(tiny_llama64, None, prompt, 24, stop_ids=set())
    out, stats = speculative_generate(tiny_llama64, None, prompt, make_proposer(medusa64), 24, stop_ids=set())
    assert out == ref
    assert set(stats.tree_sizes) == {make_proposer(medusa64).num_nodes}


def test_int8_heads_decode_losslessly_and_close_to_the_float_heads(tiny_llama64, medusa64):
    """`int8_head=True` on CPU: each head's vocabulary Linear runs as a shared int8 copy (the float heads'
    logits within int8 error), the output still equals AR's, and rows are drafted together with the same copies
    (never mixed with float heads)."""
    from specdraft.eval.proposers import int8_supported

    if not int8_supported():
        pytest.skip("no fbgemm int8 ops in this torch build")
    prop = make_proposer(medusa64, int8_head=True)
    assert prop.int8 is not None and len(prop.int8) == medusa64.config.draft_len
    assert make_proposer(medusa64, int8_head=True).int8[0] is prop.int8[0]  # quantised once per drafter
    h = torch.randn(5, medusa64.config.base_hidden_size)  # (R, H)
    exact = medusa64.head_logits(h).float()  # (R, K, Vd)
    approx = medusa64.head_logits(h, linears=prop.int8)
    assert approx.shape == exact.shape and (approx - exact).abs().max() < 0.05 * exact.abs().max()
    prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(3))
    ref, _ = ar_generate(tiny_llama64, None, prompt, 24, stop_ids=set())
    out, _ = speculative_generate(tiny_llama64, None, prompt, prop, 24, stop_ids=set())
    assert out == ref
    rows = [make_proposer(medusa64, int8_head=True) for _ in range(2)]
    tokens = [torch.tensor([1, 2]), torch.tensor([4, 5])]
    together = rows[0].propose_rows(rows, [h[:2], h[2:4]], tokens)
    assert together is not None
    # one activation scale for all rows in the int8 products: drafts may differ slightly from per-row calls
    assert [t.num_nodes for t in together] == [prop.num_nodes] * 2
    assert [int(t.tokens[0]) for t in together] == [2, 5]  # each row's own root
    assert (
        rows[0].propose_rows([rows[0], make_proposer(medusa64)], [h[:2], h[2:4]], tokens) is None
    )  # float heads


class OracleHeads(torch.nn.Module):
    """Heads whose rank-`ranks[j]` candidate is the true AR token of slot j (random tokens elsewhere)."""

    def __init__(self, ref: list[int], ranks: list[int], topk: int = 10) -> None:
        super().__init__()
        self.config = OmegaConf.create(
            {"architecture": "medusa", "draft_len": len(ranks), "topk": topk, "tree_choices": None}
        )
        self.ref, self.ranks, self.done, self.g = ref, ranks, 0, torch.Generator().manual_seed(0)

    def topk_tokens(self, hidden, k, num_heads, linears=None, root=None):
        assert num_heads == 4 and linears is None and root is not None  # the default tree reaches depth 4
        top = torch.randperm(V, generator=self.g)[: len(self.ranks) * k].reshape(len(self.ranks), k)
        for j, r in enumerate(self.ranks):
            if self.done + j < len(self.ref):
                top[j][top[j] == self.ref[self.done + j]] = -1  # keep the truth at one rank only
                top[j, r] = self.ref[self.done + j]
        return top.clamp_min(0)


class OracleProposer(MedusaProposer):
    def __init__(self, heads: OracleHeads, prompt_len: int) -> None:
        super().__init__(heads)
        self.prompt_len, self.seen = prompt_len, 0

    def propose(self, hidden, tokens):
        self.seen += tokens.shape[0]
        self.drafter.done = self.seen - (self.prompt_len - 1)  # slot j predicts ref[done + j]
        return super().propose(hidden, tokens)


def test_greedy_oracle_heads_accept_deep_paths(tiny_llama64):
    prompt = torch.arange(3, 11)
    ref, _ = ar_generate(tiny_llama64, None, prompt, 40, stop_ids=set())
    heads = OracleHeads(ref, ranks=[1, 0, 1, 3])  # (1, 0, 1) is in the default tree, (1, 0, 1, 3) is not
    out, stats = speculative_generate(
        tiny_llama64, None, prompt, OracleProposer(heads, len(prompt)), 40, stop_ids=set()
    )
    assert out == ref
    assert max(stats.accepted) == 3 and stats.tokens_per_step > 3.0


def test_sampling_on_medusa_trees_keeps_the_target_distribution():
    """First emitted token of recursive rejection over a Medusa tree ~ the target's p(root) (chi^2)."""
    sv, n = 6, 1500
    model = tiny_llama(vocab_size=sv, dtype=torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # moderately flat: every branch gets visited
    schema = OmegaConf.create(
        {
            "draft_len": 2,
            "num_layers": 1,
            "loss_decay": 0.8,
            "init_from_lm_head": True,
            "topk": 3,
            "tree_choices": None,
        }
    )
    heads = build(
        schema, model, {"name_or_path": "t", "hidden_size": H, "vocab_size": sv, "tokenizer_hash": ""}
    )
    proposer = MedusaProposer(heads.double(), [[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    prompt = torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
        tree = proposer.propose(out.hidden_states[-1][0], torch.tensor([2, 3, 4, 5]))  # root 5
        seqs = [torch.cat([prompt, tree.tokens[path_to(tree, i)]]) for i in range(tree.num_nodes)]
        logits = torch.stack([model(s[None]).logits[0, -1] for s in seqs])  # (N, V) target after each node
    p1 = logits[0].softmax(-1)
    g = torch.Generator().manual_seed(3)
    first = Counter()
    for _ in range(n):
        path, bonus = sample_verify(tree, logits, 1.0, generator=g)
        first[int(tree.tokens[path[1]]) if path.shape[0] > 1 else bonus] += 1
    e = p1 * n
    o = torch.tensor([first[t] for t in range(sv)], dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    p_value = float(
        torch.special.gammaincc(torch.tensor((sv - 1) / 2, dtype=torch.float64), torch.tensor(stat / 2))
    )
    assert p_value > 1e-3, (p_value, first, p1)
    assert len({int(t) for t in tree.tokens[1:4]}) == 3  # distinct sibling candidates from head 0


# ---- typical acceptance (lossy) ----------------------------------------------------------------------------------
def test_typical_verify_thresholds_and_tie_break():
    # root -> {1, 2}; 1 -> {3}; 2 -> {4}. Root posterior: p(1)=0.5, p(2)=0.45 -> both pass min(eps, delta e^-H).
    lp = lambda ps: torch.log(torch.tensor(ps + [1e-9] * (6 - len(ps))))  # noqa: E731
    logits = torch.stack([
        lp([0.0, 0.5, 0.45, 0.05]),  # at the root
        lp([0.0, 0.0, 0.0, 0.96, 0.04]),  # after 1: token 3 is almost sure
        lp([0.0, 0.0, 0.0, 0.0, 0.96, 0.04]),  # after 2: token 4 is almost sure
        lp([1.0]),
        lp([1.0]),
    ])  # fmt: skip
    tree = DraftTree(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([-1, 0, 0, 1, 2]))
    path, bonus = typical_verify(tree, logits, temperature=1.0, epsilon=0.09, delta=0.3)
    assert path.tolist() == [0, 1, 3] and bonus == 0  # depth 2 twice: the likelier path (0.5 * 0.96) wins
    path, _ = typical_verify(tree, logits, temperature=1.0, epsilon=0.47, delta=10.0)  # only token 1 passes
    assert path.tolist() == [0, 1, 3]
    path, _ = typical_verify(tree, logits, temperature=1.0, epsilon=0.99, delta=10.0)  # nothing passes
    assert path.tolist() == [0]
    with pytest.raises(ValueError, match="temperature > 0"):
        typical_verify(tree, logits, temperature=0.0)


def test_typical_acceptance_through_the_decoder(tiny_llama64, medusa64):
    from specdraft.eval.medusa_tree import typical_rule

    prompt = torch.arange(4, 12)
    runs = [
        speculative_generate(
            tiny_llama64,
            None,
            prompt,
            make_proposer(medusa64),
            20,
            0.7,
            set(),
            verify_fn=typical_rule(0.7, seed=1),
            generator=torch.Generator().manual_seed(0),
        )
        for _ in range(2)
    ]
    assert len(runs[0][0]) == 20 and runs[0][1].steps >= 1
    assert runs[0][0] == runs[1][0]  # the rule's own RNG is seeded
    with pytest.raises(ValueError, match="temperature > 0"):
        typical_rule(0.0)


def test_measure_rank_accuracies_matches_naive(tiny_llama, medusa64):
    from specdraft.data.collate import Collator
    from specdraft.eval.medusa_tree import measure_rank_accuracies

    heads = medusa64.float()
    g = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(0, V, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.long)}
        for n in (12, 7)
    ]
    batch = Collator(pad_id=0, draft_len=3)(rows)
    acc, n = measure_rank_accuracies(heads, tiny_llama, [batch], topk=5, chunk=4)
    hits, valid = torch.zeros(3, 5), torch.zeros(3)
    for row in rows:  # naive: unpadded forward per row, every position t with labels x_{t+2+k}
        ids = row["input_ids"]
        h = tiny_llama(ids[None], output_hidden_states=True).hidden_states[-1][0]  # (L, H)
        for t in range(len(ids) - 1):
            top = heads.head_logits(h[t]).topk(5, -1).indices  # (K, 5)
            for k in range(3):
                if t + 2 + k < len(ids):
                    valid[k] += 1
                    hits[k] += (top[k] == ids[t + 2 + k]).float()
    assert n == 11 + 6
    torch.testing.assert_close(acc.float(), hits / valid[:, None], atol=1e-6, rtol=0)
