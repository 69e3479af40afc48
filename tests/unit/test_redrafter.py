"""ReDrafter: recurrence, teacher-forced alignment and beam search against naive loops."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.models.redrafter import ReDrafter, ReDrafterConfig, build, compute_loss

H, V = 16, 11


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=V,
    )
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def make_drafter(target, **kw) -> ReDrafter:
    torch.manual_seed(1)
    cfg = ReDrafterConfig(base_hidden_size=H, vocab_size=V, draft_len=3, num_layers=2, **kw)
    model = ReDrafter(cfg).attach_embeddings(target).double()
    with torch.no_grad():  # non-trivial ResBlocks (they start as the identity)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def naive_logits(model: ReDrafter, emb: torch.Tensor, h: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Logits of every slot for one position, written out step by step from the paper's equations."""
    p = dict(model.named_parameters())
    s = emb[tokens[0]].double()  # s_1 = e(root)
    out = []
    for k in range(len(tokens)):
        if k > 0:
            e = emb[tokens[k]].double()
            if model.config.rnn:
                s = F.silu(p["rnn_u.weight"] @ s + p["rnn_u.bias"] + p["rnn_w.weight"] @ e)
            else:
                s = s + e
        g = torch.cat([s, h.double()])
        if model.input_proj is not None:
            g = p["input_proj.weight"] @ g + p["input_proj.bias"]
        for i in range(model.config.num_layers):
            g = g + F.silu(p[f"blocks.{i}.linear.weight"] @ g + p[f"blocks.{i}.linear.bias"])
        out.append(p["head.weight"] @ g)
    return torch.stack(out)  # (D, V)


@pytest.mark.parametrize("kw", [{}, {"rnn": False}, {"exit_dim": 12}])
def test_teacher_forced_forward_matches_naive_loop(target, kw):
    model = make_drafter(target, **kw)
    emb = target.get_input_embeddings().weight
    torch.manual_seed(2)
    hidden = torch.randn(2, 5, H, dtype=torch.float64)
    root = torch.randint(0, V, (2, 5))
    targets = torch.randint(0, V, (2, 5, 3))
    logits = model(hidden, root, targets)
    assert logits.shape == (2, 5, 3, V)
    for b, t in itertools.product(range(2), range(5)):
        # slot k sees the root then the labels of slots 0..k-1 (teacher forcing); its own label never.
        ref = naive_logits(model, emb, hidden[b, t], [int(root[b, t])] + targets[b, t, :2].tolist())
        torch.testing.assert_close(logits[b, t], ref)


def test_slot_does_not_see_its_own_label(target):
    model = make_drafter(target)
    hidden, root = torch.randn(1, 1, H, dtype=torch.float64), torch.tensor([[3]])
    a = model(hidden, root, torch.tensor([[[1, 2, 4]]]))
    b = model(hidden, root, torch.tensor([[[1, 2, 7]]]))  # only the last label changed
    torch.testing.assert_close(a, b)
    c = model(hidden, root, torch.tensor([[[5, 2, 4]]]))  # slot 0's label feeds slots 1 and 2
    torch.testing.assert_close(a[..., 0, :], c[..., 0, :])
    assert not torch.allclose(a[..., 1, :], c[..., 1, :])


def test_ignored_labels_are_embedded_safely(target):
    model = make_drafter(target)
    out = model(
        torch.randn(1, 2, H, dtype=torch.float64), torch.tensor([[1, 2]]), torch.full((1, 2, 3), -100)
    )
    assert torch.isfinite(out).all()


def test_beam_search_exhaustive_equals_brute_force(target):
    model = make_drafter(target)
    hidden, root, d = torch.randn(H, dtype=torch.float64), 4, 2
    beams, scores = model.beam_search(hidden, root, beam_width=V**d, draft_len=d)
    assert beams.shape == (V**d, 1 + d) and scores.shape == (V**d,)
    assert (beams[:, 0] == root).all()
    # every sequence exactly once, scored by the teacher-forced log-probs
    assert len({tuple(b.tolist()) for b in beams}) == V**d
    logp = torch.log_softmax(
        model(hidden[None, None].expand(1, V**d, H), beams[None, :, 0], beams[None, :, 1:]), -1
    )
    ref = logp[0].gather(-1, beams[:, 1:, None]).squeeze(-1).sum(-1)  # (W,)
    torch.testing.assert_close(scores.double(), ref, rtol=1e-5, atol=1e-5)
    assert (scores[:-1] >= scores[1:]).all()


def test_beam_search_small_width_beats_greedy_chain(target):
    model = make_drafter(target)
    hidden = torch.randn(H, dtype=torch.float64)
    beams, scores = model.beam_search(hidden, 2, beam_width=4, draft_len=3)
    assert beams.shape == (4, 4) and (beams[:, 0] == 2).all()
    assert len({tuple(b.tolist()) for b in beams}) == 4 and (scores[:-1] >= scores[1:]).all()
    state, tok, greedy_score = model.init_state(torch.tensor(2)), None, 0.0
    for k in range(3):  # the greedy chain, step by step with the public helpers
        if k:
            state = model.next_state(state, tok)
        logp = torch.log_softmax(model.state_logits(state, hidden), -1)
        tok = logp.argmax()
        greedy_score += float(logp[tok].detach())
    assert float(scores[0]) >= greedy_score - 1e-6


def test_build_init_from_lm_head_reproduces_target_head(target):
    schema = OmegaConf.create(
        {
            "draft_len": 2,
            "num_layers": 2,
            "rnn": True,
            "share_embeddings": True,
            "beam_width": 4,
            "init_from_lm_head": True,
        }
    )
    fp = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "x"}
    model = build(schema, target, fp)
    assert not any(n.startswith("embed") for n in model.state_dict())  # borrowed, not saved
    h = torch.randn(3, H)
    logits = model(h[None], torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 2, dtype=torch.long))
    ref = target.get_output_embeddings()(h)  # ResBlocks start as identity, head = [0 | W_lm]
    torch.testing.assert_close(logits[0, :, 0], ref)
    own = build(OmegaConf.merge(schema, {"share_embeddings": False}), target, fp)
    assert "embed.weight" in own.state_dict()
    assert model.head.weight.requires_grad  # trained unless freeze_head
    frozen = build(OmegaConf.merge(schema, {"freeze_head": True}), target, fp)
    loss, _ = compute_loss(
        frozen,
        {
            "root": torch.tensor([[1, 2]]),
            "targets": torch.tensor([[[2, 3], [3, 4]]]),
            "pos_mask": torch.ones(1, 2).bool(),
        },
        type("Out", (), {"hidden": torch.randn(1, 2, H)})(),
    )
    loss.backward()
    assert frozen.head.weight.grad is None and frozen.blocks[0].linear.weight.grad is not None
    assert "head.weight" in frozen.state_dict()  # still exported: the drafter stays self-contained


def test_compute_loss_selects_masked_positions(target):
    model = make_drafter(target).float()
    batch = {
        "root": torch.tensor([[1, 2, 3, 0]]),
        "targets": torch.tensor([[[2, 3, 4], [3, 4, -100], [4, -100, -100], [-100] * 3]]),
        "pos_mask": torch.tensor([[True, False, True, False]]),
    }

    class Out:
        hidden = torch.randn(1, 4, H)

    loss, aux = compute_loss(model, batch, Out())
    assert aux["logits"].shape == (2, 3, V) and aux["targets"].tolist() == [[2, 3, 4], [4, -100, -100]]
    loss.backward()
    assert model.head.weight.grad is not None and torch.isfinite(loss)
