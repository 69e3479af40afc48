"""Medusa heads: forward vs a naive loop, the original Medusa loss offsets, golden losses, init, export."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from specdraft.data.collate import Collator
from specdraft.models.hub import export_drafter, load_drafter
from specdraft.models.medusa import Medusa, MedusaConfig, build, compute_loss
from specdraft.models.medusa_loss import head_weights
from specdraft.models.registry import get_family
from specdraft.testing import tiny_llama

H, V, K = 16, 11, 3


def make_medusa(num_layers: int = 2, heads: int = K) -> Medusa:
    torch.manual_seed(1)
    model = Medusa(
        MedusaConfig(base_hidden_size=H, vocab_size=V, draft_len=heads, num_layers=num_layers)
    ).double()
    with torch.no_grad():  # non-trivial ResBlocks (they start as the identity)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def naive_head(model: Medusa, k: int, h: torch.Tensor) -> torch.Tensor:
    """Head k on one state h (H,), written out from the paper: x <- x + SiLU(W x + b) per layer, then W_k x."""
    p = dict(model.named_parameters())
    x = h.double()
    for i in range(model.config.num_layers):
        x = x + F.silu(p[f"heads.{k}.{i}.linear.weight"] @ x + p[f"heads.{k}.{i}.linear.bias"])
    return p[f"heads.{k}.{model.config.num_layers}.weight"] @ x  # (V,)


class Out:
    """A stand-in `TargetOutput` carrying only hidden states."""

    def __init__(self, hidden: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        self.hidden, self.logits = hidden, logits


@pytest.mark.parametrize("num_layers", [0, 1, 2])
def test_forward_matches_naive_heads(num_layers):
    model = make_medusa(num_layers)
    hidden = torch.randn(2, 5, H, dtype=torch.float64)
    logits = model(hidden, torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, K, dtype=torch.long))
    assert logits.shape == (2, 5, K, V)
    for b in range(2):
        for t in range(5):
            for k in range(K):
                torch.testing.assert_close(logits[b, t, k], naive_head(model, k, hidden[b, t]))
    assert model(hidden, None, torch.zeros(2, 5, 2, dtype=torch.long)).shape == (2, 5, 2, V)  # first D heads
    with pytest.raises(ValueError, match="3 heads"):
        model.head_logits(hidden, 4)
    assert torch.equal(model.topk_tokens(hidden[0, 0], 4), logits[0, 0].topk(4, -1).indices)


def test_loss_matches_original_medusa_shifted_ce():
    """Medusa's training code: head i's logits[:, :-(2+i)] against labels[:, 2+i:], weighted 0.8**i."""
    model = make_medusa(1).float()
    torch.manual_seed(3)
    rows = []
    for n in (9, 6):
        ids = torch.randint(0, V, (n,))
        mask = torch.ones(n, dtype=torch.long)
        mask[0] = 0  # the "prompt": position t trains iff x_{t+1} is an assistant token
        rows.append({"input_ids": ids, "loss_mask": mask})
    batch = Collator(pad_id=0, draft_len=K)(rows)
    hidden = torch.randn(2, 9, H)
    loss, aux = compute_loss(model, batch, Out(hidden), {"draft_len": K})
    assert aux["logits"].shape[1:] == (K, V)
    ref = 0.0
    with torch.no_grad():
        all_logits = model(hidden)  # (B, L, K, V)
    for i in range(K):
        lg, lb = [], []
        for b, row in enumerate(rows):
            n = row["input_ids"].shape[0]
            labels = torch.where(row["loss_mask"].bool(), row["input_ids"], -100)
            lg.append(all_logits[b, : n - (2 + i), i])
            lb.append(labels[2 + i :])
        ref += 0.8**i * F.cross_entropy(torch.cat(lg), torch.cat(lb), ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert all(head[-1].weight.grad is not None for head in model.heads)


def test_offsets_label_k_is_token_t_plus_2_plus_k():
    ids = torch.tensor([3, 1, 4, 10, 5, 9, 2, 6, 0, 7])
    batch = Collator(pad_id=0, draft_len=K)(
        [{"input_ids": ids, "loss_mask": torch.ones(10, dtype=torch.long)}]
    )
    _, aux = compute_loss(make_medusa(1).float(), batch, Out(torch.randn(1, 10, H)), {})
    t = torch.arange(aux["targets"].shape[0])  # every position trains, in order
    for k in range(K):
        ok = t + 2 + k < 10
        assert aux["targets"][ok, k].tolist() == ids[t[ok] + 2 + k].tolist()
        assert (aux["targets"][~ok, k] == -100).all()


def golden_model() -> Medusa:
    """No ResBlocks, V = H = 3, head k = diag(v_k): on h = ones the logits are exactly v_k."""
    model = Medusa(MedusaConfig(base_hidden_size=3, vocab_size=3, draft_len=2, num_layers=0))
    with torch.no_grad():
        model.heads[0][0].weight.copy_(torch.diag(torch.tensor([0.0, math.log(2), 0.0])))  # p = 1/4, 1/2, 1/4
        model.heads[1][0].weight.copy_(torch.diag(torch.tensor([math.log(3), 0.0, 0.0])))  # p = 3/5, 1/5, 1/5
    return model


def golden_batch() -> dict[str, torch.Tensor]:
    return {
        "root": torch.tensor([[0]]),
        "targets": torch.tensor([[[1, 2]]]),
        "pos_mask": torch.tensor([[True]]),
    }


def test_loss_golden_values():
    out = Out(torch.ones(1, 1, 3))
    loss, _ = compute_loss(golden_model(), golden_batch(), out, {})
    assert float(loss.detach()) == pytest.approx(math.log(2) + 0.8 * math.log(5), abs=1e-6)  # 1.980697
    assert float(loss.detach()) == pytest.approx(1.980697, abs=1e-6)
    model = golden_model()
    model.config.loss_decay = 0.5
    assert float(compute_loss(model, golden_batch(), out, {})[0].detach()) == pytest.approx(
        math.log(2) + 0.5 * math.log(5)
    )
    loss, _ = compute_loss(golden_model(), golden_batch(), out, {"slot_weights": [0.0, 1.0]})  # explicit wins
    assert float(loss.detach()) == pytest.approx(math.log(5), abs=1e-6)
    torch.testing.assert_close(head_weights(0.8, 3), torch.tensor([1.0, 0.8, 0.64]))


def test_soft_target_loss():
    """KL to cached teacher top-k: 0 when the teacher is the drafter, the closed form otherwise."""
    batch = {
        **golden_batch(),
        "root": torch.tensor([[0, 0, 0]]),
        "pos_mask": torch.tensor([[True, False, False]]),
    }
    batch["targets"] = torch.tensor([[[1, 2], [2, -100], [-100, -100]]])
    logq = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.6, 0.2, 0.2]]))  # slot 0 and slot 1 of the drafter
    ids = torch.tensor([0, 1, 2]).expand(1, 3, 3)
    same = {**batch, "topk_ids": ids, "topk_logprobs": torch.stack([logq[0], logq[0], logq[1]])[None]}
    loss, _ = compute_loss(golden_model(), same, Out(torch.ones(1, 3, 3)), {"loss": "kl"})
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    teacher = torch.log(torch.tensor([[1 / 3] * 3] * 3))[None]  # uniform teacher at every position
    loss, _ = compute_loss(
        golden_model(), {**same, "topk_logprobs": teacher}, Out(torch.ones(1, 3, 3)), {"loss": "kl"}
    )
    kl = lambda q: float((torch.log(torch.tensor(1 / 3)) - q).mean())  # noqa: E731  KL(u || q)
    assert float(loss.detach()) == pytest.approx(kl(logq[0]) + 0.8 * kl(logq[1]), abs=1e-6)

    # With the row's tokens: the teacher at t+1+k counts only while x_{t+1..t+1+k} = (root, targets[:k]).
    # Slot 0 is fed root=0 and slot 1 also targets[0]=1; the teacher saw input_ids[1] and input_ids[2].
    uniform = {**same, "topk_logprobs": teacher}

    def kl_loss(ids: list[int]) -> float:
        batch = {**uniform, "input_ids": torch.tensor([ids])}
        return float(
            compute_loss(golden_model(), batch, Out(torch.ones(1, 3, 3)), {"loss": "kl"})[0].detach()
        )

    assert kl_loss([2, 0, 1]) == pytest.approx(kl(logq[0]) + 0.8 * kl(logq[1]), abs=1e-6)  # on the chain
    assert kl_loss([2, 0, 2]) == pytest.approx(kl(logq[0]), abs=1e-6)  # leaves it after the root
    assert kl_loss([2, 1, 1]) == pytest.approx(0.0, abs=1e-9)  # the text never followed the chain


def test_build_init_from_lm_head_and_registry():
    target = tiny_llama(vocab_size=V, hidden_size=H, num_heads=2, num_kv_heads=1, num_layers=1)
    schema = OmegaConf.create(
        {"draft_len": K, "num_layers": 1, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 5,
         "tree_choices": [[0], [1], [0, 0]]}
    )  # fmt: skip
    fp = {"name_or_path": "tiny", "hidden_size": H, "vocab_size": V, "tokenizer_hash": "abc"}
    model = get_family("medusa").build(schema, target, fp)
    h = torch.randn(4, H)
    ref = target.get_output_embeddings()(h)  # every head starts as the target's LM head
    for k in range(K):
        torch.testing.assert_close(model.head_logits(h)[:, k], ref)
    assert model.config.tree_choices == [[0], [1], [0, 0]] and model.config.architecture == "medusa"
    assert (
        build(OmegaConf.merge(schema, {"init_from_lm_head": False}), target, fp).heads[0][-1].weight.std()
        < 0.1
    )


def test_export_round_trip(tmp_path):
    target = tiny_llama(vocab_size=V, hidden_size=H, num_heads=2, num_kv_heads=1, num_layers=1)
    model = make_medusa(1).float()
    model.config.update(
        {"base_model_name_or_path": "tiny", "tokenizer_hash": "abc", "tree_choices": [[0], [0, 1]]}
    )
    out = export_drafter(model, tmp_path / "export", {"steps": 3, "final_eval": {"eval/loss": 1.5}})
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    loaded = load_drafter(str(out), target=target, fingerprint={"tokenizer_hash": "abc"})
    assert isinstance(loaded, Medusa) and not loaded.training
    assert loaded.config.tree_choices == [[0], [0, 1]] and loaded.config.training_summary["steps"] == 3
    h = torch.randn(3, H)
    torch.testing.assert_close(loaded.head_logits(h), model.head_logits(h))
    with pytest.raises(ValueError, match="tokenizer_hash"):
        load_drafter(str(out), target=target, fingerprint={"tokenizer_hash": "other"})
