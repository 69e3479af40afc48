"""Serving-engine exports: Medusa heads in vLLM's layout (`models/medusa_export.py`) compute what our heads
compute; gated EAGLE heads only without their gate; `scripts/export_engine.py` converts an export folder, refuses
bad input in one line and never overwrites a folder unasked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from specdraft.models import eagle_export, medusa
from specdraft.models.base_llm import target_fingerprint
from specdraft.models.eagle_export import export_engine_layout as export_eagle
from specdraft.models.hub import export_drafter
from specdraft.models.medusa_export import (
    check_engine_layout,
    engine_logits,
    export_engine_layout,
    read_engine_layout,
    required_tensors,
)
from specdraft.testing import jitter, load_script, tiny_llama, tiny_proposer, tiny_target, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _heads(vocab: int | None, layers: int = 1, root: bool = False, copy: int = 0) -> medusa.Medusa:
    """Random (non-identity) tiny Medusa heads: 3 heads, `layers` ResBlocks, a draft vocabulary of `vocab`, a copy
    gate of order `copy` (0: none)."""
    target = tiny_llama()
    fp = target_fingerprint(target, tiny_tokenizer())
    schema = OmegaConf.create(
        {"draft_len": 3, "num_layers": layers, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 4,
         "tree_choices": None, "root_token": root, "draft_vocab_size": vocab, "copy_ngram": copy}
    )  # fmt: skip
    counts = torch.rand(int(fp["vocab_size"]), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = medusa.build(schema, target, fp, token_counts=counts)
    return jitter(model.eval(), 0.05)


@pytest.mark.parametrize(("vocab", "layers"), [(None, 1), (48, 2)])
def test_vllm_layout_computes_our_heads(tmp_path, vocab, layers):
    """vLLM's Medusa math over the exported tensors (blocks, lm_heads, token_map scattered into the vocabulary)
    equals our heads' logits mapped to target ids, and -inf outside a truncated head's vocabulary."""
    model = _heads(vocab, layers)
    out = export_engine_layout(model, tmp_path / "engine", dtype="float32")
    cfg, tensors = read_engine_layout(out)
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"]) == (3, layers, True)
    assert set(tensors) == set(required_tensors(cfg)) and check_engine_layout(cfg, tensors) == []
    v = model.config.vocab_size
    assert ("token_map" in tensors) == (vocab is not None) and cfg["truncated_vocab_size"] == (vocab or v)
    hidden = torch.randn(5, model.config.base_hidden_size)
    ours = model.head_logits(hidden).float()  # (5, 3, Vd) over the draft vocabulary
    want = torch.full((5, 3, v), float("-inf"))
    want[:, :, model.draft_ids()] = ours
    got = engine_logits(cfg, tensors, hidden)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_what_the_vllm_layout_refuses(tmp_path):
    """Heads reading the root token or drafting through a copy gate have no vLLM counterpart: one clear error,
    nothing written; the checker names missing, misshapen and unexpected tensors and a token map outside the
    vocabulary."""
    with pytest.raises(ValueError, match="root_token=true.*root_token=false"):
        export_engine_layout(_heads(None, root=True), tmp_path / "e")
    with pytest.raises(ValueError, match="copy_ngram > 0.*copy_ngram=0"):
        export_engine_layout(_heads(None, copy=3), tmp_path / "e")
    assert not (tmp_path / "e").exists()
    model = _heads(48)
    cfg, tensors = read_engine_layout(export_engine_layout(model, tmp_path / "ok"))
    bad = dict(tensors)
    bad.pop("lm_heads.1.weight")
    bad["blocks.0.layers.0.weight"] = torch.zeros(3, 3)
    bad["extra"] = torch.zeros(1)
    bad["token_map"] = torch.full((48,), 10_000)
    errs = check_engine_layout(cfg, bad)
    assert any(e.startswith("missing lm_heads.1.weight") for e in errs)
    assert any(e.startswith("blocks.0.layers.0.weight: shape") for e in errs)
    assert "unexpected extra" in errs and any("token_map ids outside" in e for e in errs)
    assert check_engine_layout({**cfg, "model_type": "llama"}, tensors) == [
        "model_type 'llama' is not 'medusa'"
    ]


def test_a_gated_eagle_head_exports_only_without_its_gate(tmp_path):
    """Engines do not run the copy gate: a gated EAGLE-3 head is refused unless asked to drop it, then written
    without any copy_gate tensor (the engine checker passes)."""
    head = tiny_proposer("eagle3_copy", tiny_target()).drafter.float()
    with pytest.raises(ValueError, match="copy gate.*drop_copy_gate=True"):
        export_eagle(head, tmp_path / "e")
    assert not (tmp_path / "e").exists()
    cfg, tensors = eagle_export.read_engine_layout(export_eagle(head, tmp_path / "e", drop_copy_gate=True))
    assert eagle_export.check_engine_layout(cfg, tensors) == []
    assert tensors and not any(k.startswith("copy_gate.") for k in tensors)


def test_export_engine_cli(tmp_path, capsys):
    """scripts/export_engine.py: Medusa and EAGLE-3 folders converted (the vLLM option printed); a non-empty
    output refused unless --force, a ReDrafter and a missing folder refused in one line, exit status 2."""
    main = load_script(ROOT / "scripts" / "export_engine.py").main
    med = export_drafter(_heads(48), tmp_path / "medusa")
    assert main([str(med), str(tmp_path / "m_engine")]) == 0
    out = capsys.readouterr().out
    assert '"method": "medusa"' in out and '"num_speculative_tokens": 3' in out
    assert (tmp_path / "m_engine" / "model.safetensors").is_file()
    keep = tmp_path / "busy"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    assert main([str(med), str(keep)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err and (keep / "notes.txt").read_text() == "mine"
    assert main([str(med), str(keep), "--force", "--dtype", "bfloat16"]) == 0
    assert (
        not (keep / "notes.txt").exists()
        and read_engine_layout(keep)[1]["lm_heads.0.weight"].dtype == torch.bfloat16
    )
    target = tiny_target()
    e3 = export_drafter(tiny_proposer("eagle3", target).drafter.float(), tmp_path / "eagle3")
    assert main([str(e3), str(tmp_path / "e_engine")]) == 0
    assert '"method": "eagle3"' in capsys.readouterr().out
    gated = export_drafter(tiny_proposer("eagle3_copy", target).drafter.float(), tmp_path / "gated")
    assert main([str(gated), str(tmp_path / "g_engine")]) == 2
    assert "--drop-copy-gate" in capsys.readouterr().err and not (tmp_path / "g_engine").exists()
    assert main([str(gated), str(tmp_path / "g_engine"), "--drop-copy-gate"]) == 0
    red = export_drafter(tiny_proposer("redrafter", target)._search.float(), tmp_path / "red")
    assert main([str(red), str(tmp_path / "r_engine")]) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("export_engine:")]  # (besides progress bars)
    assert len(ours) == 1 and "redrafter drafter" in ours[0]
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
