"""EAGLE-3 with a copy gate (models/eagle_copy.py): the gate, the mixed loss against a brute-force mixture, the
declared contract, the export round trip, and the decode-time tree (lossless: tests/unit/test_static_decode.py and
test_batch_decode.py run `eagle3_copy` with every family)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specdraft.data.collate import Collator
from specdraft.data.ngrams import ngram_candidates
from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.eagle_tree import EagleTreeProposer
from specdraft.models import eagle, eagle3
from specdraft.models.base_llm import forward_with_hidden
from specdraft.models.eagle_copy import gate, mixed_log_probs
from specdraft.models.registry import spec_of
from specdraft.testing import saved_without, tiny_llama

FP = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}
SCHEMA = dict(
    draft_len=3, tree_total_tokens=10, tree_depth=3, tree_top_k=3, target_layers=None, draft_vocab_size=None,
    ttt_decay=0.8, copy_ngram=3, copy_hidden=8, copy_scale=8.0,
)  # fmt: skip


def _head(target, dtype=torch.float64, counts=None, **over):
    torch.manual_seed(2)
    schema = SimpleNamespace(**{**SCHEMA, **over})
    return eagle3.build(schema, target, FP, token_counts=counts).to(dtype).eval()


def test_the_gate_starts_at_one_half_and_is_declared():
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    counts = torch.arange(128, dtype=torch.float64)  # the draft vocabulary: the 64 largest ids
    head = _head(target, counts=counts, draft_vocab_size=64)
    assert spec_of(head).copy_ngram_of(head.config) == 3 and head.copy_gate is not None
    assert spec_of(_head(target, copy_ngram=0)).copy_ngram_of(_head(target, copy_ngram=0).config) == 0
    assert _head(target, copy_ngram=0).copy_gate is None
    state = torch.randn(4, 32, dtype=torch.float64)
    cand = torch.tensor([100, 5, -1, 127])  # in the draft vocabulary, outside it, none, in it
    draft, lam = gate(head, state, cand, torch.tensor([2, 3, 0, 1]))
    assert lam.tolist() == [0.5, 0.0, 0.0, 0.5]
    assert draft.tolist() == [100 - 64, 0, 0, 127 - 64]
    # the mixture: the candidate gets (1 - lam) p + lam, every other token (1 - lam) p
    logits = torch.randn(4, 64, dtype=torch.float64)
    mixed = mixed_log_probs(head, state, logits, cand, torch.tensor([2, 3, 0, 1])).exp()
    p = torch.softmax(logits, -1)
    want = p.clone()
    want[[0, 3]] *= 0.5
    want[0, 36] += 0.5
    want[3, 63] += 0.5
    torch.testing.assert_close(mixed, want)
    assert torch.allclose(mixed.sum(-1), torch.ones(4, dtype=torch.float64))


def test_the_loss_is_the_soft_ce_of_the_mixture_and_trains_the_gate():
    target = tiny_llama(num_layers=8)
    head = _head(target, torch.float32).train()
    torch.manual_seed(0)
    seq = torch.randint(5, 40, (8,))
    ids = torch.cat([seq, seq, seq[:4]])  # (20,) it repeats itself: many candidates, mostly right
    items = [{"input_ids": ids, "loss_mask": torch.tensor([0] * 4 + [1] * 16)}]
    batch = Collator(pad_id=0, draft_len=3, copy_ngram=spec_of(head).copy_ngram_of(head.config))(items)
    assert "copy_ids" in batch and int((batch["copy_len"] > 0).sum()) > 10
    cand, _ = ngram_candidates(ids.tolist(), 3)
    assert batch["copy_ids"][0, 9, 0] == cand[10]  # slot 0 of position t: the candidate after x_{t+1}
    tout = forward_with_hidden(target, batch["input_ids"], layers=head.config.target_layers)
    loss, _ = eagle3.compute_loss(head, batch, tout, {"draft_len": 3})
    b, t = eagle.select_positions(batch, {})
    outs = head(tout.layers.flatten(2), eagle.next_tokens(batch["input_ids"], 3), steps=3)
    manual = 0.0
    for i in range(3):  # brute force: log of (1 - lam) softmax + lam onehot, against the teacher
        p = (t + 1 + i).clamp_max(19)
        valid = (t + 1 + i < 20) & (batch["targets"][b, t, i] != -100)
        teacher = torch.softmax(target.lm_head(tout.hidden[b, p]), -1)
        state = head.norm(outs[b, t, i])
        c, n = batch["copy_ids"][b, t, i], batch["copy_len"][b, t, i]
        lam = head.copy_gate(state, head.embed(c.clamp_min(0)), n)[:, None]  # (N, 1)
        mix = (1 - lam) * torch.softmax(head.lm_head(state), -1)
        mix = mix + lam * torch.nn.functional.one_hot(c.clamp_min(0), 128) * (n > 0)[:, None]
        ce = -(teacher * mix.log()).sum(-1)
        manual = manual + 0.8**i * (ce * valid).sum() / valid.sum()
    torch.testing.assert_close(loss, manual, rtol=1e-4, atol=1e-4)
    loss.backward()
    assert head.copy_gate.length_bias.grad.abs().sum() > 0 and head.copy_gate.out.weight.grad.abs().sum() > 0


def test_an_export_keeps_its_gate_and_an_older_one_loads_without(tmp_path):
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = _head(target)
    with torch.no_grad():
        head.copy_gate.length_bias.fill_(0.25)
    head.save_pretrained(tmp_path / "gate")
    again = eagle3.Eagle3Drafter.from_pretrained(tmp_path / "gate", torch_dtype=torch.float64)
    assert again.config.copy_ngram == 3 and torch.equal(
        again.copy_gate.length_bias, head.copy_gate.length_bias
    )
    old = eagle3.Eagle3Drafter.from_pretrained(
        saved_without(_head(target, copy_ngram=0), tmp_path / "plain", "copy_ngram")
    )  # an export from before the field
    assert old.copy_gate is None and spec_of(old).copy_ngram_of(old.config) == 0


def test_the_tree_drafts_the_candidate_the_gate_trusts_and_stays_lossless():
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = _head(target)
    with torch.no_grad():
        head.copy_gate.length_bias.fill_(2.0)  # lam ~ 1 on every candidate
    prompt = torch.randint(5, 128, (10,), generator=torch.Generator().manual_seed(3))
    ref, _ = ar_generate(target, None, prompt, 30, stop_ids=set())
    echo = torch.cat([prompt, torch.tensor(ref[:20]), prompt[-4:]])  # what followed "prompt[-4:]" comes again
    want, _ = ar_generate(target, None, echo, 24, stop_ids=set())
    proposer = EagleTreeProposer(head, total_tokens=8, depth=4, top_k=2)
    out, stats = speculative_generate(target, None, echo, proposer, 24, stop_ids=set())
    assert out == want and max(stats.accepted) >= 3  # the copied continuation accepted in runs
    # the root's best child (node 1: best first) is the lookup candidate after committed + root
    proposer.reset()
    layers = head.config.target_layers
    feats = forward_with_hidden(target, echo[None, :-1], layers=layers).layers[0].flatten(1)  # (L - 1, 3H)
    tree = proposer.propose(feats, echo[1:])  # root = echo[-1], whose 3-gram ended the prompt
    cand, length = ngram_candidates(echo.tolist(), 3)
    assert length[-1] > 0 and int(tree.tokens[1]) == cand[-1] and float(tree.scores[1]) > 0.99
    # the fixed-shape expansion looks the candidates up on the device: the same tree, and lossless
    fixed = EagleTreeProposer(head, total_tokens=8, depth=4, top_k=2, static=True)
    assert fixed.fixed is not None
    same = fixed.propose(feats, echo[1:])
    assert same.tokens.tolist() == tree.tokens.tolist() and same.parents.tolist() == tree.parents.tolist()
    fixed.reset()
    out, _ = speculative_generate(target, None, echo, fixed, 24, stop_ids=set())
    assert out == want


def test_the_fixed_shape_buffer_of_committed_tokens_grows_and_restarts():
    """300 committed tokens outgrow the 256-token device buffer: it doubles and the expansions captured against
    the old one are dropped; `reset` empties it (the buffer itself: tests/unit/test_copy_context.py)."""
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = _head(target)
    proposer = EagleTreeProposer(head, total_tokens=8, depth=4, top_k=2, static=True)
    assert proposer.fixed is not None and proposer.copy_ctx.buf.shape[0] == 256
    proposer.fixed.captured = {"stale": None}
    first = torch.randint(5, 128, (301,), generator=torch.Generator().manual_seed(0))
    feats = (
        forward_with_hidden(target, first[None, :-1], layers=head.config.target_layers).layers[0].flatten(1)
    )
    proposer.propose(feats, first[1:])  # 300 positions: 299 committed before the root
    ctx = proposer.copy_ctx
    assert ctx.buf.shape[0] == 512 and "stale" not in proposer.fixed.captured
    assert ctx.buf[:299].tolist() == first[1:-1].tolist() and int(ctx.length) == 299
    proposer.reset()
    assert ctx.n == 0 and int(ctx.length) == 0


def test_eagle1_takes_the_same_gate_on_its_first_slot_loss_and_its_tree():
    """EAGLE-1: the token loss of slot 0 through the target's LM head is the soft CE of the mixture (a brute-force
    computation), the gate starts at 1/2, and its tree drafts the candidate the gate trusts, losslessly."""
    target = tiny_llama(num_layers=2)
    torch.manual_seed(2)
    schema = SimpleNamespace(
        draft_len=3, tree_total_tokens=8, tree_depth=4, tree_top_k=2, fc_bias=True, feature_weight=1.0,
        token_weight=0.1, noise=0.0, draft_vocab_size=None, copy_ngram=3, copy_hidden=8, copy_scale=8.0,
    )  # fmt: skip
    head = eagle.build(schema, target, FP).train()
    assert spec_of(head).copy_ngram_of(head.config) == 3
    seq = torch.randint(5, 40, (8,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([seq, seq, seq[:4]])  # (20,)
    batch = Collator(pad_id=0, draft_len=3, copy_ngram=3)([{"input_ids": ids, "loss_mask": torch.ones(20)}])
    tout = forward_with_hidden(target, batch["input_ids"])
    loss, _ = eagle.compute_loss(head, batch, tout, {"draft_len": 3})
    b, t = eagle.select_positions(batch, {})
    pred = head(tout.hidden, eagle.next_tokens(batch["input_ids"], 1), steps=1)[b, t, 0]  # (N, H)
    true = tout.hidden[b, t + 1]
    c, n = batch["copy_ids"][b, t, 0], batch["copy_len"][b, t, 0]
    lam = head.copy_gate(pred, head.embed(c.clamp_min(0)), n)[:, None]  # (N, 1)
    assert set(lam[n > 0].flatten().tolist()) == {0.5}
    mix = (1 - lam) * torch.softmax(head.full_logits(pred), -1)
    mix = mix + lam * torch.nn.functional.one_hot(c.clamp_min(0), 128) * (n > 0)[:, None]
    teacher = torch.softmax(head.full_logits(true), -1)
    manual = eagle.smooth_l1_feature_loss(pred, true) + 0.1 * (-(teacher * mix.log()).sum(-1)).mean()
    torch.testing.assert_close(loss, manual, rtol=1e-4, atol=1e-5)
    loss.backward()
    assert head.copy_gate.length_bias.grad.abs().sum() > 0
    # decoding: lam ~ 1 on every candidate, the root's best child is the candidate, the output is AR's
    head = head.double().eval()
    target = target.double()
    eagle.attach(head, target)
    with torch.no_grad():
        head.copy_gate.length_bias.fill_(2.0)
    prompt = torch.randint(5, 128, (10,), generator=torch.Generator().manual_seed(3))
    ref, _ = ar_generate(target, None, prompt, 30, stop_ids=set())
    echo = torch.cat([prompt, torch.tensor(ref[:20]), prompt[-4:]])
    want, _ = ar_generate(target, None, echo, 24, stop_ids=set())
    for static in (False, True):
        proposer = EagleTreeProposer(head, total_tokens=8, depth=4, top_k=2, static=static)
        out, _ = speculative_generate(target, None, echo, proposer, 24, stop_ids=set())
        assert out == want
        proposer.reset()
        feats = forward_with_hidden(target, echo[None, :-1]).hidden[0]  # (L - 1, H)
        tree = proposer.propose(feats, echo[1:])
        cand, length = ngram_candidates(echo.tolist(), 3)
        assert length[-1] > 0 and int(tree.tokens[1]) == cand[-1]
