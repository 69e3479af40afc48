"""The static decode path (eval/static_decode.py, eval/static_kv.py): equal to AR token for token for every
family on tiny Llama / Qwen2 / Mistral targets (fp64), in its eager shape (exact-size trees over cache views),
its fixed shape (padded trees, whole-buffer attention, device-side positions) and, on CUDA, as CUDA graphs;
plus the KV compaction invariants and the packed one-sync verify against the reference rule."""

from __future__ import annotations

import pytest
import torch

from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.fallback import FallbackController
from specdraft.eval.hybrid import LookupBranch
from specdraft.eval.proposers import PromptLookupProposer, make_proposer
from specdraft.eval.static_decode import StaticDecoder, budget_for
from specdraft.eval.static_kv import StaticKVCache
from specdraft.eval.tree import DraftTree, ProposerSpec, pack_beams
from specdraft.eval.verify import greedy_verify, greedy_verify_host, greedy_verify_packed
from specdraft.models import redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.testing import (
    FAMILIES,
    OracleBeamProposer,
    RandomTreeProposer,
    ScriptedFallback,
    check_static_equals_ar,
    jitter,
    tiny_llama,
    tiny_proposer,
    tiny_target,
    tiny_tokenizer,
)
from specdraft.train.config import ReDrafterSchema

V, H = 128, 32
CPU = torch.device("cpu")
SHAPES = [
    "eager",
    "fixed",
    pytest.param("graph", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def _target(arch: str, device: torch.device = CPU) -> torch.nn.Module:
    """A tiny fp64 target of the given architecture (`specdraft.testing.tiny_target`)."""
    return tiny_target(arch, device)


def _decoder(model: torch.nn.Module, shape: str) -> StaticDecoder:
    """The decoder in one of its three shapes (a small max_len, so growing the cache is exercised too)."""
    return StaticDecoder(model, 48, static=shape != "eager", graphs=shape == "graph")


def _proposer(family: str, target: torch.nn.Module):
    """A randomly initialised drafter of `family` on `target` behind its real proposer."""
    return tiny_proposer(family, target)


@pytest.mark.parametrize("shape", SHAPES)
def test_queued_greedy_ar_stops_where_ar_stops(shape):
    """Greedy AR on the fixed-shape path reads its tokens once per `AR_QUEUE` steps: stop tokens anywhere in a
    round (its first, middle, last token) and budgets around a round's size give AR's tokens and step count,
    call after call on one decoder (the steps queued past a stop are dropped)."""
    from specdraft.eval.static_decode import AR_QUEUE

    model = _target("llama", torch.device("cuda") if shape == "graph" else CPU)
    dec = _decoder(model, shape)
    prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(7))
    full, _ = ar_generate(model, None, prompt, 40, stop_ids=set())
    cases = [(set(), n) for n in (1, AR_QUEUE - 1, AR_QUEUE, AR_QUEUE + 1, 40)]
    cases += [({full[i]}, 40) for i in (0, 3, AR_QUEUE - 1, AR_QUEUE, 2 * AR_QUEUE + 2)]
    for stop, n in cases:
        ref, ref_stats = ar_generate(model, None, prompt, n, stop_ids=stop)
        out, stats = dec.ar_generate(None, prompt, n, stop_ids=stop)
        assert (
            out == ref and stats.steps == ref_stats.steps and stats.finish_reason == ref_stats.finish_reason
        )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_test_trees_equal_ar(arch, shape):
    """Random trees (mostly rejected) and oracle beams (long accepted paths, scattered compaction)."""
    model = _target(arch, torch.device("cuda") if shape == "graph" else CPU)
    dec = _decoder(model, shape)
    for prompt_len in (1, 6, 23):
        prompt = torch.randint(0, V, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, ar_stats = ar_generate(model, None, prompt, 30, stop_ids=set())
        ar_out, st = dec.ar_generate(None, prompt, 30, stop_ids=set())
        assert ar_out == ref and st.steps == ar_stats.steps
        out, _ = dec.speculative_generate(
            None, prompt, RandomTreeProposer(V, seed=prompt_len), 30, stop_ids=set()
        )
        assert out == ref
        out, stats = dec.speculative_generate(
            None, prompt, OracleBeamProposer(ref, prompt_len, vocab=V), 30, stop_ids=set()
        )
        assert out == ref and stats.tokens_per_step > 1.8


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "family", ["redrafter", "redrafter_copy", "medusa", "medusa_root", "eagle", "eagle3"]
)
def test_fixed_shape_draft_steps_equal_ar(family, shape):
    """Each family's fixed-shape draft step (on CUDA captured as a CUDA graph, and the capture must hold: a
    failed capture warns, an error here) decodes AR's tokens, mixed prompts and stop tokens included."""
    device = torch.device("cuda") if shape == "graph" else CPU
    model = _target("llama", device)
    proposer = tiny_proposer(family, model, static=True, graphs=shape == "graph")
    assert getattr(proposer, "static", True) and getattr(proposer, "graphs", False) == (shape == "graph")
    dec = _decoder(model, shape)
    check_static_equals_ar(dec, model, proposer, vocab=V)
    assert getattr(proposer, "graphs", False) == (shape == "graph")  # still on: every capture held
    if shape == "graph":  # greedy steps replay the verify forward and its verification as one graph
        assert dec._verified and all(g is not None for g in dec._verified.values())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_every_family_equals_ar(arch, family, shape):
    """Mixed prompt lengths, stop tokens hit mid-way, budgets hit; the dynamic path gives the same trees."""
    device = torch.device("cuda") if shape == "graph" else CPU
    model = _target(arch, device)
    proposer = _proposer(family, model)
    check_static_equals_ar(_decoder(model, shape), model, proposer, vocab=V)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["redrafter", "medusa", "eagle", "eagle3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_family_with_a_lookup_branch_equals_ar(arch, family, shape):
    """Prompt lookup merged into each family's tree (eval/hybrid.py), under a node budget too."""
    device = torch.device("cuda") if shape == "graph" else CPU
    model = _target(arch, device)
    proposer = LookupBranch(_proposer(family, model), 5)
    stats = check_static_equals_ar(_decoder(model, shape), model, proposer, vocab=V)
    assert max(n for s in stats for n in s.tree_sizes) > _proposer(family, model).spec.node_budget // 2
    assert proposer.alone_steps > 0  # steps with lookup's chain alone: the drafter caught up afterwards
    proposer.fit_budget(4)  # what `NodeBudget` does: both sources draft small trees, the output holds
    check_static_equals_ar(_decoder(model, shape), model, proposer, vocab=V)


@pytest.mark.parametrize("shape", ["eager", "fixed"])
@pytest.mark.parametrize("family", ["redrafter", "eagle3"])
def test_a_priced_lookup_branch_under_a_node_budget_equals_ar(family, shape):
    """A lookup branch that prices its drafter on the verify cost curve (a steep one: the drafter idles on most
    steps, probed now and then, and lookup's chain or the root alone is verified instead), under a fitted node
    budget: echoing prompts and fresh ones, the output is the target's own greedy output."""
    from specdraft.eval.budget import CostCurve, NodeBudget

    model = _target("llama")
    dec = _decoder(model, shape)
    curve = CostCurve({1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0, 16: 5.0})  # ms: trees could pay, a random drafter not
    # 4-step fits: the mean decides (one standard error of 4 steps would keep drafting off here)
    budget = NodeBudget(curve, fit_steps=4, check_steps=2, sizes=(1, 2, 4, 8, 16), confidence=0.0)
    proposer = LookupBranch(_proposer(family, model), 6, cost=curve, min_probe=2, max_probe=8)
    for seed in (3, 4, 5):
        prompt = torch.randint(5, 128, (9,), generator=torch.Generator().manual_seed(seed))
        head, _ = ar_generate(model, None, prompt, 20, stop_ids=set())
        echo = torch.cat([prompt, torch.tensor(head[:12]), prompt[-3:]]) if seed != 4 else prompt
        ref, _ = ar_generate(model, None, echo, 30, stop_ids=set())
        out, _ = dec.speculative_generate(None, echo, proposer, 30, stop_ids=set(), budget=budget)
        assert out == ref
    assert proposer.priced_out > 0 and proposer.alone_steps > 0 and proposer.draft_ms is not None


@pytest.mark.parametrize("family", ["redrafter", "medusa", "eagle3"])
def test_a_lookup_branch_finds_an_echo_and_stays_lossless(family):
    """The AR continuation echoed in the prompt: the merged tree accepts it in long runs (more tokens per step
    than the family alone), and the output equals the target's own greedy output."""
    target = _target("llama")
    prompt = torch.randint(5, 128, (12,), generator=torch.Generator().manual_seed(3))
    ref, _ = ar_generate(target, None, prompt, 40, stop_ids=set())
    echo = torch.cat([prompt, torch.tensor(ref[:30]), prompt[-3:]])
    ref_echo, _ = ar_generate(target, None, echo, 30, stop_ids=set())
    alone, alone_stats = speculative_generate(
        target, None, echo, _proposer(family, target), 30, stop_ids=set()
    )
    both, stats = speculative_generate(
        target, None, echo, LookupBranch(_proposer(family, target), 6), 30, stop_ids=set()
    )
    assert alone == both == ref_echo
    assert max(stats.accepted) >= 4 and stats.tokens_per_step > alone_stats.tokens_per_step


@pytest.mark.parametrize("shape", ["eager", "fixed"])
def test_fallback_and_sampling_on_the_static_path(shape):
    """Root-only steps between drafted ones, and T > 0 (same draws as the dynamic path, same generator)."""
    model = _target("llama")
    dec = _decoder(model, shape)
    prompt = torch.arange(5, 16)
    ref, _ = ar_generate(model, None, prompt, 25, stop_ids=set())
    out, stats = dec.speculative_generate(
        None, prompt, PromptLookupProposer(4), 25, stop_ids=set(), fallback=FallbackController()
    )
    assert out == ref and stats.target_steps >= 1
    proposer = _proposer("redrafter", model)
    for seed in range(3):
        kw = dict(temperature=0.8, top_k=20, stop_ids=set())
        a, _ = speculative_generate(
            model, None, prompt, proposer, 20, generator=torch.Generator().manual_seed(seed), **kw
        )
        b, _ = dec.speculative_generate(
            None, prompt, proposer, 20, generator=torch.Generator().manual_seed(seed), **kw
        )
        assert a == b


class _Recording:
    """A proposer that records what the decoder hands it (hidden rows, next tokens) and delegates the rest."""

    def __init__(self, inner) -> None:
        self.inner, self.hidden, self.tokens = inner, [], []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.inner.reset()
        self.hidden, self.tokens = [], []

    def propose(self, hidden, tokens):
        self.hidden.append(hidden.clone())
        self.tokens.append(tokens.clone())
        return self.inner.propose(hidden, tokens)


def _aliased_outputs(dec: StaticDecoder) -> None:
    """Make `dec`'s verify forwards return one persistent (logits, hidden) pair per tree size, overwritten by
    the next forward of that size, as a replayed CUDA graph's outputs are (the graph path on a CPU)."""
    forward, buffers = dec._forward_tree, {}

    def aliased(tree, layers, keep_last):
        logits, hidden, valid, inp = forward(tree, layers, keep_last)
        key = (logits.shape, hidden.shape)
        if key not in buffers:
            buffers[key] = (torch.empty_like(logits), torch.empty_like(hidden))
        buffers[key][0].copy_(logits), buffers[key][1].copy_(hidden)
        return buffers[key][0], buffers[key][1], valid, inp

    dec._forward_tree = aliased


@pytest.mark.parametrize("shape", [*SHAPES, "aliased"])
def test_plain_steps_hand_every_position_to_the_next_draft(shape):
    """Plain target steps between drafts (the fallback's, or a node budget that is off) take AR's one-node
    step on the eager path and hold their positions: the next draft gets each committed position once, in
    order, with the features and next token a decoder drafting at every step hands over (fp64), and the
    output equals AR's. `aliased`: the fixed shape with every forward's outputs in one buffer per size, as
    graph replays give them (held plain-step states must be copies, not views)."""
    model = _target("llama", torch.device("cuda") if shape == "graph" else CPU)
    dec = _decoder(model, "fixed" if shape == "aliased" else shape)
    if shape == "aliased":
        _aliased_outputs(dec)
    prompt = torch.randint(5, V, (9,), generator=torch.Generator().manual_seed(3))
    ref, _ = ar_generate(model, None, prompt, 30, stop_ids=set())
    seen = {}
    for pattern in ("D", "..D", ".D...D"):
        rec = _Recording(_proposer("redrafter", model))
        out, stats = dec.speculative_generate(
            None, prompt, rec, 30, stop_ids=set(), fallback=ScriptedFallback(pattern)
        )
        assert out == ref
        assert stats.target_steps >= (pattern.count(".") > 0)
        seen[pattern] = (torch.cat(rec.hidden), torch.cat(rec.tokens))
    hidden, tokens = seen["D"]
    committed = torch.cat([prompt[1:], torch.tensor(ref)])
    for h, t in seen.values():
        n = t.shape[0]
        assert t.tolist() == committed[:n].tolist()  # every position once, in order
        assert h.shape[0] == n and torch.allclose(h, hidden[:n], rtol=0, atol=1e-9)


def test_packed_verify_matches_the_reference_rule():
    """Same path and bonus as `greedy_verify` on random trees and logits; padding never accepted."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        tokens = torch.randint(0, 4, (n,), generator=g)  # a tiny vocabulary: many matches
        tree = DraftTree(tokens, parents)
        logits = torch.randn(n, 4, generator=g)
        path, bonus = greedy_verify(tree, logits)
        packed = greedy_verify_packed(tree.tokens, tree.parents, tree.ancestors, tree.depth, logits)
        a = int(packed[0])
        assert a == path.shape[0] and int(packed[1]) == bonus
        assert packed[2 : 2 + a].tolist() == path.tolist() and packed[2 + a : 2 + n].tolist() == list(
            range(a, n)
        )
        assert packed[2 + n : 2 + n + a].tolist() == tokens[path].tolist()
    # a padding node that matches the argmax is still never accepted
    tree = DraftTree(torch.tensor([0, 1]), torch.tensor([-1, 0]))
    logits = torch.tensor([[0.0, 5.0], [0.0, 0.0]])
    valid = torch.tensor([True, False])
    assert (
        int(greedy_verify_packed(tree.tokens, tree.parents, tree.ancestors, tree.depth, logits, valid)[0])
        == 1
    )


def test_host_verify_is_the_packed_rule():
    """`greedy_verify_host` (the CPU decode's rule) returns `greedy_verify_packed`'s row exactly: random trees of
    1-12 nodes over 2-5 tokens, with and without padding nodes and the prefix counts."""
    g = torch.Generator().manual_seed(1)
    for _ in range(1000):
        n, v = int(torch.randint(1, 13, (1,), generator=g)), int(torch.randint(2, 6, (1,), generator=g))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        tree = DraftTree(torch.randint(0, v, (n,), generator=g), parents)
        logits = torch.randn(n, v, generator=g)
        pad = bool(torch.rand(1, generator=g) < 0.5)
        valid = torch.cat([torch.tensor([True]), torch.rand(n - 1, generator=g) < 0.8]) if pad else None
        prefix = bool(torch.rand(1, generator=g) < 0.5)
        want = greedy_verify_packed(
            tree.tokens, tree.parents, tree.ancestors, tree.depth, logits, valid, prefix
        )
        got = greedy_verify_host(
            tree.tokens.tolist(), parents.tolist(), tree.depth.tolist(), logits.argmax(-1).tolist(),
            None if valid is None else valid.tolist(), prefix,
        )  # fmt: skip
        assert got == want.tolist()


@pytest.mark.parametrize("static", [False, True])
def test_kv_compaction_invariants(static):
    """commit() keeps exactly prefix + accepted nodes in order, never reallocates, and leaves the rest stale."""
    model = tiny_llama(num_layers=2, dtype=torch.float64)
    cache = StaticKVCache(model, 32, static)
    bufs = [(layer.keys, layer.values) for layer in cache.layers]
    ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in bufs]
    for k, v in bufs:  # position p holds the value p everywhere
        k.copy_(torch.arange(32, dtype=k.dtype)[None, None, :, None].expand_as(k))
        v.copy_(-k)
    cache.set_length(5)
    path = torch.tensor([0, 2, 3, 6])  # accepted nodes of a 7-node tree written at 5..11
    padded = torch.cat([path, torch.arange(4, 7)]) if static else path
    cache.commit(padded, 4)
    assert cache.length == 9 and int(cache.length_t) == 9
    for (k, v), ptr in zip(bufs, ptrs):
        assert (k.data_ptr(), v.data_ptr()) == ptr
        assert k[0, 0, :9, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 11]
        assert torch.equal(v[0, :, :9], -k[0, :, :9])
    before = cache.buffer.clone()  # every layer's keys and values are views of this one buffer
    chain = torch.tensor([0, 1, 2])  # accepted nodes already in place: nothing moves
    cache.commit(torch.cat([chain, torch.arange(3, 7)]) if static else chain, 3, in_place=True)
    assert cache.length == 12 and int(cache.length_t) == 12 and torch.equal(cache.buffer, before)
    with pytest.raises(ValueError, match="KV cache full"):
        cache.check_room(21)


def test_budgets_and_shapes():
    """Power-of-two budgets; the fixed shape pads, so only a few verify shapes ever occur."""
    assert [budget_for(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]
    model = tiny_llama(num_layers=2, dtype=torch.float64)
    dec = StaticDecoder(model, 64, static=True)
    prompt = torch.arange(4, 10)
    ref, _ = ar_generate(model, None, prompt, 20, stop_ids=set())
    dec.speculative_generate(None, prompt, RandomTreeProposer(V, max_nodes=12), 20, stop_ids=set())
    assert set(dec._inputs) <= {1, 2, 4, 8, 16}
    with pytest.raises(ValueError, match="graphs=True"):
        StaticDecoder(model, 64, static=False, graphs=True)


def test_pack_beams_trees_verify_in_every_shape():
    """A dedup-packed tree (the ReDrafter shape) through both shapes gives the same path as the reference."""
    model = tiny_llama(num_layers=2, dtype=torch.float64)
    prompt = torch.arange(3, 9)
    ref, _ = ar_generate(model, None, prompt, 8, stop_ids=set())
    beams = torch.tensor([[ref[0], ref[1], ref[2]], [ref[0], ref[1], 7], [ref[0], 9, ref[2]]])
    tree, _ = pack_beams(beams)
    for static in (False, True):
        dec = StaticDecoder(model, 32, static=static)

        class Once:
            spec, last_compression = ProposerSpec(), None

            def reset(self):
                pass

            def propose(self, hidden, tokens):
                return tree if int(tokens[-1]) == ref[0] else DraftTree(tokens[-1:], torch.tensor([-1]))

        out, stats = dec.speculative_generate(None, prompt, Once(), 8, stop_ids=set())
        assert out == ref and stats.accepted[0] == 2


@pytest.mark.parametrize("vocab_cut", [None, 64])
def test_fixed_beam_search_equals_the_dynamic_one(vocab_cut):
    """All W beams from slot 0 (dead ones at -inf) give the same beams and scores as widening from 1."""
    from specdraft.models.redrafter_beam import beam_search, beam_search_fixed_rows

    target = tiny_llama(num_layers=2, dtype=torch.float64)
    fp = target_fingerprint(target, tiny_tokenizer())
    schema = ReDrafterSchema(draft_len=4, beam_width=4, num_layers=1, draft_vocab_size=vocab_cut)
    counts = torch.arange(V, 0, -1).float() if vocab_cut else None  # a reduced draft vocabulary needs counts
    d = jitter(redrafter.build(schema, target, fp, token_counts=counts).double().eval(), 0.3)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        hidden = torch.randn(H, generator=g, dtype=torch.float64)
        root = int(torch.randint(0, V, (1,), generator=g))
        beams, cum = beam_search(d, hidden, root, 4, 4)
        fixed, fcum = beam_search_fixed_rows(d, hidden[None], torch.tensor([root]), 4, 4)  # one row
        assert torch.equal(beams, fixed[0]) and torch.allclose(cum, fcum[0])


@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_shape_redrafter_proposer_is_lossless(shape):
    """The constant-topology tree (1 + W*D nodes, no dedup, optionally a CUDA-graph draft step)."""
    device = torch.device("cuda") if shape == "graph" else CPU
    model = _target("llama", device)
    fp = target_fingerprint(model, tiny_tokenizer())
    d = jitter(
        redrafter.build(ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1), model, fp)
        .to(device=device, dtype=torch.float64)
        .eval()
    )
    proposer = make_proposer(d, static=True, graphs=shape == "graph")
    assert proposer.static and proposer.graphs == (shape == "graph")
    dec = _decoder(model, shape)
    for prompt_len in (2, 13):
        prompt = torch.randint(5, V, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(model, None, prompt, 24, stop_ids=set())
        out, stats = dec.speculative_generate(None, prompt, proposer, 24, stop_ids=set())
        assert out == ref and set(stats.tree_sizes) == {1 + 4 * 3}
    # variants that read growing state keep the dynamic draft step
    ctx = ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1, context_heads=2, context_dim=16)
    assert not make_proposer(redrafter.build(ctx, model, fp).double(), static=True).static
    if device.type == "cpu":  # graphs asked for a CPU drafter: the fixed-shape step runs eagerly
        assert not make_proposer(d, static=True, graphs=True).graphs
