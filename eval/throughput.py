"""Throughput against batch size (`eval.batch_sizes`): batched AR and each drafter on the same requests.

For every batch size B, `BatchDecoder(model, B)` serves all first turns of a benchmark with continuous
batching, greedy, once as AR and once per drafter (one proposer per row), under each scheduler (`fifo`:
arrival order; `length`: longest predicted response first, `eval/scheduler.py`; `oracle`: longest measured
response first, an upper bound; `groups` / `oracle_groups`: S3's length groups under the KV memory that FIFO
uses at batch B, B x (longest prompt + max_new_tokens) tokens, each group with its own batch size
(`eval/grouped.py`), by the predicted reserve or by the measured lengths). Reported per (benchmark, B, method,
scheduler): tokens/s over the whole call (`length` and `groups` include the time spent predicting), tokens per
step and request, row utilisation, the speedup over batched AR at the same B and scheduler, over batch-1 AR
(when B = 1 is measured) and over the same method under FIFO, and how many outputs equal batch-1 AR's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from specdraft.eval.bandit_budget import BanditBudget
from specdraft.eval.batch_decode import (
    PHASES,
    BatchDecoder,
    cache_margin,
    make_batch_decoder,
    rows_budget_for,
)
from specdraft.eval.batch_width import WidthPolicy
from specdraft.eval.budget import SIZES, CapPolicy, CostCurve, NodeBudget, marginal_min_prob
from specdraft.eval.decode import Proposer
from specdraft.eval.grouped import GroupedStats, add_call, serve_grouped
from specdraft.eval.scheduler import SCHEDULERS, schedule_order

if TYPE_CHECKING:
    from rich.console import Console


@dataclass(frozen=True)
class PerBatchFactory:
    """A method whose proposers depend on the batch size's per-row verify cost (`BatchDecoder.row_cost_curve`):
    `make(threshold(curve))` is the proposer factory at that batch size, e.g. a ReDrafter whose `min_prob` is
    `budget.marginal_min_prob` of the curve (confident nodes only, fewer as the batch grows)."""

    threshold: Callable[[CostCurve], float]  # the setting at a batch size, from its per-row cost curve
    make: Callable[[float], Callable[[], Proposer]]  # setting -> proposer factory


@dataclass(frozen=True)
class PerStepWidth:
    """A method served with one verify width per batched step chosen from every row's calibrated confidence
    (`batch_width.WidthPolicy` on the batch size's per-row cost curve), instead of a node budget."""

    make: Callable[[], Proposer]  # the method's proposer factory (full trees)


Factory = Callable[[], Proposer] | PerBatchFactory | PerStepWidth | None  # None: AR


def width_method(name: str, factory: Callable[[], Proposer]) -> tuple[str, Factory]:
    """The method `name` again, its trees cut each step to the width the batch's confidence pays for
    (`name@width`, `eval.batch_width=auto`)."""
    return f"{name}@width", PerStepWidth(factory)


def pruned_method(
    name: str, make: Callable[[float], Callable[[], Proposer]], min_prob: float | None
) -> tuple[str, Factory]:
    """The method `name` with its trees pruned below drafter probability `min_prob` (`name@p=0.3`), or below each
    batch size's break-even (None: `name@p=auto`, `budget.marginal_min_prob` of that batch's cost curve).

    Args:
        name: the unpruned method's name.
        make: min_prob -> proposer factory (`proposers.pruned_factories`).
        min_prob: a probability in (0, 1), or None for auto.
    """
    if min_prob is None:
        return f"{name}@p=auto", PerBatchFactory(marginal_min_prob, make)
    return f"{name}@p={min_prob:g}", make(min_prob)


def throughput_rows(
    model: torch.nn.Module,
    bench: str,
    prompts: list[list[int]],
    methods: list[tuple[str, Factory]],
    batch_sizes: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    log: Callable[[str], None] = lambda msg: print(msg, flush=True),
    schedulers: Sequence[str] = ("fifo",),
    predicted: Sequence[float] | None = None,
    predict_s: float = 0.0,
    reserve: Sequence[int] | None = None,
    node_budget: bool = False,
    bandit: bool = False,
    sample: dict[str, Any] | None = None,
    budget_refit: int = 128,
    budget_refit_scale: int = 4,
    budget_confidence: float = 1.0,
    budget_refit_on_call: bool = True,
    budget_memory: int = 192,
    cuda_graphs: str = "auto",
    node_cap: int | None = None,
    prefill_rows: int = 0,
    phases: bool = False,
    refill_rows: int = 0,
) -> list[dict[str, Any]]:
    """One record per (batch size, method, scheduler); `methods[0]` must be AR (factory None), the reference.

    Every method is warmed up at every batch size before it is timed (`warm_up`: its CUDA graphs captured, its
    proposers kept for the timed calls), on a cache sized once for all methods, so no timed call captures a
    graph or reallocates the cache.

    Args:
        model: the target.
        bench: benchmark label.
        prompts: the requests' prompt ids.
        methods: (name, proposer factory) pairs.
        batch_sizes: B values, in order.
        max_new_tokens: per request.
        stop_ids: end-of-generation tokens.
        schedulers: admission orders to measure, each on the same prompts (`fifo` | `length` | `oracle`);
            `oracle` follows the method's FIFO output lengths at the same B (so `fifo` must come first).
        predicted: (N,) predicted response lengths, needed by `length`.
        predict_s: wall time spent predicting them, added to every `length` / `groups` call's time.
        reserve: (N,) predicted response bounds (`LengthPredictor.reserve_length`), needed by `groups`.
        node_budget: fit a `NodeBudget` per (B, drafter) on B's measured per-row cost curve
            (`BatchDecoder.row_cost_curve`), shared by that drafter's scheduler runs at B (`eval.node_budget`);
            from the second batch size on it starts from the previous one's gain curve (`NodeBudget.warm_start`).
        bandit: with `node_budget`, a `BanditBudget` per (B, drafter) instead: each batched step's cap chosen
            from the measured tokens per second of that batch size (`eval.node_budget=bandit`, `auto` on a CPU);
            B's cost curve only bounds its arms. Each batch size learns afresh; only batch 1 learns per context
            (the step before a hit or a miss): a batched step's outcome mixes rows in and out of their streaks,
            and each context explores every arm (session 69: 1.05 nodes a step at batch 16 with one bandit,
            1.08-1.14 with contexts).
        budget_refit: batched steps after a budget settles on no drafting before it is refitted (0: no
            refits at all; `eval.node_budget_refit`).
        budget_refit_scale: a refit drafts trees of at most this many times the settled cap, >= 4 nodes (0:
            full-size trees; `eval.node_budget_refit_scale`).
        budget_confidence: drafting turns on only if the best size beats plain steps with its gain this many
            standard errors lower (`NodeBudget.confidence`, `eval.node_budget_confidence`).
        budget_refit_on_call: a batched call refits a budget settled on no drafting (`NodeBudget.refit_on_call`).
        budget_memory: probe steps over every fit that rate the caps (`NodeBudget.memory`, `eval.node_budget_memory`).
        node_cap: every drafter's trees cut to this many nodes at every batch size, no fitting
            (`NodeBudget.fixed`; instead of `node_budget`).
        sample: temperature / top_k / top_p / seed to sample every row (None: greedy); each call draws from
            a generator seeded with `seed`, and `identical` is then None (outputs are samples, not AR's).
        cuda_graphs: `eval.cuda_graphs` (auto | on | off): the batch decoders' fixed-shape, graph-captured
            verify (`batch_decode.make_batch_decoder`; auto: on exactly when the target is on CUDA).
        prefill_rows: admitted rows prefilled per forward (`eval.prefill_rows`; 0: all on CUDA, 1 on a CPU).
        refill_rows: free rows before queued requests are admitted (`eval.refill_rows`; 0: a quarter of the
            rows on CUDA, 1 on a CPU: `batch_decode.auto_refill_rows`).
        phases: after each method's timed calls, one more FIFO call with the device synced at every phase
            boundary: its ms per batched step and phase (`batch_decode.PHASES`) go into the FIFO record as
            `phase_ms_per_step` (the timed calls stay unsynced).
    """
    for s in schedulers:
        if s not in SCHEDULERS:
            raise ValueError(f"scheduler {s!r}: expected one of {', '.join(SCHEDULERS)}")
    if "length" in schedulers and (predicted is None or len(predicted) != len(prompts)):
        raise ValueError("the length scheduler needs one predicted length per prompt")
    if "groups" in schedulers and (reserve is None or len(reserve) != len(prompts)):
        raise ValueError("the groups scheduler needs one reserve per prompt")
    if {"oracle", "oracle_groups"} & set(schedulers) and schedulers[0] != "fifo":
        raise ValueError("the oracle schedulers read the FIFO run's lengths: list fifo first")
    worst = max((len(p) for p in prompts), default=0) + max_new_tokens  # FIFO's reserve per row
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    batch1_ar: float | None = None
    fitted: dict[str, NodeBudget] = {}  # per method: its budget at the previous batch size (gains carry over)
    learnt: dict[str, WidthPolicy] = {}  # per method: its width policy at the previous batch size
    for b in batch_sizes:
        dec = make_batch_decoder(model, b, cuda_graphs, prefill_rows=prefill_rows, refill_rows=refill_rows)
        ar_rate: dict[str, float] = {}
        per_batch = any(isinstance(f, PerBatchFactory | PerStepWidth) for _, f in methods)
        wanted = (node_budget and any(f for _, f in methods)) or per_batch
        curve = dec.row_cost_curve(log=log) if wanted else None
        made: list[tuple[str, Callable[[], Proposer] | None, float | None]] = []  # (name, factory, setting)
        by_width: set[str] = set()  # the methods served with a per-step width
        for name, method in methods:
            if isinstance(method, PerStepWidth):
                made.append((name, method.make, None))
                by_width.add(name)
            elif isinstance(method, PerBatchFactory):
                assert curve is not None
                value = method.threshold(curve)
                made.append((name, method.make(value), value))
                log(
                    f"[throughput {bench}] batch {b} {name}: setting {value:.3f} from this batch's cost curve"
                )
            else:
                made.append((name, method, None))
        # one cache for every method (each call's prompts + budget + largest tree), sized before any capture
        dec.reserve(worst + max(cache_margin(f() if f is not None else None) for _, f, _ in made))
        for name, factory, setting in made:
            fifo_rate, measured = 0.0, None
            budget: CapPolicy | None = None
            width: WidthPolicy | None = None
            if name in by_width:
                assert curve is not None
                width = WidthPolicy(curve)
                if name in learnt:  # the calibration does not depend on the batch size
                    width.learn_from(learnt[name])
                learnt[name] = width
            if node_cap is not None and factory:  # (a width policy chooses within the fixed cap)
                budget = NodeBudget.fixed(node_cap)
            elif curve and factory and node_budget and width is None and bandit:
                budget = BanditBudget(curve, label=f"{name} at batch {b}", contexts=b == 1)
            elif curve and factory and node_budget and width is None:
                budget = NodeBudget(
                    curve,
                    label=f"{name} at batch {b}",
                    refit_gap=budget_refit,
                    refit_scale=budget_refit_scale,
                    confidence=budget_confidence,
                    refit_on_call=budget_refit_on_call,
                    memory=budget_memory,
                    trim_slowest=dec.graphs,  # captures happen only under graphs
                )
                if name in fitted:  # its gain curve from the previous batch size
                    budget.warm_start(fitted[name])
                fitted[name] = budget
            warm_up(dec, prompts, max_new_tokens, stop_ids, factory, budget, node_cap, width is not None)
            first = len(rows)  # this method's first record (its FIFO one when fifo is measured)
            for sched in schedulers:
                kw = _sample_kw(sample, model)
                extra = predict_s if sched in ("length", "groups") else 0.0
                if sched.endswith("groups"):
                    bound = reserve if sched == "groups" else measured
                    nodes = None  # (not collected across groups)
                    toks, gs = serve_grouped(
                        model, prompts, list(bound or []), max_new_tokens, b * worst, stop_ids, factory,
                        budget=budget, sample=kw, cuda_graphs=cuda_graphs, width=width,
                    )  # fmt: skip
                else:
                    lengths = measured if sched == "oracle" else predicted
                    order = schedule_order(sched, len(prompts), lengths)
                    out = dec.generate(
                        prompts,
                        max_new_tokens,
                        stop_ids,
                        factory,
                        order=order,
                        budget=budget,
                        width=width,
                        **kw,
                    )
                    toks = [t for t, _ in out]
                    sizes = [n for _, st in out for n in st.tree_sizes]
                    nodes = sum(sizes) / len(sizes) if sizes else None
                    gs = GroupedStats(
                        time_s=out[0][1].batch.time_s if out else 0.0, new_tokens=sum(map(len, toks))
                    )
                    add_call(gs, out, b, worst)  # one continuous batch of b rows
                rate = gs.new_tokens / max(gs.time_s + extra, 1e-9)
                if sched == "fifo":
                    fifo_rate, measured = rate, [len(t) for t in toks]
                if factory is None:
                    ar_rate[sched] = rate
                    if b == 1 and sched == schedulers[0]:
                        batch1_ar = rate
                    reference = toks if reference is None or b == 1 else reference
                ar = ar_rate.get(sched)
                rows.append(
                    {
                        "bench": bench,
                        "batch": b,
                        "method": name,
                        "scheduler": sched,
                        "tokens_per_s": rate,
                        "tokens_per_step": sum(len(t) for t in toks) / max(gs.request_steps, 1),
                        "batch_steps": gs.steps,
                        "nodes_per_step": nodes,  # verified tree nodes per request and step (1: AR)
                        "idle_row_steps": gs.idle_row_steps,
                        "row_utilisation": gs.row_utilisation if gs.groups else None,
                        "kv_budget": b
                        * worst,  # KV tokens: FIFO's B rows at the worst case; groups stay within
                        "group_batch_sizes": gs.batch_sizes or [b],
                        "overflows": gs.overflows,
                        "predict_s": extra,
                        "node_cap": budget.cap if budget else None,  # after this call (1: no drafting)
                        "budget_refits": budget.refits if budget else None,  # fits redone so far
                        "setting": setting,  # a PerBatchFactory's value at this batch size (else None)
                        "width_fallbacks": width.fallbacks
                        if width
                        else None,  # per-step width: pauses so far
                        "speedup_vs_ar_same_batch": rate / ar if ar else None,
                        "speedup_vs_batch1_ar": rate / batch1_ar if batch1_ar else None,
                        "speedup_vs_fifo": rate / fifo_rate if fifo_rate else None,
                        "identical": None if sample else sum(x == y for x, y in zip(toks, reference or toks)),
                        "requests": len(prompts),
                        "output_lengths": [len(t) for t in toks],  # per request, in request order
                    }
                )
                log(
                    f"[throughput {bench}] batch {b} {name} {sched}: {rate:.1f} tok/s, "
                    f"{rows[-1]['batch_steps']} steps, rows used {rows[-1]['row_utilisation'] or 0:.0%}"
                )
            if phases:
                out = dec.generate(
                    prompts, max_new_tokens, stop_ids, factory, budget=budget, profile=True, width=width,
                    **_sample_kw(sample, model),
                )  # fmt: skip
                st = out[0][1].batch if out else None
                steps = max(st.steps, 1) if st else 1
                rows[first]["phase_ms_per_step"] = {
                    k: 1000 * (st.phase_s.get(k, 0.0) if st else 0.0) / steps for k in PHASES
                }
                rows[first]["profiled_tokens_per_s"] = st.tokens_per_s if st else None
    return rows


def warm_up(
    dec: BatchDecoder,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    factory: Callable[[], Proposer] | None,
    budget: CapPolicy | None,
    node_cap: int | None,
    widths: bool = False,
) -> None:
    """Serve the first B prompts once with `factory` (None: AR) before its timed calls, the rows finishing one
    by one (budgets 2, 4, ..., 2B tokens), so every padded row count drafts and every tree size verifies once:
    on a GPU each of their CUDA graphs is captured here, not inside a timed call, and the factory's proposers
    (with their draft graphs) stay with `dec` for the timed calls (`BatchDecoder.proposers_for`). A drafter
    runs at its full trees, or at `node_cap`; with a fitted `budget` under graphs, at each size the budget
    may settle on too (each under its own fixed budget: `budget` itself is not touched), or with `widths` (a
    per-step width policy) under graphs, at every padded width the policy may choose.

    Args:
        dec: the batch decoder of this batch size, its cache already sized (`BatchDecoder.reserve`).
        prompts: the requests (the first B are served).
        max_new_tokens: the timed calls' budget (warm-up budgets stay below it).
        stop_ids: end-of-generation tokens.
        factory: the method's proposer factory, the one its timed calls pass.
        budget: the method's node budget (fitted or a bandit), if any; node_cap: its fixed cap, if any.
        widths: the method's timed calls choose a width per step (`batch_width.WidthPolicy`).
    """
    few = prompts[: dec.batch_size]
    lengths = [max(1, min(max_new_tokens, 2 * (i + 1))) for i in range(len(few))]
    if factory is None:
        dec.generate(few, lengths, stop_ids)
        return
    caps: list[int | None] = [node_cap] if node_cap is not None else [None]
    if (budget is not None or widths) and node_cap is None and dec.graphs:
        # the proposers the warm-up and the timed calls share; 0: the proposer declares no budget
        full = dec.proposers_for(factory)[0].spec.node_budget or max(SIZES)
        if widths:  # every padded width below the full tree's
            caps += sorted({rows_budget_for(n) for n in range(1, full)} - {rows_budget_for(full)})
        else:
            caps += [c for c in cast(CapPolicy, budget).sizes if 1 < c < full]
    for cap in caps:
        dec.generate(few, lengths, stop_ids, factory, budget=None if cap is None else NodeBudget.fixed(cap))


def _sample_kw(sample: dict[str, Any] | None, model: torch.nn.Module) -> dict[str, Any]:
    """`BatchDecoder.generate` keywords for one call: {} (greedy) or the sampling settings with a fresh
    generator seeded with `sample["seed"]` on the model's device."""
    if not sample or float(sample.get("temperature", 0.0)) <= 0:
        return {}
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(int(sample.get("seed", 0)))
    return {
        "temperature": float(sample["temperature"]),
        "top_k": int(sample.get("top_k", 0)),
        "top_p": float(sample.get("top_p", 1.0)),
        "generator": g,
    }


def _batches(r: dict[str, Any]) -> str:
    """The table's batches cell: `B rows` for one continuous batch, else `n groups of lo-hi rows (k overflows)`."""
    sizes = r.get("group_batch_sizes") or [r["batch"]]
    if len(sizes) == 1 and not r.get("overflows"):
        return f"{sizes[0]} rows"
    return f"{len(sizes)} of {min(sizes)}-{max(sizes)} rows, {r.get('overflows', 0)} overflows"


def print_throughput(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    """A rich table per benchmark: tokens/s and speedups against batch size."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)  # logs: as the speedup table
    for bench in dict.fromkeys(r["bench"] for r in rows):
        table = Table(title=f"{bench}: throughput vs batch size (greedy, continuous batching)")
        for col in (
            "batch",
            "method",
            "scheduler",
            "tok/s",
            "tok/step/request",
            "nodes/step",
            "rows used",
            "vs AR same batch",
            "vs batch-1 AR",
            "vs FIFO",
            "batches",
            "node cap",
            "same as AR",
        ):
            table.add_column(col)
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        for r in (r for r in rows if r["bench"] == bench):
            used = r.get("row_utilisation")
            table.add_row(
                str(r["batch"]), r["method"], r.get("scheduler", "fifo"), f"{r['tokens_per_s']:.1f}",
                f"{r['tokens_per_step']:.2f}", "-" if r.get("nodes_per_step") is None else f"{r['nodes_per_step']:.2f}",
                "-" if used is None else f"{used:.0%}",
                fmt(r["speedup_vs_ar_same_batch"]), fmt(r["speedup_vs_batch1_ar"]), fmt(r.get("speedup_vs_fifo")),
                _batches(r), _cap(r),
                "sampled" if r["identical"] is None else f"{r['identical']}/{r['requests']}",
            )  # fmt: skip
        console.print(table)


def print_phases(rows: list[dict[str, Any]], console: Console | None = None) -> None:
    """Where each method's batched step goes (the records with `phase_ms_per_step`, `throughput_rows(phases=
    True)`): ms per step and phase, the time outside the verify forward (draft + accept + commit) as a
    fraction of it (prefills are per request, not per step, and stay out of it), and the speedup over the
    synced AR call of the same batch size if drafting took no time (`free_draft_speedup`): below 1, no
    drafter of this acceptance can beat batched AR on this machine at this batch size."""
    from rich.console import Console
    from rich.table import Table

    timed = [r for r in rows if r.get("phase_ms_per_step")]
    if not timed:
        return
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title="ms per batched step and phase (a separate call, synced at every phase boundary)")
    cols = ("bench", "batch", "method", *PHASES, "step", "outside verify / verify", "tok/s synced")
    for col in (*cols, "vs AR, drafting free"):
        table.add_column(col)
    for r in timed:
        ph = r["phase_ms_per_step"]
        outside = ph["draft"] + ph["accept"] + ph["commit"]
        ar = next(
            (x for x in timed if (x["bench"], x["batch"], x["method"]) == (r["bench"], r["batch"], "ar")),
            None,
        )
        free = free_draft_speedup(r, ar) if ar is not None else None
        table.add_row(
            r["bench"], str(r["batch"]), r["method"], *(f"{ph[k]:.2f}" for k in PHASES),
            f"{sum(ph.values()):.2f}", f"{outside / max(ph['verify'], 1e-9):.2f}",
            f"{r.get('profiled_tokens_per_s') or 0:.1f}", "-" if free is None else f"{free:.2f}x",
        )  # fmt: skip
    console.print(table)


def free_draft_speedup(method: dict[str, Any], ar: dict[str, Any]) -> float | None:
    """`method`'s synced tokens/s with its draft phase taken out of its time (tok/s x step / (step - draft)),
    over AR's synced tokens/s at the same batch size: the most any drafter with these trees and acceptance can
    reach there. None without the profiled rates."""
    ph, rate, base = (
        method["phase_ms_per_step"],
        method.get("profiled_tokens_per_s"),
        ar.get("profiled_tokens_per_s"),
    )
    step = sum(ph.values())
    if not rate or not base or step - ph["draft"] <= 0:
        return None
    return rate * step / (step - ph["draft"]) / base


def _cap(r: dict[str, Any]) -> str:
    """The table's node cap cell: the cap, with a per-batch setting (`PerBatchFactory`) after it."""
    cap = "-" if r.get("node_cap") is None else str(r["node_cap"])
    return cap if r.get("setting") is None else f"{cap}, p >= {r['setting']:.2f}"


def plot_throughput(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """tokens/s against batch size, one line per (method, scheduler): one colour per method, one line style
    per scheduler (solid FIFO, dashed length-aware, dotted oracle, dash-dot length groups, sparse dots oracle
    groups); one PNG per benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for bench in dict.fromkeys(r["bench"] for r in rows):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        mine = [r for r in rows if r["bench"] == bench]
        styles = {"fifo": "-", "length": "--", "oracle": ":", "groups": "-.", "oracle_groups": (0, (1, 4))}
        for i, m in enumerate(dict.fromkeys(r["method"] for r in mine)):
            for sched in dict.fromkeys(r.get("scheduler", "fifo") for r in mine):
                pts = [
                    (r["batch"], r["tokens_per_s"])
                    for r in mine
                    if r["method"] == m and r.get("scheduler", "fifo") == sched
                ]
                if pts:
                    ax.plot(
                        [p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                        linestyle=styles.get(sched, "-."), label=f"{m} ({sched})",
                    )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s (all requests)")
        ax.set_title(f"{bench}: throughput")
        ax.legend(fontsize=7)
        paths.append(out_dir / f"throughput_{bench}.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths
