"""Throughput against batch size: batched AR and batched tree decoding on the same requests, in one run.

    # AR and prompt lookup at batch 1, 4 and 16 over 16 MT-Bench first turns, 64 new tokens each
    python scripts/bench_batch.py --requests 16 --batch 1 4 16 --lookup 10
    # a trained drafter too (one proposer per row), alone and with prompt lookup merged into its trees
    python scripts/bench_batch.py --drafter outputs/redrafter_smollm2/export --batch 1 4 16 --lookup-branch 10
    # ... with each drafter's node budget fitted per batch size on that batch size's measured cost curve
    python scripts/bench_batch.py --drafter outputs/redrafter_smollm2/export --batch 1 4 16 --budget
    # ... and again with beam positions below drafter probability 0.3 / 0.6 / the batch's break-even pruned
    python scripts/bench_batch.py --drafter outputs/redrafter_smollm2_copy/export --batch 1 4 16 --cap 8 --min-prob 0.3 0.6 auto
    # ... and again with one verify width per step, chosen from every row's calibrated confidence
    python scripts/bench_batch.py --drafter outputs/redrafter_smollm2_copy/export --batch 1 16 --cap 8 --min-prob 0.5 --width
    # trees cut to 2 nodes at every batch size (no fitting steps), drafting rows together against one by one
    python scripts/bench_batch.py --drafter <exports> --batch 4 16 --requests 48 --cap 2 --draft-rows both --repeats 2
    # on a GPU: every batched verify has a fixed shape and is replayed as a CUDA graph (--graphs auto: on
    # exactly when the target is on CUDA; off: the eager batched path, for an A/B in another run)
    python scripts/bench_batch.py --device cuda --dtype bf16 --batch 1 4 16 64 --lookup 10 \
        --drafter outputs/redrafter_smollm2_copy/export --budget --json $OUT/bench_batch_gpu.json
    # where a batched step's time goes: ms per step for prefill, draft, verify, accept and commit (a separate,
    # synced call per method; every method is warmed up first, its CUDA graphs captured before timing)
    python scripts/bench_batch.py --drafter outputs/redrafter_smollm2_copy/export --batch 1 16 --phases
    # FIFO vs length-aware admission (S3 predictor from scripts/train_length_predictor.py) vs the oracle order
    python scripts/bench_batch.py --requests 32 --batch 4 8 --max-new-tokens 128 --scheduler fifo length oracle \
        --length-predictor outputs/redrafter_smollm2/length_predictor.safetensors

Prints tokens/s (all requests' new tokens over the wall time of the batched call), tokens per step and the
speedup over batched AR at the same batch size and over batch-1 AR; every output is checked against the
batch-1 AR output of its request. Continuous batching: finished rows are refilled from the queue, in arrival
order (`fifo`), longest predicted response first (`length`, timed including the prediction) or longest
measured response first (`oracle`, the FIFO run's lengths: an upper bound for any predictor). `groups` /
`oracle_groups` serve S3's length groups within the KV memory FIFO uses at each batch size (eval/grouped.py):

    python scripts/bench_batch.py --requests 64 --batch 4 16 --max-new-tokens 128 \
        --scheduler fifo groups oracle_groups --length-predictor outputs/redrafter_smollm2/length_predictor.safetensors
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch


def report_predictions(predicted: list[float], actual: list[int], edges: tuple[int, ...], cap: int) -> None:
    """How the predictor did on these prompts: bucket accuracy of the predicted expected lengths against the
    measured greedy lengths (capped at `cap`), against always predicting the majority bucket, and the rank
    correlation that the scheduler relies on."""
    from specdraft.eval.length_predictor import bucketize

    true, pred = bucketize(actual, edges), bucketize([round(x) for x in predicted], edges)
    const = int(torch.bincount(true).argmax())
    r = torch.tensor([predicted, actual], dtype=torch.float32).argsort(1).argsort(1).float()  # ranks (2, N)
    rho = float(torch.corrcoef(r)[0, 1]) if len(actual) > 1 else float("nan")
    print(
        f"length predictor on these prompts (max_new_tokens {cap}): bucket accuracy "
        f"{float((pred == true).float().mean()):.3f} vs constant {float((true == const).float().mean()):.3f}; "
        f"rank correlation {rho:.2f}; measured lengths {actual}"
    )


def median_speedups(passes: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (batch, method, scheduler) over the passes: median tok/s, median and range of the speedup over the
    same pass's AR at that batch size, and the node caps settled on (an even number of passes: the mean of the
    middle two, not the upper one)."""
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for rows in passes:
        for r in rows:
            groups.setdefault((r["batch"], r["method"], r["scheduler"]), []).append(r)
    out = []
    for (b, m, sched), rs in groups.items():
        sp = sorted(float(r["speedup_vs_ar_same_batch"] or 0.0) for r in rs)
        rates = sorted(float(r["tokens_per_s"]) for r in rs)
        out.append(
            {
                "batch": b, "method": m, "scheduler": sched, "passes": len(rs),
                "tokens_per_s_median": statistics.median(rates), "speedup_median": statistics.median(sp),
                "speedup_min": sp[0], "speedup_max": sp[-1], "node_caps": [r["node_cap"] for r in rs],
            }
        )  # fmt: skip
    return out


def print_medians(medians: list[dict[str, Any]], console: Any) -> None:
    """The table of `median_speedups`."""
    from rich.table import Table

    t = Table(title="medians over the passes (speedup over the same pass's batched AR)")
    for c in ("batch", "method", "scheduler", "passes", "tok/s", "speedup", "range", "node caps"):
        t.add_column(c)
    for r in medians:
        t.add_row(
            str(r["batch"]), r["method"], r["scheduler"], str(r["passes"]), f"{r['tokens_per_s_median']:.1f}",
            f"{r['speedup_median']:.2f}x", f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}",
            ", ".join(str(c) for c in r["node_caps"]),
        )  # fmt: skip
    console.print(t)


def _row_by_row(factory: Callable[[], Any], wrap: Callable[[Any], Any]) -> Callable[[], Any]:
    """A factory of `wrap(factory())`: the same proposer, drafted one row at a time."""
    return lambda: wrap(factory())


def _probability(p: argparse.ArgumentParser, value: str) -> float | None:
    """A `--min-prob` value: a probability in (0, 1), or None for `auto` (exits with a usage line otherwise)."""
    from specdraft.conf.validate import is_probability

    if value == "auto":
        return None
    if not is_probability(value):
        p.error(f"--min-prob {value}: expected a probability in (0, 1) or auto")
    return float(value)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run every method at every batch size and scheduler, print (and save) the table."""
    from specdraft.eval.bench_common import add_target_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--scheduler",
        nargs="+",
        default=["fifo"],
        choices=["fifo", "length", "oracle", "groups", "oracle_groups"],
    )
    p.add_argument(
        "--length-predictor", default=None, help="predictor file (needed by --scheduler length/groups)"
    )
    p.add_argument(
        "--reserve-quantile", type=float, default=0.9, help="groups: bucket bound at this quantile"
    )
    p.add_argument(
        "--budget",
        action="store_true",
        help="a node budget per (batch size, drafter): fitted (eval.node_budget=fit; with --bandit a bandit)",
    )
    p.add_argument(
        "--bandit",
        action="store_true",
        help="with --budget: a per-step bandit per (batch size, drafter) instead of a fitted budget "
        "(eval.node_budget=bandit, auto on a CPU in evaluate.py)",
    )
    p.add_argument(
        "--budget-memory",
        type=int,
        default=192,
        help="with --budget: eval.node_budget_memory (probe steps of every fit that rate the caps; 0: the newest 48)",
    )
    p.add_argument(
        "--cap",
        type=int,
        default=None,
        help="every drafter's trees cut to this many nodes at every batch size, no fitting (instead of --budget)",
    )
    p.add_argument(
        "--min-prob",
        nargs="+",
        default=[],
        help="ReDrafter drafters again with beam positions below each of these drafter probabilities pruned "
        "(eval.draft_min_prob: rows draft only where the drafter is confident; a batched verify leaves the "
        "pruned nodes out of its products); auto: per batch size, the probability at which a node pays for "
        "its verify on that batch's measured cost curve (eval.budget.marginal_min_prob)",
    )
    p.add_argument(
        "--width",
        action="store_true",
        help="every drafter (and --lookup) again with one verify width per batched step, chosen from every row's "
        "calibrated confidence, with a fallback to plain steps (eval.batch_width=auto; name@width; within --cap "
        "if given)",
    )
    p.add_argument(
        "--draft-rows",
        default="together",
        choices=["together", "each", "both"],
        help="drafters: every row in one call where the family can (together), one call per row (each: the "
        "old way), or both side by side (an A/B in one run)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="> 1: run every pass this many times and add a table of median tok/s and median speedup "
        "(each pass's speedup over the AR of that pass) per batch size and method",
    )
    p.add_argument(
        "--graphs", default="auto", help="auto | on | off: fixed-shape batched verify as CUDA graphs"
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="also one call per (batch size, method) synced at every phase boundary: ms per step for prefill, "
        "draft, verify, accept and commit, and the time outside the verify as a fraction of it",
    )
    p.add_argument(
        "--prefill-rows",
        type=int,
        default=0,
        help="admitted rows prefilled per forward (eval.prefill_rows; 0: all on CUDA, 1 on a CPU)",
    )
    p.add_argument(
        "--refill-rows",
        type=int,
        default=0,
        help="free rows before queued requests are admitted (eval.refill_rows; 0: B/4 on CUDA, 1 on a CPU)",
    )
    a = p.parse_args(argv)
    if a.refill_rows < 0:
        p.error(f"--refill-rows {a.refill_rows}: use 0 (auto) or a row count >= 1")
    if a.prefill_rows < 0:
        p.error(f"--prefill-rows {a.prefill_rows}: use 0 (auto) or a row count >= 1")
    if a.budget_memory < 0:
        p.error(
            f"--budget-memory {a.budget_memory}: expected a step count >= 0 (0: the newest fit's steps only)"
        )
    if a.cap is not None and (a.budget or a.cap < 1):
        p.error("--cap takes a node count >= 1 and replaces --budget")
    probs = [_probability(p, v) for v in a.min_prob]  # None: auto

    from rich.console import Console

    from specdraft.eval.bench_common import first_turns, load_bench, write_json
    from specdraft.eval.decode import model_device
    from specdraft.eval.graphs import graphs_wanted, report_captures
    from specdraft.eval.proposers import PromptLookupProposer, make_proposer, pruned_factories
    from specdraft.eval.throughput import (
        Factory,
        print_phases,
        print_throughput,
        pruned_method,
        throughput_rows,
        width_method,
    )

    bench = load_bench(a)
    model, stop = bench.model, bench.stop_ids
    requests = first_turns(bench.tokenizer, a.bench, a.requests)
    methods: list[tuple[str, Factory]] = [("ar", None)]
    # one drafter module shared by every row's proposer (rows are drafted in one call where the family can:
    # eval.decode.RowBatchedProposer); int8 vocabulary heads and EAGLE layers (eval.draft_block=auto) on CPU, as
    # evaluate.py drafts
    # with graphs (a GPU) each row's draft step takes its fixed shape and CUDA graph, as evaluate.py's
    g = graphs_wanted(model_device(model), a.graphs)
    fixed = dict(int8_head=True, draft_block="auto", static=g, graphs=g)
    methods += [(name, partial(make_proposer, d, **fixed)) for name, d in bench.drafters]
    if a.lookup_branch:  # each drafter again, prompt lookup's chain merged into its trees (eval/hybrid.py)
        n = a.lookup_branch
        methods += [
            (f"{name}+lookup", partial(make_proposer, d, lookup_tokens=n, **fixed))
            for name, d in bench.drafters
        ]
    if a.draft_rows != "together":  # the same proposers drafted one row at a time
        from specdraft.eval.batch_decode import OneRowAtATime

        each = [(f"{n} (rows each)", _row_by_row(cast(Callable, f), OneRowAtATime)) for n, f in methods[1:]]
        methods = [methods[0], *each] if a.draft_rows == "each" else [*methods, *each]
    for prob in probs:  # confidence-pruned trees (ReDrafter's beam positions below prob dropped)
        for name, d in bench.drafters:
            make = pruned_factories(d, **fixed)
            if make is None:
                print(f"--min-prob: {name} is not a ReDrafter: left out")
            else:
                methods.append(pruned_method(name, make, prob))
    if a.width:  # every drafter again, its trees cut each step to the width the batch's confidence pays for
        methods += [width_method(name, partial(make_proposer, d, **fixed)) for name, d in bench.drafters]
    if a.lookup:
        lookup = (f"lookup:{a.lookup}", partial(PromptLookupProposer, a.lookup))
        methods.append(lookup)
        if a.width:  # prompt lookup's chains cut each step to the width its calibrated ranks pay for
            methods.append(width_method(*lookup))
    predicted, reserve, predict_s = None, None, 0.0
    if {"length", "groups"} & set(a.scheduler):
        if not a.length_predictor:
            p.error("--scheduler length/groups needs --length-predictor")
        from specdraft.eval.length_predictor import load_length_predictor, prompt_features

        predictor = load_length_predictor(a.length_predictor)
        t0 = time.perf_counter()
        feats = prompt_features(model, requests, predictor.signal)  # (N, F)
        predicted = predictor.expected_length(feats).clamp(max=a.max_new_tokens).tolist()
        reserve = predictor.reserve_length(feats, a.max_new_tokens, a.reserve_quantile).tolist()
        predict_s = time.perf_counter() - t0
        print(f"predicted lengths ({predictor.signal}, {predict_s:.2f} s): {[round(x) for x in predicted]}")
        print(f"reserves at quantile {a.reserve_quantile}: {reserve}")
    passes: list[list[dict[str, Any]]] = []
    for rep in range(a.repeats):  # whole passes, so a machine's drift hits every method alike
        rows = throughput_rows(
            model, Path(a.bench).stem, requests, methods, a.batch, a.max_new_tokens, stop,
            schedulers=a.scheduler, predicted=predicted, predict_s=predict_s, reserve=reserve,
            node_budget=a.budget, bandit=a.bandit, cuda_graphs=a.graphs, node_cap=a.cap, prefill_rows=a.prefill_rows,
            phases=a.phases, refill_rows=a.refill_rows, budget_memory=a.budget_memory,
        )  # fmt: skip
        for r in rows:
            r["repeat"] = rep
        passes.append(rows)
    print_throughput(passes[-1], Console(width=160))
    print_phases(passes[-1], Console(width=160))
    medians = median_speedups(passes) if a.repeats > 1 else []
    if medians:
        print_medians(medians, Console(width=160))
    if predicted is not None:
        report_predictions(predicted, passes[-1][0]["output_lengths"], predictor.edges, a.max_new_tokens)
    report_captures()
    write_json(a.json, model, {"rows": [r for rows in passes for r in rows], "medians": medians})


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
