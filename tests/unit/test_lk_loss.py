"""The acceptance-aware (LK) loss `models.losses.expected_accept_loss`: golden value, brute force, chain ends, and
its `train.loss=ce+lk` wiring in every family (ReDrafter, Medusa, EAGLE-1, EAGLE-3). CPU only."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdraft.conf.validate import validate_config
from specdraft.data.collate import Collator
from specdraft.models import eagle, eagle3
from specdraft.models.base_llm import forward_with_hidden
from specdraft.models.eagle_common import chain_labels
from specdraft.models.losses import expected_accept_loss, label_logprobs
from specdraft.models.medusa import Medusa, MedusaConfig
from specdraft.models.medusa import compute_loss as medusa_loss
from specdraft.models.redrafter import ReDrafter, ReDrafterConfig
from specdraft.models.redrafter import compute_loss as redrafter_loss
from specdraft.testing import tiny_llama

L2, L3 = math.log(2.0), math.log(3.0)
# (N=2, K=3, V=3). softmax([ln2, 0, 0]) = (1/2, 1/4, 1/4); softmax([0, 0, 0]) = 1/3 each;
# softmax([ln3, 0, 0]) = (3/5, 1/5, 1/5)
GOLD_LOGITS = torch.tensor([[[L2, 0.0, 0.0], [0.0, 0.0, 0.0], [L3, 0.0, 0.0]]] * 2, dtype=torch.float64)
GOLD_LABELS = torch.tensor([[0, 2, 0], [0, -100, 0]])


def test_golden_value():
    # chain 0: q = (1/2, 1/3, 3/5): E[L] = 1/2 + 1/6 + 1/10 = 23/30
    # chain 1: slot 1 ignored ends the chain: E[L] = 1/2 = 15/30
    # loss = -(23/30 + 15/30) / 2 = -19/30 = -0.6333...
    assert float(expected_accept_loss(GOLD_LOGITS, GOLD_LABELS)) == pytest.approx(-0.6333333333, abs=1e-9)
    # a chain whose slot 0 is ignored adds nothing and is not counted
    lg = torch.cat([GOLD_LOGITS, GOLD_LOGITS[:1]])
    lb = torch.cat([GOLD_LABELS, torch.tensor([[-100, 0, 0]])])
    assert float(expected_accept_loss(lg, lb)) == pytest.approx(-19 / 30, abs=1e-9)
    # any batch shape, fp32 too
    assert float(expected_accept_loss(GOLD_LOGITS[None].float(), GOLD_LABELS[None])) == pytest.approx(
        -19 / 30, abs=1e-6
    )
    assert float(expected_accept_loss(GOLD_LOGITS[:0], GOLD_LABELS[:0])) == 0.0  # no chain


def brute_force_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-mean E[accepted length]: every draft sequence of every chain, weighted by its probability under
    independent slots, times its number of leading matches with the labels (an ignored label never matches)."""
    n, k, v = logits.shape
    p = torch.softmax(logits, dim=-1)  # (N, K, V)
    total, chains = logits.new_zeros(()), 0
    for r in range(n):
        if labels[r, 0] == -100:
            continue
        chains += 1
        for seq in itertools.product(range(v), repeat=k):
            prob = torch.stack([p[r, i, x] for i, x in enumerate(seq)]).prod()
            accepted = 0
            for i, x in enumerate(seq):
                if int(labels[r, i]) != x:
                    break
                accepted += 1
            total = total + prob * accepted
    return -total / max(chains, 1)


def test_value_and_gradient_match_brute_force():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 4, dtype=torch.float64)
    labels = torch.randint(0, 4, (4, 3))
    labels[1, 2] = -100
    labels[2, 1] = -100
    labels[3, 0] = -100
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    fast = expected_accept_loss(a, labels, chunk_rows=5)  # chunks that split chains
    ref = brute_force_loss(b, labels)
    assert fast.dtype == torch.float64
    assert torch.allclose(fast, ref, rtol=1e-12, atol=1e-12)
    fast.backward()
    ref.backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(a.grad[3], torch.zeros_like(a.grad[3]))  # an ignored slot 0: no gradient at all
    assert torch.equal(a.grad[1, 2], torch.zeros_like(a.grad[1, 2]))  # ignored slot: none either


def test_label_logprobs_chunked_matches_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(3, 2, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (3, 2))
    assert torch.autograd.gradcheck(lambda x: label_logprobs(x, labels, chunk_rows=4), (logits,))
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert torch.allclose(label_logprobs(logits, labels, chunk_rows=2), ref)
    bf = label_logprobs(logits.detach().bfloat16().requires_grad_(True), labels)
    assert bf.dtype == torch.float32


def test_ignored_label_ends_chain_and_perfect_draft_scores_minus_k():
    labels = torch.tensor([[1, 0, 2, 1], [2, 2, -100, 0]])
    perfect = 60.0 * torch.nn.functional.one_hot(labels.clamp_min(0), 3).double()  # q = 1 - 2e-26
    loss = expected_accept_loss(perfect, labels)
    # chain 0 accepts all 4 slots, chain 1 stops at its ignored slot 2 (its slot 3 counts for nothing)
    assert float(loss) == pytest.approx(-(4 + 2) / 2, abs=1e-12)
    assert float(expected_accept_loss(perfect[:1], labels[:1])) == pytest.approx(-4.0, abs=1e-12)
    # a miss at slot 0 (q = 0) makes the later, perfect slots worthless
    miss = perfect.clone()
    miss[0, 0] = 60.0 * torch.nn.functional.one_hot(torch.tensor(0), 3)
    assert float(expected_accept_loss(miss[:1], labels[:1])) == pytest.approx(0.0, abs=1e-12)


# ---- the families' training loss with train.loss=ce+lk -------------------------------------------------------
def _batch(draft_len: int = 3):
    torch.manual_seed(0)
    items = []
    for n in (20, 16):
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3 :] = 1
        items.append({"input_ids": torch.randint(5, 128, (n,)), "loss_mask": mask})
    return Collator(pad_id=0, draft_len=draft_len)(items)


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():  # non-trivial residual blocks and heads (some start at zero)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _check_family(model, loss_fn, batch, tout) -> None:
    """ce + 0 * lk is bit-for-bit ce; ce+lk adds lk_weight * the LK loss and changes the gradient."""
    ce, aux = loss_fn(model, batch, tout, {"draft_len": 3, "loss": "ce"})
    zero, _ = loss_fn(model, batch, tout, {"draft_len": 3, "loss": "ce+lk", "lk_weight": 0.0})
    both, _ = loss_fn(model, batch, tout, {"draft_len": 3, "loss": "ce+lk", "lk_weight": 0.5})
    assert torch.equal(ce, zero)
    assert torch.isfinite(both) and float(both.detach()) < float(ce.detach())  # -E[L] < 0 is added
    g_ce, g_both = _grads(model, ce), _grads(model, both)
    assert g_ce.shape == g_both.shape and not torch.allclose(g_ce, g_both)


def test_teacher_forced_families_ce_plus_lk():
    target = tiny_llama()
    batch = _batch()
    tout = forward_with_hidden(target, batch["input_ids"], attention_mask=batch["attention_mask"])
    redrafter = ReDrafter(ReDrafterConfig(base_hidden_size=32, vocab_size=128, draft_len=3, num_layers=1))
    medusa = Medusa(MedusaConfig(base_hidden_size=32, vocab_size=128, draft_len=3, num_layers=1))
    for model, fn in (
        (_perturbed(redrafter.attach_embeddings(target)), redrafter_loss),
        (_perturbed(medusa), medusa_loss),
    ):
        model = model.double().train()
        _check_family(model, fn, batch, tout)
        # the added term is exactly lk_weight * expected_accept_loss(logits, labels)
        ce, aux = fn(model, batch, tout, {"draft_len": 3})
        both, _ = fn(model, batch, tout, {"draft_len": 3, "loss": "ce+lk", "lk_weight": 0.5})
        lk = expected_accept_loss(aux["logits"], aux["targets"])
        torch.testing.assert_close(both - ce, 0.5 * lk)


EAGLE_SCHEMA = dict(draft_len=3, tree_total_tokens=10, tree_depth=3, tree_top_k=3)
FP = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}


def test_eagle_ce_plus_lk():
    target = tiny_llama()
    schema = SimpleNamespace(**EAGLE_SCHEMA, fc_bias=True, feature_weight=1.0, token_weight=0.1, noise=0.0)
    torch.manual_seed(1)
    head = eagle.build(schema, target, FP).double().train()
    batch = _batch()
    tout = forward_with_hidden(target, batch["input_ids"], attention_mask=batch["attention_mask"])
    _check_family(head, eagle.compute_loss, batch, tout)
    head.eval()  # eval returns every slot's logits: the added term is lk_weight * LK of that chain
    with torch.no_grad():
        ce, aux = eagle.compute_loss(head, batch, tout, {"draft_len": 3})
        both, aux_lk = eagle.compute_loss(head, batch, tout, {"draft_len": 3, "loss": "ce+lk"})
    b, t = eagle.select_positions(batch, {})
    torch.testing.assert_close(aux_lk["logits"], aux["logits"])
    torch.testing.assert_close(both - ce, expected_accept_loss(aux["logits"], chain_labels(batch, b, t, 3)))


@pytest.mark.parametrize("draft_vocab_size", [None, 64])
def test_eagle3_ce_plus_lk(draft_vocab_size):
    target = tiny_llama(num_layers=8)
    schema = SimpleNamespace(
        **EAGLE_SCHEMA, target_layers=None, draft_vocab_size=draft_vocab_size, ttt_decay=0.8
    )
    torch.manual_seed(2)
    counts = torch.rand(128, dtype=torch.float64)
    head = eagle3.build(schema, target, FP, token_counts=counts).double().train()
    batch = _batch()
    tout = forward_with_hidden(target, batch["input_ids"], layers=head.config.target_layers)
    _check_family(head, eagle3.compute_loss, batch, tout)
    if draft_vocab_size is None:  # full vocabulary: eval logits are the draft logits
        head.eval()
        with torch.no_grad():
            ce, aux = eagle3.compute_loss(head, batch, tout, {"draft_len": 3})
            both, _ = eagle3.compute_loss(head, batch, tout, {"draft_len": 3, "loss": "ce+lk"})
        b, t = eagle.select_positions(batch, {})
        lk = expected_accept_loss(aux["logits"], chain_labels(batch, b, t, 3))
        torch.testing.assert_close(both - ce, lk)


def test_chain_labels_end_where_the_text_leaves_the_labels():
    batch = _batch()
    b, t = eagle.select_positions(batch, {})
    base = chain_labels(batch, b, t, 3)
    assert torch.equal(base, batch["targets"][b, t, :3])  # labels are the text itself here
    batch["targets"][b[0], t[0], 0] += 1  # slot 0's label is no longer x_{t+2}: slot 1 was fed other text
    out = chain_labels(batch, b, t, 3)
    assert out[0].tolist() == [int(batch["targets"][b[0], t[0], 0]), -100, -100]


# ---- config ------------------------------------------------------------------------------------------------------
def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from specdraft.conf.schema import register_configs

    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_dir(
        config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"
    ):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("preset", ["redrafter_smollm2", "medusa_smollm2", "eagle_smollm2", "eagle3_smollm2"])
def test_config_accepts_lk(preset):
    validate_config(_compose(f"conf={preset}", "train.loss=ce+lk", "train.lk_weight=0.3"))


def test_config_rejects_a_negative_lk_weight():
    with pytest.raises(ValueError) as err:
        validate_config(_compose("conf=redrafter_smollm2", "train.lk_weight=-1"))
    assert "train.lk_weight=-1" in str(err.value) and "expected >= 0" in str(err.value)
    with pytest.raises(ValueError, match="train.loss=lk\\+ce: expected one of"):
        validate_config(_compose("conf=redrafter_smollm2", "train.loss=lk+ce"))
