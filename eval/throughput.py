"""Throughput against batch size (`eval.batch_sizes`): batched AR and each drafter on the same requests.

For every batch size B, `BatchDecoder(model, B)` serves all first turns of a benchmark with continuous
batching (FIFO refill), greedy, once as AR and once per drafter (one proposer per row). Reported per
(benchmark, B, method): tokens/s over the whole call, tokens per step and request, the speedup over batched
AR at the same B and over batch-1 AR (when B = 1 is measured), and how many outputs equal batch-1 AR's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.decode import Proposer

Factory = Callable[[], Proposer] | None  # None: AR


def throughput_rows(
    model: torch.nn.Module,
    bench: str,
    prompts: list[list[int]],
    methods: list[tuple[str, Factory]],
    batch_sizes: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    log: Callable[[str], None] = lambda msg: print(msg, flush=True),
) -> list[dict[str, Any]]:
    """One record per (batch size, method); `methods[0]` must be AR (factory None), the reference.

    Args:
        model: the target.
        bench: benchmark label.
        prompts: the requests' prompt ids.
        methods: (name, proposer factory) pairs.
        batch_sizes: B values, in order.
        max_new_tokens: per request.
        stop_ids: end-of-generation tokens.
    """
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    batch1_ar: float | None = None
    for b in batch_sizes:
        dec = BatchDecoder(model, b)
        dec.generate(prompts[:b], 4, stop_ids)  # warm-up (allocator, kernels)
        ar_rate = 0.0
        for name, factory in methods:
            out = dec.generate(prompts, max_new_tokens, stop_ids, factory)
            toks = [t for t, _ in out]
            rate = out[0][1].batch.tokens_per_s if out else 0.0
            if factory is None:
                ar_rate = rate
                if b == 1:
                    batch1_ar = rate
                reference = toks if reference is None or b == 1 else reference
            steps = sum(st.steps for _, st in out)
            rows.append(
                {
                    "bench": bench,
                    "batch": b,
                    "method": name,
                    "tokens_per_s": rate,
                    "tokens_per_step": sum(len(t) for t in toks) / max(steps, 1),
                    "speedup_vs_ar_same_batch": rate / ar_rate if ar_rate else None,
                    "speedup_vs_batch1_ar": rate / batch1_ar if batch1_ar else None,
                    "identical": sum(x == y for x, y in zip(toks, reference or toks)),
                    "requests": len(prompts),
                }
            )
            log(f"[throughput {bench}] batch {b} {name}: {rate:.1f} tok/s")
    return rows


def print_throughput(rows: list[dict[str, Any]], console=None) -> None:
    """A rich table per benchmark: tokens/s and speedups against batch size."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for bench in dict.fromkeys(r["bench"] for r in rows):
        table = Table(title=f"{bench}: throughput vs batch size (greedy, continuous batching, FIFO)")
        for col in (
            "batch",
            "method",
            "tok/s",
            "tok/step/request",
            "vs AR same batch",
            "vs batch-1 AR",
            "same as AR",
        ):
            table.add_column(col)
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        for r in (r for r in rows if r["bench"] == bench):
            table.add_row(
                str(r["batch"]), r["method"], f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_step']:.2f}",
                fmt(r["speedup_vs_ar_same_batch"]), fmt(r["speedup_vs_batch1_ar"]), f"{r['identical']}/{r['requests']}",
            )  # fmt: skip
        console.print(table)


def plot_throughput(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """tokens/s against batch size, one line per method, one PNG per benchmark (`throughput_<bench>.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for bench in dict.fromkeys(r["bench"] for r in rows):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        mine = [r for r in rows if r["bench"] == bench]
        for m in dict.fromkeys(r["method"] for r in mine):
            pts = [(r["batch"], r["tokens_per_s"]) for r in mine if r["method"] == m]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s (all requests)")
        ax.set_title(f"{bench}: throughput")
        ax.legend(fontsize=7)
        paths.append(out_dir / f"throughput_{bench}.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths
