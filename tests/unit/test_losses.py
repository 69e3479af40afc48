"""Golden values for models/losses.py, computed by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.models.losses import (
    chain_acceptance_length,
    distill_loss,
    multi_position_ce,
    per_slot_accuracy,
    per_slot_ce,
    simulated_acceptance_length,
    soft_kl,
    topk_hits,
    unigram_hits,
)

L3 = math.log(3.0)
# (N=2, D=2, V=2). softmax([ln3, 0]) = (3/4, 1/4); softmax([0, 0]) = (1/2, 1/2)
LOGITS = torch.tensor([[[0.0, 0.0], [L3, 0.0]], [[L3, 0.0], [0.0, 0.0]]])
TARGETS = torch.tensor([[0, 1], [0, -100]])


def test_per_slot_ce_golden():
    # slot 0: (ln 2 + ln 4/3) / 2 ; slot 1: ln 4 (its second entry is ignored)
    ce = per_slot_ce(LOGITS, TARGETS)
    assert ce.tolist() == pytest.approx([(math.log(2) + math.log(4 / 3)) / 2, math.log(4)], abs=1e-6)


def test_multi_position_ce_golden_and_weights():
    assert float(multi_position_ce(LOGITS, TARGETS)) == pytest.approx(0.4904146 + 1.3862944, abs=1e-6)
    w = torch.tensor([1.0, 0.5])
    assert float(multi_position_ce(LOGITS, TARGETS, w)) == pytest.approx(0.4904146 + 0.6931472, abs=1e-6)
    # any batch shape: (B=1, L=2, D, V) gives the same number
    assert float(multi_position_ce(LOGITS[None], TARGETS[None])) == pytest.approx(1.876709, abs=1e-6)


def test_all_ignored_slot_contributes_zero():
    t = torch.full((2, 2), -100)
    assert float(multi_position_ce(LOGITS, t)) == 0.0


def test_soft_kl_golden():
    # q uniform over 3 tokens; teacher top-2 log-probs (ln .5, ln .25) renormalise to p = (2/3, 1/3):
    # KL = 2/3 ln((2/3)/(1/3)) + 1/3 ln((1/3)/(1/3)) = (2/3) ln 2
    logits = torch.zeros(1, 1, 3)  # (N, D, V)
    ids = torch.tensor([[[0, 1]]])
    lps = torch.log(torch.tensor([[[0.5, 0.25]]]))
    kl = soft_kl(logits, ids, lps, torch.tensor([[True]]))
    assert float(kl) == pytest.approx(2 / 3 * math.log(2), abs=1e-6)
    assert float(soft_kl(logits, ids, lps, torch.tensor([[False]]))) == 0.0
    # the drafter equal to the (renormalised) teacher has zero KL
    exact = torch.log(torch.tensor([[[2 / 3, 1 / 3, 1e-12]]]))
    assert float(soft_kl(exact, ids, lps, torch.tensor([[True]]))) == pytest.approx(0.0, abs=1e-6)


def test_soft_kl_drops_minus_inf_entries_with_finite_gradients():
    # an entry at -inf (a token the drafter cannot draft) is dropped: the same golden value as without it
    logits = torch.zeros(2, 1, 3, requires_grad=True)  # (N, D, V)
    ids = torch.tensor([[[0, 1, 2]], [[0, 1, 2]]])
    lps = torch.log(torch.tensor([[[0.5, 0.25, 0.0]], [[0.0, 0.0, 0.0]]]))  # row 2: nothing draftable
    kl = soft_kl(logits, ids, lps, torch.tensor([[True], [False]]))
    assert float(kl.detach()) == pytest.approx(2 / 3 * math.log(2), abs=1e-6)
    kl.backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    assert float(logits.grad[1].abs().sum()) == 0.0


def test_distill_loss_golden():
    # LOGITS / TARGETS: the CE golden value alone; plus a KL term on slot 0 of row 0 only (the one-hot teacher on
    # token 1 of softmax([0, 0]): KL = ln 2), weighted 0.5
    assert float(distill_loss(LOGITS, TARGETS)) == pytest.approx(0.4904146 + 1.3862944, abs=1e-6)
    ids, lps = torch.ones(2, 2, 1, dtype=torch.long), torch.zeros(2, 2, 1)
    valid = torch.tensor([[True, False], [False, False]])
    out = distill_loss(LOGITS, TARGETS, kl=(ids, lps, valid), kl_weight=0.5)
    assert float(out) == pytest.approx(0.4904146 + 1.3862944 + 0.5 * math.log(2), abs=1e-6)


@pytest.mark.parametrize("terms", ["ce", "kl", "ce+kl"])
@pytest.mark.parametrize("chunk_rows", [1, 7, None])  # None: one chunk here (the default size)
def test_distill_loss_equals_the_reference_value_and_gradient(terms, chunk_rows):
    """The chunked loss is `multi_position_ce + kl_weight * soft_kl`: value and gradient, with ignored labels,
    -inf teacher entries, a row with nothing draftable, slot weights and chunks that do not divide the rows."""
    g = torch.Generator().manual_seed(chunk_rows or 0)
    n, d, v, k = 9, 3, 40, 5
    base = torch.randn(n, d, v, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, v, (n, d), generator=g)
    targets[::4, 1:] = -100
    ids = torch.randint(0, v, (n, d, k), generator=g)
    lps = torch.randn(n, d, k, generator=g, dtype=torch.float64)
    lps[0, 0, 2:] = float("-inf")
    lps[1, 1] = float("-inf")  # nothing draftable (still `valid`: counts with KL 0, as in soft_kl)
    valid = torch.rand(n, d, generator=g) > 0.2
    valid[1, 1] = True
    weights = torch.tensor([1.0, 0.5, 0.25])
    ce_on, kl_on = "ce" in terms, "kl" in terms

    ref_in = base.clone().requires_grad_()
    ref = multi_position_ce(ref_in, targets, weights) if ce_on else ref_in.new_zeros(())
    if kl_on:
        ref = ref + 0.7 * soft_kl(ref_in, ids, lps, valid, weights)
    ref.backward()
    out_in = base.clone().requires_grad_()
    kl = (ids, lps, valid) if kl_on else None
    out = distill_loss(out_in, targets if ce_on else None, weights, kl, 0.7, chunk_rows)
    out.backward()
    torch.testing.assert_close(out.double(), ref.double(), rtol=1e-6, atol=1e-6)
    assert ref_in.grad is not None and out_in.grad is not None
    # the reference computes in fp32 (`.float()`), so agreement is to fp32 rounding
    torch.testing.assert_close(out_in.grad, ref_in.grad, rtol=1e-5, atol=1e-8)


def test_topk_hits_and_accuracy_golden():
    logits = torch.tensor(
        [[[0.1, 0.5, 0.4], [0.3, 0.2, 0.1]], [[0.9, 0.0, 0.1], [0.0, 0.0, 1.0]]]
    )  # (2, 2, 3)
    targets = torch.tensor([[2, 0], [0, -100]])
    top1 = topk_hits(logits, targets, 1)
    assert top1.tolist() == [[False, True], [True, False]]
    assert topk_hits(logits, targets, 2).tolist() == [[True, True], [True, False]]
    acc = per_slot_accuracy(top1, targets != -100)
    assert acc.tolist() == pytest.approx([0.5, 1.0])


def test_simulated_acceptance_length_golden():
    assert simulated_acceptance_length(torch.tensor([0.5, 0.5])) == pytest.approx(1.75)
    assert simulated_acceptance_length(torch.tensor([1.0, 0.8, 0.5])) == pytest.approx(3.2)
    assert simulated_acceptance_length(torch.zeros(4)) == 1.0


def test_chain_acceptance_length_golden():
    hits = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1]]).bool()  # leading hits 2, 1, 0
    valid = torch.ones(3, 3, dtype=torch.bool)
    assert chain_acceptance_length(hits, valid) == pytest.approx(2.0)
    # an ignored slot ends the chain; a row whose slot 0 is ignored is skipped
    valid2 = torch.tensor([[1, 0, 1], [1, 1, 1], [0, 0, 0]]).bool()
    assert chain_acceptance_length(hits, valid2) == pytest.approx(1 + (1 + 1) / 2)


def test_unigram_hits_golden():
    counts = torch.tensor([5.0, 1.0, 9.0])
    targets = torch.tensor([[2, 0], [-100, 2]])
    assert unigram_hits(counts, targets, 1).tolist() == [[True, False], [False, True]]
    assert unigram_hits(counts, targets, 2).tolist() == [[True, True], [False, True]]
