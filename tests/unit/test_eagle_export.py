"""Engine-layout export of EAGLE / EAGLE-3 heads: required keys and shapes, config keys, round trip."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specdraft.models import eagle, eagle3
from specdraft.models.eagle_export import (
    check_engine_layout,
    export_engine_layout,
    export_from_folder,
    import_engine_layout,
    required_tensors,
)
from specdraft.testing import tiny_llama

FP = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}
SCHEMA = SimpleNamespace(
    draft_len=3,
    tree_total_tokens=10,
    tree_depth=3,
    tree_top_k=3,
    fc_bias=True,
    feature_weight=1.0,
    token_weight=0.1,
    noise=0.0,
    target_layers=None,
    draft_vocab_size=64,
    ttt_decay=0.8,
)
# What the public checkpoints hold (yuhuili/EAGLE-Vicuna-7B-v1.3, yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), per layer kind.
EAGLE1_KEYS = (
    {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight"}
    | {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    | {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
)
EAGLE3_KEYS = (
    {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.post_attention_layernorm.weight",
    }
    | {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"}
    | {f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
)


def _heads():
    target = tiny_llama(num_layers=8)
    torch.manual_seed(0)
    return (
        target,
        eagle.build(SimpleNamespace(**{**vars(SCHEMA), "draft_vocab_size": None}), target, FP),
        eagle3.build(SCHEMA, target, FP, token_counts=torch.rand(128)),
    )


def test_engine_layout_keys_shapes_and_config(tmp_path):
    target, e1, e3 = _heads()
    for head, keys, arch in (
        (e1, EAGLE1_KEYS, "LlamaForCausalLM"),
        (e3, EAGLE3_KEYS, "LlamaForCausalLMEagle3"),
    ):
        out = export_engine_layout(head, tmp_path / arch)
        cfg = json.loads((out / "config.json").read_text())
        tensors = load_file(str(out / "model.safetensors"))
        assert set(tensors) == keys and check_engine_layout(cfg, tensors) == []
        assert (
            cfg["architectures"] == [arch] and cfg["num_hidden_layers"] == 1 and cfg["model_type"] == "llama"
        )
        assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_key_value_heads"]) == (32, 128, 2)
        assert cfg["torch_dtype"] == "float16" and tensors["fc.weight"].dtype == torch.float16
        assert not cfg["tie_word_embeddings"]
    assert tensors["fc.weight"].shape == (32, 96) and tensors["midlayer.self_attn.q_proj.weight"].shape == (
        32,
        64,
    )
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (16, 64)  # GQA: 2 kv heads of 8
    assert cfg["draft_vocab_size"] == 64 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        4,
        5,
    ]
    assert (
        tensors["d2t"].dtype == torch.int64
        and tensors["t2d"].dtype == torch.bool
        and int(tensors["t2d"].sum()) == 64
    )
    assert torch.equal(tensors["d2t"] + torch.arange(64), e3.draft_ids())


def test_check_engine_layout_flags_problems():
    cfg = {
        "hidden_size": 32,
        "vocab_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "architectures": ["LlamaForCausalLM"],
        "bias": True,
    }
    tensors = {k: torch.zeros(s) for k, s in required_tensors(cfg).items()}
    assert check_engine_layout(cfg, tensors) == []
    tensors["fc.weight"] = torch.zeros(32, 32)
    del tensors["layers.0.mlp.up_proj.weight"]
    tensors["layers.0.input_layernorm.weight"] = torch.zeros(32)
    errs = check_engine_layout(cfg, tensors)
    assert any("missing layers.0.mlp.up_proj" in e for e in errs)
    assert any("fc.weight: shape" in e for e in errs) and any(
        "unexpected layers.0.input_layernorm" in e for e in errs
    )


def test_round_trip_through_engine_layout_and_hf_folder(tmp_path):
    from specdraft.models.hub import export_drafter

    target, e1, e3 = _heads()
    ids = torch.randint(0, 128, (1, 8))
    for head, width in ((e1, 32), (e3, 96)):
        feats = torch.randn(1, 6, width)
        out = export_engine_layout(head, tmp_path / head.config.architecture, dtype="float32", target=target)
        assert "embed_tokens.weight" in load_file(str(out / "model.safetensors"))  # optional, on request
        back = import_engine_layout(out, target, FP)
        assert type(back) is type(head)
        torch.testing.assert_close(back(feats, ids, steps=3), head(feats, ids, steps=3))
        torch.testing.assert_close(back.draft_logits(torch.ones(32)), head.draft_logits(torch.ones(32)))
        export_drafter(head, tmp_path / "hf", {})  # our HF folder -> engine layout without the target
        again = export_from_folder(tmp_path / "hf", tmp_path / "engine2", dtype="float32")
        assert set(load_file(str(again / "model.safetensors"))) == set(head.state_dict())
    with pytest.raises(ValueError, match="dtype"):
        export_engine_layout(e1, tmp_path / "x", dtype="int8")
