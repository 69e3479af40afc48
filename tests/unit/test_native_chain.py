"""The native one-beam ReDrafter search (eval/native_chain.py, models/draft_chain.c): its drafts against a torch
rendering of the same int8 arithmetic, on both code paths (AVX-512 VNNI with int8 activations, AVX2 with fp32
ones), and lossless decoding with it in the proposer."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specdraft.data.ngrams import NgramIndex
from specdraft.eval.decode import ar_generate
from specdraft.eval.native_chain import NativeChain, rows_int8, unsupported
from specdraft.eval.proposers import ReDrafterProposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import qdot, redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.models.panel_linear import panel_available
from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.train.config import ReDrafterSchema

pytestmark = pytest.mark.skipif(not panel_available(), reason="needs the CPU kernel library")


def _drafter(hidden: int, copy_ngram: int = 3, exit_dim: int | None = None, target_layers=()):
    """A tiny fp32 ReDrafter with the recurrence, an input projection and (optionally) the copy gate, its
    weights perturbed so no product is zero; and its target."""
    target = tiny_llama(hidden_size=hidden, num_layers=2, num_heads=4, num_kv_heads=2)
    schema = ReDrafterSchema(
        draft_len=4, beam_width=4, num_layers=2, exit_dim=exit_dim or hidden, copy_ngram=copy_ngram,
        target_layers=list(target_layers),
    )  # fmt: skip
    d = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer())).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return d, target


def _quant(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The kernel's activation quantisation: x ~ sx q, q = round-half-even(x / sx) within +-127."""
    m = x.detach().float().abs().max()  # float32 throughout, as the kernel computes it
    s = m / 127.0 if float(m) > 0 else torch.tensor(1.0)
    inv = torch.tensor(1.0) / s
    return torch.round(x.detach().float() * inv).clamp(-127, 127), float(s)


@torch.no_grad()
def _reference_chain(d, hidden, root, draft_len, copy, vnni):
    """The one-beam search in torch with the kernel's arithmetic (float64 sums): int8 weights with row scales,
    activations quantised per vector where `vnni`, else fp32; the copy gate and mixture as `mix_log_probs`."""
    q = {name: rows_int8(lin.weight) for name, lin in [("u", d.rnn_u), ("w", d.rnn_w), ("p", d.input_proj),
         ("h", d.head), *[(f"b{i}", b.linear) for i, b in enumerate(d.blocks)]]}  # fmt: skip
    e = d.rnn_u.weight.shape[0]

    def mv(name, x, cols=slice(None)):
        w, s = q[name]
        w = w[:, cols].double()
        if vnni:
            xq, sx = _quant(x.float())
            return (s.double() * sx * (w @ xq.double())).float()
        return (s.double() * (w @ x.double())).float()

    feats = d.features(hidden.reshape(1, -1))[0].float()
    fproj = mv("p", feats, slice(e, None)) + d.input_proj.bias.float()
    state = d.embed_tokens(torch.tensor([root]))[0].float()
    tokens, cum, total = [root], [0.0], 0.0
    for k in range(draft_len):
        if k > 0:
            emb = d.embed_tokens(torch.tensor([tokens[-1]]))[0].float()
            state = F.silu(mv("u", state) + d.rnn_u.bias.float() + mv("w", emb))
        g = mv("p", state, slice(0, e)) + fproj
        for i, b in enumerate(d.blocks):
            g = g + F.silu(mv(f"b{i}", g) + b.linear.bias.float())
        logits = mv("h", g)
        logp = torch.log_softmax(logits.double(), -1)
        cand, m = copy.lookup(tokens) if copy is not None else (-1, 0)
        cd = int(d.to_draft_ids(torch.tensor([cand]), missing=-1)[0]) if cand >= 0 else -1
        if cd >= 0 and m > 0:
            lam = float(d.copy_gate(g, d.embed_tokens(torch.tensor([cand]))[0], torch.tensor(m)))
            pi = (1 - lam) * logp[cd].exp() + lam
            logp = logp + torch.log1p(torch.tensor(-lam, dtype=torch.float64))
            logp[cd] = pi.log()
        pick = int(logp.argmax())
        tokens.append(int(d.to_target_ids(torch.tensor([pick]))[0]))
        total += float(logp[pick])
        cum.append(total)
    return tokens, cum


@pytest.mark.parametrize("vnni", [False, True])
@pytest.mark.parametrize("copy_ngram", [0, 3])
def test_native_chain_drafts_the_int8_search(vnni, copy_ngram):
    """Same tokens as the torch rendering of the kernel's arithmetic, log-probs within float rounding, with
    and without the copy gate (its candidates from a history that repeats itself), on the VNNI path (inner
    sizes of 64) and the AVX2 one (`SPECDRAFT_AVX512=0`'s switch)."""
    if qdot.set_vnni(vnni) != vnni:
        qdot.set_vnni(os.environ.get("SPECDRAFT_AVX512", "1") != "0")
        pytest.skip("no AVX-512 VNNI here")
    try:
        d, _ = _drafter(64, copy_ngram=copy_ngram, target_layers=(1,))
        assert unsupported(d) is None
        native = NativeChain(d)
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            hidden = torch.randn(2 * 64, generator=g)
            history = torch.randint(0, 128, (12,), generator=g).tolist() * 2  # repeats: copy candidates
            copies = []
            for _ in range(2):
                c = NgramIndex(3) if copy_ngram else None
                if c is not None:
                    c.extend(history[:-1])
                copies.append(c)
            chain, cum = native.chain(hidden, history[-1], 4, copies[0])
            tokens, ref_cum = _reference_chain(d, hidden, history[-1], 4, copies[1], vnni)
            assert chain == tokens
            assert torch.allclose(
                torch.tensor(cum, dtype=torch.float64), torch.tensor(ref_cum, dtype=torch.float64), atol=1e-4
            )
    finally:
        qdot.set_vnni(os.environ.get("SPECDRAFT_AVX512", "1") != "0")


@pytest.mark.parametrize("min_logp", [None, -1.0])
def test_chain_tree_is_what_pack_beams_makes_of_one_beam(min_logp):
    """`NativeChain.tree`: the tokens, topology and per-node scores `pack_beams` + `beam_scores` give the same
    beam (pruned below `min_logp` as the proposer prunes), without their tensor work."""
    from specdraft.eval.proposers import beam_scores
    from specdraft.eval.tree import PAD, pack_beams

    d, _ = _drafter(32)
    native = NativeChain(d)
    tokens, cum = [5, 9, 9, 3, 7], [0.0, -0.2, -0.7, -1.3, -2.0]
    got = native.tree(tokens, cum, min_logp)
    beams, c = torch.tensor([tokens]), torch.tensor([cum])
    if min_logp is not None:
        beams = beams.masked_fill(c < min_logp, PAD)
    ref, _ = pack_beams(beams)
    ref.scores = beam_scores(ref, c)
    assert got.num_nodes == ref.num_nodes == (3 if min_logp is not None else 5)
    for name in ("tokens", "parents", "depth", "ancestors", "scores"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert native.tree(tokens, cum, min_logp).parents.data_ptr() != got.parents.data_ptr()  # fresh tensors


def test_unsupported_says_why():
    """Prefix attention, no recurrence, or not fp32 on the CPU: `unsupported` names it, the proposer drafts in
    torch."""
    d, _ = _drafter(32)
    assert unsupported(d) is None
    assert "fp32" in (unsupported(d.double()) or "")
    no_rnn, _ = _drafter(32)
    no_rnn.config.rnn = False
    assert "recurrence" in (unsupported(no_rnn) or "")
    assert unsupported(torch.nn.Linear(4, 4)) == "not a ReDrafter (Linear)"


@pytest.mark.parametrize("beam_length", [2, 4])
def test_proposer_with_the_native_chain_is_lossless(beam_length, monkeypatch):
    """One-beam searches through the native chain (the int8 view's proposer, `draft_block=int8`), a float64
    target: greedy output equals AR with mixed prompt lengths and a stop token; `SPECDRAFT_NATIVE_CHAIN=0`
    drafts in torch."""
    d, _ = _drafter(32)
    target = tiny_llama(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, dtype=torch.float64)
    d.attach_embeddings(target)
    dec = StaticDecoder(target, 64)
    proposer = ReDrafterProposer(d, beam_width=1, beam_length=beam_length, int8_layers=True)
    assert proposer._native is not None
    for prompt_len, stop in [(3, set()), (11, {7})]:
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(target, None, prompt, 24, stop_ids=stop)
        out, stats = dec.speculative_generate(None, prompt, proposer, 24, stop_ids=stop)
        assert out == ref and max(stats.tree_sizes) == beam_length
    monkeypatch.setenv("SPECDRAFT_NATIVE_CHAIN", "0")
    assert ReDrafterProposer(d, beam_width=1, beam_length=2, int8_layers=True)._native is None


def test_sampling_with_the_native_chain_keeps_the_target_distribution(monkeypatch):
    """T > 0 with the native chain drafting: the first two sampled tokens follow the target's own distribution
    (chi-square over 1,000 draws against two exact target forwards), with drafted tokens both kept and rejected;
    the same harness rejects a rule that draws the bonus token from p instead of the residual
    (`testing.check_sampling_keeps_distribution`)."""
    from specdraft.testing import check_sampling_keeps_distribution, peaked_tiny_target

    target = peaked_tiny_target()

    def chain() -> ReDrafterProposer:  # a copy-gate ReDrafter's one-beam chain drafting 3 tokens
        schema = ReDrafterSchema(draft_len=3, beam_width=1, num_layers=1, exit_dim=32, copy_ngram=2)
        d = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer())).float().eval()
        proposer = ReDrafterProposer(d, beam_width=1, beam_length=3, int8_layers=True)
        assert proposer._native is not None
        return proposer

    check_sampling_keeps_distribution(target, chain, monkeypatch)


def test_a_lone_drafting_row_of_a_batch_takes_the_native_chain(monkeypatch):
    """The batched decoder with one row drafting (batch 1, and a queue's tail once the other requests end)
    drafts through the row's native chain, two or more rows through the one torch search over all rows; every
    row's greedy output equals its own AR output (fp64 target)."""
    from specdraft.eval.batch_decode import BatchDecoder
    from specdraft.testing import random_prompts

    d, _ = _drafter(32)
    target = tiny_llama(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, dtype=torch.float64)
    d.attach_embeddings(target)
    calls = []
    chain = NativeChain.chain
    monkeypatch.setattr(NativeChain, "chain", lambda self, *a: calls.append(1) or chain(self, *a))
    prompts = random_prompts([4, 9, 6])
    budgets = [20, 6, 12]  # rows end at different steps: the last one drafts alone

    def factory():
        return ReDrafterProposer(d, beam_width=1, beam_length=3, int8_layers=True)

    for batch_size in (1, 3):
        calls.clear()
        res = BatchDecoder(target, batch_size, 64).generate(prompts, budgets, set(), factory)
        for prompt, n, (out, _) in zip(prompts, budgets, res, strict=True):
            assert out == ar_generate(target, None, torch.tensor(prompt), n, stop_ids=set())[0]
        assert calls  # batch 1 always, batch 3 once two rows have ended


def test_a_freed_drafter_drops_its_native_chain():
    """The chains are cached per drafter, weakly: a ReDrafter that is freed takes its int8 copies with it."""
    import gc
    import weakref

    from specdraft.eval.proposers import _native_chain

    d, _ = _drafter(32)
    assert _native_chain(d) is not None
    alive = weakref.ref(d)
    del d
    gc.collect()
    assert alive() is None
