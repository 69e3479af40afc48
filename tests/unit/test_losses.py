"""Golden values for train/losses.py, computed by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.train.losses import (
    chain_acceptance_length,
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
    assert float(kl) == pytest.approx(2 / 3 * math.log(2), abs=1e-6)
    kl.backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    assert float(logits.grad[1].abs().sum()) == 0.0


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
