"""The selected-positions unroll (`unroll(..., at=(b, t))`) equals the whole-sequence unroll at those positions."""

from __future__ import annotations

import pytest
import torch

from specdraft.models import eagle
from specdraft.models.base_llm import forward_with_hidden
from specdraft.models.eagle_common import row_slots
from specdraft.testing import tiny_llama
from tests.unit.test_eagle import build_eagle
from tests.unit.test_eagle3 import build_eagle3


def test_row_slots_number_positions_within_each_row():
    b = torch.tensor([2, 0, 2, 2, 0])
    slot, m = row_slots(b, 4)
    assert slot.tolist() == [0, 0, 1, 2, 1] and m == 3
    empty, m0 = row_slots(torch.zeros(0, dtype=torch.long), 3)
    assert empty.numel() == 0 and m0 == 0


def _inputs(head, target, steps, family):
    torch.manual_seed(3)
    ids = torch.randint(5, 128, (3, 12))  # (B, L)
    layers = head.config.target_layers if family == "eagle3" else None
    tout = forward_with_hidden(target, ids, layers=layers)
    feats = tout.layers.flatten(2) if family == "eagle3" else tout.hidden  # (B, L, F)
    return feats, eagle.next_tokens(ids, steps)  # (B, L + S - 1)


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
@pytest.mark.parametrize("steps", [1, 4])
def test_unroll_at_equals_whole_sequence_unroll(family, steps):
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = build_eagle3(target) if family == "eagle3" else build_eagle(target)
    feats, nxt = _inputs(head, target, steps, family)
    full = head(feats, nxt, steps=steps)  # (B, L, S, H)
    # uneven rows (row 1 has none), unsorted, the last position (whose later tokens are padding) included
    b = torch.tensor([2, 0, 0, 2, 0, 2, 2])
    t = torch.tensor([11, 0, 5, 3, 9, 4, 7])
    sparse = head(feats, nxt, steps=steps, at=(b, t))  # (N, S, H)
    assert sparse.shape == (7, steps, full.shape[-1])
    torch.testing.assert_close(sparse, full[b, t], rtol=1e-10, atol=1e-10)


def test_unroll_at_gradients_equal_whole_sequence_gradients():
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = build_eagle3(target).train()
    feats, nxt = _inputs(head, target, 3, "eagle3")
    b, t = torch.tensor([0, 0, 1, 2]), torch.tensor([2, 8, 6, 10])
    w = torch.randn(4, 3, target.config.hidden_size, dtype=torch.float64)
    grads = []
    for at in (None, (b, t)):
        head.zero_grad()
        out = head(feats, nxt, steps=3, grad_steps=2, at=at)
        out = out[b, t] if at is None else out  # (N, S, H)
        (out * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 3
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-9, atol=1e-11, msg=name)
