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
    beams, cum = model.beam_search(hidden, root, beam_width=V**d, draft_len=d)
    scores = cum[:, -1]  # (W,) the beams' scores
    assert beams.shape == (V**d, 1 + d) and cum.shape == (V**d, 1 + d)
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
    beams, cum = model.beam_search(hidden, 2, beam_width=4, draft_len=3)
    scores = cum[:, -1]  # (W,)
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


# ---- reduced draft vocabulary ---------------------------------------------------------------------------------
DRAFT_IDS = torch.tensor([1, 2, 4, 6, 7, 9])  # Vd = 6 of V = 11


def reduced_pair(target) -> tuple[ReDrafter, ReDrafter]:
    """(full, reduced): the same drafter, the reduced one keeping only the head rows of DRAFT_IDS."""
    full = make_drafter(target)
    small = ReDrafter(
        ReDrafterConfig(
            base_hidden_size=H, vocab_size=V, draft_len=3, num_layers=2, draft_vocab_size=len(DRAFT_IDS)
        )
    )
    small = small.attach_embeddings(target).double()
    state = {k: v for k, v in full.state_dict().items() if k != "head.weight"}
    small.load_state_dict({**state, "head.weight": full.head.weight[DRAFT_IDS]}, strict=False)
    small.d2t.copy_(DRAFT_IDS - torch.arange(len(DRAFT_IDS)))
    return full, small


def test_draft_vocab_id_maps(target):
    _, small = reduced_pair(target)
    assert small.draft_ids().tolist() == DRAFT_IDS.tolist()
    assert small.to_target_ids(torch.tensor([0, 3, 5])).tolist() == [1, 6, 9]
    assert small.to_draft_ids(torch.tensor([[1, 3, -100], [9, 0, 6]])).tolist() == [
        [0, -100, -100],
        [5, -100, 3],
    ]
    assert small.to_draft_ids(torch.tensor([3, 4]), missing=-1).tolist() == [-1, 2]
    assert "d2t" in small.state_dict() and "d2t" not in make_drafter(target).state_dict()
    # the target -> draft table is cached per d2t and rebuilt when d2t changes in place
    old = int(small.draft_ids()[1])  # draft id 1's target id
    assert small.to_draft_ids(torch.tensor([old, old + 1])).tolist()[0] == 1
    small.d2t[1] += 1  # draft id 1 now stands for the next target id
    assert small.to_draft_ids(torch.tensor([old, old + 1])).tolist() == [-100, 1]
    small.d2t[1] -= 1
    assert small.to_draft_ids(torch.tensor([old])).tolist() == [1]
    # the full vocabulary maps every id to itself without a table; negative ids -> missing
    full = make_drafter(target)
    v = int(full.config.vocab_size)
    assert full.to_draft_ids(torch.tensor([[0, 5], [-100, v - 1]])).tolist() == [[0, 5], [-100, v - 1]]


def test_draft_vocab_beam_search_equals_masked_full_vocab(target):
    full, small = reduced_pair(target)
    hidden, root, d, vd = torch.randn(H, dtype=torch.float64), 4, 2, len(DRAFT_IDS)
    beams, cum = small.beam_search(hidden, root, beam_width=vd**d, draft_len=d)
    scores = cum[:, -1]  # (W,)
    assert set(beams[:, 1:].flatten().tolist()) == set(DRAFT_IDS.tolist())  # target ids, never outside
    assert len({tuple(b.tolist()) for b in beams}) == vd**d
    # brute force: the full drafter's logits restricted to the draft vocabulary, renormalised there
    logits = full(hidden[None, None].expand(1, vd**d, H), beams[None, :, 0], beams[None, :, 1:])[0]
    logp = torch.log_softmax(logits[..., DRAFT_IDS], -1)  # (W, D, Vd)
    pos = small.to_draft_ids(beams[:, 1:])
    ref = logp.gather(-1, pos[..., None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(scores.double(), ref, rtol=1e-6, atol=1e-6)


def test_draft_vocab_loss_ignores_out_of_vocabulary_labels(target):
    full, small = reduced_pair(target)
    full, small = full.float(), small.float()
    batch = {
        "root": torch.tensor([[1, 2, 3]]),
        "targets": torch.tensor([[[2, 3, 4], [6, 9, -100], [4, 7, 1]]]),  # 3 is outside the draft vocab
        "pos_mask": torch.ones(1, 3, dtype=torch.bool),
    }

    class Out:
        hidden = torch.randn(1, 3, H)

    loss, aux = compute_loss(small, batch, Out())
    assert aux["logits"].shape == (3, 3, len(DRAFT_IDS))  # training: draft ids, cheap
    assert aux["targets"].tolist() == [[1, -1, 2], [3, 5, -100], [2, 4, 0]]
    logits = full(Out.hidden, batch["root"], batch["targets"])[0][..., DRAFT_IDS]  # (L, D, Vd)
    labels = small.to_draft_ids(batch["targets"][0])
    ref = sum(
        F.cross_entropy(logits[:, k], labels[:, k], ignore_index=-100) for k in range(3)
    )  # multi_position_ce: sum over slots of the per-slot mean
    torch.testing.assert_close(loss, ref)
    small.eval()
    _, aux = compute_loss(small, batch, Out())
    assert aux["logits"].shape == (3, 3, V) and torch.equal(aux["targets"], batch["targets"][0])
    top = aux["logits"].argmax(-1)
    assert set(top.flatten().tolist()) <= set(DRAFT_IDS.tolist())
    torch.testing.assert_close(aux["logits"][..., DRAFT_IDS], logits.detach())


def test_draft_vocab_soft_kl_drops_undraftable_teacher_tokens(target):
    _, small = reduced_pair(target)
    small = small.float()
    batch = {
        "root": torch.tensor([[1, 2, 4]]),
        "targets": torch.tensor([[[2, 4], [4, 6], [6, -100]]]),
        "pos_mask": torch.tensor([[True, False, False]]),
        "topk_ids": torch.tensor([[[2, 3, 0], [4, 2, 5], [6, 1, 3]]]),  # 3, 0, 5 outside the draft vocab
        "topk_logprobs": torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]])),
    }

    class Out:
        hidden = torch.randn(1, 3, H)

    loss, _ = compute_loss(small, batch, Out(), {"loss": "kl"})
    logq = torch.log_softmax(
        small(Out.hidden[:, :1], batch["root"][:, :1], batch["targets"][:, :1])[0, 0], -1
    )
    # slot 0 imitates position 1 (teacher {4: .6, 2: .3}), slot 1 position 2 (teacher {6: .7, 1: .2})
    ref = 0.0
    for k, (ids, ps) in enumerate([([4, 2], [0.6, 0.3]), ([6, 1], [0.7, 0.2])]):
        p = torch.tensor(ps) / sum(ps)
        q = logq[k, small.to_draft_ids(torch.tensor(ids))]
        ref = ref + (p * (p.log() - q)).sum()
    torch.testing.assert_close(loss, ref)
    assert torch.isfinite(loss)


def test_draft_vocab_build_and_export_round_trip(target, tmp_path):
    schema = OmegaConf.create(
        {
            "draft_len": 2,
            "num_layers": 1,
            "rnn": True,
            "share_embeddings": True,
            "beam_width": 4,
            "init_from_lm_head": True,
            "draft_vocab_size": 4,
        }
    )
    fp = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "x"}
    with pytest.raises(ValueError, match="needs training token counts"):
        build(schema, target, fp)
    with pytest.raises(ValueError, match="draft_vocab_size=12"):
        build(OmegaConf.merge(schema, {"draft_vocab_size": 12}), target, fp, token_counts=torch.ones(V))
    counts = torch.tensor([0, 9, 1, 8, 0, 7, 2, 6, 0, 0, 3.0])
    model = build(schema, target, fp, token_counts=counts)
    assert model.draft_ids().tolist() == [1, 3, 5, 7] and model.head.weight.shape == (4, H + H)
    h = torch.randn(3, H)
    logits = model(h[None], torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 2, dtype=torch.long))
    ref = target.get_output_embeddings()(h)[:, [1, 3, 5, 7]]  # head = the target's rows of the draft vocab
    torch.testing.assert_close(logits[0, :, 0], ref)
    model.save_pretrained(tmp_path)
    back = ReDrafter.from_pretrained(tmp_path).attach_embeddings(target)
    assert back.config.draft_vocab_size == 4 and torch.equal(back.d2t, model.d2t)
    torch.testing.assert_close(
        back(h[None], torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 2, dtype=torch.long)), logits
    )


def test_warm_start_remaps_head_rows_to_a_new_draft_vocabulary(target, tmp_path):
    from specdraft.models.hub import warm_start

    fp = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "x"}
    full, small = reduced_pair(target)
    full.config.tokenizer_hash = "x"
    full.float().save_pretrained(tmp_path / "full")
    fresh = ReDrafter(small.config).attach_embeddings(target)
    fresh.d2t.copy_(small.d2t)
    assert warm_start(fresh, str(tmp_path / "full"), fp) == len(full.state_dict())
    torch.testing.assert_close(fresh.head.weight, full.head.weight[DRAFT_IDS].float())
    torch.testing.assert_close(fresh.blocks[1].linear.weight, full.blocks[1].linear.weight.float())
    # and back: the full head gets the draft rows; a token new to the vocabulary gets the mean row, so its logit
    # is the mean logit and never outranks a trained token
    small.float().save_pretrained(tmp_path / "small")
    back = make_drafter(target).float()
    warm_start(back, str(tmp_path / "small"), fp)
    torch.testing.assert_close(back.head.weight[DRAFT_IDS], small.head.weight)
    others = torch.ones(V, dtype=torch.bool).index_fill_(0, DRAFT_IDS, False)
    torch.testing.assert_close(
        back.head.weight[others], small.head.weight.mean(0).expand(int(others.sum()), -1)
    )
    h, prev, drafted = torch.randn(1, 5, H), torch.randint(0, V, (1, 5)), torch.randint(0, V, (1, 5, 2))
    top = back(h, prev, drafted).argmax(-1)  # (1, 5, 3)
    assert bool(torch.isin(top, DRAFT_IDS).all())
    wide = ReDrafter(
        ReDrafterConfig(base_hidden_size=H, vocab_size=V, draft_len=3, num_layers=2, exit_dim=12)
    )
    with pytest.raises(ValueError, match="has no tensor 'input_proj.weight'"):
        warm_start(wide.attach_embeddings(target), str(tmp_path / "full"), fp)
    deep = ReDrafter(
        ReDrafterConfig(base_hidden_size=H, vocab_size=V, draft_len=3, num_layers=2, embed_dim=8)
    )
    with pytest.raises(ValueError, match="'rnn_u.weight' has shape"):
        warm_start(deep, str(tmp_path / "full"), fp)
    with pytest.raises(ValueError, match="tokenizer_hash"):
        warm_start(fresh, str(tmp_path / "full"), {**fp, "tokenizer_hash": "other"})


# ---- extra target layers (`target_layers`) ----------------------------------------------------------------------
def test_target_layers_widen_h_with_rms_normalised_layers(target):
    """g = [s, h, rms(l)]: checked against the naive loop fed the normalised features by hand."""
    model = make_drafter(target, target_layers=[0], exit_dim=12)
    assert model.input_proj is not None and model.input_proj.weight.shape == (12, H + 2 * H)
    h, layer = torch.randn(H).double(), 50 * torch.randn(H).double()  # raw residual stream: any scale
    tokens = [3, 5, 7]
    got = model(torch.cat([h, layer])[None, None], torch.tensor([[3]]), torch.tensor([[tokens[1:] + [0]]]))
    feats = torch.cat([h, layer / layer.pow(2).mean().sqrt()])
    ref = naive_logits(model, target.get_input_embeddings().weight, feats, tokens)
    torch.testing.assert_close(got[0, 0], ref, rtol=1e-5, atol=1e-5)  # rms_norm's eps
    scaled = model(torch.cat([h, 10 * layer])[None, None], torch.tensor([[3]]), torch.tensor([[[5, 7, 0]]]))
    torch.testing.assert_close(scaled, got, rtol=1e-6, atol=1e-6)  # an extra layer's scale does not matter


def test_build_with_target_layers_checks_indices_and_starts_as_the_lm_head(target):
    schema = OmegaConf.create(
        {"draft_len": 2, "num_layers": 1, "rnn": True, "share_embeddings": True, "beam_width": 4,
         "init_from_lm_head": True, "target_layers": [0, 1]}
    )  # fmt: skip
    fp = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "x"}
    for bad in ([2], [1, 1], [-1]):
        with pytest.raises(ValueError, match=r"drafter.target_layers=.*\[0, 1\]"):
            build(OmegaConf.merge(schema, {"target_layers": bad}), target, fp)
    model = build(schema, target, fp)
    assert model.config.target_layers == [0, 1] and model.head.weight.shape == (V, H + 3 * H)
    h = torch.randn(3, H)
    feats = torch.cat([h, torch.randn(3, 2 * H)], dim=-1)  # (3, 3H): [h; l_0; l_1]
    logits = model(feats[None], torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 2, dtype=torch.long))
    torch.testing.assert_close(logits[0, :, 0], target.get_output_embeddings()(h))  # extra columns start at 0
    batch = {"root": torch.tensor([[1, 2]]), "targets": torch.tensor([[[2, 3], [3, 4]]]),
             "pos_mask": torch.ones(1, 2).bool()}  # fmt: skip
    out = type("Out", (), {"hidden": h[None, :2], "layers": None})()
    with pytest.raises(ValueError, match=r"needs target layers \[0, 1\]"):
        compute_loss(model, batch, out)
    out.layers = feats[None, :2, H:].unflatten(-1, (2, H))  # (1, 2, m, H)
    _, aux = compute_loss(model, batch, out)
    ref = model(feats[None, :2], batch["root"], batch["targets"])[0]
    torch.testing.assert_close(aux["logits"], ref.detach())


def test_warm_start_adds_target_layers_to_an_export_exactly(target, tmp_path):
    """An export without extra layers warm-starts a drafter with them: new input columns start at 0, so the
    drafter computes the export's logits whatever the new layers hold."""
    from specdraft.models.hub import warm_start

    fp = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "x"}
    src = make_drafter(target, exit_dim=12).float()
    src.config.tokenizer_hash = "x"
    src.save_pretrained(tmp_path / "src")
    wide = make_drafter(target, exit_dim=12, target_layers=[0, 1]).float()
    assert warm_start(wide, str(tmp_path / "src"), fp) == len(src.state_dict())
    h, extra = torch.randn(1, 4, H), 30 * torch.randn(1, 4, 2 * H)
    root, drafted = torch.randint(0, V, (1, 4)), torch.randint(0, V, (1, 4, 3))
    torch.testing.assert_close(wide(torch.cat([h, extra], -1), root, drafted), src(h, root, drafted))
    wide.config.tokenizer_hash = "x"
    wide.save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError, match="'input_proj.weight' has shape"):  # fewer inputs: not a widening
        warm_start(make_drafter(target, exit_dim=12).float(), str(tmp_path / "wide"), fp)


def test_warm_start_into_a_deeper_drafter_keeps_new_blocks_at_identity(target, tmp_path):
    from specdraft.models.hub import warm_start

    fp = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "x"}
    src = make_drafter(target).float()
    src.config.tokenizer_hash = "x"
    src.save_pretrained(tmp_path / "src")
    deep = ReDrafter(ReDrafterConfig(base_hidden_size=H, vocab_size=V, draft_len=3, num_layers=4))
    assert warm_start(deep.attach_embeddings(target), str(tmp_path / "src"), fp) == len(src.state_dict())
    h, root, drafted = torch.randn(1, 4, H), torch.randint(0, V, (1, 4)), torch.randint(0, V, (1, 4, 3))
    torch.testing.assert_close(deep(h, root, drafted), src(h, root, drafted))
    deeper = ReDrafter(ReDrafterConfig(base_hidden_size=H, vocab_size=V, draft_len=3, num_layers=5))
    deep.config.tokenizer_hash = "x"
    deep.save_pretrained(tmp_path / "deep")
    with torch.no_grad():  # not at its identity init: a tensor the export lacks is an error again
        deeper.blocks[4].linear.weight.fill_(1.0)
    with pytest.raises(ValueError, match="has no tensor 'blocks.4.linear.weight'"):
        warm_start(deeper.attach_embeddings(target), str(tmp_path / "deep"), fp)


def test_feature_dropout_acts_only_in_training_mode(target, tmp_path):
    """`feature_dropout` zeroes (and rescales) target features while training; eval-mode logits (metrics, beam
    search, a reloaded export) are exactly the dropout-free drafter's. `build` refuses p outside [0, 1)."""
    plain = make_drafter(target, target_layers=[0])
    noisy = make_drafter(target, target_layers=[0], feature_dropout=0.5)
    h, root = torch.randn(2, 5, 2 * H, dtype=torch.float64), torch.randint(0, V, (2, 5))
    drafted = torch.randint(0, V, (2, 5, 3))
    noisy.eval()
    torch.testing.assert_close(noisy(h, root, drafted), plain.eval()(h, root, drafted))
    noisy.train()
    feats = noisy.features(h)  # (2, 5, 2H)
    ref = plain.features(h)
    dropped = feats == 0
    assert 0.3 < dropped.double().mean() < 0.7  # about half the features dropped
    torch.testing.assert_close(feats[~dropped], 2 * ref[~dropped])  # the rest scaled by 1 / (1 - p)
    assert not torch.allclose(noisy(h, root, drafted), plain(h, root, drafted))
    noisy.float().save_pretrained(tmp_path / "export")
    back = ReDrafter.from_pretrained(tmp_path / "export").attach_embeddings(target).double()
    assert back.config.feature_dropout == 0.5 and not back.training
    torch.testing.assert_close(back(h, root, drafted), plain(h, root, drafted).detach(), rtol=1e-5, atol=1e-5)
    schema = OmegaConf.create(
        {"draft_len": 2, "num_layers": 1, "rnn": True, "share_embeddings": True, "beam_width": 4,
         "init_from_lm_head": True, "feature_dropout": 1.0}
    )  # fmt: skip
    fp = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "x"}
    with pytest.raises(ValueError, match=r"drafter.feature_dropout=1.0 must be in \[0, 1\)"):
        build(schema, target, fp)
    assert build(OmegaConf.merge(schema, {"feature_dropout": 0.1}), target, fp).config.feature_dropout == 0.1
