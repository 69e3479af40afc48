"""EAGLE-1 head: feature alignment against a naive loop, training-time-test unroll, losses, save/load, presets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.data.collate import Collator
from specdraft.models import eagle
from specdraft.models.base_llm import forward_with_hidden
from specdraft.testing import tiny_llama

FP = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}
SCHEMA = dict(
    draft_len=3,
    tree_total_tokens=10,
    tree_depth=3,
    tree_top_k=3,
    fc_bias=True,
    feature_weight=1.0,
    token_weight=0.1,
    noise=0.0,
)


def build_eagle(target, dtype=torch.float64, **over):
    torch.manual_seed(1)
    return eagle.build(SimpleNamespace(**{**SCHEMA, **over}), target, FP).to(dtype).eval()


def naive_outputs(head, feats, tokens, t, chain):
    """Head output for position t after `chain` unroll steps, one pair at a time through a fresh cache."""
    from transformers import DynamicCache

    cache, n = DynamicCache(), 0
    out = None
    for j in range(t + 1):  # committed pairs (f_j, x_{j+1}), one at a time
        n += 1
        out = head.step(
            head.encode_target(feats[:, j : j + 1]),
            tokens[:, j : j + 1],
            cache,
            torch.tensor([[j]]),
            torch.ones(1, n, dtype=torch.bool),
        )
    for i in range(1, chain + 1):  # drafted chain: own output + the true next token, position t + i
        n += 1
        out = head.step(
            out,
            tokens[:, t + i : t + i + 1],
            cache,
            torch.tensor([[t + i]]),
            torch.ones(1, n, dtype=torch.bool),
        )
    return out[0, 0]


def test_teacher_forcing_and_unroll_match_naive_loop():
    target = tiny_llama(dtype=torch.float64)
    head = build_eagle(target)
    ids = torch.randint(5, 128, (1, 9))
    feats = forward_with_hidden(target, ids).hidden  # (1, 9, H)
    steps = 3
    nxt = eagle.next_tokens(ids, steps)  # (1, 9 + 2): column j = x_{j+1}
    assert torch.equal(nxt[0, :8], ids[0, 1:]) and bool((nxt[0, 8:] == 0).all())
    outs = head(feats, nxt, steps=steps)  # (1, 9, 3, H)
    for t in (0, 3, 7):
        for i in range(steps):
            ref = naive_outputs(head, feats, nxt, t, i)
            torch.testing.assert_close(outs[0, t, i], ref, rtol=1e-9, atol=1e-9)


def test_losses_golden():
    pred, true = torch.tensor([[0.0, 0.5, 3.0]]), torch.zeros(1, 3)
    assert float(eagle.smooth_l1_feature_loss(pred, true)) == pytest.approx((0 + 0.125 + 2.5) / 3)
    logits = torch.zeros(2, 4)
    probs = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0]])
    assert float(eagle.soft_cross_entropy(logits, probs)) == pytest.approx(
        torch.log(torch.tensor(4.0)).item()
    )
    valid = torch.tensor([True, False])
    sharp = torch.tensor([[10.0, 0, 0, 0], [0.0, 0, 0, 0]])
    assert float(eagle.soft_cross_entropy(sharp, probs, valid)) == pytest.approx(
        float(-torch.log_softmax(sharp[0], -1)[0])
    )


def _batch(target, length=24, bsz=2, draft_len=3):
    torch.manual_seed(0)
    items = []
    for b in range(bsz):
        n = length - 3 * b
        ids = torch.randint(5, 128, (n,))
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3 :] = 1
        items.append({"input_ids": ids, "loss_mask": mask})
    batch = Collator(pad_id=0, draft_len=draft_len)(items)
    return batch, forward_with_hidden(target, batch["input_ids"], attention_mask=batch["attention_mask"])


def test_compute_loss_matches_manual_and_trains():
    target = tiny_llama()
    head = build_eagle(target, torch.float32)
    batch, tout = _batch(target)
    head.train()
    loss, aux = eagle.compute_loss(head, batch, tout, {"draft_len": 3})
    b, t = eagle.select_positions(batch, {})
    assert aux["logits"].shape == (b.numel(), 1, 128) and torch.equal(
        aux["targets"], batch["targets"][b, t, :1]
    )
    pred = head(tout.hidden, eagle.next_tokens(batch["input_ids"], 1))[b, t, 0]
    true = tout.hidden[b, t + 1]
    manual = eagle.smooth_l1_feature_loss(pred, true) + 0.1 * eagle.soft_cross_entropy(
        head.draft_logits(pred), torch.softmax(head.draft_logits(true), -1)
    )
    torch.testing.assert_close(loss, manual)
    head.eval()
    with torch.no_grad():
        _, aux = eagle.compute_loss(head, batch, tout, {"draft_len": 3})
    assert aux["logits"].shape[1] == 3  # eval unrolls every draft slot
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        loss, _ = eagle.compute_loss(head, batch, tout, {"draft_len": 3})
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < first
    assert all(p.grad is None for p in target.parameters())  # the borrowed target is never trained


def test_export_roundtrip_keeps_target_out(tmp_path):
    from specdraft.models.hub import export_drafter, load_drafter

    target = tiny_llama()
    head = build_eagle(target, torch.float32)
    assert not any("embed" in k or "lm_head" in k for k in head.state_dict())  # borrowed, never saved
    export_drafter(head, tmp_path / "export", {"steps": 1})
    loaded = load_drafter(str(tmp_path / "export"), target=target)
    assert type(loaded) is eagle.EagleDrafter and loaded.config.block_config == head.config.block_config
    f, ids = torch.randn(1, 6, 32), torch.randint(0, 128, (1, 8))
    torch.testing.assert_close(loaded(f, ids, steps=3), head(f, ids, steps=3))


def test_draft_vocabulary_scores_the_kept_rows_of_the_lm_head(tmp_path):
    """draft_vocab_size: the drafts are the full logits restricted to the most frequent labels (same head
    weights), mapped back to target ids; the int8 source Linear is those rows; the held-out logits score the
    same drafts; the export keeps the vocabulary, the engine layout (full-vocabulary engines) drops it."""
    from specdraft.models.eagle_export import export_engine_layout, read_engine_layout
    from specdraft.models.hub import export_drafter, load_drafter

    target = tiny_llama()
    counts = torch.rand(128, generator=torch.Generator().manual_seed(0))  # (V,)
    full = build_eagle(target, torch.float32)
    torch.manual_seed(1)
    head = eagle.build(SimpleNamespace(**SCHEMA, draft_vocab_size=40), target, FP, token_counts=counts).eval()
    ids = counts.topk(40).indices.sort().values  # (40,) the kept target ids, ascending
    assert head.reduced and not full.reduced and "d2t" not in full.state_dict()
    assert torch.equal(head.draft_ids(), ids) and torch.equal(head.to_target_ids(torch.arange(40)), ids)
    out = torch.randn(5, 32)  # (N, H)
    torch.testing.assert_close(head.draft_logits(out), full.draft_logits(out)[:, ids])  # same head weights
    pre, rows = head.draft_head()
    torch.testing.assert_close(rows(pre(out)), head.draft_logits(out))
    assert head.draft_head()[1] is rows  # one Linear (int8 copies are shared by identity)
    with pytest.raises(ValueError, match="needs training token counts"):
        eagle.build(SimpleNamespace(**SCHEMA, draft_vocab_size=40), target, FP)
    # held-out logits: the drafts in target ids, every token outside below every kept one
    batch, tout = _batch(target)
    with torch.no_grad():
        _, aux = eagle.compute_loss(head, batch, tout, {"draft_len": 3})
    lg = aux["logits"]  # (N, 3, V)
    outside = torch.ones(128, dtype=torch.bool)
    outside[ids] = False
    assert (lg[..., outside].amax(-1) < lg[..., ids].amin(-1)).all()
    # export round trip; engine layout without d2t
    export_drafter(head, tmp_path / "export", {"steps": 1})
    loaded = load_drafter(str(tmp_path / "export"), target=target)
    assert loaded.reduced and torch.equal(loaded.draft_ids(), ids)
    torch.testing.assert_close(loaded.draft_logits(out), head.draft_logits(out))
    cfg, tensors = read_engine_layout(export_engine_layout(head, tmp_path / "engine", "float32"))
    assert "d2t" not in tensors and "draft_vocab_size" not in cfg


@pytest.mark.parametrize("preset", ["eagle_smollm2", "eagle3_smollm2", "eagle_vicuna7b", "eagle3_llama3_8b"])
def test_presets_compose(preset):
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specdraft.conf.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    conf_dir = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        cfg = compose("config", overrides=[f"conf={preset}"])
    assert cfg.drafter.family == ("eagle3" if "eagle3" in preset else "eagle")
    assert cfg.name == preset
