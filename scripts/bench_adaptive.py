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
from collections.abc import Callable


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run AR, every fixed tree and its adaptive variants per prompt, print the table."""
    from specdraft.eval.bench_common import add_target_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.3])
    p.add_argument(
        "--no-fallback", type=float, nargs="*", default=[], help="also these thresholds without the fallback"
    )
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of the warm-up prompt")
    p.add_argument("--int8-head", action=argparse.BooleanOptionalAction, default=True, help="as eval default")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from specdraft.eval.adaptive import AdaptiveProposer
    from specdraft.eval.bench_common import first_turns, load_bench, write_json
    from specdraft.eval.decode import DecodeStats, Proposer
    from specdraft.eval.proposers import PromptLookupProposer, make_proposer
    from specdraft.eval.static_decode import make_decoder

    bench = load_bench(a)
    model, tok, stop = bench.model, bench.tokenizer, bench.stop_ids
    dec = make_decoder(model, "static", "auto")
    assert dec is not None
    print(f"decode path {dec.path_name()}")
    families: list[tuple[str, Callable[[], Proposer]]] = [  # (name, fresh fixed-tree proposer)
        (name, lambda d=d: make_proposer(d, int8_head=a.int8_head)) for name, d in bench.drafters
    ]
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
    prompts = first_turns(tok, a.bench, a.prompts + 1)
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
        f" {a.prompts} {a.bench} prompts x {a.max_new_tokens} tokens"
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
    write_json(a.json, model, {"rows": rows})


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
