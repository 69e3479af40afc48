"""EAGLE-2 dynamic tree: construction against a brute-force enumeration, head-cache alignment, losslessness."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.eagle_tree import EagleTreeProposer
from specdraft.eval.proposers import make_proposer
from specdraft.eval.tree import tree_attention_mask
from specdraft.models import eagle, eagle3
from specdraft.models.base_llm import forward_with_hidden
from specdraft.testing import tiny_llama

FP = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}
SCHEMA = SimpleNamespace(
    draft_len=3,
    tree_total_tokens=10,
    tree_depth=4,
    tree_top_k=3,
    fc_bias=True,
    feature_weight=1.0,
    token_weight=0.1,
    noise=0.0,
    target_layers=None,
    draft_vocab_size=None,
    ttt_decay=0.8,
)


def _head(family, target, seed=3):
    torch.manual_seed(seed)
    head = family.build(SCHEMA, target, FP).double().eval()
    with torch.no_grad():  # sharper draft distributions: fewer near-ties in the brute-force comparison
        for p in head.parameters():
            p.mul_(3.0) if p.ndim == 2 else None
    return head


@torch.no_grad()
def _brute_force(head, feats, tokens, total, depth, k):
    """EAGLE-2 by enumeration: every node's distribution from a fresh cache, selection in plain Python."""

    def out_of(path):
        cache, n = DynamicCache(), feats.shape[0]
        out = head.step(
            head.encode_target(feats)[None],
            tokens[None],
            cache,
            torch.arange(n)[None],
            torch.ones(n, n, dtype=torch.bool).tril(),
        )[0, -1]
        for d, tok in enumerate(path, start=1):
            out = head.step(
                out[None, None],
                torch.tensor([[tok]]),
                cache,
                torch.tensor([[n - 1 + d]]),
                torch.ones(1, n + d, dtype=torch.bool),
            )[0, 0]
        return out

    def children(path, score):
        logp = torch.log_softmax(head.draft_logits(out_of(path)).float(), -1)
        sc, ix = logp.topk(k)
        return {path + (int(head.to_target_ids(i)),): score + float(s) for s, i in zip(sc, ix)}

    pool = children((), 0.0)
    frontier = dict(pool)
    for _ in range(1, depth):
        cands = {}
        for path, score in frontier.items():
            cands.update(children(path, score))
        pool.update(cands)
        frontier = dict(sorted(cands.items(), key=lambda kv: -kv[1])[:k])
    return set(sorted(pool, key=lambda p: -pool[p])[:total])


def _paths(tree):
    out = set()
    for i in range(1, tree.num_nodes):
        anc = tree.ancestors[i].nonzero().squeeze(1).tolist()  # ascending: root .. i
        assert len(anc) == int(tree.depth[i]) + 1
        out.add(tuple(int(tree.tokens[j]) for j in anc[1:]))
    return out


@pytest.mark.parametrize("family", [eagle, eagle3])
@pytest.mark.parametrize("total,depth,k", [(10, 4, 3), (100, 3, 2), (5, 2, 4), (7, 1, 3)])
def test_dynamic_tree_matches_brute_force(family, total, depth, k):
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = _head(family, target)
    ids = torch.randint(5, 128, (1, 7))
    tout = forward_with_hidden(target, ids, layers=getattr(head.config, "target_layers", ()) or ())
    feats = tout.layers.flatten(2)[0] if tout.layers is not None else tout.hidden[0]  # (7, F)
    tokens = torch.cat([ids[0, 1:], torch.tensor([42])])  # what each position predicts; root 42
    prop = EagleTreeProposer(head, total, depth, k)
    tree = prop.propose(feats, tokens)
    expected = _brute_force(head, feats, tokens, total, depth, k)
    n_cand = k + (depth - 1) * k * k
    assert tree.num_nodes == 1 + min(total, n_cand) and int(tree.tokens[0]) == 42
    assert bool((tree.parents[1:] < torch.arange(1, tree.num_nodes)).all())
    assert int(tree.depth.max()) <= depth
    assert _paths(tree) == expected
    mask = tree_attention_mask(tree, 5, torch.float64)  # (1, 1, N, 5 + N)
    assert bool((mask[0, 0, :, :5] == 0).all()) and torch.equal(mask[0, 0, :, 5:] == 0, tree.ancestors)
    if total >= n_cand:  # everything kept: depth 1 has k nodes, deeper levels k*k each
        assert torch.bincount(tree.depth).tolist() == [1, k] + [k * k] * (depth - 1)
    # best first: the first b nodes (the decoder's node budget on the static path) are EAGLE-2's tree for a
    # budget of b - 1, not the shallowest nodes
    for b in range(1, tree.num_nodes + 1):
        assert _paths(tree.truncated(b)) == _brute_force(head, feats, tokens, b - 1, depth, k)


def test_head_cache_holds_exactly_the_committed_positions():
    target = tiny_llama(dtype=torch.float64)
    head = _head(eagle, target)
    ids = torch.randint(5, 128, (1, 12))
    feats = forward_with_hidden(target, ids).hidden[0]  # (12, H)
    nxt = torch.cat([ids[0, 1:], torch.tensor([7])])
    prop = EagleTreeProposer(head, 8, 3, 2)
    for lo, hi in ((0, 5), (5, 6), (6, 9), (9, 12)):  # prefill, then accepted paths of 1 and 3 positions
        prop.propose(feats[lo:hi], nxt[lo:hi])
    assert prop.committed == 12 and prop.cache.get_seq_length() > 12  # draft entries still appended
    prop.commit(feats[:0], nxt[:0])  # drops them again
    fresh = DynamicCache()
    head.step(
        feats[None], nxt[None], fresh, torch.arange(12)[None], torch.ones(12, 12, dtype=torch.bool).tril()
    )
    torch.testing.assert_close(prop.cache.layers[0].keys, fresh.layers[0].keys)
    torch.testing.assert_close(prop.cache.layers[0].values, fresh.layers[0].values)


@pytest.mark.parametrize("family,int8", [(eagle, False), (eagle3, False), (eagle3, True)])
def test_greedy_lossless_through_the_shared_decoder(family, int8, tiny_tokenizer):
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = _head(family, target)
    prop = make_proposer(head, tree_nodes=12, int8_head=int8)  # depth 4, top-k 3 from the head config
    assert (prop.int8 is not None) == int8 or not int8
    assert prop.spec.feature_layers == tuple(getattr(head.config, "target_layers", ()))
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(5, 128, (6 + 3 * seed,)).tolist()
        ref, _ = ar_generate(target, tiny_tokenizer, prompt, 30, stop_ids=set())
        out, stats = speculative_generate(target, tiny_tokenizer, prompt, prop, 30, stop_ids=set())
        assert out == ref
        assert max(stats.tree_sizes) <= 13
    gen = torch.Generator().manual_seed(0)
    out, _ = speculative_generate(
        target, tiny_tokenizer, prompt, prop, 20, temperature=0.8, stop_ids=set(), generator=gen
    )
    assert len(out) == 20
