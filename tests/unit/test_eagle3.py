"""EAGLE-3 head: training-time-test unroll and loss on a tiny model, draft-vocabulary mapping."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.data.collate import Collator
from specdraft.models import eagle, eagle3
from specdraft.models.base_llm import forward_with_hidden
from specdraft.testing import tiny_llama

FP = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}
SCHEMA = dict(
    draft_len=3,
    tree_total_tokens=10,
    tree_depth=3,
    tree_top_k=3,
    target_layers=None,
    draft_vocab_size=None,
    ttt_decay=0.8,
)


def build_eagle3(target, dtype=torch.float64, counts=None, **over):
    torch.manual_seed(2)
    return (
        eagle3.build(SimpleNamespace(**{**SCHEMA, **over}), target, FP, token_counts=counts).to(dtype).eval()
    )


def test_default_layers_and_vocab_mapping():
    assert eagle3.default_target_layers(32) == [2, 16, 29] and eagle3.default_target_layers(30) == [2, 15, 27]
    target = tiny_llama(num_layers=8)
    counts = torch.arange(128, dtype=torch.float64).flip(0)  # token 0 most frequent
    counts[100] = 1e6
    head = build_eagle3(target, counts=counts, draft_vocab_size=16)
    assert head.config.target_layers == [2, 4, 5]
    ids = head.draft_ids()
    assert ids.tolist() == sorted(list(range(15)) + [100])  # the 16 most frequent, ascending
    assert torch.equal(head.to_target_ids(torch.arange(16)), ids)
    assert int(head.t2d.sum()) == 16 and bool(head.t2d[ids].all())
    torch.testing.assert_close(head.lm_head.weight, target.lm_head.weight[ids].double())
    with pytest.raises(ValueError, match="token counts"):
        build_eagle3(target, draft_vocab_size=16)
    with pytest.raises(ValueError, match="target_layers"):
        build_eagle3(target, target_layers=[2, 9])


def _naive_chain(head, fused, tokens, t, chain):
    """Step-by-step decode of position t then `chain` drafted steps on the head's own outputs."""
    from transformers import DynamicCache

    cache, n, out = DynamicCache(), 0, None
    for j in range(t + 1):
        n += 1
        out = head.step(
            head.encode_target(fused[:, j : j + 1]),
            tokens[:, j : j + 1],
            cache,
            torch.tensor([[j]]),
            torch.ones(1, n, dtype=torch.bool),
        )
    for i in range(1, chain + 1):
        n += 1
        out = head.step(
            out,
            tokens[:, t + i : t + i + 1],
            cache,
            torch.tensor([[t + i]]),
            torch.ones(1, n, dtype=torch.bool),
        )
    return out[0, 0]


def test_training_time_test_unroll_matches_decode_chain():
    target = tiny_llama(num_layers=8, dtype=torch.float64)
    head = build_eagle3(target)
    ids = torch.randint(5, 128, (1, 10))
    tout = forward_with_hidden(target, ids, layers=head.config.target_layers)
    fused = tout.layers.flatten(2)  # (1, 10, 3H)
    nxt = eagle.next_tokens(ids, 4)
    outs = head(fused, nxt, steps=4)  # (1, 10, 4, H)
    for t in (0, 4, 8):
        for i in range(4):
            torch.testing.assert_close(
                outs[0, t, i], _naive_chain(head, fused, nxt, t, i), rtol=1e-9, atol=1e-9
            )


def test_ttt_loss_is_decayed_soft_ce_and_reaches_every_step():
    target = tiny_llama(num_layers=8)
    counts = torch.rand(128, dtype=torch.float64)
    head = build_eagle3(target, torch.float32, counts=counts, draft_vocab_size=64).train()
    torch.manual_seed(0)
    items = [{"input_ids": torch.randint(5, 128, (20,)), "loss_mask": torch.tensor([0] * 6 + [1] * 14)}]
    batch = Collator(pad_id=0, draft_len=3)(items)
    tout = forward_with_hidden(target, batch["input_ids"], layers=head.config.target_layers)
    loss, aux = eagle3.compute_loss(head, batch, tout, {"draft_len": 3})
    b, t = eagle.select_positions(batch, {})
    assert aux["logits"].shape == (b.numel(), 1, 128)  # training: slot 0 metrics only
    outs = head(tout.layers.flatten(2), eagle.next_tokens(batch["input_ids"], 3), steps=3)
    ids, manual = head.draft_ids(), 0.0
    for i in range(3):
        p = (t + 1 + i).clamp_max(19)
        valid = (t + 1 + i < 20) & (batch["targets"][b, t, i] != -100)
        teacher = torch.softmax(target.lm_head(tout.hidden[b, p])[:, ids], -1)
        manual = manual + 0.8**i * eagle.soft_cross_entropy(head.draft_logits(outs[b, t, i]), teacher, valid)
    torch.testing.assert_close(loss, manual)
    loss.backward()
    # eval mode scores every slot; the draft logits land on their target ids, everything else is masked out
    head.eval()
    with torch.no_grad():
        _, aux = eagle3.compute_loss(head, batch, tout, {"draft_len": 3})
    head.train()
    q = head.draft_logits(outs[b, t, 1]).detach()
    assert aux["logits"].shape == (b.numel(), 3, 128) and torch.equal(
        aux["targets"], batch["targets"][b, t, :3]
    )
    torch.testing.assert_close(aux["logits"][:, 1, ids], q)
    assert bool((aux["logits"][:, 1, ~head.t2d] <= q.min(-1, keepdim=True).values - 19.9).all())
    assert head.fc.weight.grad is not None and head.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0
    # a loss on the last unroll step alone still reaches fc through the chain of own predictions
    head.zero_grad()
    outs = head(tout.layers.flatten(2), eagle.next_tokens(batch["input_ids"], 3), steps=3)
    head.draft_logits(outs[:, :, 2]).sum().backward()
    assert head.fc.weight.grad.abs().sum() > 0
