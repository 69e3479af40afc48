"""Throughput of distill's batched generation vs a one-prompt-at-a-time `model.generate` loop.

Same process, same prompts (first user turns of ShareGPT, chat-templated), same dtype, greedy, same
`max_new_tokens` and stop tokens; both paths get a warm-up. Prints a table, the ratio, and a JSON line.

    python scripts/bench_distill.py                       # SmolLM2-135M bf16 CPU, 32 prompts x 64 tokens
    python scripts/bench_distill.py --num-prompts 16 --max-new-tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tabulate import tabulate

from specdraft.conf.schema import BaseModelConfig
from specdraft.data.chat import prompt_ids
from specdraft.data.conversations import load_conversations
from specdraft.distill.generate import GenerationSettings, generate_batched, stop_token_ids
from specdraft.models.base_llm import load_target
from specdraft.models.linear_layout import apply_layout


def first_turn_prompts(tokenizer, n: int, max_prompt_len: int, source: str) -> list[list[int]]:
    """Chat-templated first user turns of `source` with at most `max_prompt_len` tokens."""
    convs, _ = load_conversations(source, limit=20 * n)
    out = []
    for c in convs:
        first = next(i for i, m in enumerate(c.messages) if m["role"] == "assistant")
        ids = prompt_ids(tokenizer, c.messages[:first])
        if len(ids) <= max_prompt_len:
            out.append(ids)
        if len(out) == n:
            break
    return out


def run_sequential(
    model, prompts: list[list[int]], max_new: int, stop: tuple[int, ...], pad: int
) -> list[list[int]]:
    """Greedy `model.generate`, one prompt at a time; returns the generated ids per prompt."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=list(stop),
            pad_token_id=pad,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


def main() -> None:
    """Parse arguments, time both paths, print the ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="auto | fp32 | bf16 | fp16 (auto: bf16 where native, but fp32 where the panel kernels decode)",
    )
    ap.add_argument(
        "--layout",
        default="auto",
        help="target Linear weights, as distill.linear_layout (both paths run on them; native: as loaded)",
    )
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--source", default="sharegpt", help="conversations for the prompts")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--no-refill", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_target(BaseModelConfig(name_or_path=a.model, dtype=a.dtype, device=a.device))
    layout = apply_layout(model, a.layout)  # as distill.py lays the target out
    prompts = first_turn_prompts(tok, a.num_prompts, a.max_prompt_len, a.source)
    stop = stop_token_ids(tok, model)
    pad = int(tok.pad_token_id)
    s = GenerationSettings(
        max_new_tokens=a.max_new_tokens,
        stop_ids=stop,
        pad_id=pad,
        batch_tokens=a.batch_tokens,
        max_batch_size=a.max_batch_size,
        refill=not a.no_refill,
    )
    generate_batched(
        model, prompts[:2], GenerationSettings(max_new_tokens=4, stop_ids=stop, pad_id=pad)
    )  # warm-up
    run_sequential(model, prompts[:1], 4, stop, pad)

    t0 = time.perf_counter()
    batched = [g.tokens for g in generate_batched(model, prompts, s)]
    t_batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    seq = run_sequential(model, prompts, a.max_new_tokens, stop, pad)
    t_seq = time.perf_counter() - t0

    n_b, n_s = sum(map(len, batched)), sum(map(len, seq))
    tps_b, tps_s = n_b / t_batched, n_s / t_seq
    same = sum(b == q for b, q in zip(batched, seq))
    lens = [len(p) for p in prompts]
    print(
        f"{len(prompts)} prompts ({min(lens)}-{max(lens)} tokens), max_new_tokens={a.max_new_tokens}, {a.model} "
        f"{a.dtype} {a.device}, Linear layout {layout}, torch threads={torch.get_num_threads()}"
    )
    table = [
        ["batched (distill.generate)", n_b, f"{t_batched:.2f}", f"{tps_b:.1f}"],
        ["sequential model.generate", n_s, f"{t_seq:.2f}", f"{tps_s:.1f}"],
    ]
    print(tabulate(table, headers=["path", "tokens", "seconds", "tokens/s"]))
    print(f"speedup (tokens/s ratio): {tps_b / tps_s:.2f}x; identical outputs: {same}/{len(prompts)}")
    result = {
        "prompts": len(prompts),
        "max_new_tokens": a.max_new_tokens,
        "dtype": a.dtype,
        "layout": layout,
        "threads": torch.get_num_threads(),
        "batched_tokens_per_s": round(tps_b, 2),
        "sequential_tokens_per_s": round(tps_s, 2),
        "ratio": round(tps_b / tps_s, 3),
        "identical_outputs": same,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
