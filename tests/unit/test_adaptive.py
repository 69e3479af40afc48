"""Confidence-adaptive drafting (eval/adaptive.py): pruning keeps a valid, ancestor-closed tree cut to a fixed
budget; the controller shrinks to plain target steps while drafts fail and probes again; per-node draft
scores of ReDrafter and prompt lookup; and the wrapped proposers decode exactly as AR (fp64, tiny Llama /
Qwen2 / Mistral, static and dynamic paths)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.eval.adaptive import (
    BUDGETS,
    AcceptanceController,
    AdaptiveProposer,
    accepted_length,
    effective_scores,
    prune_tree,
)
from specdraft.eval.decode import ar_generate
from specdraft.eval.fallback import FallbackController
from specdraft.eval.proposers import (
    PromptLookupProposer,
    ReDrafterProposer,
    make_proposer,
    prompt_lookup_scored,
)
from specdraft.eval.static_decode import StaticDecoder
from specdraft.eval.tree import DraftTree, ProposerSpec
from specdraft.models import eagle, redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.testing import (
    OracleBeamProposer,
    RandomTreeProposer,
    check_static_equals_ar,
    tiny_target,
    tiny_tokenizer,
)
from specdraft.train.config import ReDrafterSchema

V = 128


def _random_tree(g: torch.Generator, n: int, monotone: bool) -> DraftTree:
    """n nodes, random parents; scores random in [0, 1] (a cumulative product along paths if `monotone`)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    probs = torch.rand(n, generator=g)
    probs[0] = 1.0
    if monotone:
        for i in range(1, n):
            probs[i] *= probs[parents[i]]
    return DraftTree(torch.randint(0, V, (n,), generator=g), torch.tensor(parents), scores=probs)


def _paths(tree: DraftTree) -> dict[int, tuple[int, ...]]:
    """Root path token tuple of every node."""
    out: dict[int, tuple[int, ...]] = {}
    for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        out[i] = (*out[p], t) if p >= 0 else (t,)
    return out


@pytest.mark.parametrize("monotone", [True, False])
def test_prune_keeps_a_valid_closed_tree(monotone):
    """Property test over random trees, thresholds, caps and depths."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 40, (1,), generator=g))
        tree = _random_tree(g, n, monotone)
        thr = float(torch.rand(1, generator=g)) ** 2
        cap = int(torch.randint(1, 70, (1,), generator=g))
        depth = int(torch.randint(0, 8, (1,), generator=g))
        out = prune_tree(tree, thr, cap, depth)  # DraftTree validates parents[i] < i, parents[0] == -1
        b = out.num_nodes
        assert b in BUDGETS and b <= max(cap, 1) and b <= n
        assert out.tokens[0] == tree.tokens[0] and out.depth is not None and int(out.depth.max()) <= depth
        # every kept node is an original node whose whole root path was kept (no orphaned descendants)
        eff = effective_scores(tree)
        eff_by_path = (
            {p: float(eff[i]) for i, p in _paths(tree).items()} if len(set(tree.tokens.tolist())) == n else {}
        )
        for i, path in _paths(out).items():
            assert path in set(_paths(tree).values())
            if i >= 2 and eff_by_path:  # beyond the root and its best child: confident nodes only
                assert eff_by_path[path] >= thr
        # nodes come best first: truncating the pruned tree keeps the most confident nodes
        assert (effective_scores(out)[1:].diff() <= 1e-7).all()
        if depth >= 1 and n > 1:
            assert b >= 2 or cap < 2  # the root's most likely child is always drafted


def test_prune_example():
    """r(1.0) ─ a(.6) ─ b(.5); r ─ c(.3) ─ d(.2): threshold 0.25 keeps 4 nodes, 0.9 keeps r + a, cap 2 too."""
    t = DraftTree(
        torch.tensor([5, 6, 7, 8, 9]),
        torch.tensor([-1, 0, 1, 0, 3]),
        scores=torch.tensor([1, 0.6, 0.5, 0.3, 0.2]),
    )
    out = prune_tree(t, 0.25, 64, 5)
    assert out.tokens.tolist() == [5, 6, 7, 8] and out.parents.tolist() == [-1, 0, 1, 0]
    assert prune_tree(t, 0.9, 64, 5).tokens.tolist() == [5, 6]
    assert prune_tree(t, 0.0, 2, 5).tokens.tolist() == [5, 6]
    assert prune_tree(t, 0.0, 64, 1).tokens.tolist() == [5, 6]  # depth 1: r, a, c -> budget 2
    assert prune_tree(t, 0.0, 64, 0).tokens.tolist() == [5]


def test_accepted_length_walks_the_previous_tree():
    t = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, 1, 0, 3]))
    assert accepted_length(t, [6, 7, 1]) == 2  # a, b accepted, then the bonus
    assert accepted_length(t, [8, 9, 4, 4]) == 2  # with target steps after it (a fallback)
    assert accepted_length(t, [3]) == 0


def test_controller_falls_back_and_probes():
    c = AcceptanceController(max_depth=4, max_nodes=16, patience=2, min_probe=2, max_probe=8)
    assert c.depth == 4 and c.nodes == 16
    for _ in range(2):
        assert c.should_draft()
        c.observe(0, 4)
    assert c.nodes == 4 and c.depth <= 2 and c.fallbacks == 1
    assert [c.should_draft() for _ in range(3)] == [False, False, True]  # 2 target steps, then a probe
    c.observe(0, 1)  # failed probe: a longer fallback
    assert [c.should_draft() for _ in range(5)] == [False] * 4 + [True]
    c.observe(1, 1)  # accepted: draft on, budget grows back
    assert c.should_draft() and c.probe == 2 and c.nodes == 4  # 2 after the failed probe, doubled
    for _ in range(6):
        c.observe(4, 4)
    assert c.depth == 4 and c.nodes == 16


def test_lookup_scores_golden():
    """Occurrences of the 2-gram (1, 2) at 0 and 3; the most recent full one continues 4, 1: 1 of 2 agree."""
    cont, probs = prompt_lookup_scored(torch.tensor([1, 2, 3, 1, 2, 4, 1, 2]), 3, 2)
    assert cont.tolist() == [4, 1] and torch.allclose(probs, torch.tensor([1 / 3, 1 / 3]))
    cont, probs = prompt_lookup_scored(
        torch.tensor([7, 8, 9, 7, 8, 9, 7]), 1, 3
    )  # 7 at 0, 3: both go on 8 9 7
    assert cont.tolist() == [8, 9, 7] and torch.allclose(probs, torch.tensor([2 / 3] * 3))
    cont, probs = prompt_lookup_scored(torch.tensor([7, 8, 9, 7, 8, 5, 7]), 1, 3)  # 8 9 7 | 8 5 7
    assert cont.tolist() == [8, 5, 7] and torch.allclose(probs, torch.tensor([2 / 3, 1 / 3, 1 / 3]))
    tree = PromptLookupProposer(3).propose(torch.zeros(7, 1), torch.tensor([7, 8, 9, 7, 8, 9, 7]))
    assert tree.scores is not None and tree.scores.tolist()[0] == 1.0 and tree.num_nodes == 4


def _redrafter(target: torch.nn.Module, **kw) -> ReDrafterProposer:
    """A randomly initialised ReDrafter (random non-identity weights) behind its proposer, W=4, D=3."""
    torch.manual_seed(1)
    d = redrafter.build(
        ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1),
        target,
        target_fingerprint(target, tiny_tokenizer()),
    )
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ReDrafterProposer(d.double().eval(), beam_width=4, beam_length=4, **kw)


def test_redrafter_scores_are_path_probabilities():
    target = tiny_target("llama")
    prop = _redrafter(target)
    prop.reset()
    tree = prop.propose(torch.randn(3, 32, dtype=torch.float64), torch.tensor([5, 6, 7]))
    assert tree.scores is not None and tree.scores.shape == (tree.num_nodes,) and tree.scores[0] == 1.0
    assert (tree.scores > 0).all() and (tree.scores[1:] <= tree.scores[tree.parents[1:]] + 1e-6).all()
    fixed = _redrafter(target, static=True).propose(
        torch.randn(3, 32, dtype=torch.float64), torch.tensor([5, 6, 7])
    )
    assert fixed.scores is not None and fixed.scores.shape == (13,)


class _ScoredRandomTrees(RandomTreeProposer):
    """Random trees with random (non-monotone) node scores."""

    def propose(self, hidden, tokens):
        tree = super().propose(hidden, tokens)
        tree.scores = torch.rand(tree.num_nodes, generator=self.g)
        return tree


class _ScoredOracle(OracleBeamProposer):
    """Oracle beams (long accepted paths) with random node scores: acceptance, pruning and fallback mix."""

    def propose(self, hidden, tokens):
        tree = super().propose(hidden, tokens)
        tree.scores = torch.rand(tree.num_nodes, generator=self.g).sqrt()
        return tree


@pytest.mark.parametrize("shape", ["eager", "fixed"])
@pytest.mark.parametrize("family", ["redrafter", "random", "lookup"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_adaptive_equals_ar(arch, family, shape):
    """Greedy output == AR token for token on the static path (and the dynamic path, same trees)."""
    model = tiny_target(arch)
    dec = StaticDecoder(model, 48, static=shape == "fixed")

    def make() -> AdaptiveProposer:
        inner = {
            "redrafter": lambda: _redrafter(model),
            "random": lambda: _ScoredRandomTrees(V, max_nodes=20, seed=3),
            "lookup": lambda: PromptLookupProposer(6, 2),
        }[family]()
        return AdaptiveProposer(inner, threshold=0.3, controller=AcceptanceController(6, 16, patience=2))

    stats = check_static_equals_ar(dec, model, make(), reference=make())
    sizes = {n for st in stats for n in st.tree_sizes}
    assert sizes <= set(BUDGETS)  # every verify is one of the fixed budgets


@pytest.mark.parametrize("family", ["redrafter", "lookup"])
def test_adaptive_in_batches_equals_batch1_ar(family):
    """One adaptive wrapper per row of the batched decoder (it reads acceptance from the positions the
    decoder hands it, so it needs no batch coupling): every request's output equals its batch-1 AR output."""
    from specdraft.eval.batch_decode import BatchDecoder
    from specdraft.testing import random_prompts

    model = tiny_target("llama")
    prompts = random_prompts([5, 12, 3, 9, 7])
    budgets = [14, 6, 18, 10, 12]
    refs = [ar_generate(model, None, p, m, stop_ids=set())[0] for p, m in zip(prompts, budgets, strict=True)]

    def make() -> AdaptiveProposer:
        inner = _redrafter(model) if family == "redrafter" else PromptLookupProposer(6, 2)
        return AdaptiveProposer(inner, threshold=0.3, controller=AcceptanceController(6, 16, patience=2))

    out = BatchDecoder(model, 3).generate(prompts, budgets, set(), make)
    assert [t for t, _ in out] == refs
    assert {n for _, st in out for n in st.tree_sizes} <= set(BUDGETS)


def _eagle(target: torch.nn.Module):
    """A randomly initialised EAGLE-2 head behind its dynamic-tree proposer (10 nodes, depth 4, top-3)."""
    torch.manual_seed(1)
    schema = SimpleNamespace(
        draft_len=3, tree_total_tokens=10, tree_depth=4, tree_top_k=3, fc_bias=True, feature_weight=1.0,
        token_weight=0.1, noise=0.0, target_layers=None, draft_vocab_size=None, ttt_decay=0.8,
    )  # fmt: skip
    d = eagle.build(schema, target, target_fingerprint(target, tiny_tokenizer())).double().eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return make_proposer(d, tree_nodes=10)


def test_eagle_scores_and_adaptive_equals_ar():
    """EAGLE-2 trees carry path probabilities; the adaptive wrapper around them decodes exactly as AR."""
    model = tiny_target("qwen2")
    prop = _eagle(model)
    prop.reset()
    tree = prop.propose(torch.randn(4, 32, dtype=torch.float64), torch.tensor([5, 6, 7, 8]))
    assert tree.scores is not None and tree.scores[0] == 1.0
    assert (tree.scores[1:] <= tree.scores[tree.parents[1:]] + 1e-6).all()
    dec = StaticDecoder(model, 48)
    check_static_equals_ar(
        dec, model, AdaptiveProposer(_eagle(model), 0.05), AdaptiveProposer(_eagle(model), 0.05)
    )


def test_adaptive_long_paths_and_decoder_fallback():
    """Oracle beams: long accepted paths through the pruned trees, with the decoder's own fallback on top."""
    model = tiny_target("llama")
    dec = StaticDecoder(model, 48)
    for prompt_len in (2, 9):
        prompt = torch.randint(5, V, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(model, None, prompt, 40, stop_ids=set())
        prop = AdaptiveProposer(_ScoredOracle(ref, prompt_len, vocab=V), threshold=0.2)
        out, st = dec.speculative_generate(None, prompt, prop, 40, stop_ids=set())
        assert out == ref and st.tokens_per_step > 1.3
        fb = FallbackController()
        out, st = dec.speculative_generate(None, prompt, prop, 40, stop_ids=set(), fallback=fb)
        assert out == ref


def test_spec_passthrough():
    class Inner(RandomTreeProposer):
        spec = ProposerSpec(feature_layers=(1, 2), keep_last_hidden=True, max_depth=5, node_budget=21)

    prop = AdaptiveProposer(Inner(V))
    assert prop.spec == Inner.spec and prop.max_nodes == 16 and prop.controller.max_depth == 5
    prop.fit_budget(5)
    assert prop.max_nodes == 4 and prop.controller.nodes == 4
    prop.fit_budget(1 << 30)  # a budget refit (`budget.FULL`): back to its own largest budget
    assert prop.max_nodes == 16
    with pytest.raises(ValueError):
        AdaptiveProposer(Inner(V), threshold=1.5)


def test_config_fields_are_checked():
    """`eval.adaptive` / `eval.adaptive_threshold` have ranges in conf/validate.py."""
    from specdraft.conf.validate import EVAL

    assert EVAL["adaptive"].ok("on") and not EVAL["adaptive"].ok("yes")
    assert EVAL["adaptive_threshold"].ok(0.1) and not EVAL["adaptive_threshold"].ok(1.5)
