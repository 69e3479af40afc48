"""Verify-forward cost per node count under each Linear weight layout of the target, interleaved in one run.

    # native, transposed, MKL-packed and panel weights (models/linear_layout.py), 1..32 nodes after a 256-token prefix
    python scripts/bench_layouts.py --layouts native transposed packed panel --sizes 1 2 3 4 6 8 12 16 32 --reps 11
    # the panel layout with grouped-query SDPA (models/attention.py, the default) and with transformers' repeat_kv
    python scripts/bench_layouts.py --layouts panel --attention both --sizes 1 2 4 8 16 32 --reps 9
    # panels of exact 4/8-bit blocks (a dequantised GGUF target: models/exact_panels.py) against fp32 panels
    python scripts/bench_layouts.py --layouts panel-fp32 panel --sizes 1 2 4 8 16 32 --reps 9
    # exact panels one after the other against paired ones (models/exact_panels.py: SPECDRAFT_PAIRED_PANELS)
    python scripts/bench_layouts.py --layouts panel-single panel --sizes 1 2 3 4 6 8 16 32 --reps 9

Each layout gets its own copy of the target and its own decoder (the static path in the shape evaluate.py
uses on this device); every repetition times each node count under every layout back to back (round robin,
`eval.budget.time_round_robin`), so the machine's drift hits all layouts alike. Prints, per layout, the median ms
per node count, its ratio to that layout's one-token step, its speedup over the first layout and the memory the
layout adds to the target; `--json` writes them with the command and the machine, atomically. With
`--attention both` every layout runs twice: as loaded (grouped-query SDPA) and as `<layout>+sdpa`, with
transformers' own SDPA attention (K/V copied per query group under a mask).
"""

from __future__ import annotations

import argparse
import copy


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, lay out one copy of the target per layout, time them round robin, print the table."""
    from specdraft.eval.bench_common import add_target_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument(
        "--layouts", nargs="+", default=["native", "transposed", "packed", "panel"], help="layouts to compare"
    )
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8, 12, 16, 32], help="node counts")
    p.add_argument("--prefix", type=int, default=256, help="cached tokens before the verified nodes")
    p.add_argument("--reps", type=int, default=11, help="timed repetitions (after one warm-up)")
    p.add_argument(
        "--attention",
        choices=["gqa", "sdpa", "both"],
        default="gqa",
        help="gqa: as load_target sets it (models/attention.py); sdpa: transformers' own; both: side by side",
    )
    a = p.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    from specdraft.eval.bench_common import apply_bench_layout, load_bench, write_json
    from specdraft.eval.budget import time_round_robin
    from specdraft.eval.static_decode import make_decoder
    from specdraft.models.linear_layout import weight_bytes

    model = load_bench(a, layout=False).model  # native weights; each layout below lays out its own copy
    sizes = tuple(sorted(set(a.sizes)))
    base = weight_bytes(model)
    probes, added = [], {}
    attentions = {"gqa": [""], "sdpa": ["+sdpa"], "both": ["", "+sdpa"]}[a.attention]
    variants = [layout + suffix for layout in a.layouts for suffix in attentions]  # the table's columns
    for variant in variants:
        layout, _, attn = variant.partition("+")
        m = copy.deepcopy(model)
        # "panel-fp32": fp32 panels even for exact 4/8-bit weights
        apply_bench_layout(m, layout, q8=a.q8_activations)
        if attn:
            m.set_attn_implementation("sdpa")  # transformers' own (repeat_kv under a mask)
        added[variant] = weight_bytes(m) - base
        dec = make_decoder(m, "static", "auto")
        assert dec is not None
        probes.append(dec.cost_probe(sizes, a.prefix))
    a.layouts = variants
    keys = [(k, b) for b in sizes for k in range(len(a.layouts))]  # round robin: every variant at each size
    with torch.inference_mode():
        med = time_round_robin(
            lambda i: probes[keys[i][0]](keys[i][1]), tuple(range(len(keys))), a.reps, model.device
        )
    ms = {
        layout: {b: med[i] for i, (k, b) in enumerate(keys) if k == j} for j, layout in enumerate(a.layouts)
    }

    table = Table(
        title=f"verify forward after {a.prefix} tokens on {model.device} ({model.dtype}): ms (x one token)"
    )
    table.add_column("nodes")
    for layout in a.layouts:
        table.add_column(layout)
        if layout != a.layouts[0]:
            table.add_column(f"{layout} vs {a.layouts[0]}")
    for b in sizes:
        row = [str(b)]
        for layout in a.layouts:
            row.append(f"{ms[layout][b]:.1f} ({ms[layout][b] / ms[layout][sizes[0]]:.2f}x)")
            if layout != a.layouts[0]:
                row.append(f"{ms[a.layouts[0]][b] / ms[layout][b]:.2f}x")
        table.add_row(*row)
    mem = [f"{added[a.layouts[0]] / 2**20:.0f} MiB"]
    for layout in a.layouts[1:]:
        mem += [f"{added[layout] / 2**20:.0f} MiB", ""]
    table.add_row("memory added", *mem)
    Console(width=200).print(table)
    write_json(
        a.json,
        model,
        {"layouts": a.layouts, "prefix": a.prefix, "reps": a.reps, "ms": ms, "added_bytes": added},
    )


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
