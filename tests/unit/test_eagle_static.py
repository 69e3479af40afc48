"""EAGLE-2 trees in fixed shapes (`EagleTreeProposer(static=True)`, eval/eagle_static.py): lossless through both
StaticDecoder shapes for EAGLE-1 and EAGLE-3 heads on tiny Llama / Qwen2 / Mistral targets (fp64), the same trees
as the dynamic proposer, a constant tree size, the head cache's invariants and, on CUDA, the captured expansion."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from specdraft.eval.decode import ar_generate
from specdraft.eval.eagle_static import (
    HeadKVCache,
    StaticHeadState,
    commit_mask,
    draft_mask,
    fixed_ancestors,
)
from specdraft.eval.eagle_tree import EagleTreeProposer
from specdraft.eval.proposers import make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.eval.tree import ancestor_matrix
from specdraft.models import eagle, eagle3
from specdraft.models.base_llm import forward_with_hidden, target_fingerprint
from specdraft.testing import check_static_equals_ar, tiny_llama, tiny_target, tiny_tokenizer

V, H = 128, 32
CPU = torch.device("cpu")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SCHEMA = SimpleNamespace(
    draft_len=3, tree_total_tokens=10, tree_depth=4, tree_top_k=3, fc_bias=True, feature_weight=1.0,
    token_weight=0.1, noise=0.0, target_layers=None, draft_vocab_size=None, ttt_decay=0.8,
)  # fmt: skip


def _target(arch: str, device: torch.device = CPU) -> torch.nn.Module:
    """A tiny fp64 target of the given architecture (`specdraft.testing.tiny_target`)."""
    return tiny_target(arch, device)


def _head(family, target: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """A built EAGLE-1 / EAGLE-3 head on `target` with jittered (non-identity) fp64 weights."""
    torch.manual_seed(seed)
    head = family.build(SCHEMA, target, target_fingerprint(target, tiny_tokenizer()))
    head = head.to(device=next(target.parameters()).device, dtype=torch.float64).eval()  # the target's device
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return head


def _features(head, target, ids: torch.Tensor) -> torch.Tensor:
    """(L, F) the features the decoder hands the proposer for prompt ids (1, L)."""
    layers = tuple(getattr(head.config, "target_layers", ()) or ())
    out = forward_with_hidden(target, ids, layers=layers)
    return out.layers.flatten(2)[0] if out.layers is not None else out.hidden[0]


def _paths(tree) -> set[tuple[int, ...]]:
    """The tree's nodes as token paths below the root."""
    out = set()
    for i in range(1, tree.num_nodes):
        anc = tree.ancestors[i].nonzero().squeeze(1).tolist()  # ascending: root .. i
        out.add(tuple(int(tree.tokens[j]) for j in anc[1:]))
    return out


@pytest.mark.parametrize(
    "shape", ["eager", "fixed", pytest.param("graph", marks=CUDA)]
)  # StaticDecoder shape; "graph" also captures the proposer's expansion
@pytest.mark.parametrize("family", [eagle, eagle3])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_static_proposer_is_lossless(arch, family, shape):
    """Greedy output == AR for prompt lengths 3 and 17, with and without a stop token hit mid-way; the
    dynamic proposer on the dynamic decoder accepts exactly as often (same trees); every tree has 11 nodes."""
    device = torch.device("cuda") if shape == "graph" else CPU
    model = _target(arch, device)
    head = _head(family, model)
    prop = make_proposer(head, tree_nodes=10, static=True, graphs=shape == "graph")
    dyn = make_proposer(head, tree_nodes=10)
    assert prop.static and prop.fixed is not None and not dyn.static
    dec = StaticDecoder(model, 48, static=shape != "eager", graphs=shape == "graph")
    for stats in check_static_equals_ar(dec, model, prop, dyn, vocab=V):
        assert set(stats.tree_sizes) == {11}  # 1 + total_tokens (pool: 3 + 3 * 9 = 30 candidates)
    assert prop.graphs == (shape == "graph") and (prop.fixed.graph is not None) == (shape == "graph")


@pytest.mark.parametrize("family", [eagle, eagle3])
@pytest.mark.parametrize(
    "total,depth,k,int8,rows",
    [
        (10, 4, 3, False, 8),
        (100, 3, 2, False, 2),
        (5, 2, 4, False, 8),
        (7, 1, 3, False, 1),
        (10, 4, 3, True, 3),
    ],
)
def test_static_tree_equals_the_dynamic_tree(family, total, depth, k, int8, rows):
    """Same commits (prefill, then accepted paths of 1, 3 and 6 positions) -> the same tree, node for node.

    Both modes run the same expansion and reranking code on the same committed state; the only difference is
    how the head attends (whole preallocated buffer under a device mask vs `DynamicCache` views), so the pool
    scores agree to rounding and, with no top-k ties (random fp64 heads have none), the selected nodes, their
    best-first layout and topology are identical (also with the int8 vocabulary head). The static head cache starts too small (4 positions), so
    growing it (and re-sizing the expansion) is exercised too. The draft step commits the newest `rows`
    positions itself (the rest eagerly first): 1, 2 and 3 make the 6-position commits split. The tree size
    never changes: 1 + min(total, k + (depth - 1) * k * k)."""
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = _head(family, target, seed=3)
    ids = torch.randint(5, V, (1, 16), generator=torch.Generator().manual_seed(0))
    feats = _features(head, target, ids)  # (16, F)
    nxt = torch.cat([ids[0, 1:], torch.tensor([42])])  # what each position predicts
    dyn = EagleTreeProposer(head, total, depth, k, int8_head=int8)
    st = EagleTreeProposer(head, total, depth, k, int8_head=int8, static=True)
    assert (st.int8 is None) == (dyn.int8 is None)
    st.fixed = StaticHeadState(head, (depth - 1) * k, k, capacity=4, commit_rows=rows)
    n_nodes = 1 + min(total, k + (depth - 1) * k * k)
    for lo, hi in ((0, 6), (6, 7), (7, 10), (10, 16)):
        a, b = dyn.propose(feats[lo:hi], nxt[lo:hi]), st.propose(feats[lo:hi], nxt[lo:hi])
        assert dyn.last_pool is not None and st.last_pool is not None
        torch.testing.assert_close(st.last_pool["scores"], dyn.last_pool["scores"], rtol=0, atol=1e-9)
        assert _paths(b) == _paths(a) and len(_paths(b)) == n_nodes - 1
        assert torch.equal(b.tokens, a.tokens) and torch.equal(b.parents, a.parents)
        assert torch.equal(b.depth, a.depth) and torch.equal(b.ancestors, a.ancestors)
        assert b.num_nodes == n_nodes and int(b.tokens[0]) == int(nxt[hi - 1])
        assert bool((b.parents[1:] < torch.arange(1, n_nodes)).all()) and int(b.parents[0]) == -1
    assert st.committed == dyn.committed == 16 and st.fixed.cache.capacity >= 16 + (depth - 1) * k


@pytest.mark.parametrize("family", [eagle, eagle3])
def test_static_budget_sizes_equal_the_dynamic_trees(family):
    """A node budget shrinks the static expansion as it does the dynamic one (`fit_budget`: fewer levels, not the
    full tree cut afterwards): at every size, both modes give the same tree, of 1 + min(total, pool) nodes and
    depth <= nodes - 1; a refit (`budget.FULL`) restores the full size."""
    from specdraft.eval.budget import FULL

    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = _head(family, target, seed=4)
    ids = torch.randint(5, V, (1, 20), generator=torch.Generator().manual_seed(1))
    feats, nxt = _features(head, target, ids), torch.cat([ids[0, 1:], torch.tensor([42])])
    dyn, st = EagleTreeProposer(head, 10, 4, 3), EagleTreeProposer(head, 10, 4, 3, static=True)
    cuts = ((0, 6, FULL), (6, 8, 2), (8, 11, 4), (11, 12, 8), (12, 15, FULL), (15, 20, 3))
    for lo, hi, nodes in cuts:
        dyn.fit_budget(nodes)
        st.fit_budget(nodes)
        total, depth = min(10, max(nodes - 1, 1)), min(4, max(nodes - 1, 1))
        a, b = dyn.propose(feats[lo:hi], nxt[lo:hi]), st.propose(feats[lo:hi], nxt[lo:hi])
        assert torch.equal(b.tokens, a.tokens) and torch.equal(b.parents, a.parents)
        assert b.num_nodes == 1 + min(total, 3 + (depth - 1) * 9) and int(b.depth.max()) <= depth
        assert (st.total_tokens, st.depth) == (total, depth)
    assert st.committed == dyn.committed == 20


def test_head_cache_holds_the_committed_positions_in_place():
    """After commits and expansions the static head cache's first C positions are exactly a fresh causal pass
    over the C committed pairs; the buffers are reused (no reallocation) while they have room."""
    target = tiny_llama(dtype=torch.float64)
    head = _head(eagle, target)
    ids = torch.randint(5, V, (1, 12), generator=torch.Generator().manual_seed(1))
    feats, nxt = _features(head, target, ids), torch.cat([ids[0, 1:], torch.tensor([7])])
    prop = EagleTreeProposer(head, 8, 3, 2, static=True)
    assert prop.fixed is not None
    cache = prop.fixed.cache
    prop.propose(feats[:5], nxt[:5])
    ptr = cache.layer.keys.data_ptr()
    for lo, hi in ((5, 6), (6, 9), (9, 12)):
        prop.propose(feats[lo:hi], nxt[lo:hi])
    assert cache.length == int(cache.length_t) == 12 and cache.layer.keys.data_ptr() == ptr
    fresh = DynamicCache()
    head.step(
        feats[None], nxt[None], fresh, torch.arange(12)[None], torch.ones(12, 12, dtype=torch.bool).tril()
    )
    torch.testing.assert_close(cache.layer.keys[:, :, :12], fresh.layers[0].keys)
    torch.testing.assert_close(cache.layer.values[:, :, :12], fresh.layers[0].values)
    assert prop.commit(feats[:0], nxt[:0]).shape == (0, H) and cache.length == 12
    assert cache.reserve(cache.capacity + 1)  # growing keeps the committed positions
    torch.testing.assert_close(cache.layer.keys[:, :, :12], fresh.layers[0].keys)
    prop.reset()
    assert cache.length == int(cache.length_t) == 0


def test_fixed_ancestors_and_draft_mask():
    """`fixed_ancestors` equals `ancestor_matrix` on random trees; `draft_mask` shows the committed prefix and each
    query's drafted ancestors, never stale positions; `commit_mask` is causal over the new rows after the prefix."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 14, (1,), generator=g))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        anc, depth = ancestor_matrix(parents)
        fa, fd = fixed_ancestors(parents, int(depth.max()))
        assert torch.equal(fa, anc) and torch.equal(fd, depth)
    rows = torch.tensor([[True, False, True], [False, True, True]])  # (2 queries, 3 draft entries)
    cache = HeadKVCache(CPU, 10, 2)
    cache.set_length(4)
    mask = draft_mask(rows, cache.length_t, 10)[0, 0]  # (2, 10)
    assert mask[:, :4].all() and not mask[:, 7:].any()
    assert torch.equal(mask[:, 4:7], rows)
    cache.prepare_write(3, 2)
    assert cache.write_pos.tolist() == [7, 8]
    cm = commit_mask(3, cache.length_t, 10)[0, 0]  # (3 new rows at [4, 7), 10)
    assert cm[:, :4].all() and not cm[:, 7:].any()
    assert torch.equal(cm[:, 4:7], torch.ones(3, 3, dtype=torch.bool).tril())


def test_make_proposer_passes_static_and_graphs():
    """The eagle / eagle3 branch forwards `static` and `graphs`; graphs need the head on CUDA."""
    target = tiny_llama(dtype=torch.float64)
    for family in (eagle, eagle3):
        head = _head(family, target)
        assert not make_proposer(head).static and make_proposer(head).fixed is None
        prop = make_proposer(head, static=True, graphs=True)  # CPU head: eager fixed shapes
        assert prop.static and prop.fixed is not None and not prop.graphs


@CUDA
@pytest.mark.parametrize("family", [eagle, eagle3])
def test_captured_expansion_equals_the_eager_one(family):
    """On CUDA the expansion is captured once (no host sync inside, or capture would fail) and its replays give
    the eager fixed-shape trees, call after call; the decode through graph-captured verify stays lossless."""
    cuda = torch.device("cuda")
    target = _target("llama", cuda)
    head = _head(family, target)
    ids = torch.randint(5, V, (1, 14), generator=torch.Generator().manual_seed(2)).to(cuda)
    feats, nxt = _features(head, target, ids), torch.cat([ids[0, 1:], torch.tensor([9], device=cuda)])
    graph = EagleTreeProposer(head, 10, 4, 3, static=True, graphs=True)
    eager = EagleTreeProposer(head, 10, 4, 3, static=True)
    for lo, hi in ((0, 5), (5, 6), (6, 10), (10, 14)):
        a, b = eager.propose(feats[lo:hi], nxt[lo:hi]), graph.propose(feats[lo:hi], nxt[lo:hi])
        assert graph.graphs and graph.fixed is not None and graph.fixed.graph is not None
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert torch.equal(a.ancestors, b.ancestors) and b.num_nodes == 11
    captured = graph.fixed.graph
    graph.fit_budget(4)  # a node budget's smaller size: captured once, beside the full one
    small = graph.propose(feats[13:14], nxt[13:14])
    assert small.num_nodes == 4 and graph.fixed.graph is not captured
    graph.fit_budget(1 << 30)  # the full size again: the first graph replays
    graph.propose(feats[13:14], nxt[13:14])
    assert graph.fixed.graph is captured and len(graph.fixed.captured) == 2
    graph.reset()
    dec = StaticDecoder(target, 48, static=True, graphs=True)
    prompt = ids[0, :9].cpu()
    ref, _ = ar_generate(target, None, prompt, 24, stop_ids=set())
    out, stats = dec.speculative_generate(None, prompt, graph, 24, stop_ids=set())
    assert out == ref and set(stats.tree_sizes) == {11}
    assert graph.fixed.graph is captured  # replayed, never recaptured (the head cache had room)


@pytest.mark.parametrize("family", [eagle, eagle3])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("total,depth,k", [(4, 5, 3), (3, 4, 2), (6, 6, 2)])
def test_early_stop_keeps_the_same_tree(family, static, total, depth, k):
    """`early_stop` ends the expansion once the best frontier score is <= the `total`-th best candidate's, so
    the tree is node for node the one the full expansion keeps, from fewer head passes: over 12 commits of
    random lengths (fp64 heads, both modes) every tree is identical, the expansion stopped early at least once,
    and without early stop it always runs depth - 1 levels."""
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = _head(family, target, seed=5)
    with torch.no_grad():  # a peaked vocabulary head: confident and unsure steps both occur
        head.draft_head()[1].weight.mul_(6.0)
    ids = torch.randint(5, V, (1, 40), generator=torch.Generator().manual_seed(2))
    feats, nxt = _features(head, target, ids), torch.cat([ids[0, 1:], torch.tensor([42])])
    full = EagleTreeProposer(head, total, depth, k, static=static, early_stop=False)
    fast = EagleTreeProposer(head, total, depth, k, static=static)
    cuts = [0, 5, 6, 9, 10, 13, 17, 18, 22, 27, 30, 34, 40]
    levels = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        a, b = full.propose(feats[lo:hi], nxt[lo:hi]), fast.propose(feats[lo:hi], nxt[lo:hi])
        assert torch.equal(b.tokens, a.tokens) and torch.equal(b.parents, a.parents)
        assert torch.equal(b.depth, a.depth) and torch.equal(b.ancestors, a.ancestors)
        if a.scores is not None:
            assert b.scores is not None and torch.equal(b.scores, a.scores)
        assert full.last_levels == depth - 1 and 1 <= fast.last_levels <= depth - 1
        levels.append(fast.last_levels)
    assert min(levels) < depth - 1, levels  # it did stop early
