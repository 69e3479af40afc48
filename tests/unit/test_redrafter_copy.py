"""ReDrafter's copy gate (`copy_ngram` > 0): the lookup candidates against a naive search, the mixture's logits, the
same candidates and logits in training and at decode time, a warm start, and lossless decoding."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.data.collate import Collator
from specdraft.data.ngrams import NO_CANDIDATE, NgramIndex, ngram_candidates, slot_candidates
from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.hybrid import LookupBranch
from specdraft.eval.proposers import ReDrafterProposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models import redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.models.copy_lookup import lookup_fixed_rows, mix_log_probs, mix_logits
from specdraft.models.redrafter import ReDrafter
from specdraft.models.redrafter_beam import beam_search, beam_search_fixed_rows
from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.train.config import ReDrafterSchema

D, N = 3, 3


def _naive(ids: list[int], n: int) -> tuple[int, int]:
    """The candidate at the end of `ids`: longest suffix m-gram (m <= n) with an earlier occurrence, newest one."""
    p = len(ids) - 1
    for m in range(min(n, p + 1), 0, -1):
        for q in range(p - 1, m - 2, -1):
            if ids[q - m + 1 : q + 1] == ids[p - m + 1 : p + 1]:
                return ids[q + 1], m
    return NO_CANDIDATE, 0


def test_candidates_match_a_naive_search_in_training_and_decoding():
    rng = random.Random(0)
    for _ in range(1500):
        n, vocab = rng.randint(1, 4), rng.randint(2, 5)
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        cand, length = ngram_candidates(ids, n)
        assert [(c, m) for c, m in zip(cand, length)] == [_naive(ids[: p + 1], n) for p in range(len(ids))]
        cut = rng.randint(0, len(ids) - 1)  # committed tokens, then a drafted chain
        index = NgramIndex(n)
        index.extend(ids[:cut])
        assert index.lookup(ids[cut:]) == _naive(ids, n)


def test_slot_candidates_stop_where_the_chain_leaves_the_row():
    ids = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2])
    cand, length = (torch.tensor(x) for x in ngram_candidates(ids.tolist(), N))
    assert cand.tolist()[3:] == [2, 3, 1, 2, 3] and length.tolist()[3:] == [1, 2, 3, 3, 3]
    root = torch.cat([ids[1:], ids[:1]])  # x_{t+1}
    targets = torch.stack([ids[2:5], ids[3:6], ids[4:7], ids[5:8]] + [torch.full((D,), -100)] * 4)  # (L, D)
    targets[1, 1] = 7  # position 1: slot 1's label leaves the row's text, so slot 2 has no candidate
    c, m = slot_candidates(cand, length, ids, root, targets)
    assert c[0].tolist() == [cand[1], cand[2], cand[3]] and m[3].tolist() == [2, 3, 3]
    assert c[1].tolist() == [cand[2], cand[3], NO_CANDIDATE] and m[1, 2] == 0
    batch = Collator(pad_id=0, draft_len=D, copy_ngram=N)(
        [{"input_ids": ids, "loss_mask": torch.ones(8, dtype=torch.long)}]
    )
    assert batch["copy_ids"].shape == (1, 8, D) and batch["copy_ids"][0, 3].tolist() == [3, 1, 2]


def test_mix_logits_gives_the_mixture_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 11, generator=g, dtype=torch.float64) * 3  # (..., V)
    cand = torch.randint(0, 11, (5, 7), generator=g)
    lam = torch.rand(5, 7, generator=g, dtype=torch.float64)
    lam[0] = 0.0  # no candidate: logits unchanged, bit for bit
    out = mix_logits(logits, cand, lam)
    ref = (1 - lam[..., None]) * logits.softmax(-1) + lam[..., None] * torch.nn.functional.one_hot(cand, 11)
    torch.testing.assert_close(out.softmax(-1), ref)
    assert torch.equal(out[0], logits[0])
    other = torch.ones_like(logits, dtype=torch.bool).scatter(-1, cand[..., None], False)
    assert torch.equal(out[other], logits[other])  # only the candidate's logit moves
    sure = mix_logits(torch.tensor([[0.0, 30.0, -30.0]]), torch.tensor([2]), torch.tensor([0.9]))
    assert sure.argmax(-1).item() == 2  # a copy the head scores 60 nats down still wins at lam = 0.9


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_mix_log_probs_are_the_log_softmax_of_mix_logits(dtype):
    """The beam search's scores (`mix_log_probs`, decode time) equal log_softmax(mix_logits(...)) computed in
    the float dtype they come out in; rows without a candidate are the plain log-softmax."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 6, 13, generator=g, dtype=torch.float64) * 4).to(dtype)  # (..., V)
    cand = torch.randint(0, 13, (4, 6), generator=g)
    lam = torch.rand(4, 6, generator=g, dtype=torch.float64).to(dtype)
    lam[1] = 0.0
    lam[2, :2] = torch.tensor([0.999, 1e-6], dtype=dtype)
    out = mix_log_probs(logits, cand, lam)
    wide = torch.promote_types(dtype, torch.float32)
    assert out.dtype == wide
    ref = torch.log_softmax(mix_logits(logits.to(wide), cand, lam.to(wide)), -1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 if wide == torch.float32 else 1e-12)
    assert torch.equal(out[1], torch.log_softmax(logits[1].to(wide), -1))


def test_state_log_probs_are_the_log_softmax_of_state_logits(target_and_drafter):
    """`state_logits(..., log_probs=True)` (float32 scores), with and without a copy candidate."""
    _, drafter = target_and_drafter
    g = torch.Generator().manual_seed(5)
    h = drafter.features(torch.randn(3, 32, generator=g, dtype=torch.float64))  # (3, F)
    state = drafter.init_state(torch.tensor([5, 9, 17]))  # (3, E)
    copy = (torch.tensor([41, 7, 3]), torch.tensor([3, 0, 1]))
    for c in (None, copy):
        ref = torch.log_softmax(drafter.state_logits(state, h, copy=c).float(), -1)
        got = drafter.state_logits(state, h, copy=c, log_probs=True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _mix_reference(logits: torch.Tensor, cand: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """`mix_logits` written directly with autograd ops (the chunked Function must match it)."""
    lse = torch.logsumexp(logits, -1)
    l_c = logits.gather(-1, cand[..., None])[..., 0]
    p_c = torch.exp(l_c - lse)
    pi = (1 - lam) * p_c + lam
    new = torch.log(pi) - torch.log1p(-pi) + lse + torch.log1p(-p_c)
    delta = torch.where(lam > 0, new - l_c, torch.zeros_like(new))
    return logits.scatter_add(-1, cand[..., None], delta[..., None])


@pytest.mark.parametrize("chunk_rows", [1, 3, None])
def test_mix_logits_value_and_gradient_match_autograd(chunk_rows):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 5, 13, generator=g, dtype=torch.float64) * 3).requires_grad_()
    cand = torch.randint(0, 13, (4, 5), generator=g)
    lam = torch.rand(4, 5, generator=g, dtype=torch.float64)
    lam[1, :2] = 0.0
    lam.requires_grad_()
    up = torch.randn(4, 5, 13, generator=g, dtype=torch.float64)  # an arbitrary upstream gradient
    out = mix_logits(logits, cand, lam, chunk_rows)
    ref = _mix_reference(logits, cand, lam)
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad((out * up).sum(), (logits, lam))
    want = torch.autograd.grad((ref * up).sum(), (logits, lam))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    low = logits.detach().bfloat16().requires_grad_()  # bf16 logits (training): float32 inside, bf16 out
    out16 = mix_logits(low, cand, lam.detach().float())
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float().softmax(-1), ref.detach().float().softmax(-1), atol=2e-2, rtol=0)
    out16.float().sum().backward()
    assert low.grad is not None and low.grad.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def target_and_drafter() -> tuple[torch.nn.Module, ReDrafter]:
    target = tiny_llama(dtype=torch.float64)
    schema = ReDrafterSchema(
        draft_len=D, beam_width=4, num_layers=1, exit_dim=32, copy_ngram=N, copy_hidden=8
    )
    drafter = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer())).double().eval()
    with torch.no_grad():  # non-trivial weights everywhere, the gate's zero-initialised output included
        torch.manual_seed(0)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        assert drafter.copy_gate is not None
        drafter.copy_gate.length_bias.copy_(torch.tensor([0.0, -0.3, 0.0, 0.6]))  # lam ~ 0.1 / 0.5 / 0.99
    return target, drafter


def _repetitive(seed: int, n: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (n,), generator=g) * 7  # a small alphabet: many repeated n-grams


def test_decoder_candidates_give_the_training_logits(target_and_drafter):
    """Teacher-forced logits with the collator's candidates equal the decode-time steps with `NgramIndex`, and
    the gate changes them (the candidate's logit only)."""
    _, drafter = target_and_drafter
    ids = _repetitive(1)
    feats = torch.randn(ids.shape[0], 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    batch = Collator(pad_id=0, draft_len=D, copy_ngram=N)(
        [{"input_ids": ids, "loss_mask": torch.ones_like(ids)}]
    )
    ts = torch.tensor([4, 9, 15])
    root, targets = batch["root"][0, ts], batch["targets"][0, ts]  # (3,), (3, D)
    copy = (batch["copy_ids"][0, ts][None], batch["copy_len"][0, ts][None])
    ref = drafter(feats[ts][None], root[None], targets[None], copy=copy)[0]  # (3, D, V)
    plain = drafter(feats[ts][None], root[None], targets[None], copy=(copy[0], copy[1] * 0))[0]
    changed = (ref != plain).sum(-1)  # (3, D) logits moved per slot: the candidate's, where there is one
    assert torch.equal(changed, (copy[1][0] > 0).long())
    for i, t in enumerate(ts.tolist()):
        index = NgramIndex(N)
        index.extend(ids[: t + 1].tolist())
        h = drafter.features(feats[t][None])  # (1, F)
        chain = ids[t + 1 : t + 2]  # root, then the labels as drafted tokens
        state = drafter.init_state(chain)
        for k in range(D):
            if k > 0:
                state = drafter.next_state(state, ids[t + 1 + k][None])
                chain = ids[t + 1 : t + 2 + k]
            out = drafter.state_logits(state, h, copy=index.lookup_beams(chain[None]))[0]
            torch.testing.assert_close(out, ref[i, k])


def test_the_gate_can_make_the_candidate_the_draft(target_and_drafter):
    _, drafter = target_and_drafter
    state, h = (
        drafter.init_state(torch.tensor([3])),
        drafter.features(torch.zeros(1, 32, dtype=torch.float64)),
    )
    cand = torch.tensor([41])
    big = drafter.state_logits(state, h, copy=(cand, torch.tensor([3])))  # (1, V), lam ~ 0.99 on token 41
    none = drafter.state_logits(state, h, copy=(cand, torch.tensor([0])))
    assert torch.equal(big.argmax(-1), cand) and not torch.equal(none.argmax(-1), cand)
    with pytest.raises(ValueError, match="copy_ngram > 0 needs"):
        drafter(h[None], torch.tensor([[3]]), torch.tensor([[[1, 2, 3]]]))


@pytest.mark.parametrize("prompt_len", [1, 3, 20])
def test_copy_gate_decoding_is_lossless(target_and_drafter, prompt_len):
    target, drafter = target_and_drafter
    inner = ReDrafterProposer(drafter, 4, D + 1)
    proposer = LookupBranch(inner, 4, lookup_alone=False)  # a lookup chain merged in on every step
    assert inner.copy_ngram == N
    prompt = _repetitive(prompt_len, prompt_len)
    ref, _ = ar_generate(target, None, prompt, 30, stop_ids=set())
    for _ in range(2):  # the proposer is reused: `reset` must forget the previous prompt's index
        out, stats = speculative_generate(target, None, prompt, proposer, 30, stop_ids=set())
        assert out == ref
        # indexed: x_1 .. the token before the last step's root (each step commits its accepted drafts + 1)
        grown = prompt_len + sum(stats.accepted[:-1]) + stats.steps - 2
        assert inner.copy_ctx.index is not None and len(inner.copy_ctx.index.ids) == grown


def test_warm_start_adds_the_copy_gate_at_its_init(target_and_drafter, tmp_path):
    """The export's tensors are copied and the new gate starts at lam = 1/2: the export's distribution, halved,
    plus 1/2 on each candidate (and exactly the export's logits where a slot has none)."""
    from specdraft.models.hub import warm_start

    target, drafter = target_and_drafter
    fp = target_fingerprint(target, tiny_tokenizer())
    src = redrafter.build(ReDrafterSchema(draft_len=D, num_layers=1, exit_dim=32), target, fp).double()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    src.save_pretrained(tmp_path / "src")
    schema = ReDrafterSchema(draft_len=D, num_layers=1, exit_dim=32, copy_ngram=N, copy_hidden=8)
    dst = redrafter.build(schema, target, fp).double()
    assert dst.copy_gate is not None
    with torch.no_grad():  # a gate that is not at its init (trained elsewhere) is refused
        dst.copy_gate.length_bias.fill_(1.0)
    with pytest.raises(ValueError, match="has no tensor 'copy_gate"):
        warm_start(dst, str(tmp_path / "src"), fp)
    dst = redrafter.build(schema, target, fp).double()
    assert warm_start(dst, str(tmp_path / "src"), fp) == len(src.state_dict())
    ids = _repetitive(2)
    feats = torch.randn(ids.shape[0], 32, dtype=torch.float64)
    batch = Collator(pad_id=0, draft_len=D, copy_ngram=N)(
        [{"input_ids": ids, "loss_mask": torch.ones_like(ids)}]
    )
    t = torch.tensor([5, 12, 18])
    args = (feats[t][None], batch["root"][0, t][None], batch["targets"][0, t][None])
    copy = (batch["copy_ids"][0, t][None], batch["copy_len"][0, t][None])
    has = copy[1] > 0
    assert bool(has.any()) and not bool(has.all())
    mine, theirs = dst(*args, copy=copy), src(*args)  # (1, 3, D, V)
    assert torch.equal(mine[~has], theirs[~has])
    onehot = torch.nn.functional.one_hot(copy[0].clamp_min(0), mine.shape[-1])
    torch.testing.assert_close(mine[has].softmax(-1), 0.5 * theirs[has].softmax(-1) + 0.5 * onehot[has])
    dst.save_pretrained(tmp_path / "dst")  # and the export round trip keeps the gate
    back = ReDrafter.from_pretrained(tmp_path / "dst").double()
    redrafter.attach(back, target)
    assert back.config.copy_ngram == N
    torch.testing.assert_close(back(*args, copy=copy), dst(*args, copy=copy))


def test_device_lookup_equals_the_index():
    """`lookup_fixed_rows` (fixed shapes, the form a CUDA graph captures) gives `NgramIndex.lookup` for every beam,
    whatever the buffer holds past the committed tokens."""
    rng = random.Random(1)
    for _ in range(400):
        n, vocab = rng.randint(1, 4), rng.randint(2, 5)
        n0, c, w = rng.randint(0, 20), rng.randint(1, 5), rng.randint(1, 4)
        committed = [rng.randrange(vocab) for _ in range(n0)]
        chains = [[rng.randrange(vocab) for _ in range(c)] for _ in range(w)]
        index = NgramIndex(n)
        index.extend(committed)
        buf = torch.tensor(committed + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))])  # stale tail
        cand, size = (
            x[0] for x in lookup_fixed_rows(buf[None], torch.tensor([n0]), torch.tensor(chains)[None], n)
        )
        assert list(zip(cand.tolist(), size.tolist())) == [index.lookup(ch) for ch in chains]


def test_fixed_beam_search_with_the_copy_gate_equals_the_dynamic_one(target_and_drafter):
    _, drafter = target_and_drafter
    g = torch.Generator().manual_seed(3)
    for seed in range(6):
        ids = _repetitive(seed, 30).tolist()
        n0 = 5 * seed
        index = NgramIndex(N)
        index.extend(ids[:n0])
        buf = torch.tensor(ids[:n0] + [0] * 7)
        hidden = torch.randn(32, generator=g, dtype=torch.float64)
        beams, cum = beam_search(drafter, hidden, ids[n0], 4, D, copy=index)
        fixed, fcum = beam_search_fixed_rows(
            drafter, hidden[None], torch.tensor([ids[n0]]), 4, D, copy=(buf[None], torch.tensor([n0]), N)
        )  # one row
        assert torch.equal(beams, fixed[0]) and torch.allclose(cum, fcum[0])


@pytest.mark.parametrize("prompt_len", [1, 20])
def test_fixed_shape_copy_gate_decoding_is_lossless(target_and_drafter, prompt_len):
    """The copy-gate ReDrafter on the fixed-shape step (its device buffer grown past 256 tokens) equals AR and
    accepts exactly as the dynamic step does, call after call."""
    target, drafter = target_and_drafter
    fixed = ReDrafterProposer(drafter, 4, D + 1, static=True)
    dynamic = ReDrafterProposer(drafter, 4, D + 1)
    assert fixed.static and not dynamic.static
    dec = StaticDecoder(target, 48, static=True)
    prompt = _repetitive(prompt_len, prompt_len)
    ref, _ = ar_generate(target, None, prompt, 300, stop_ids=set())
    for _ in range(2):  # reused: `reset` empties the buffer
        out, stats = dec.speculative_generate(None, prompt, fixed, 300, stop_ids=set())
        _, dyn = speculative_generate(target, None, prompt, dynamic, 300, stop_ids=set())
        assert out == ref and stats.accepted == dyn.accepted
        assert (
            fixed.copy_ctx.buf.shape[0] > 256
            and fixed.copy_ctx.n == prompt_len + sum(stats.accepted[:-1]) + stats.steps - 2
        )
