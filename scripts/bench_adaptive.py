"""Confidence-adaptive drafting (eval/adaptive.py) against the fixed tree of the same family, in one run.

    # the trained demo ReDrafter and prompt lookup, two thresholds, 4 MT-Bench prompts x 64 tokens (CPU fp32)
    python scripts/bench_adaptive.py --drafter outputs/redrafter_smollm2/export --lookup 10 \
        --thresholds 0.05 0.2 --prompts 4 --max-new-tokens 64

Per prompt every method runs back to back (interleaved) on the default decode path (`eval.decode_path=static`:
eager exact-size trees on a CPU, padded power-of-two trees as CUDA graphs on a GPU), after one warm-up prompt.
One table: tokens/step (tokens per target forward, plain target steps included), nodes verified per step
(root included), tok/s, speedup over AR from the same run, the share of one-node steps (the adaptive
fallback's plain target steps, or a lookup miss), and whether the output equals AR's. `--no-fallback` adds
adaptive variants that only prune and shrink (never switch drafting off), to separate the two effects.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16")
    p.add_argument(
        "--layout",
        default="auto",
        choices=["auto", "transposed", "native"],
        help="target Linear weights: auto | transposed | native (eval.linear_layout)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--drafter", nargs="*", default=[], help="exported ReDrafter / EAGLE folders")
    p.add_argument("--lookup", type=int, default=0, help="> 0: also prompt lookup with this many tokens")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.3])
    p.add_argument(
        "--no-fallback", type=float, nargs="*", default=[], help="also these thresholds without the fallback"
    )
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of the warm-up prompt")
    p.add_argument("--int8-head", action=argparse.BooleanOptionalAction, default=True, help="as eval default")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from rich.console import Console
    from rich.table import Table

    from specdraft.data.benchmarks import load_benchmark
    from specdraft.data.chat import prompt_ids
    from specdraft.eval.adaptive import AdaptiveProposer
    from specdraft.eval.decode import DecodeStats, Proposer, default_stop_ids
    from specdraft.eval.proposers import PromptLookupProposer, drafter_family, make_proposer
    from specdraft.eval.static_decode import make_decoder
    from specdraft.models.base_llm import load_target, target_fingerprint
    from specdraft.models.hub import load_drafter
    from specdraft.models.linear_layout import apply_layout

    model, tok = load_target(SimpleNamespace(name_or_path=a.target, dtype=a.dtype, device=a.device))
    apply_layout(model, a.layout)  # as evaluate.py does
    dec = make_decoder(model, "static", "auto")
    assert dec is not None
    stop = default_stop_ids(tok, model)
    print(
        f"device={model.device} dtype={model.dtype} threads={torch.get_num_threads()} path={dec.path_name()}"
    )

    families: list[tuple[str, Callable[[], Proposer]]] = []  # (name, fresh fixed-tree proposer)
    for path in a.drafter:
        d = load_drafter(path, model, target_fingerprint(model, tok))
        where = Path(path)
        name = f"{drafter_family(d)}:{where.parent.name if where.name == 'export' else where.name}"
        families.append((name, lambda d=d: make_proposer(d, int8_head=a.int8_head)))
    if a.lookup:
        families.append((f"lookup:{a.lookup}", lambda: PromptLookupProposer(a.lookup)))
    Run = Callable[[list[int], int], tuple[list[int], DecodeStats]]
    methods: list[tuple[str, str, Run]] = [
        ("ar", "-", lambda ids, n: dec.ar_generate(tok, ids, n, stop_ids=stop))
    ]
    for name, new in families:
        variants = [("fixed", new())]
        variants += [(f"adaptive@{t:g}", AdaptiveProposer(new(), t)) for t in a.thresholds]
        variants += [
            (f"adaptive@{t:g} no fallback", AdaptiveProposer(new(), t, fallback=False)) for t in a.no_fallback
        ]
        for label, prop in variants:
            methods.append(
                (
                    name,
                    label,
                    lambda ids, n, q=prop: dec.speculative_generate(tok, ids, q, n, stop_ids=stop),
                )
            )
    items = load_benchmark("mt_bench", a.prompts + 1)
    prompts = [prompt_ids(tok, [{"role": "user", "content": i.turns[0]}]) for i in items]
    for _, _, fn in methods:  # warm-up on the extra prompt
        fn(prompts[0], a.warmup_tokens)
    tot: dict[tuple[str, str], dict] = {}
    for k, ids in enumerate(prompts[1:]):
        ref: list[int] = []
        for name, label, fn in methods:
            out, st = fn(ids, a.max_new_tokens)
            ref = ref or out
            t = tot.setdefault((name, label), dict(n=0, dec=0, time=0.0, steps=0, nodes=0, target=0, same=0))
            t["n"] += len(out)
            t["dec"] += len(out) - 1  # the first token comes from the prefill
            t["time"] += st.time_s
            t["steps"] += st.steps
            t["nodes"] += sum(st.tree_sizes) if st.tree_sizes else st.steps
            t["target"] += sum(n == 1 for n in st.tree_sizes) if st.tree_sizes else st.steps
            t["same"] += out == ref
        print(f"prompt {k + 1}/{a.prompts} done", flush=True)
    ar_rate = tot[("ar", "-")]["n"] / tot[("ar", "-")]["time"]
    table = Table(
        title=f"confidence-adaptive vs fixed trees on {model.device} ({str(model.dtype).replace('torch.', '')}),"
        f" {a.prompts} MT-Bench prompts x {a.max_new_tokens} tokens"
    )
    cols = ("method", "tree", "tok/step", "nodes/step", "tok/s", "vs AR", "1-node steps", "same as AR")
    for col in cols:
        table.add_column(col)
    rows = []
    for (name, label), t in tot.items():
        steps = max(t["steps"], 1)
        row = dict(
            method=name, tree=label, tok_step=t["dec"] / steps, nodes_step=t["nodes"] / steps,
            tok_s=t["n"] / t["time"], vs_ar=t["n"] / t["time"] / ar_rate, target_frac=t["target"] / steps,
            same=f"{t['same']}/{a.prompts}",
        )  # fmt: skip
        rows.append(row)
        table.add_row(
            name, label, f"{row['tok_step']:.2f}", f"{row['nodes_step']:.1f}", f"{row['tok_s']:.1f}",
            f"{row['vs_ar']:.2f}x", f"{row['target_frac']:.0%}", row["same"],
        )  # fmt: skip
    Console(width=200).print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
