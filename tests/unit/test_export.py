"""Export round trip (identical logits), registry dispatch and the target-mismatch guard."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from specdraft.models import redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.models.hub import check_target_match, export_drafter, load_drafter
from specdraft.models.registry import DRAFTERS, get_family
from specdraft.testing import tiny_llama

SCHEMA = {
    "draft_len": 3,
    "num_layers": 2,
    "rnn": True,
    "share_embeddings": True,
    "beam_width": 4,
    "init_from_lm_head": True,
}


def _trained_like(model: torch.nn.Module) -> None:
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))


@pytest.mark.parametrize("share", [True, False])
def test_export_round_trip_identical_logits(tmp_path, tiny_llama, tiny_tokenizer, share):
    fp = target_fingerprint(tiny_llama, tiny_tokenizer)
    model = redrafter.build(OmegaConf.create({**SCHEMA, "share_embeddings": share}), tiny_llama, fp)
    _trained_like(model)
    out = export_drafter(model, tmp_path / "export", {"steps": 7, "final_eval": {"eval/acc1_s0": 0.5}})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "redrafter" and cfg["format_version"] == redrafter.FORMAT_VERSION
    assert (
        cfg["base_model_name_or_path"] == fp["name_or_path"] and cfg["tokenizer_hash"] == fp["tokenizer_hash"]
    )
    assert cfg["training_summary"]["steps"] == 7
    assert "eval/acc1_s0" in (out / "README.md").read_text()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any("model.layers" in k or "lm_head" in k for k in keys)  # never the target's weights
    assert ("embed.weight" in keys) == (not share)

    loaded = load_drafter(str(out), target=tiny_llama, fingerprint=fp)
    assert type(loaded) is DRAFTERS["redrafter"]
    torch.manual_seed(4)
    hidden, root, targets = (
        torch.randn(2, 5, 32),
        torch.randint(0, 128, (2, 5)),
        torch.randint(0, 128, (2, 5, 3)),
    )
    model.eval()
    torch.testing.assert_close(loaded(hidden, root, targets), model(hidden, root, targets), rtol=0, atol=0)
    b1, s1 = model.beam_search(hidden[0, 0], 5, 4, 3)
    b2, s2 = loaded.beam_search(hidden[0, 0], 5, 4, 3)
    # same beams; scores to fp32 rounding (a one-row matmul may take an alignment-dependent kernel path)
    assert torch.equal(b1, b2)
    torch.testing.assert_close(s1, s2, rtol=0, atol=1e-6)


def test_loaded_without_target_needs_embeddings(tmp_path, tiny_llama, tiny_tokenizer):
    model = redrafter.build(
        OmegaConf.create(SCHEMA), tiny_llama, target_fingerprint(tiny_llama, tiny_tokenizer)
    )
    export_drafter(model, tmp_path / "e")
    loaded = load_drafter(str(tmp_path / "e"))
    with pytest.raises(RuntimeError, match="attach_embeddings"):
        loaded(torch.randn(1, 1, 32), torch.tensor([[1]]), torch.tensor([[[1, 2, 3]]]))


def test_mismatched_target_is_refused(tmp_path, tiny_llama, tiny_tokenizer):
    fp = target_fingerprint(tiny_llama, tiny_tokenizer)
    export_drafter(redrafter.build(OmegaConf.create(SCHEMA), tiny_llama, fp), tmp_path / "e")
    other = tiny_llama_with_vocab(100)
    with pytest.raises(ValueError, match=r"vocab_size: 128 \(artifact\) != 100 \(target\)"):
        load_drafter(str(tmp_path / "e"), target=other)
    with pytest.raises(ValueError, match="tokenizer_hash"):
        load_drafter(str(tmp_path / "e"), target=tiny_llama, fingerprint={**fp, "tokenizer_hash": "deadbeef"})


def tiny_llama_with_vocab(v: int):
    return tiny_llama(vocab_size=v)


def test_dataset_manifest_guard_names_fields():
    found = {"name_or_path": "a/b", "hidden_size": 64, "vocab_size": 128, "tokenizer_hash": "x"}
    check_target_match(found, dict(found), "dataset d")  # same target: fine
    with pytest.raises(
        ValueError, match=r"dataset d was made for a different target \(a/b\).*hidden_size: 64"
    ):
        check_target_match(found, {**found, "hidden_size": 32, "name_or_path": "c/d"}, "dataset d")


def test_registry_unknown_family():
    assert get_family("redrafter").MODEL is redrafter.ReDrafter
    with pytest.raises(ValueError, match="unknown drafter family 'nope'"):
        get_family("nope")


def test_load_refuses_non_drafter(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no `architecture`"):
        load_drafter(str(tmp_path / "x"))


def test_push_to_hub_uses_hf_token_and_never_logs_it(tmp_path, monkeypatch, caplog):
    import huggingface_hub

    from specdraft.models.hub import push_to_hub

    calls = []

    class FakeApi:
        def __init__(self, token):
            calls.append(("init", token))

        def create_repo(self, repo_id, private, exist_ok):
            calls.append(("create", repo_id))

        def upload_folder(self, folder_path, repo_id, commit_message):
            calls.append(("upload", folder_path, repo_id))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="HF_TOKEN"):
        push_to_hub(tmp_path, "me/drafter")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    with caplog.at_level("DEBUG"):
        url = push_to_hub(tmp_path, "me/drafter")
    assert url.endswith("me/drafter") and calls[0] == ("init", "hf_secret_value")
    assert ("upload", str(tmp_path), "me/drafter") in calls
    assert "hf_secret_value" not in caplog.text
