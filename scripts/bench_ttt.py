"""Training-time-test unroll cost: the whole-sequence unroll against the selected-positions one, in one run.

    # EAGLE-3 at the long preset's shapes (SmolLM2-135M sizes, 16 x 512 tokens, 7 steps, 256 scored positions)
    python scripts/bench_ttt.py
    # EAGLE-1 with the LK loss (its unroll has grads through every step), 4 steps
    python scripts/bench_ttt.py --family eagle --steps 4

A head of the target's shape (random weights: the cost depends on shapes only; `--layers` decoder layers are
enough to feed EAGLE-3's three fused layers) is unrolled forward and backward over random features, both
ways, `--repeats` times interleaved after one warm-up each. Prints seconds per call, the ratio, and the
largest difference between the two outputs at the scored positions (same values, other summation order).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parse the arguments, time both unrolls, print the comparison; returns its numbers."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="eagle3", choices=["eagle", "eagle3"])
    p.add_argument("--hidden", type=int, default=576, help="target hidden size (SmolLM2-135M: 576)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-vocab", type=int, default=16384, help="EAGLE-3 draft vocabulary")
    p.add_argument("--layers", type=int, default=3, help="target decoder layers built (features are random)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--steps", type=int, default=7, help="unroll steps (training-time-test depth)")
    p.add_argument(
        "--positions", type=int, default=256, help="scored positions per batch (train.max_positions)"
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the numbers (+ command, machine) here")
    a = p.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.eval.bench_common import write_json
    from specdraft.models import eagle, eagle3

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip
    target = LlamaForCausalLM(cfg).eval()
    fp = {"name_or_path": "bench", "hidden_size": a.hidden, "vocab_size": a.vocab, "tokenizer_hash": "b"}
    common = dict(draft_len=a.steps, tree_total_tokens=16, tree_depth=6, tree_top_k=4)
    if a.family == "eagle3":
        schema = SimpleNamespace(**common, target_layers=list(range(a.layers)), draft_vocab_size=a.draft_vocab,
                                 ttt_decay=0.8)  # fmt: skip
        head: torch.nn.Module = eagle3.build(schema, target, fp, token_counts=torch.rand(a.vocab))
        width = a.layers * a.hidden
    else:
        schema = SimpleNamespace(**common, fc_bias=True, feature_weight=1.0, token_weight=0.1, noise=0.0)
        head, width = eagle.build(schema, target, fp), a.hidden
    head.train()
    feats = torch.randn(a.batch, a.length, width)  # (B, L, F)
    tokens = eagle.next_tokens(torch.randint(0, a.vocab, (a.batch, a.length)), a.steps)  # (B, L + S - 1)
    sel = torch.randperm(a.batch * a.length)[: a.positions].sort().values
    b, t = sel // a.length, sel % a.length  # (N,) each
    w = torch.randn(a.positions, a.steps, a.hidden)  # a fixed linear read-out as the loss

    def call(sparse: bool) -> tuple[float, torch.Tensor]:
        head.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = (
            head(feats, tokens, steps=a.steps, at=(b, t))
            if sparse
            else head(feats, tokens, steps=a.steps)[b, t]
        )
        (out * w).sum().backward()  # (N, S, H)
        return time.perf_counter() - t0, out.detach()

    times: dict[str, list[float]] = {"whole": [], "selected": []}
    outs = {}
    for name in times:  # warm-up
        call(name == "selected")
    for _ in range(a.repeats):
        for name in times:
            dt, outs[name] = call(name == "selected")
            times[name].append(dt)
    whole, selected = min(times["whole"]), min(times["selected"])
    diff = float((outs["whole"] - outs["selected"]).abs().max())
    print(f"{a.family}: B={a.batch} L={a.length} S={a.steps} N={a.positions} H={a.hidden}, forward + backward, "
          f"best of {a.repeats} (torch threads {torch.get_num_threads()})")  # fmt: skip
    print(f"  whole-sequence unroll     {whole:8.2f} s")
    print(f"  selected-positions unroll {selected:8.2f} s   ({whole / selected:.1f}x faster)")
    print(f"  max |difference| of the outputs at the scored positions: {diff:.2e}")
    res = {"whole_s": whole, "selected_s": selected, "ratio": whole / selected, "max_abs_diff": diff}
    write_json(a.json, head, {"settings": vars(a), "results": res, "times": times})
    return res


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
