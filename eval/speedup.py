"""Speedup summaries, tables and plots from per-call records (`runner.run_benchmark`).

Definitions (per group of records, e.g. one benchmark x method, or one category x method):
  * tokens/s        = total new tokens / total wall time of the generate calls (prefill included);
  * speedup         = method tokens/s / its reference's tokens/s on the same prompts (`ar` for our
                      drafters, `hf_ar` = plain `model.generate` for the transformers baselines);
  * tokens/step     = tokens emitted per target forward in the decode phase = mean(accepted drafts + 1)
                      for our decoder; (new tokens - 1) / (target forwards - 1) for `model.generate`;
  * acceptance rate = accepted drafts / (steps x draft length) (our drafters only).
"""

from __future__ import annotations

import io
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.utils import atomic_write_bytes

if TYPE_CHECKING:
    from rich.console import Console


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def summarize(
    records: list[dict[str, Any]], by_category: bool = False, by_turn: bool = False
) -> list[dict[str, Any]]:
    """One summary record per bench x method (x category, or x turn: MT-Bench's first and second turns), in
    first-seen order."""
    keys: tuple[str, ...] = ("bench", "method")
    if by_category or by_turn:
        keys = ("bench", "category" if by_category else "turn", "method")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in keys)].append(r)
    rate = {
        g: _rate(sum(r["new_tokens"] for r in rs), sum(r["time_s"] for r in rs)) for g, rs in groups.items()
    }
    out = []
    for g, rs in groups.items():
        head = dict(zip(keys, g))
        ref_key = tuple(rs[0]["reference"] if k == "method" else head[k] for k in keys)
        ref_rate = rate.get(ref_key, 0.0)
        kind = rs[0]["kind"]
        rec: dict[str, Any] = {**head, "kind": kind, "reference": rs[0]["reference"], "prompts": len(rs)}
        if kind == "spec":
            acc = [a for r in rs for a in r["accepted"]]
            steps = max(len(acc), 1)
            rec["tokens_per_step"] = (sum(acc) + len(acc)) / steps
            d = rs[0].get("draft_len")
            rec["acceptance_rate"] = sum(acc) / (steps * d) if d else None
            comps = [r["mean_compression"] for r in rs if r.get("mean_compression")]
            rec["compression"] = sum(comps) / len(comps) if comps else None
            rec["mean_tree_size"] = sum(r["mean_tree_size"] for r in rs) / len(rs)
        elif kind == "hf":
            fwd = sum(r["steps"] for r in rs)
            rec["tokens_per_step"] = sum(max(r["new_tokens"] - 1, 0) for r in rs) / fwd if fwd else None
            rec["acceptance_rate"] = None
        else:
            rec["tokens_per_step"], rec["acceptance_rate"] = 1.0, None
        rec["new_tokens"] = sum(r["new_tokens"] for r in rs)
        rec["time_s"] = sum(r["time_s"] for r in rs)
        rec["ar_tokens_per_s"] = ref_rate
        rec["spec_tokens_per_s"] = rate[g]
        rec["speedup"] = rate[g] / ref_rate if ref_rate > 0 else None
        if any("identical" in r for r in rs):
            divs = [r["divergence"] for r in rs if not r.get("identical", True)]
            rec["identical"] = sum(bool(r.get("identical")) for r in rs)
            rec["total"] = len(rs)
            rec["near_tie_divergences"] = sum(bool(d and d["near_tie"]) for d in divs)
        if kind == "spec" and any(r.get("profile") for r in rs):
            rec["profile_s"] = {k: sum(r["profile"][k] for r in rs) for k in rs[0]["profile"]}
        out.append(rec)
    return out


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_tables(
    summary: list[dict],
    categories: list[dict],
    console: Console | None = None,
    turns: list[dict] | None = None,
) -> None:
    """Rich tables: one per benchmark (all methods) and one per benchmark x category, with a row per turn
    below the categories where the benchmark has more than one (`turns`: `summarize(..., by_turn=True)`)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    for bench in dict.fromkeys(s["bench"] for s in summary):
        rows = [s for s in summary if s["bench"] == bench]
        lossless = any("identical" in s for s in rows)
        t = Table(title=f"{bench}: speedup over autoregressive decoding (same prompts, same process)")
        for col in ["method", "vs", "tokens/step", "accept rate", "ref tok/s", "tok/s", "speedup"]:
            t.add_column(col, justify="left" if col in ("method", "vs") else "right")
        if lossless:
            t.add_column("identical", justify="right")
            t.add_column("near-tie div.", justify="right")
        for s in rows:
            cells = [
                s["method"],
                s["reference"] if s["method"] != s["reference"] else "",
                _fmt(s["tokens_per_step"], ".2f"),
                _fmt(s["acceptance_rate"], ".1%"),
                _fmt(s["ar_tokens_per_s"], ".1f"),
                _fmt(s["spec_tokens_per_s"], ".1f"),
                _fmt(s["speedup"], ".2f") + ("x" if s["speedup"] is not None else ""),
            ]
            if lossless:
                same = f"{s['identical']}/{s['total']}" if "identical" in s else "-"
                cells += [same, str(s.get("near_tie_divergences", "-"))]
            t.add_row(*cells)
        console.print(t)
        cats = [c for c in categories if c["bench"] == bench and c["kind"] != "ar" and c["method"] != "hf_ar"]
        if not cats:
            continue
        methods = list(dict.fromkeys(c["method"] for c in cats))
        by_turn = [c for c in turns or [] if c["bench"] == bench and c["method"] in methods]
        groups = [
            (cat, [c for c in cats if c["category"] == cat])
            for cat in dict.fromkeys(c["category"] for c in cats)
        ]
        turn_rows = [
            (f"turn {n}", [c for c in by_turn if c["turn"] == n])
            for n in dict.fromkeys(c["turn"] for c in by_turn)
        ]
        turn_rows = turn_rows if len(turn_rows) > 1 else []
        split = "category and turn" if turn_rows else "category"
        t = Table(title=f"{bench}: per {split} (speedup | tokens/step)")
        t.add_column(split.replace(" and ", " / "))
        for m in methods:
            t.add_column(m, justify="right")
        for i, (label, group) in enumerate(groups + turn_rows):
            if i == len(groups):
                t.add_section()  # the same methods split by turn instead
            row = {c["method"]: c for c in group}
            t.add_row(
                label,
                *[
                    f"{_fmt(row[m]['speedup'], '.2f')}x | {_fmt(row[m]['tokens_per_step'], '.2f')}"
                    if m in row
                    else "-"
                    for m in methods
                ],
            )
        console.print(t)


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def write_plots(records: list[dict], categories: list[dict], out_dir: Path) -> list[Path]:
    """Accepted-length histogram and per-category speedup, one PNG each per benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for bench in dict.fromkeys(r["bench"] for r in records):
        spec = [r for r in records if r["bench"] == bench and r["kind"] == "spec"]
        methods = list(dict.fromkeys(r["method"] for r in spec))
        if methods:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            top = max(max(r["accepted"], default=0) for r in spec)
            width = 0.8 / len(methods)
            for i, m in enumerate(methods):
                acc = [a for r in spec if r["method"] == m for a in r["accepted"]]
                freq = [acc.count(k) / max(len(acc), 1) for k in range(top + 1)]
                ax.bar([k + i * width for k in range(top + 1)], freq, width=width, label=m)
            ax.set_xlabel("accepted draft tokens per step")
            ax.set_ylabel("fraction of steps")
            ax.set_title(f"{bench}: accepted length")
            ax.legend(fontsize=7)
            paths.append(out_dir / f"accept_hist_{bench}.png")
            _save(fig, paths[-1])
            plt.close(fig)
        cats = [c for c in categories if c["bench"] == bench and c["kind"] != "ar" and c["method"] != "hf_ar"]
        if cats:
            names = list(dict.fromkeys(c["category"] for c in cats))
            ms = list(dict.fromkeys(c["method"] for c in cats))
            fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.9), 3.5))
            width = 0.8 / len(ms)
            for i, m in enumerate(ms):
                val = {c["category"]: c["speedup"] or 0.0 for c in cats if c["method"] == m}
                ax.bar(
                    [j + i * width for j in range(len(names))],
                    [val.get(n, 0.0) for n in names],
                    width=width,
                    label=m,
                )
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_xticks(
                [j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, ha="right", fontsize=8
            )
            ax.set_ylabel("speedup over AR")
            ax.set_title(f"{bench}: speedup per category")
            ax.legend(fontsize=7)
            paths.append(out_dir / f"category_speedup_{bench}.png")
            _save(fig, paths[-1])
            plt.close(fig)
    return paths
