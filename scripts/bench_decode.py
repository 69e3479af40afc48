"""Where the time of one speculative step goes, on the real target (no Hydra; a profiling aid).

    # forward cost vs. tree size, then AR vs. speculative on 3 MT-Bench prompts with a phase breakdown
    python scripts/bench_decode.py --drafter outputs/redrafter_smollm2/export --prompts 3 --threads 2
    # no trained drafter yet: a freshly initialised ReDrafter (timing only; acceptance is meaningless)
    python scripts/bench_decode.py --fresh-redrafter --beam-width 4 --beam-length 4

Prints: forward latency for N = 1, 4, 8, 16, 32, 64 tree nodes after a 300-token prefix; for each prompt
AR and speculative tokens/s; the speculative loop's time split into prefill / draft / verify forward /
accept+KV compaction (device-synchronised), and tokens per step.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch


def forward_costs(model, sizes=(1, 4, 8, 16, 32, 64), prefix=300, reps=5) -> dict[int, float]:
    """Median latency (ms) of one tree forward of N nodes (a chain) after a `prefix`-token cache."""
    from specdraft.eval.decode import target_forward
    from specdraft.eval.kv import new_cache, rollback
    from specdraft.eval.tree import DraftTree, tree_attention_mask, tree_position_ids

    dev, dtype = model.device, model.dtype
    ids = torch.randint(0, model.config.vocab_size, (1, prefix), device=dev)
    cache = new_cache(model)
    out = {}
    with torch.inference_mode():
        target_forward(model, ids, cache, logits_rows=slice(-1, None))
        for n in sizes:
            tree = DraftTree(torch.randint(0, 100, (n,), device=dev), torch.arange(n, device=dev) - 1)
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                mask = tree_attention_mask(tree, prefix, dtype)
                target_forward(model, tree.tokens[None], cache, tree_position_ids(tree, prefix), mask)
                ts.append(time.perf_counter() - t)
                rollback(cache, prefix)
            out[n] = sorted(ts)[len(ts) // 2] * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16 (auto: bf16 where native)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--drafter", default=None, help="exported drafter folder / Hub id")
    p.add_argument("--fresh-redrafter", action="store_true", help="use an untrained ReDrafter (timing only)")
    p.add_argument("--beam-width", type=int, default=None)
    p.add_argument("--beam-length", type=int, default=None)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--int8-head", action="store_true", help="draft with an int8 copy of the drafter's vocab head"
    )
    p.add_argument("--skip-forward-costs", action="store_true")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from specdraft.data.benchmarks import load_benchmark
    from specdraft.data.chat import prompt_ids
    from specdraft.eval.decode import ar_generate, default_stop_ids, speculative_generate
    from specdraft.eval.proposers import make_proposer
    from specdraft.models.base_llm import load_target, target_fingerprint

    model, tok = load_target(SimpleNamespace(name_or_path=a.target, dtype=a.dtype, device=a.device))
    print(f"threads={torch.get_num_threads()} dtype={model.dtype}")
    if not a.skip_forward_costs:
        costs = forward_costs(model)
        print(
            "tree forward after 300 tokens (ms): "
            + ", ".join(f"N={n}: {c:.1f} ({c / costs[1]:.2f}x)" for n, c in costs.items())
        )
    if a.drafter:
        from specdraft.models.hub import load_drafter

        drafter = load_drafter(a.drafter, model, target_fingerprint(model, tok))
    elif a.fresh_redrafter:
        from specdraft.models import redrafter
        from specdraft.train.config import ReDrafterSchema

        drafter = redrafter.build(ReDrafterSchema(exit_dim=576), model, target_fingerprint(model, tok)).to(
            model.dtype
        )
    else:
        return
    proposer = make_proposer(drafter, a.beam_width, a.beam_length, int8_head=a.int8_head)
    stop = default_stop_ids(tok, model)
    tot = {"ar_t": 0.0, "ar_n": 0, "sp_t": 0.0, "sp_n": 0}
    for item in load_benchmark("mt_bench", a.prompts):
        ids = prompt_ids(tok, [{"role": "user", "content": item.turns[0]}])
        ar, st_ar = ar_generate(model, tok, ids, a.max_new_tokens, stop_ids=stop)
        sp, st = speculative_generate(
            model, tok, ids, proposer, a.max_new_tokens, stop_ids=stop, profile=True
        )
        tot["ar_t"] += st_ar.time_s
        tot["ar_n"] += len(ar)
        tot["sp_t"] += st.time_s
        tot["sp_n"] += len(sp)
        per = 1e3 / max(st.steps, 1)
        print(
            f"[{item.category}] AR {len(ar) / st_ar.time_s:.1f} tok/s ({st_ar.time_s / max(len(ar), 1) * 1e3:.1f} ms/tok) | "
            f"spec {len(sp) / st.time_s:.1f} tok/s, {st.tokens_per_step:.2f} tok/step, same={ar == sp} | per step: "
            f"draft {st.draft_s * per:.1f} ms, verify {st.verify_s * per:.1f} ms (N={sum(st.tree_sizes) / max(st.steps, 1):.1f}), "
            f"accept {st.accept_s * per:.1f} ms; prefill {st.prefill_s * 1e3:.0f} ms"
        )
    ar_rate, sp_rate = tot["ar_n"] / tot["ar_t"], tot["sp_n"] / tot["sp_t"]
    print(f"total: AR {ar_rate:.1f} tok/s, spec {sp_rate:.1f} tok/s, speedup {sp_rate / ar_rate:.2f}x")


if __name__ == "__main__":
    main()
