"""EAGLE-3 options: training-time-test depth 1..7 (loss, gradients, decode-consistent unroll, config range)
and the EAGLE-3.1 normalisation (`norm_fused`): unit-RMS fused chunks, off = EAGLE-3 unchanged, export round
trips, lossless greedy decoding. Everything runs on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from safetensors.torch import load_file
from transformers import DynamicCache

from specdraft.conf.schema import register_configs
from specdraft.conf.validate import validate_config
from specdraft.data.chat import prompt_ids
from specdraft.data.collate import Collator
from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.proposers import make_proposer
from specdraft.models import eagle3
from specdraft.models.base_llm import forward_with_hidden
from specdraft.models.eagle_common import next_tokens
from specdraft.models.eagle_export import check_engine_layout, export_engine_layout, import_engine_layout
from specdraft.models.hub import export_drafter, load_drafter
from specdraft.testing import tiny_llama, tiny_tokenizer

CPU = torch.device("cpu")
CONF = Path(__file__).resolve().parents[2] / "conf"
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


@pytest.fixture(scope="module")
def target64():
    """8-layer tiny Llama in fp64 (fused layers 2, 4, 5)."""
    return tiny_llama(num_layers=8, dtype=torch.float64).to(CPU)


def build(target, dtype=torch.float64, counts=None, **over):
    torch.manual_seed(2)
    schema = SimpleNamespace(**{**SCHEMA, **over})
    return eagle3.build(schema, target, FP, token_counts=counts).to(CPU, dtype).eval()


def fused_inputs(target, head, length: int = 12, steps: int = 3):
    """(1, L, 3H) fused target layers of a random sequence and its (1, L + steps - 1) next tokens."""
    ids = torch.randint(5, 128, (1, length), generator=torch.Generator().manual_seed(0))
    tout = forward_with_hidden(target, ids, layers=head.config.target_layers)
    return tout.layers.flatten(2), next_tokens(ids, steps)


def naive_chain(head, fused, tokens, t: int, chain: int):
    """Decode-time path: commit positions 0..t one by one, then `chain` steps on the head's own outputs."""
    cache, n, out = DynamicCache(), 0, None
    for j in range(t + 1):
        n += 1
        g = head.encode_target(fused[:, j : j + 1])
        out = head.step(
            g, tokens[:, j : j + 1], cache, torch.tensor([[j]]), torch.ones(1, n, dtype=torch.bool)
        )
    for i in range(1, chain + 1):
        n += 1
        pos, mask = torch.tensor([[t + i]]), torch.ones(1, n, dtype=torch.bool)
        out = head.step(out, tokens[:, t + i : t + i + 1], cache, pos, mask)
    return out[0, 0]  # (H,)


def rms(x):
    return x.pow(2).mean(-1).sqrt()


# ---- training-time-test depth ------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", range(1, 8))
def test_every_ttt_depth_trains_with_decayed_step_losses(depth):
    target = tiny_llama(num_layers=8).to(CPU)
    head = build(target, torch.float32, draft_len=depth, ttt_decay=0.5).train()
    items = [{"input_ids": torch.randint(5, 128, (24,)), "loss_mask": torch.tensor([0] * 4 + [1] * 20)}]
    batch = Collator(pad_id=0, draft_len=depth)(items)
    tout = forward_with_hidden(target, batch["input_ids"], layers=head.config.target_layers)
    loss, aux = eagle3.compute_loss(head, batch, tout)  # depth from the config (drafter.draft_len)
    steps = aux["step_losses"]
    assert steps.shape == (depth,) and bool(torch.isfinite(loss)) and bool((steps > 0).all())
    torch.testing.assert_close(loss.detach(), (0.5 ** torch.arange(depth) * steps).sum())
    loss.backward()
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    for p in (head.midlayer.self_attn.q_proj.weight, head.midlayer.mlp.down_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    head.eval()  # evaluation scores every unrolled slot
    with torch.no_grad():
        _, aux = eagle3.compute_loss(head, batch, tout)
    assert aux["logits"].shape[1:] == (depth, 128) and aux["targets"].shape[1] == depth


@pytest.mark.parametrize("norm_fused", [False, True])
def test_depth_7_unroll_matches_step_by_step_decoding(target64, norm_fused):
    """Step i of the unroll attends to the step-0 prefix and its own steps 1..i, exactly as decoding does."""
    head = build(target64, draft_len=7, norm_fused=norm_fused)
    fused, nxt = fused_inputs(target64, head, length=10, steps=7)
    outs = head(fused, nxt, steps=7)  # (1, 10, 7, H)
    assert outs.shape == (1, 10, 7, 32)
    for t, i in ((0, 6), (3, 6), (5, 2), (9, 0)):
        torch.testing.assert_close(outs[0, t, i], naive_chain(head, fused, nxt, t, i), rtol=1e-9, atol=1e-9)


def _compose(*overrides: str):
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_validate_allows_ttt_depth_1_to_7_only():
    for ok in ("drafter.draft_len=1", "drafter.draft_len=7", "drafter.norm_fused=true"):
        validate_config(_compose("conf=eagle3_smollm2", ok))
    for bad in (0, 8):
        with pytest.raises(ValueError) as err:
            validate_config(_compose("conf=eagle3_smollm2", f"drafter.draft_len={bad}"))
        assert str(err.value).startswith(
            f"drafter.draft_len={bad}: expected an integer in [1, 7] (training-time-test unroll steps)"
        )
    validate_config(_compose("conf=redrafter_smollm2", "drafter.draft_len=8"))  # other families: no cap


# ---- EAGLE-3.1 normalisation -------------------------------------------------------------------------------
def test_norm_fused_normalises_each_fused_layer_and_the_fed_back_state(target64):
    head = build(target64, norm_fused=True)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(head.state_dict())
    seen = []
    head.fc.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    feats = torch.randn(2, 5, 96, dtype=torch.float64) * torch.tensor([30.0, 1.0, 0.1]).repeat_interleave(32)
    head.encode_target(feats)
    chunks = seen[0].unflatten(-1, (3, 32))  # (2, 5, 3, H): what fc reads
    torch.testing.assert_close(rms(chunks), torch.ones(2, 5, 3, dtype=torch.float64), rtol=1e-3, atol=1e-3)
    # every unroll step's output (fed back as the next g, read by lm_head as is) is the post-norm state
    fused, nxt = fused_inputs(target64, head)
    outs = head(fused, nxt, steps=3)  # (1, 12, 3, H)
    torch.testing.assert_close(rms(outs), torch.ones(1, 12, 3, dtype=torch.float64), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(head.draft_logits(outs), head.lm_head(outs))
    pre, lin = head.draft_head()  # the int8 drafting path sees the same logits
    torch.testing.assert_close(lin(pre(outs)), head.draft_logits(outs))
    # off: fc reads the raw concatenation
    seen.clear()
    off = build(target64)
    off.fc.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    off.encode_target(feats)
    assert torch.equal(seen[0], feats) and off.fc_norm is None


def test_norm_fused_off_is_eagle3_unchanged(target64):
    off, legacy, on = build(target64, norm_fused=False), build(target64), build(target64, norm_fused=True)
    shared = off.state_dict()
    assert (
        set(shared)
        == set(legacy.state_dict())
        == set(on.state_dict()) - {f"fc_norm.{i}.weight" for i in range(3)}
    )
    for name, w in shared.items():  # same seed, same EAGLE-3 weights, option on or off
        assert torch.equal(w, legacy.state_dict()[name]) and torch.equal(w, on.state_dict()[name]), name
    fused, nxt = fused_inputs(target64, off)
    outs = off(fused, nxt, steps=3)
    assert torch.equal(outs, legacy(fused, nxt, steps=3))
    # golden values of EAGLE-3 before the option existed (same seed, same weights)
    logits = off.draft_logits(outs)
    torch.testing.assert_close(outs.sum().item(), 2.9091052541094826, rtol=1e-9, atol=0)
    torch.testing.assert_close(outs.abs().sum().item(), 22.745525517236153, rtol=1e-9, atol=0)
    torch.testing.assert_close(logits.sum().item(), 499.06759917948807, rtol=1e-9, atol=0)
    assert not torch.allclose(on(fused, nxt, steps=3), outs)  # the option does change the head


def test_norm_fused_survives_export_and_engine_layout(target64, tmp_path):
    head = build(target64, norm_fused=True)
    with torch.no_grad():  # trained-looking norm weights, so a lost tensor or flag shows
        for i, norm in enumerate(head.fc_norm):
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
    fused, nxt = fused_inputs(target64, head)
    ref = head(fused, nxt, steps=3)
    export_drafter(head, tmp_path / "hf", {})
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["norm_fused"] is True
    back = load_drafter(str(tmp_path / "hf"), target=target64).to(torch.float64)
    assert back.config.norm_fused and back.fc_norm is not None
    torch.testing.assert_close(back(fused, nxt, steps=3), ref, rtol=1e-5, atol=1e-5)  # loads in fp32

    out = export_engine_layout(head, tmp_path / "engine", dtype="float32")
    cfg, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and check_engine_layout(cfg, tensors) == []
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
    imported = import_engine_layout(out, target64, FP).to(torch.float64)
    assert imported.config.norm_fused
    torch.testing.assert_close(imported(fused, nxt, steps=3), ref, rtol=1e-5, atol=1e-5)  # fp32 weights
    plain = export_engine_layout(build(target64), tmp_path / "plain", dtype="float32")
    assert "fc_norm" not in json.loads((plain / "config.json").read_text())
    cfg["norm_output"] = False  # one of the two EAGLE-3.1 normalisations alone: not this head
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="fc_norm=True with norm_output=False"):
        import_engine_layout(out, target64, FP)


def test_norm_fused_greedy_decoding_is_lossless(target64):
    head = build(target64, norm_fused=True)
    tok = tiny_tokenizer()
    prompt = prompt_ids(tok, [{"role": "user", "content": "alpha beta gamma"}])
    ref, _ = ar_generate(target64, tok, prompt, 24, stop_ids=set())
    out, _ = speculative_generate(
        target64, tok, prompt, make_proposer(head, tree_nodes=10), 24, stop_ids=set()
    )
    assert out == ref and len(out) == 24
