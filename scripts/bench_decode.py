"""Where the time of a decode step goes, old (dynamic) path against new (static) path, in one run.

    # forward cost per node count, then AR and each drafter on both paths over 3 MT-Bench prompts
    python scripts/bench_decode.py --drafter outputs/redrafter_smollm2/export --prompts 3
    # no trained drafter: prompt lookup through the tree decoder (timing of the decoder itself)
    python scripts/bench_decode.py --lookup 10 --prompts 3
    # CPU: the static path again over the target's Linear weights stored transposed (eval.linear_layout)
    python scripts/bench_decode.py --drafter outputs/redrafter_smollm2/export --layout both --budget --prompts 4
    # CPU: native, transposed, MKL-packed and panel weights side by side (cost curves and decoding, one run)
    python scripts/bench_decode.py --lookup 10 --layout all --budget --prompts 3
    # each drafter alone and with prompt lookup's chain merged into its trees, both with the fitted budget
    python scripts/bench_decode.py --drafter <exports> --lookup 10 --lookup-branch 10 --layout panel --budget
    # CPU: the panel kernel against the transposed layout it replaced
    python scripts/bench_decode.py --drafter <export> --lookup 10 --layout panel-vs-transposed --budget
    # CPU: a dequantised GGUF target's weights as exact 4/8-bit blocks against fp32 panels
    python scripts/bench_decode.py --drafter <export> --lookup 10 --layout panel-exact --budget
    # CPU: exact panels one after the other against paired ones (SPECDRAFT_PAIRED_PANELS)
    python scripts/bench_decode.py --drafter <export> --lookup 10 --layout panel-paired --budget
    # on a GPU: the static path captures CUDA graphs (--graphs auto is on exactly when the target is on CUDA)
    python scripts/bench_decode.py --device cuda --dtype bf16 --drafter <export> --prompts 8

Prints the verify cost curve (ms for 1..128 nodes after a 256-token prefix, on the static path) and one table:
per method and path, tok/s, tokens/step, speedup over AR on the same path and over the dynamic AR, and ms
per step in draft / verify / accept (device-synchronised), with the overhead outside the verify forward as
a fraction of it. The target's Linear weights are laid out as evaluate.py lays them out (`--layout auto`, the
default: `eval.linear_layout=auto`); `--layout native` and the other values measure another layout. `--budget`
adds each drafter with the node budget fitted to this machine (`--budget-refit 0 128` once with a final first
fit and once refitted every 128+ steps, the default).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from functools import partial

LAYOUT_SETS = {
    "both": ("native", "transposed"),
    "all": ("native", "transposed", "packed", "panel"),
    "panel-vs-transposed": ("transposed", "panel"),  # the CPU `auto` before and after the panel kernel
    "panel-exact": (
        "panel-fp32",
        "panel",
    ),  # fp32 panels against exact 4/8-bit blocks (models/exact_panels.py)
    "panel-paired": ("panel-single", "panel"),  # exact panels one after the other against paired ones
    # fp32 products against int8 activations (models/qdot.py: the GGUF runtime's arithmetic, another target)
    "panel-q8-vs-fp32": ("panel", "panel-q8"),
}
SUFFIX = {
    "native": "",
    "transposed": "-T",
    "packed": "-P",
    "panel": "-panel",
    "panel-fp32": "-panel32",
    "panel-single": "-single",
    "panel-q8": "-q8",
}


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, measure the cost curves, run every method on every path, print the table."""
    from specdraft.eval.bench_common import add_target_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(
        p,
        layouts=(
            "auto",
            "native",
            "transposed",
            "packed",
            "panel",
            "panel-fp32",
            "panel-single",
            "panel-q8",
            *LAYOUT_SETS,
        ),
        layout_default="auto",  # what evaluate.py runs (eval.linear_layout=auto): the panels on most CPUs
    )
    p.add_argument("--graphs", default="auto", help="auto | on | off: CUDA graphs on the static path")
    p.add_argument("--budget", action="store_true", help="also run each drafter with eval.node_budget=auto")
    p.add_argument(
        "--budget-refit",
        type=int,
        nargs="+",
        default=[128],
        help="with --budget: one row per value of eval.node_budget_refit (0: the first fit is final)",
    )
    p.add_argument(
        "--budget-refit-scale",
        type=int,
        nargs="+",
        default=[4],
        help="with --budget: rows per value of eval.node_budget_refit_scale too (refits draft <= this x the "
        "settled cap, >= 4 nodes; 0: full-size trees)",
    )
    p.add_argument(
        "--budget-memory",
        type=int,
        default=192,
        help="with --budget: eval.node_budget_memory (probe steps of every fit that rate the caps; 0: the newest 48)",
    )
    p.add_argument(
        "--float-heads",
        action="store_true",
        help="draft with the drafters' own vocabulary heads (default on CPU: int8 copies, as evaluate.py's "
        "eval.int8_draft_head; the output is the same either way)",
    )
    p.add_argument(
        "--draft-block",
        nargs="+",
        default=["auto"],
        choices=["auto", "hf", "fused", "int8"],
        help="EAGLE heads' layer / ReDrafter's and Medusa's products while drafting (eval.draft_block); "
        "several: one row per value (an A/B)",
    )
    p.add_argument(
        "--dynamic",
        default="all",
        choices=["all", "ar"],
        help="the dynamic (eager) reference path for every method, or for AR only (on a GPU, where eager drafting "
        "is slow and says little)",
    )
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from specdraft.eval.bench_common import apply_bench_layout, first_turns, load_bench, write_json
    from specdraft.eval.budget import CostCurve, NodeBudget, machine_key
    from specdraft.eval.decode import ar_generate, speculative_generate
    from specdraft.eval.graphs import report_captures
    from specdraft.eval.proposers import PromptLookupProposer, make_proposer
    from specdraft.eval.runner import precapture
    from specdraft.eval.static_decode import make_decoder
    from specdraft.models.linear_layout import match_target_layout

    layouts = LAYOUT_SETS.get(a.layout, (a.layout,))
    bench = load_bench(a, layout=False)  # native; every layout below gets its own copy of the target
    model, tok, stop = bench.model, bench.tokenizer, bench.stop_ids
    native = copy.deepcopy(model) if len(layouts) > 1 else model

    def factories(drafters: list, fixed: bool = False) -> list:
        """(name, proposer factory) per drafter, then prompt lookup: each method gets its own proposer (a
        fitted budget may shrink the one it drives). `fixed`: fixed-shape draft steps, CUDA graphs where the
        drafter is on CUDA (as evaluate.py builds them for a graph decoder)."""
        int8 = not a.float_heads  # as evaluate.py's eval.int8_draft_head (CPU only)
        blocks = a.draft_block
        shape = dict(static=fixed, graphs=fixed)
        out = [
            (
                name + (f"[{b}]" if len(blocks) > 1 else ""),
                lambda d=d, b=b: make_proposer(d, int8_head=int8, draft_block=b, **shape),
            )
            for name, d in drafters
            for b in blocks
        ]
        if (
            a.lookup_branch
        ):  # each drafter again, prompt lookup's chain merged into its trees (eval/hybrid.py)
            n = a.lookup_branch
            out += [
                (
                    f"{name}+lookup",
                    lambda d=d: make_proposer(
                        d, int8_head=int8, lookup_tokens=n, draft_block=blocks[0], **shape
                    ),
                )
                for name, d in drafters
            ]
        if a.lookup:
            out.append((f"lookup:{a.lookup}", lambda: PromptLookupProposer(a.lookup)))
        return out

    # static paths: (label, decoder, cost curve, proposer factories over drafters laid out like that target);
    # "static" over native weights, "-T" transposed, "-P" packed, "-panel" panels
    paths, applied = [], []
    for k, layout in enumerate(layouts):
        m = model if k == 0 else copy.deepcopy(native)
        layout = apply_bench_layout(m, layout, q8=a.q8_activations)  # "panel" + --q8-activations: "panel-q8"
        applied.append(layout)  # "auto" resolved
        dec = make_decoder(m, "static", a.graphs)
        assert dec is not None
        cost = CostCurve.load_or_measure(machine_key(m, dec.path_name()), dec.measure_costs, refresh=True)
        print(
            f"decode path {dec.path_name()}, {layout} weights: verify ms per node count",
            {b: round(ms, 1) for b, ms in cost.ms.items()},
        )
        drafters = [(name, copy.deepcopy(d)) for name, d in bench.drafters]
        for _, d in drafters:
            match_target_layout(d, m)  # as evaluate.py does
        paths.append(("static" + SUFFIX[layout], dec, cost, factories(drafters, fixed=dec.static)))
    del native
    proposers = factories(bench.drafters)  # the dynamic reference path: native target and drafters
    # (name, path, fn(ids) -> (tokens, stats))
    methods = [
        ("ar", "dynamic", lambda ids: ar_generate(model, tok, ids, a.max_new_tokens, stop_ids=stop)),
    ]
    methods += [
        ("ar", label, lambda ids, d=d: d.ar_generate(tok, ids, a.max_new_tokens, stop_ids=stop))
        for label, d, _, _ in paths
    ]
    budgets: dict[tuple[str, str], NodeBudget] = {}  # (method, path) -> its fitted node budget
    warm: list[Callable[[list[int], int], None]] = []  # per budgeted method on a fixed-shape path: precapture
    for i, (name, new_proposer) in enumerate(proposers):
        if a.dynamic == "all":
            prop = new_proposer()
            methods.append(
                (
                    name,
                    "dynamic",
                    lambda ids, q=prop: speculative_generate(
                        model, tok, ids, q, a.max_new_tokens, stop_ids=stop, profile=True
                    ),
                )
            )
        for label, d, c, path_factories in paths:
            new_proposer = path_factories[i][1]
            prop = new_proposer()
            methods.append(
                (
                    name,
                    label,
                    lambda ids, q=prop, d=d: d.speculative_generate(
                        tok, ids, q, a.max_new_tokens, stop_ids=stop, profile=True
                    ),
                )
            )
            scales = a.budget_refit_scale  # without refits (0) the probe size is never used: one row
            combos = (
                [(r, x) for r in a.budget_refit for x in (scales if r else scales[:1])] if a.budget else []
            )
            for refit, scale in combos:
                b = NodeBudget(
                    c,
                    label=name,
                    refit_gap=refit,
                    refit_scale=scale,
                    trim_slowest=d.graphs,
                    memory=a.budget_memory,
                )
                prop = new_proposer()
                what = [f"refit {refit}"] if len(a.budget_refit) > 1 else []
                what += (
                    [f"probe x{scale}" if scale else "full refits"] if len(a.budget_refit_scale) > 1 else []
                )
                tag = name + "+budget" + (f"({', '.join(what)})" if what else "")
                budgets[(tag, label)] = b
                if d.static:  # every cap's shapes captured before timing (as evaluate.py's warm-up does)
                    warm.append(partial(precapture, d, tok, prop, b, stop))
                methods.append(
                    (
                        tag,
                        label,
                        lambda ids, q=prop, b=b, d=d: d.speculative_generate(
                            tok, ids, q, a.max_new_tokens, stop_ids=stop, profile=True, budget=b
                        ),
                    )
                )
    prompts = first_turns(tok, a.bench, a.prompts + 1)
    for (
        _,
        _,
        fn,
    ) in methods:  # warm-up on the extra prompt (allocator, kernels, graphs, budgets start fitting)
        fn(prompts[0])
    for prepare in warm:
        prepare(prompts[0], a.max_new_tokens)
    tot: dict[tuple[str, str], dict] = {}
    ref: dict[tuple[int, bool], list[int]] = {}  # (prompt, int8 activations): the first output of that target
    for k, ids in enumerate(prompts[1:]):
        for name, path, fn in methods:
            out, st = fn(ids)
            key = (k, path.endswith(SUFFIX["panel-q8"]))  # a q8 path decodes another target (models/qdot.py)
            ref.setdefault(key, out)
            t = tot.setdefault(
                (name, path), dict(n=0, time=0.0, steps=0, acc=0, draft=0.0, verify=0.0, accept=0.0, same=0)
            )
            t["n"] += len(out)
            t["time"] += st.time_s
            t["steps"] += st.steps
            t["acc"] += sum(st.accepted) + len(st.accepted) if st.accepted else st.steps
            t["draft"] += st.draft_s
            t["verify"] += st.verify_s
            t["accept"] += st.accept_s
            t["same"] += out == ref[key]
    rate = {key: t["n"] / t["time"] for key, t in tot.items()}
    table = Table(
        title=f"decode paths on {model.device} ({str(model.dtype).replace('torch.', '')}), {a.prompts} {a.bench} prompts"
    )
    for col in (
        "method",
        "path",
        "tok/s",
        "tok/step",
        "vs AR same path",
        "vs dynamic AR",
        "draft ms",
        "verify ms",
        "accept ms",
        "overhead/verify",
        "same as AR",
    ):
        table.add_column(col)
    rows = []
    for (name, path), t in tot.items():
        per = 1e3 / max(t["steps"], 1)
        spec = name != "ar"
        over = (t["draft"] + t["accept"]) / t["verify"] if spec and t["verify"] > 0 else None
        ar_same = rate[("ar", path)]
        row = dict(
            method=name, path=path, tok_s=rate[(name, path)], tok_step=t["acc"] / max(t["steps"], 1),
            vs_ar_same=rate[(name, path)] / ar_same, vs_dynamic_ar=rate[(name, path)] / rate[("ar", "dynamic")],
            draft_ms=t["draft"] * per if spec else None, verify_ms=t["verify"] * per if spec else None,
            accept_ms=t["accept"] * per if spec else None, overhead=over, same=f"{t['same']}/{a.prompts}",
        )  # fmt: skip
        if (name, path) in budgets:  # every cap the budget settled on (1: no drafting), refits included
            row["budget_caps"] = budgets[(name, path)].history
        rows.append(row)
        f = lambda x, s=".2f": "-" if x is None else format(x, s)  # noqa: E731
        table.add_row(
            name,
            path,
            f(row["tok_s"], ".1f"),
            f(row["tok_step"]),
            f(row["vs_ar_same"]) + "x",
            f(row["vs_dynamic_ar"]) + "x",
            f(row["draft_ms"], ".1f"),
            f(row["verify_ms"], ".1f"),
            f(row["accept_ms"], ".1f"),
            f(over),
            row["same"],
        )
    Console(width=200).print(table)
    costs = {"cost_ms": paths[0][2].ms}
    costs.update({f"cost_ms_{layout}": c.ms for layout, (_, _, c, _) in list(zip(layouts, paths))[1:]})
    report_captures()
    write_json(
        a.json,
        model,
        {"path": paths[0][1].path_name(), "layout": a.layout, "layouts": applied, **costs, "rows": rows},
    )


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
