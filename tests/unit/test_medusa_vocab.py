"""Medusa with a reduced draft vocabulary (`drafter.draft_vocab_size`): the pruned heads are the full heads' kept
rows, the loss ignores labels outside the vocabulary, greedy decoding stays lossless on both decoder paths, the
export keeps the mapping, warm starts remap rows, and a bad size is refused naming the field. All on CPU."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from safetensors import safe_open

from specdraft.conf.schema import register_configs
from specdraft.conf.validate import validate_config
from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.medusa_tree import MedusaProposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.eval.tree import DraftTree
from specdraft.models.hub import export_drafter, load_drafter, warm_start
from specdraft.models.medusa import Medusa, MedusaConfig, build, compute_loss
from specdraft.testing import tiny_llama

H, V, VD = 32, 128, 40  # the tiny Llama's sizes and the draft vocabulary
CPU = torch.device("cpu")
FP = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "abc"}


def schema(draft_vocab_size: int | None = VD, **kw: object) -> object:
    """`cfg.drafter` of a 3-head Medusa (1 ResBlock per head, top-4, the LM-head init)."""
    base = {"draft_len": 3, "num_layers": 1, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 4}
    return OmegaConf.create({**base, "tree_choices": None, "draft_vocab_size": draft_vocab_size, **kw})


def counts(seed: int) -> torch.Tensor:
    """(V,) distinct label counts, so the top-VD set has no ties."""
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed)).float()


def kept(c: torch.Tensor, vd: int = VD) -> torch.Tensor:
    """(vd,) ascending target ids of the vd most frequent labels."""
    return torch.tensor(sorted(c.argsort(descending=True)[:vd].tolist()))


def jitter(model: Medusa, seed: int = 5) -> Medusa:
    """Non-trivial ResBlocks and heads (the build leaves ResBlocks at the identity)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture
def target64() -> torch.nn.Module:
    return tiny_llama(dtype=torch.float64).to(CPU)


def test_pruned_heads_are_the_full_heads_kept_rows(target64):
    full = jitter(build(schema(None), target64, FP)).double().eval()
    c = counts(0)
    pruned = build(schema(), target64, FP, token_counts=c).double().eval()
    ids = kept(c)
    lm = target64.get_output_embeddings().weight
    for head in pruned.heads:  # the LM-head init keeps the draft vocabulary's rows
        torch.testing.assert_close(head[-1].weight, lm[ids], rtol=0, atol=0)
    assert not full.reduced_vocab and pruned.reduced_vocab and pruned.config.draft_vocab_size == VD
    with torch.no_grad():  # the same weights restricted to the kept rows
        for hf, hp in zip(full.heads, pruned.heads, strict=True):
            hp[0].load_state_dict(hf[0].state_dict())
            hp[-1].weight.copy_(hf[-1].weight[ids])
    h = torch.randn(5, H, dtype=torch.float64)
    lp, lf = pruned.head_logits(h), full.head_logits(h)  # (5, 3, VD), (5, 3, V)
    assert lp.shape == (5, 3, VD) and lf.shape == (5, 3, V)
    torch.testing.assert_close(
        lp, lf[..., ids], rtol=0, atol=1e-12
    )  # fp64: BLAS may round a narrower GEMM differently (4e-16 on a Zen 3 EPYC)
    # the mapping: draft id i <-> target id ids[i]; tokens outside the vocabulary and -100 -> `missing`
    assert pruned.draft_ids().tolist() == ids.tolist()
    assert pruned.to_target_ids(torch.arange(VD)).tolist() == ids.tolist()
    out = torch.tensor(sorted(set(range(V)) - set(ids.tolist()))[:3])
    probe = torch.cat([ids[[0, 7, VD - 1]], out, torch.tensor([-100])])
    assert pruned.to_draft_ids(probe, missing=-1).tolist() == [0, 7, VD - 1, -1, -1, -1, -1]
    # decode-time top-k: target ids, the full heads' top-k among the kept tokens
    masked = torch.full_like(lf[-1], float("-inf"))
    masked[:, ids] = lf[-1][:, ids]
    assert torch.equal(pruned.topk_tokens(h[-1], 4), masked.topk(4, dim=-1).indices)
    assert torch.equal(full.topk_tokens(h[-1], 4), lf[-1].topk(4, dim=-1).indices)  # full: unchanged


def golden_pruned() -> Medusa:
    """V = 4, draft vocabulary {0, 2, 3} (token 1 dropped), no ResBlocks, head k = diag(v_k): on h = ones the
    draft logits are exactly v_k."""
    model = Medusa(
        MedusaConfig(base_hidden_size=3, vocab_size=4, draft_vocab_size=3, draft_len=2, num_layers=0)
    )
    with torch.no_grad():
        model.d2t.copy_(torch.tensor([0, 2, 3]) - torch.arange(3))
        model.heads[0][0].weight.copy_(torch.diag(torch.tensor([0.0, math.log(2), 0.0])))  # 1/4, 1/2, 1/4
        model.heads[1][0].weight.copy_(torch.diag(torch.tensor([math.log(3), 0.0, 0.0])))  # 3/5, 1/5, 1/5
    return model


def test_loss_ignores_labels_outside_the_draft_vocabulary():
    # position A: labels (2, 1); position B: labels (3, 0) - token 1 is not in the draft vocabulary
    batch = {
        "root": torch.tensor([[0, 0]]),
        "targets": torch.tensor([[[2, 1], [3, 0]]]),
        "pos_mask": torch.tensor([[True, True]]),
    }
    out = SimpleNamespace(hidden=torch.ones(1, 2, 3), layers=None, logits=None)
    model = golden_pruned()
    loss, aux = compute_loss(model, batch, out, {})
    # slot 0: mean(-log 1/2, -log 1/4); slot 1: only B counts, -log 3/5 (A's label is ignored, not a miss)
    golden = 1.5 * math.log(2) + 0.8 * math.log(5 / 3)
    assert float(loss.detach()) == pytest.approx(golden, abs=1e-6)
    assert float(loss.detach()) == pytest.approx(1.448381, abs=1e-6)
    assert aux["logits"].shape == (2, 2, 3) and aux["targets"].tolist() == [[1, -1], [2, 0]]  # draft ids
    loss_b, _ = compute_loss(model, {**batch, "pos_mask": torch.tensor([[False, True]])}, out, {})
    assert float(loss_b.detach()) == pytest.approx(math.log(4) + 0.8 * math.log(5 / 3), abs=1e-6)
    model.eval()  # held-out metrics in target ids: the dropped token is never predicted
    _, aux = compute_loss(model, batch, out, {})
    assert aux["logits"].shape == (2, 2, 4) and aux["targets"].tolist() == [[2, 1], [3, 0]]
    assert aux["logits"][0].argmax(-1).tolist() == [2, 0]
    assert bool((aux["logits"][..., 1] < aux["logits"][..., [0, 2, 3]].min(-1).values).all())


class RecordingProposer(MedusaProposer):
    """MedusaProposer that keeps every drafted token (to check that trees hold target ids)."""

    def __init__(self, drafter: torch.nn.Module) -> None:
        super().__init__(drafter)
        self.drafted: set[int] = set()

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        tree = super().propose(hidden, tokens)
        self.drafted |= set(tree.tokens[1:].tolist())
        return tree


@pytest.mark.parametrize("prompt_len", [1, 9])
def test_greedy_pruned_medusa_equals_ar_on_both_decoders(target64, prompt_len):
    prompt = torch.randint(0, V, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    ref, _ = ar_generate(target64, None, prompt, 32, stop_ids=set())
    c = counts(1)
    c[torch.tensor(ref)] += V  # the generated tokens are frequent labels: drafts can be accepted
    drafter = jitter(build(schema(), target64, FP, token_counts=c)).double().eval()
    vocab = set(kept(c).tolist())
    for run in (
        lambda p: speculative_generate(target64, None, prompt, p, 32, stop_ids=set()),
        lambda p: StaticDecoder(target64, 48).speculative_generate(None, prompt, p, 32, stop_ids=set()),
    ):
        proposer = RecordingProposer(drafter)
        out, stats = run(proposer)
        assert out == ref
        assert proposer.drafted <= vocab and max(proposer.drafted) >= VD  # target ids, not draft ids
        assert sum(stats.accepted) > 0


def test_export_round_trip_keeps_the_mapping_and_warm_start_remaps_rows(tmp_path, target64):
    c = counts(2)
    model = jitter(build(schema(), target64, FP, token_counts=c)).float()
    out = export_drafter(model, tmp_path / "pruned", {"steps": 1})
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "d2t" in set(f.keys())
    assert "the 40 most frequent training labels" in (out / "README.md").read_text()
    loaded = load_drafter(str(out), target=tiny_llama(), fingerprint=FP)
    assert isinstance(loaded, Medusa) and loaded.reduced_vocab and loaded.config.draft_vocab_size == VD
    assert torch.equal(loaded.draft_ids(), model.draft_ids())
    h = torch.randn(4, H)
    torch.testing.assert_close(loaded.head_logits(h), model.eval().head_logits(h), rtol=0, atol=0)
    assert torch.equal(loaded.topk_tokens(h[0], 4), model.topk_tokens(h[0], 4))
    # a full-vocabulary export keeps its original tensors (no d2t)
    full = export_drafter(build(schema(None), target64, FP).float(), tmp_path / "full")
    with safe_open(str(full / "model.safetensors"), "pt") as f:
        assert "d2t" not in set(f.keys())
    # warm start into another draft vocabulary: shared tokens keep their rows, new ones get the mean row
    c2 = counts(3)
    other = build(schema(), target64, FP, token_counts=c2).float()
    assert warm_start(other, str(out), FP) == 3 * 3  # per head: ResBlock weight, bias, projection
    src, dst = model.draft_ids().tolist(), other.draft_ids().tolist()
    for hm, ho in zip(model.heads, other.heads, strict=True):
        w, wo = hm[-1].weight, ho[-1].weight
        for j, tok in enumerate(dst):
            expect = w[src.index(tok)] if tok in src else w.mean(0)
            torch.testing.assert_close(wo[j], expect)


def test_invalid_draft_vocab_size_names_the_field(target64):
    conf = str(Path(__file__).resolve().parents[2] / "conf")
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["conf=medusa_smollm2", "drafter.draft_vocab_size=0"])
    with pytest.raises(ValueError, match=r"drafter\.draft_vocab_size=0: expected null or >= 1"):
        validate_config(cfg)
    for bad in (0, V + 1):
        with pytest.raises(
            ValueError, match=rf"drafter\.draft_vocab_size={bad} must be in \[1, vocab_size=128\]"
        ):
            build(schema(bad), target64, FP, token_counts=counts(0))
    with pytest.raises(ValueError, match="needs training token counts"):
        build(schema(), target64, FP)
    with pytest.raises(ValueError, match="draft_vocab_size=0"):
        Medusa(MedusaConfig(vocab_size=V, draft_vocab_size=0))


def test_rank_accuracies_of_pruned_heads_count_target_ids(target64):
    """`measure_rank_accuracies` compares labels with the heads' top-k in target ids (a label outside the draft
    vocabulary is a miss at every rank, still counted)."""
    from specdraft.data.collate import Collator
    from specdraft.eval.medusa_tree import measure_rank_accuracies

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (14,), generator=g)
    c = counts(4)
    c[ids[::2]] += V  # half the labels in the vocabulary (at least), the rest by chance
    heads = jitter(build(schema(), target64, FP, token_counts=c)).double().eval()
    batch = Collator(pad_id=0, draft_len=3)(
        [{"input_ids": ids, "loss_mask": torch.ones(14, dtype=torch.long)}]
    )
    acc, n = measure_rank_accuracies(heads, target64, [batch], topk=4, chunk=5)
    hits, valid = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    h = target64(ids[None], output_hidden_states=True).hidden_states[-1][0]  # (L, H)
    for t in range(len(ids) - 1):
        top = heads.topk_tokens(h[t], 4)  # (3, 4) target ids
        for k in range(3):
            if t + 2 + k < len(ids):
                valid[k] += 1
                hits[k] += (top[k] == ids[t + 2 + k]).double()
    assert n == 13 and float(hits.sum()) > 0
    torch.testing.assert_close(acc, hits / valid[:, None], atol=1e-12, rtol=0)
