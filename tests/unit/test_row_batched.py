"""Drafting several batch rows in one drafter call (`eval.decode.RowBatchedProposer`): ReDrafter's beam search
over R rows (`beam_search_rows`), Medusa's heads run once, and the prompt-lookup branch around them give every
row exactly the tree its own `propose` gives, step after step (per-row state such as the copy-gate index
advances alike); the batched decoder drafts each step in one call and its outputs equal batch-1 AR."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.data.ngrams import NgramIndex
from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.decode import RowBatchedProposer, ar_generate
from specdraft.eval.hybrid import LookupBranch
from specdraft.eval.proposers import ReDrafterProposer
from specdraft.eval.tree import PAD, pack_beams
from specdraft.models import redrafter_beam
from specdraft.testing import random_prompts, tiny_proposer, tiny_proposer_factory, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
CPU = torch.device("cpu")
BATCHED = [
    "redrafter", "redrafter_copy", "medusa", "medusa_root", "eagle", "eagle_vocab", "eagle3", "eagle3_fused",
    "eagle_copy", "eagle3_copy", "lookup", "redrafter_copy+lookup", "medusa+lookup", "medusa_root+lookup",
    "eagle3+lookup",
]  # fmt: skip


def _same(a, b) -> bool:
    """Two trees with the same tokens and topology."""
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


@pytest.mark.parametrize("copy", [False, True])
def test_beam_search_rows_equals_one_search_per_row(copy):
    """Each row of one R-row search equals `beam_search` from that row's features and root alone, beams and
    cumulative log-probs, with and without the copy gate (each row's candidates from its own text)."""
    model = tiny_target("llama", CPU)
    drafter = tiny_proposer("redrafter_copy" if copy else "redrafter", model).drafter
    torch.manual_seed(3)
    hidden = torch.randn(5, model.config.hidden_size, dtype=torch.float64)  # (R, F)
    roots = torch.randint(0, 128, (5,))  # (R,)
    texts = random_prompts([7, 12, 3, 20, 9], seed=2)
    copies = [NgramIndex(3) for _ in texts] if copy else None
    for c, t in zip(copies or [], texts, strict=False):
        c.extend(t)
    beams, cum = redrafter_beam.beam_search_rows(drafter, hidden, roots, 4, 3, copies=copies)  # (R, W, 1 + D)
    assert beams.shape == (5, 4, 4) and cum.shape == (5, 4, 4)
    for r in range(5):
        one_b, one_c = drafter.beam_search(hidden[r], int(roots[r]), 4, 3, copy=copies[r] if copies else None)
        assert torch.equal(beams[r], one_b)
        torch.testing.assert_close(cum[r], one_c, rtol=1e-12, atol=1e-12)
    assert (beams[:, :, 0] == roots[:, None]).all()


@pytest.mark.parametrize("copy", [False, True])
def test_beam_search_stops_early_where_everything_left_is_pruned(copy, monkeypatch):
    """`min_logp`: the search stops after the first slot where every row's beams are below it, and the
    positions the proposer keeps (cum >= min_logp) are the full search's exactly, tokens and log-probs, for
    thresholds that stop it at every depth; the slots it skipped are -inf (pruned)."""
    model = tiny_target("llama", CPU)
    drafter = tiny_proposer("redrafter_copy" if copy else "redrafter", model).drafter
    torch.manual_seed(4)
    hidden = 30 * torch.randn(
        3, model.config.hidden_size, dtype=torch.float64
    )  # peaked drafts: varied depths
    roots = torch.randint(0, 128, (3,))
    texts = random_prompts([9, 4, 15], seed=3)

    def search(min_logp):
        copies = [NgramIndex(3) for _ in texts] if copy else None
        for c, t in zip(copies or [], texts, strict=False):
            c.extend(t)
        calls = []
        inner = drafter.state_logits
        monkeypatch.setattr(drafter, "state_logits", lambda *a, **k: calls.append(1) or inner(*a, **k))
        out = redrafter_beam.beam_search_rows(drafter, hidden, roots, 3, 4, copies=copies, min_logp=min_logp)
        monkeypatch.undo()
        return (*out, len(calls))

    beams, cum, n = search(None)
    assert n == 4
    best = cum.amax(dim=(0, 1))  # (1 + D,) the best log-prob at each depth, over rows and beams
    depths = set()
    for t in [float(x) for x in best[1:]] + [0.5 * float(best[1]), float(best[1]) + 1e-6, -1e9]:
        b, c, calls = search(t)
        keep = cum >= t
        assert torch.equal(c >= t, keep)
        assert torch.equal(b[keep], beams[keep]) and torch.equal(c[keep], cum[keep])
        stop = int((best[1:] >= t).sum()) + 1  # slots searched: the confident ones and the first that is not
        assert calls == min(stop, 4)
        assert (c[..., 1 + calls :] == float("-inf")).all()
        depths.add(calls)
    assert {1, 4} < depths  # stopped at once, in between, and not at all (ties may merge two depths)


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("min_prob", [0.2, 0.3, 0.5, 0.55, 0.7])
def test_min_prob_tree_is_the_full_width_search_pruned(copy, min_prob):
    """A ReDrafter proposer with `min_prob` p stops its search at the first slot where every beam is below p,
    yet its tree (tokens, topology) is the full-depth search's with every position below p pruned."""
    model = tiny_target("llama", CPU)
    family = "redrafter_copy" if copy else "redrafter"
    drafter = tiny_proposer(family, model).drafter
    g = torch.Generator().manual_seed(6)
    prop = ReDrafterProposer(drafter, 8, 5, min_prob=min_prob)
    assert prop.beam_width == (
        1 if min_prob > 0.5 else 8
    )  # above 1/2: the greedy chain finds every kept node
    prompt = random_prompts([12], seed=4)[0]
    tokens = torch.tensor(prompt[1:] + [prompt[0]])
    ref = NgramIndex(3) if copy else None
    if ref is not None:
        ref.extend(prompt[1:])
    sizes = []
    for step in range(4):
        scale = 3.0 + 3.0 * step  # drafts from flat to peaked: branches, early stops and whole chains
        hidden = scale * torch.randn(len(tokens), model.config.hidden_size, dtype=torch.float64, generator=g)
        tree = prop.propose(hidden, tokens)
        sizes.append(tree.num_nodes)
        beams, cum = drafter.beam_search(hidden[-1], int(tokens[-1]), 8, 4, copy=ref)  # (8, 5) each
        want, _ = pack_beams(beams.masked_fill(cum < math.log(min_prob), PAD))
        assert torch.equal(tree.tokens, want.tokens) and torch.equal(tree.parents, want.parents), step
        if ref is not None:  # the next call indexes this root and the new tokens before its own root
            ref.extend([int(tokens[-1]), 5 + step])
        tokens = torch.tensor([5 + step, 9 + step])
    assert max(sizes) > 1  # something was drafted


def test_rows_above_one_half_search_one_beam_and_keep_the_full_search_pruned():
    """`propose_rows` of proposers with p > 1/2 (one beam each) gives every row the 8-wide search's tree pruned
    below p, rows drafting nothing, one node or a chain alike."""
    model = tiny_target("llama", CPU)
    drafter = tiny_proposer("redrafter", model).drafter
    ps = [ReDrafterProposer(drafter, 8, 5, min_prob=0.6) for _ in range(4)]
    assert all(p.beam_width == 1 for p in ps)
    g = torch.Generator().manual_seed(11)
    sizes = set()
    for step in range(3):
        hidden = [
            (2.0 + 4.0 * r + 3.0 * step)
            * torch.randn(2, model.config.hidden_size, dtype=torch.float64, generator=g)
            for r in range(4)
        ]  # flat to peaked drafts across the rows
        tokens = [torch.tensor([7 + r, 20 + 3 * r + step]) for r in range(4)]
        trees = ps[0].propose_rows(ps, hidden, tokens)
        assert trees is not None
        for h, t, tree in zip(hidden, tokens, trees, strict=True):
            beams, cum = drafter.beam_search(h[-1], int(t[-1]), 8, 4)  # (8, 5) each
            want, _ = pack_beams(beams.masked_fill(cum < math.log(0.6), PAD))
            assert torch.equal(tree.tokens, want.tokens) and torch.equal(tree.parents, want.parents), step
            sizes.add(tree.num_nodes)
    assert len(sizes) > 1 and max(sizes) > 2  # not every row the same: roots alone and chains


@pytest.mark.parametrize("family", BATCHED)
def test_propose_rows_equals_propose_row_by_row(family):
    """Two sets of R proposers around the same drafter fed the same rows for several steps: `propose_rows` on
    one set gives every row the tree `propose` gives the other, every step (the rows' own state advances)."""
    model = tiny_target("llama", CPU)
    make = tiny_proposer_factory(family, model)
    together, alone = [make() for _ in range(3)], [make() for _ in range(3)]
    assert isinstance(together[0], RowBatchedProposer)
    g = torch.Generator().manual_seed(5)
    prompts = random_prompts([6, 20, 9], seed=7)  # 20: longer than EAGLE's padded commit (`eagle_rows.SOLO`)
    layers = (together[0].inner if family.endswith("+lookup") else together[0]).spec.feature_layers
    f = 32 * max(len(layers), 1)  # EAGLE-3 reads several target layers
    hidden = [torch.randn(len(p), f, dtype=torch.float64, generator=g) for p in prompts]  # R of (n, F)
    tokens = [torch.tensor(p[1:] + [p[0]]) for p in prompts]  # R of (n,)
    for step in range(4):
        trees = together[0].propose_rows(together, hidden, tokens)
        assert trees is not None and len(trees) == 3
        for r in range(3):
            ref = alone[r].propose(hidden[r], tokens[r])
            assert _same(trees[r], ref), (family, step, r)
            assert together[r].last_compression == alone[r].last_compression
        # every row commits its tree's first node (the root) and one more token (a new root)
        hidden = [torch.randn(2, f, dtype=torch.float64, generator=g) for _ in range(3)]
        tokens = [
            torch.tensor([int(t.tokens[min(1, t.num_nodes - 1)]), 7 + step + r]) for r, t in enumerate(trees)
        ]


def test_propose_rows_declines_rows_it_cannot_draft_together():
    """Rows with another search size or drafter, or a fixed-shape step, are declined (None) with nothing
    changed, so the decoder drafts them row by row."""
    model = tiny_target("llama", CPU)
    p = tiny_proposer("redrafter_copy", model)
    other = ReDrafterProposer(p.drafter, beam_width=2, beam_length=4)
    h, t = [torch.randn(3, 32, dtype=torch.float64)] * 2, [torch.tensor([4, 5, 6])] * 2
    assert p.propose_rows([p, other], h, t) is None
    assert p.copy_ctx.index is None and other.copy_ctx.index is None  # no row's state was advanced
    assert p.propose_rows([p, tiny_proposer("redrafter_copy", model)], h, t) is None  # another drafter module
    assert LookupBranch(p, 4).propose_rows([LookupBranch(p, 4), p], h, t) is None


@pytest.mark.parametrize(
    "family", ["redrafter_copy", "medusa", "eagle3", "eagle3_int8", "redrafter_copy+lookup", "eagle+lookup"]
)
def test_batched_decoder_drafts_each_step_in_one_call(family, monkeypatch):
    """With one shared drafter the batched decoder never calls a row's `propose` for the drafter (one
    `propose_rows` per step instead), and every request's output equals its batch-1 AR output."""
    model = tiny_target("llama", CPU)
    prompts = random_prompts([1, 4, 25, 9, 17, 6, 13], seed=4)
    budgets = [14, 20, 1, 9, 20, 16, 11]
    refs = [ar_generate(model, None, p, m, stop_ids=set())[0] for p, m in zip(prompts, budgets, strict=True)]
    make = tiny_proposer_factory(family, model)
    inner = type(make().inner if family.endswith("+lookup") else make())
    calls = {"rows": 0}

    def no_single(self, hidden, tokens):
        raise AssertionError("a row was drafted alone")

    real = inner.propose_rows

    def counted(self, rows, hidden, tokens):
        calls["rows"] += 1
        return real(self, rows, hidden, tokens)

    monkeypatch.setattr(inner, "propose", no_single)
    monkeypatch.setattr(inner, "propose_rows", counted)
    for static in (False, True):
        res = BatchDecoder(model, 3, static=static).generate(prompts, budgets, set(), make)
        assert [out for out, _ in res] == refs
        assert max(n for _, s in res for n in s.tree_sizes) > 1
    assert calls["rows"] > 0


def test_int8_heads_are_shared_by_the_proposers_of_one_drafter():
    """B proposers of one drafter share one quantised head (quantising it per row cost ~70 ms each on a
    SmolLM2-sized head); a changed weight is quantised again."""
    from specdraft.eval.proposers import int8_copy, int8_supported

    if not int8_supported():
        pytest.skip("no fbgemm int8 ops in this torch build")
    model = tiny_target("llama", CPU)
    drafter = tiny_proposer("redrafter", model).drafter
    a = ReDrafterProposer(drafter, 4, 4, int8_head=True)
    b = ReDrafterProposer(drafter, 4, 4, int8_head=True)
    assert a.head is not None and a.head is b.head
    with torch.no_grad():
        drafter.head.weight.mul_(1.5)
    assert int8_copy(drafter.head) is not a.head


def test_one_row_at_a_time_gives_the_same_output():
    """`OneRowAtATime` (the A/B of `scripts/bench_batch.py --draft-rows each`) drafts row by row: the rows'
    `propose_rows` is never called and the outputs are batch-1 AR's."""
    from specdraft.eval.batch_decode import OneRowAtATime

    model = tiny_target("llama", CPU)
    prompts = random_prompts([5, 11, 3, 8], seed=9)
    refs = [ar_generate(model, None, p, 12, stop_ids=set())[0] for p in prompts]
    make = tiny_proposer_factory("redrafter_copy", model)
    made = []

    def factory():
        made.append(make())
        return OneRowAtATime(made[-1])

    res = BatchDecoder(model, 2).generate(prompts, 12, set(), factory)
    assert [out for out, _ in res] == refs
    assert not isinstance(factory(), RowBatchedProposer)
    assert all(
        p.copy_ctx.index is not None for p in made[:2]
    )  # each row's own proposer drafted (its index grew)
