"""The target in two dtypes, in one run: verify cost per node count and greedy AR tok/s of each.

    # fp32 (the auto Linear layout: the panel kernels on an AMD CPU) against native bf16
    python scripts/bench_dtype.py --prompts 4 --max-new-tokens 64
    # any two dtypes, e.g. on a GPU
    python scripts/bench_dtype.py --device cuda --dtypes bf16 fp16 --json $OUT/bench_dtype_gpu.json

The target is loaded once per dtype, each with `--layout` applied (as evaluate.py does), each with its own
decoder. Verify forwards of every `--sizes` node count after a 256-token prefix are timed back to back, dtype
after dtype (`eval.budget.time_round_robin`: a first round warms up), so the machine's drift hits both alike;
then AR over MT-Bench first turns, alternated prompt by prompt. Prints the median verify ms of each and their ratio, AR tok/s of each, and how many AR outputs agree
(two dtypes are two targets: their greedy outputs may differ). What `base_model.dtype=auto` picks here is
printed too (`specdraft.hardware.auto_dtype`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, time both dtypes, print (and save) the table."""
    from rich.console import Console
    from rich.table import Table

    from specdraft.eval.bench_common import add_target_args, first_turns, load_bench, write_json
    from specdraft.eval.budget import time_round_robin
    from specdraft.eval.static_decode import StaticDecoder
    from specdraft.hardware import SHORT_NAMES, auto_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--dtypes", nargs=2, default=["fp32", "bf16"], help="the two dtypes compared")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="verify node counts")
    p.add_argument("--reps", type=int, default=5, help="forwards per size and dtype")
    p.add_argument("--prompts", type=int, default=4, help="MT-Bench first turns decoded by AR in each dtype")
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args(argv)
    if a.dtypes[0] == a.dtypes[1] or "auto" in a.dtypes:
        raise SystemExit(f"bench_dtype: --dtypes {' '.join(a.dtypes)}: name two different dtypes (not auto)")
    benches: dict[str, Any] = {}
    for name in a.dtypes:
        a.dtype = name
        benches[name] = load_bench(a)
    decs = {k: StaticDecoder(b.model, 2048) for k, b in benches.items()}
    device = next(benches[a.dtypes[0]].model.parameters()).device
    keys = [(k, s) for s in a.sizes for k in decs]  # round robin: both dtypes back to back at every size
    with torch.inference_mode():
        run = {k: d.cost_probe(tuple(a.sizes)) for k, d in decs.items()}
        med = time_round_robin(lambda i: run[keys[i][0]](keys[i][1]), tuple(range(len(keys))), a.reps, device)
    ms = {key: med[i] for i, key in enumerate(keys)}  # (dtype, nodes) -> median ms
    first, second = a.dtypes
    prompts = first_turns(benches[first].tokenizer, a.bench, a.prompts)
    ar = {k: 0.0 for k in decs}
    outs: dict[str, list[list[int]]] = {k: [] for k in decs}
    for prompt in prompts:
        for k, dec in decs.items():
            stops = benches[k].stop_ids
            dec.ar_generate(None, prompt, 4, stop_ids=stops)  # warm-up
            t0 = time.perf_counter()
            out, _ = dec.ar_generate(None, prompt, a.max_new_tokens, stop_ids=stops)
            ar[k] += time.perf_counter() - t0
            outs[k].append(out)
    auto, why = auto_dtype(device)
    table = Table(title=f"the target in {first} and {second} on {device} ({decs[first].path_name()} path)")
    for col in ("nodes", f"{first} ms", f"{second} ms", f"{second} / {first}"):
        table.add_column(col)
    rows = []
    for s in a.sizes:
        x, y = ms[first, s], ms[second, s]
        rows.append({"nodes": s, f"{first}_ms": x, f"{second}_ms": y, "ratio": y / x})
        table.add_row(str(s), f"{x:.2f}", f"{y:.2f}", f"{y / x:.3f}")
    tok_s = {k: sum(len(o) for o in outs[k]) / ar[k] for k in decs}
    table.add_row(
        "AR tok/s", f"{tok_s[first]:.1f}", f"{tok_s[second]:.1f}", f"{tok_s[second] / tok_s[first]:.3f}x"
    )
    Console().print(table)
    same = sum(x == y for x, y in zip(outs[first], outs[second], strict=True))
    print(f"AR outputs equal in both dtypes: {same}/{len(prompts)}")
    print(f"base_model.dtype=auto picks {SHORT_NAMES.get(auto, auto)} here ({why})")
    payload = {"dtypes": a.dtypes, "verify": rows, "ar_tok_s": tok_s, "ar_same": same, "auto": str(auto)}
    write_json(a.json, benches[first].model, payload)


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
