"""An EAGLE head's one-chain draft through C (`eval/eagle_chain.py`, `sd_eagle_slot`): the chain torch drafts with
the same weights (EAGLE-1, EAGLE-3, with and without the copy gate), lossless decoding through it under capped
budgets, the torch cache complete after chain steps (a refit's full tree, batch rows drafted together), and the
cases it leaves to torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from specdraft.data.ngrams import NgramIndex
from specdraft.eval import eagle_chain
from specdraft.eval.budget import FULL, NodeBudget
from specdraft.eval.decode import ar_generate
from specdraft.eval.eagle_tree import EagleTreeProposer
from specdraft.eval.proposers import make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.testing import on_int8_grid, tiny_proposer, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
FAMILIES = ["eagle", "eagle3", "eagle_copy", "eagle3_copy"]


def _head(family: str) -> tuple[nn.Module, nn.Module]:
    """A tiny fp32 EAGLE head of `family` (random, on the int8 grid; EAGLE-1 drafts through the target's LM head,
    which goes on the grid too) and its target, in fp32 as well (the head borrows its embeddings and LM head)."""
    target = tiny_target("llama").float()
    head: Any = tiny_proposer(family, target).drafter.float()
    on_int8_grid(head)
    on_int8_grid(target.lm_head)
    return head, target


def _features(head: Any, target: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The target features the head reads at every position of ids (1, P): (P, F)."""
    from specdraft.models.base_llm import forward_with_hidden
    from specdraft.models.registry import spec_of

    layers = spec_of(head).layers_for(head.config)
    out = forward_with_hidden(target, ids, layers=layers, logits=False)
    return (out.layers[0].flatten(-2) if layers else out.hidden[0]).float()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_chain_is_what_torch_drafts(family):
    """Same tokens as the torch head's top-1 chain (`EagleTreeProposer` with top_k = 1: EAGLE-2's tree is then a
    chain), cumulative log-probs within float rounding, over several calls (the cache growing past its first
    capacity, the root moving, a history that repeats itself so the gate has candidates)."""
    head, target = _head(family)
    chain = eagle_chain.EagleChain(head, capacity=4)  # grown (entries copied) as the positions pass 4, 8
    torch_chain = EagleTreeProposer(head, 4, 4, 1)
    ids = torch.tensor([[5, 9, 17, 33, 9, 17, 33, 64, 5, 9, 17, 40]])
    feats = _features(head, target, ids)  # (12, F)
    copy = NgramIndex(3) if head.copy_gate is not None else None
    start = 0
    for end in (5, 6, 9, 11):  # committed positions [start, end): each pairs with the token after it
        toks = ids[0, start + 1 : end + 1]
        if copy is not None:
            torch_chain.copy_ctx.update_index(toks)
            # the native chain reads the same index as the proposer's (the tokens before the root)
        got, cum = chain.propose(
            feats[start:end], toks.tolist(), 4, torch_chain.copy_ctx.index if copy else None
        )
        out = torch_chain.commit(feats[start:end], toks)
        tok, par, score, depth = torch_chain.grow(out[-1], root=toks[-1:])
        want = torch_chain.rerank(toks[-1:], tok, par, score, depth, torch.device("cpu"))
        assert got == want.tokens.tolist(), (family, end)
        assert want.scores is not None
        torch.testing.assert_close(torch.tensor(cum), want.scores.log(), rtol=0, atol=2e-4)
        start = end


@pytest.mark.parametrize("family", ["eagle3", "eagle_copy"])
def test_decoding_through_the_chain_is_lossless_and_switches_with_the_budget(family):
    """Greedy output equals AR under caps of 2-7 nodes (chains through C, at 7 as deep as the head drafts) with
    mixed prompt lengths and a stop token; after chain steps a full tree (a refit) drafts in torch from a complete cache: the same tree as a
    proposer that never used the chain, fed the same positions."""
    head, target = _head(family)
    dec = StaticDecoder(target, 64)
    proposer = make_proposer(head, tree_nodes=8, int8_head=True, draft_block="int8")
    assert isinstance(proposer, EagleTreeProposer) and proposer.chain is not None
    for cap, prompt_len, stop in [(2, 3, set()), (4, 11, {7}), (3, 5, set()), (7, 9, set())]:  # 7: a 4-chain
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(target, None, prompt, 24, stop_ids=stop)
        out, stats = dec.speculative_generate(
            None, prompt, proposer, 24, stop_ids=stop, budget=NodeBudget.fixed(cap)
        )
        assert out == ref and max(stats.tree_sizes) <= cap
    ids = torch.randint(5, 128, (1, 14), generator=torch.Generator().manual_seed(1))
    feats = _features(head, target, ids)
    proposer.reset()
    proposer.fit_budget(4)
    for start, end in ((0, 6), (6, 8), (8, 11)):  # chain steps
        proposer.propose(feats[start:end], ids[0, start + 1 : end + 1])
    proposer.fit_budget(FULL)
    tree = proposer.propose(feats[11:13], ids[0, 12:14])  # torch takes the 11 positions it lacks, then these
    log = proposer.chain_log  # only the newest positions, which the chain has not seen, are still kept
    assert len(log.chunks) == 1 and log.at == {"torch": 1, "native": 0}
    plain = make_proposer(head, tree_nodes=8, int8_head=True, draft_block="int8")
    plain.chain = None  # the 13 positions in one torch commit, as the catch-up's (int8 activations per call)
    want = plain.propose(feats[:13], ids[0, 1:14])
    assert proposer.committed == plain.committed == 13
    assert tree.tokens.tolist() == want.tokens.tolist()


def test_batch_rows_draft_together_in_torch_and_a_lone_row_takes_its_chain():
    """Rows drafted together (`propose_rows`, 2 rows) draft in torch: each row's cache first takes the positions
    only its chain had seen, so their trees equal those of rows that never used the chain; a row that then
    drafts alone takes its chain again, whose cache also holds the positions the rows' step committed (the same
    chain as a proposer that only ever drafted chains)."""
    head, target = _head("eagle3")
    ids = torch.randint(5, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    feats = [_features(head, target, ids[r : r + 1]) for r in range(2)]
    together, alone = {}, {}
    for kind in ("chain", "torch"):
        ps = [make_proposer(head, tree_nodes=8, int8_head=True, draft_block="int8") for _ in range(2)]
        for r, p in enumerate(ps):
            if kind == "torch":
                p.chain = None
            p.fit_budget(3)
            p.propose(feats[r][:6], ids[r, 1:7])  # alone: the chain (or torch)
        if kind == "chain":  # one set of int8 copies for the head, a cache per row
            assert ps[0].chain.head is ps[1].chain.head and ps[0].chain.kc is not ps[1].chain.kc
        together[kind] = ps[0].propose_rows(ps, [f[6:8] for f in feats], [ids[r, 7:9] for r in range(2)])
        alone[kind] = ps[0].propose_rows([ps[0]], [feats[0][8:10]], [ids[0, 9:11]])
        assert (ps[0].group is None) == (kind == "chain")  # the lone chain call took its positions back
    assert together["chain"] is not None and together["torch"] is not None
    for a, b in zip(together["chain"], together["torch"], strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
    fresh = make_proposer(head, tree_nodes=8, int8_head=True, draft_block="int8")
    fresh.fit_budget(3)
    want = fresh.propose(feats[0][:10], ids[0, 1:11])  # a chain over the same 10 positions
    assert alone["chain"] is not None and alone["chain"][0].tokens.tolist() == want.tokens.tolist()


def test_what_drafts_in_torch(monkeypatch):
    """Not an EAGLE head, EAGLE-3.1's normalised fusion, another dtype, the fixed-shape expansion, no int8 layer
    or head, or `SPECDRAFT_NATIVE_CHAIN=0`: no chain (`unsupported` says why)."""
    head, target = _head("eagle3")
    assert eagle_chain.unsupported(head) is None
    assert "not an EAGLE head" in str(eagle_chain.unsupported(nn.Linear(2, 2)))
    fp64 = tiny_proposer("eagle3", tiny_target("llama")).drafter
    assert "fp32 on the CPU" in str(eagle_chain.unsupported(fp64))
    head.config.norm_fused = True
    assert "EAGLE-3.1" in str(eagle_chain.unsupported(head))
    head.config.norm_fused = False
    p = make_proposer(head, tree_nodes=8, int8_head=True, draft_block="int8")
    assert p.chain is not None and not p.chain_now()  # full-size trees: EAGLE-2's, in torch
    p.fit_budget(
        7
    )  # any cap below the full tree (8 nodes, depth 4), a probe's too: a chain of the depth allowed
    assert p.chain_now() and (p.total_tokens, p.depth) == (6, 4)
    p.fit_budget(FULL)
    assert not p.chain_now()
    assert make_proposer(head, tree_nodes=8, int8_head=True, draft_block="fused").chain is None
    assert make_proposer(head, tree_nodes=8, int8_head=False, draft_block="int8").chain is None
    assert make_proposer(head, tree_nodes=8, int8_head=True, draft_block="int8", static=True).chain is None
    monkeypatch.setenv("SPECDRAFT_NATIVE_CHAIN", "0")
    assert make_proposer(head, tree_nodes=8, int8_head=True, draft_block="int8").chain is None


@pytest.mark.parametrize("family", ["eagle3", "eagle3_copy"])
def test_the_chain_with_int8_activations_on_vnni(family):
    """Sizes that are multiples of 64 take the VNNI products (activations quantised to int8 per vector): the
    chain still drafts what the torch head drafts where its choice is not a near tie (all but a few tokens),
    cumulative log-probs within the quantisation's error."""
    from specdraft.models import qdot
    from specdraft.testing import tiny_llama

    if not qdot.set_vnni(True):
        pytest.skip("no AVX-512 VNNI here")
    target = tiny_llama(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2)  # fp32, I = 128
    head: Any = tiny_proposer(family, target).drafter.float()
    on_int8_grid(head)
    chain, torch_chain = eagle_chain.EagleChain(head), EagleTreeProposer(head, 4, 4, 1)
    ids = torch.randint(5, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    ids[0, 20:30] = ids[0, 5:15]  # a repeat: copy candidates
    feats = _features(head, target, ids)
    same, total, start = 0, 0, 0
    for end in range(8, 40, 3):
        toks = ids[0, start + 1 : end + 1]
        torch_chain.copy_ctx.update_index(toks) if head.copy_gate is not None else None
        index = torch_chain.copy_ctx.index if head.copy_gate is not None else None
        got, cum = chain.propose(feats[start:end], toks.tolist(), 4, index)
        out = torch_chain.commit(feats[start:end], toks)
        want = torch_chain.rerank(toks[-1:], *torch_chain.grow(out[-1], root=toks[-1:]), torch.device("cpu"))
        agree = next((i for i, (a, b) in enumerate(zip(got, want.tokens.tolist())) if a != b), len(got))
        same, total = same + agree - 1, total + len(got) - 1  # drafted tokens up to the first difference
        assert want.scores is not None
        torch.testing.assert_close(torch.tensor(cum[:agree]), want.scores.log()[:agree], rtol=0.15, atol=0.05)
        start = end
    assert same >= 0.85 * total, (same, total)


def test_sampling_through_the_chain_keeps_the_target_distribution(monkeypatch):
    """T > 0 with the chain drafting: the first two sampled tokens follow the target's own distribution
    (chi-square over 1,000 draws against two exact target forwards), with drafted tokens both kept and
    rejected; the same harness rejects a rule that draws the bonus token from p instead of the residual
    (`testing.check_sampling_keeps_distribution`)."""
    from specdraft.testing import check_sampling_keeps_distribution, peaked_tiny_target

    target = peaked_tiny_target()

    def chain() -> Any:  # a gated EAGLE-3 head's chain drafting 2 tokens
        head: Any = tiny_proposer("eagle3_copy", target).drafter.float()
        proposer = make_proposer(head, tree_nodes=6, int8_head=True, draft_block="int8")
        proposer.fit_budget(3)
        assert proposer.chain_now()
        return proposer

    check_sampling_keeps_distribution(target, chain, monkeypatch)


def test_a_freed_head_drops_its_int8_copies():
    """The heads' int8 copies are cached per head, weakly: a head that is freed (its chains with it) takes them."""
    import gc
    import weakref

    head, _ = _head("eagle3")
    chain = eagle_chain.make_chain(head)
    assert chain is not None
    alive = weakref.ref(head)
    del head, chain
    gc.collect()
    assert alive() is None
