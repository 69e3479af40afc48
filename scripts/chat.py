"""Load a target (default: the embedded SmolLM2-135M), print its config and answer one chat prompt.

python scripts/chat.py "What is the capital of France?" [--model smollm2-135m] [--dtype auto]
"""

from __future__ import annotations

import argparse
import time

import torch

from specdraft.conf.schema import BaseModelConfig
from specdraft.data.chat import prompt_ids, stop_token_ids
from specdraft.models.base_llm import load_target, target_fingerprint


def main() -> None:
    """Parse arguments, load the target, greedy-generate an answer."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default="What is the capital of France?")
    p.add_argument("--model", default="smollm2-135m", help="embedded alias, Hub id, HF folder or .gguf file")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto | fp32 | bf16 | fp16 (auto: bf16 where native, but fp32 where the panel kernels decode)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    t0 = time.perf_counter()
    model, tok = load_target(BaseModelConfig(name_or_path=a.model, dtype=a.dtype, device=a.device))
    c = model.config
    print(
        f"loaded in {time.perf_counter() - t0:.1f}s: {type(model).__name__} hidden={c.hidden_size} "
        f"layers={c.num_hidden_layers} heads={c.num_attention_heads} kv_heads={c.num_key_value_heads} "
        f"vocab={c.vocab_size} dtype={model.dtype}"
    )
    print("fingerprint:", target_fingerprint(model, tok))
    ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": a.prompt}])], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=a.max_new_tokens,
            do_sample=False,
            eos_token_id=stop_token_ids(tok),
            pad_token_id=tok.pad_token_id,
        )
    print(f"user: {a.prompt}\nassistant: {tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)}")


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
