"""The decoders' target forward: transformers' own against the lean one (`models/fast_target.py`), in one run.

    # verify forwards of 1-16 nodes after a 256-token prefix, then greedy AR over 4 MT-Bench first turns
    python scripts/bench_target_forward.py --prompts 4 --max-new-tokens 64
    # on a GPU, with the verify forwards replayed as CUDA graphs (fewer kernels per graph with the lean forward)
    python scripts/bench_target_forward.py --device cuda --dtype bf16 --json $OUT/target_forward_gpu.json
    # a CPU panel target: the lean forward with torch's per-row ops against the row kernels (models/row_ops.py)
    python scripts/bench_target_forward.py --compare rows --prompts 4 --max-new-tokens 64
    # a CPU panel target: the per-layer Python loop against all layers in one kernel call (models/layer_rows.py)
    python scripts/bench_target_forward.py --compare layers --prompts 4 --max-new-tokens 64
    # on a GPU: q/k/v and gate/up as one product each (models/stacked_linear.py) against one by one
    python scripts/bench_target_forward.py --device cuda --dtype bf16 --compare stacked --json $OUT/stacked.json
    # on a GPU: each elementwise stretch of a layer as one compiled kernel (models/fused_ops.py) against op by op
    python scripts/bench_target_forward.py --device cuda --dtype bf16 --compare fused --json $OUT/fused.json
    # a kernel change: the committed panel_linear.c as the baseline against the working tree's
    git show HEAD:models/panel_linear.c > /tmp/base.c
    python scripts/bench_target_forward.py --compare kernel --baseline-source /tmp/base.c --prompts 4
    # the same for the row kernels or the layer loop: a file named row_ops.c / layer_rows.c replaces that one
    mkdir -p /tmp/base && git show HEAD:models/row_ops.c > /tmp/base/row_ops.c
    python scripts/bench_target_forward.py --compare kernel --baseline-source /tmp/base/row_ops.c --prompts 4

Each forward has its own decoder; they are timed back to back at every size and repetition
(`SPECDRAFT_TARGET_FORWARD`, `SPECDRAFT_ROW_OPS` with `--compare rows`, `SPECDRAFT_LAYER_ROWS` with `--compare
layers`, `SPECDRAFT_STACKED_LINEARS` with `--compare stacked`, `SPECDRAFT_FUSED_OPS` with `--compare fused`, or the kernel library with `--compare kernel`, switched in the process), so the machine's drift hits both alike. Prints per node
count the median verify ms of each, their ratio and the median of the paired ratios, then AR tok/s of each on
the same prompts (alternated prompt by prompt), with every AR output checked equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from specdraft.eval.bench_common import add_target_args, first_turns, load_bench, write_json
    from specdraft.eval.graphs import graphs_wanted, report_captures
    from specdraft.eval.static_decode import StaticDecoder
    from specdraft.models import fused_ops, layer_rows, panel_linear, row_ops, stacked_linear
    from specdraft.models.fast_target import ENV, unsupported

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="verify node counts")
    p.add_argument(
        "--rounds", type=int, default=6, help="alternated rounds (each: every size, both forwards)"
    )
    p.add_argument("--reps", type=int, default=5, help="forwards per size, forward and round")
    p.add_argument(
        "--prompts", type=int, default=4, help="MT-Bench first turns decoded by AR with each forward"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--graphs", default="auto", help="auto | on | off: CUDA graphs for the fixed-shape verify")
    p.add_argument(
        "--compare",
        choices=["forward", "rows", "layers", "stacked", "fused", "kernel"],
        default="forward",
        help="forward: transformers' against the lean forward; rows: the lean forward's torch ops against its "
        "row kernels (a CPU panel target); layers: the per-layer Python loop against the one-call loop "
        "(models/layer_rows.py); stacked: the lean forward's q/k/v and gate/up products one by one against stacked "
        "(models/stacked_linear.py: plain Linears, e.g. a GPU); fused: the layers' elementwise ops one by one against "
        "compiled into one kernel per stretch (models/fused_ops.py); kernel: --baseline-source's panel kernel against the "
        "built one",
    )
    p.add_argument(
        "--baseline-source",
        default=None,
        help="with --compare kernel: a C source to build as the baseline; named row_ops.c or layer_rows.c it "
        "replaces that source, any other name panel_linear.c (e.g. `git show HEAD:models/panel_linear.c`)",
    )
    a = p.parse_args(argv)
    if (a.compare == "kernel") != (a.baseline_source is not None):
        raise SystemExit(
            "bench_target_forward: --baseline-source goes with --compare kernel, and only with it"
        )
    b = load_bench(a)
    model = b.model
    why = unsupported(model)
    if why is not None:
        raise SystemExit(f"bench_target_forward: the lean forward does not run this target ({why})")
    device = next(model.parameters()).device
    graphs = graphs_wanted(device, a.graphs)
    libs: dict[str, Any] = {}
    if a.compare == "kernel":
        try:
            libs = {
                "baseline": panel_linear.baseline_library(Path(a.baseline_source)),
                "built": panel_linear.panel_lib(),
            }
        except (RuntimeError, OSError) as e:
            raise SystemExit(f"bench_target_forward: --baseline-source {a.baseline_source}: {e}") from None
    # (the two variants' keys, the variable that switches them and its value for each, their column names)
    kinds, var, value, names = {
        "forward": (("hf", "fast"), ENV, {"hf": "hf", "fast": "fast"}, ("transformers", "lean")),
        "rows": (("torch_ops", "row_kernels"), row_ops.ENV, {"torch_ops": "0", "row_kernels": "1"}, ("torch ops", "row kernels")),
        "layers": (("layer_loop", "one_call"), layer_rows.ENV, {"layer_loop": "0", "one_call": "1"}, ("layer loop", "one call")),
        "stacked": (("separate", "stacked"), stacked_linear.ENV, {"separate": "0", "stacked": "1"}, ("separate products", "stacked")),
        "fused": (("eager_ops", "fused"), fused_ops.ENV, {"eager_ops": "off", "fused": "on"}, ("eager ops", "fused ops")),
        "kernel": (("baseline", "built"), None, {}, ("baseline kernel", "built kernel")),
    }[a.compare]  # fmt: skip

    def switch(k: str) -> None:
        """Make variant `k` the one the next forward runs."""
        if var is None:
            panel_linear.swap_library(libs[k])
        else:
            os.environ[var] = value[k]

    # a decoder per forward: under graphs each captures (and replays) its own forward's kernels
    decs = {k: StaticDecoder(model, 2048, static=graphs, graphs=graphs) for k in kinds}
    ms: dict[str, dict[int, list[float]]] = {k: {s: [] for s in a.sizes} for k in kinds}
    with torch.inference_mode():
        run = {}
        for k in kinds:
            switch(k)
            run[k] = decs[k].cost_probe(tuple(a.sizes))
            for s in a.sizes:
                run[k](s)  # warm-up (and capture)
        for _ in range(a.rounds * a.reps):  # the two forwards back to back at every size: paired timings
            for s in a.sizes:
                for k in kinds:
                    switch(k)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    run[k](s)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    ms[k][s].append(1e3 * (time.perf_counter() - t0))
    prompts = first_turns(b.tokenizer, a.bench, a.prompts)
    ar: dict[str, list[float]] = {k: [] for k in kinds}
    outs: dict[str, list[list[int]]] = {k: [] for k in kinds}
    for prompt in prompts:
        for k in kinds:
            switch(k)
            decs[k].ar_generate(None, prompt, 4, stop_ids=b.stop_ids)  # warm-up
            t0 = time.perf_counter()
            out, _ = decs[k].ar_generate(None, prompt, a.max_new_tokens, stop_ids=b.stop_ids)
            ar[k].append(time.perf_counter() - t0)
            outs[k].append(out)
    if var is None:
        switch("built")
    else:
        os.environ.pop(var, None)
    path = decs[kinds[0]].path_name()
    first, second = kinds
    table = Table(title=f"target forward on {device} ({next(model.parameters()).dtype}), {path} path")
    for col in (
        "nodes",
        f"{names[0]} ms",
        f"{names[1]} ms",
        f"{names[1]} / {names[0]}",
        "median of paired ratios",
    ):
        table.add_column(col)
    rows = []
    for s in a.sizes:
        a_ms, b_ms = statistics.median(ms[first][s]), statistics.median(ms[second][s])
        paired = statistics.median(y / x for y, x in zip(ms[second][s], ms[first][s], strict=True))
        rows.append(
            {
                "nodes": s,
                f"{first}_ms": a_ms,
                f"{second}_ms": b_ms,
                "ratio": b_ms / a_ms,
                "paired_ratio": paired,
            }
        )
        table.add_row(str(s), f"{a_ms:.2f}", f"{b_ms:.2f}", f"{b_ms / a_ms:.3f}", f"{paired:.3f}")
    tokens = sum(len(o) for o in outs[first])
    tok_s = {k: sum(len(o) for o in outs[k]) / sum(ar[k]) for k in kinds}
    same = sum(x == y for x, y in zip(outs[first], outs[second], strict=True))
    table.add_row(
        "AR tok/s", f"{tok_s[first]:.1f}", f"{tok_s[second]:.1f}", f"{tok_s[second] / tok_s[first]:.3f}x"
    )
    Console().print(table)
    print(f"AR outputs equal: {same}/{len(prompts)} ({tokens} tokens each way)")
    report_captures()
    payload = {
        "compare": a.compare,
        "baseline_source": a.baseline_source,
        "path": path,
        "verify": rows,
        "ar_tok_s": tok_s,
        "ar_same": same,
    }
    write_json(a.json, model, payload)


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
