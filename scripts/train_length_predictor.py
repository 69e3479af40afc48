"""Train the response-length predictor (S3) for the length-aware batch scheduler on a distilled dataset.

    python scripts/train_length_predictor.py --data outputs/redrafter_smollm2/distilled \\
        --out outputs/redrafter_smollm2/length_predictor.safetensors

Each distilled row gives one example: the prompt (tokens before the first assistant token) and the length of
the target's greedy response to it (`response_lengths[0]`; a response cut at distill's max_new_tokens counts as
that many tokens, i.e. the top bucket). Features are computed with the target for every signal (`length`,
`embed`, `hidden`; the cached bf16 `hidden` column is not used so that training sees exactly the fp32 features
the scheduler computes at serving time). Each signal is scored by k-fold cross-validation (every row predicted
by a probe that did not see it) against the constant baseline (the training folds' majority bucket), with the
Spearman rank correlation of the out-of-fold expected length and the true length (the scheduler sorts by it);
the chosen signal (`--signal`, default: the best cross-validated accuracy, then rank correlation, then the
cheaper) is refitted on all rows and saved (safetensors; the accuracy table is also written beside it as <out>.json,
with the command, wall time and machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def load_examples(path: str) -> tuple[list[list[int]], list[int], dict[str, Any]]:
    """(prompts, first-response lengths, manifest) from a distilled folder; rows without a response skipped."""
    from specdraft.distill.shards import load_distilled

    ds, manifest = load_distilled(path, allow_incomplete=True)
    prompts, lengths = [], []
    for ids, mask, resp in zip(ds["input_ids"], ds["loss_mask"], ds["response_lengths"], strict=True):
        start = next((i for i, m in enumerate(mask) if m), None)
        if start is None or start == 0 or not resp:
            continue
        prompts.append(list(ids[:start]))
        lengths.append(int(resp[0]))
    return prompts, lengths, manifest


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two (N,) tensors (average ranks for ties)."""

    def ranks(x: torch.Tensor) -> torch.Tensor:
        order = x.argsort()
        r = torch.empty(len(x))
        r[order] = torch.arange(len(x), dtype=torch.float32)
        for v in x.unique():  # average the ranks of ties
            sel = x == v
            r[sel] = r[sel].mean()
        return r

    ra, rb = ranks(a.float()), ranks(b.float())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / ((ra.norm() * rb.norm()).clamp_min(1e-12)))


def cross_validate(
    feats: torch.Tensor, lengths: list[int], signal: str, edges: list[int], folds: int, seed: int, wd: float
) -> dict[str, Any]:
    """Pooled out-of-fold predictions of the probe and of the constant (majority) baseline: `accuracy_report`."""
    from specdraft.eval.length_predictor import accuracy_report, bucketize, fit_length_predictor

    n, k = len(lengths), len(edges) + 1
    y = bucketize(lengths, edges)  # (N,)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    pred, const = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
    expected = torch.empty(n)  # (N,) out-of-fold expected lengths: what the scheduler sorts by
    for f in range(folds):
        test = perm[f::folds]
        train = torch.ones(n, dtype=torch.bool).index_fill_(0, test, False).nonzero().squeeze(1)  # row ids
        model = fit_length_predictor(feats[train], [lengths[i] for i in train], signal, edges, wd)
        pred[test] = model.predict_bucket(feats[test])
        expected[test] = model.expected_length(feats[test])
        const[test] = int(torch.bincount(y[train], minlength=k).argmax())
    rep = accuracy_report(pred, y, 0, k)
    rep["spearman_expected_length"] = spearman(expected, torch.tensor(lengths, dtype=torch.float32))
    rep["constant_baseline"] = float((const == y).float().mean())
    rep["constant_bucket"] = int(torch.bincount(y, minlength=k).argmax())
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="distilled folder (manifest.json + shard-*)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--target", default=None, help="target model (default: the manifest's)")
    p.add_argument("--dtype", default="fp32", help="auto | fp32 | bf16 | fp16 (match the serving dtype)")
    p.add_argument("--device", default="cpu", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--signal", default=None, choices=["length", "embed", "hidden"], help="default: best CV")
    p.add_argument("--edges", type=int, nargs="+", default=[32, 64, 128], help="bucket edges (tokens)")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=1.0, help="L2 on the probe weights")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table
    from tqdm.auto import tqdm

    from specdraft.eval.cli import machine_info
    from specdraft.eval.length_predictor import SIGNALS, bucket_names, fit_length_predictor, prompt_features
    from specdraft.models.base_llm import load_target
    from specdraft.utils import atomic_write_json

    t0 = time.perf_counter()
    if not Path(a.data).is_dir():
        print(
            f"error: --data {a.data}: no such folder (a distilled dataset written by distill.py)",
            file=sys.stderr,
        )
        return 2
    if sorted(set(a.edges)) != a.edges or a.edges[0] < 1 or a.folds < 2:
        print(f"error: --edges {a.edges} must be ascending positive ints and --folds >= 2", file=sys.stderr)
        return 2
    try:
        prompts, lengths, manifest = load_examples(a.data)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(prompts) < 2 * a.folds:
        print(
            f"error: {a.data}: {len(prompts)} rows with a response, need at least {2 * a.folds}",
            file=sys.stderr,
        )
        return 2
    target = a.target or manifest.get("target", {}).get("name_or_path", "smollm2-135m")
    model, _ = load_target(SimpleNamespace(name_or_path=target, dtype=a.dtype, device=a.device))
    signals = [a.signal] if a.signal else list(SIGNALS)
    feats: dict[str, torch.Tensor] = {}
    for s in signals:
        chunks = [prompts[i : i + 8] for i in range(0, len(prompts), 8)]
        bar = tqdm(
            chunks, desc=f"features {s}", unit="x8 prompts", disable=s != "hidden"
        )  # only hidden is slow
        feats[s] = torch.cat([prompt_features(model, c, s) for c in bar])  # (N, F)
    names = bucket_names(a.edges)
    counts = torch.bincount(
        torch.bucketize(torch.tensor(lengths), torch.tensor(a.edges), right=True), minlength=len(names)
    )
    reports = {
        s: cross_validate(feats[s], lengths, s, a.edges, a.folds, a.seed, a.weight_decay) for s in signals
    }

    table = Table(
        title=f"length predictor: {a.folds}-fold cross-validated bucket accuracy ({len(prompts)} prompts)"
    )
    for col in [
        "signal",
        "overall",
        "constant baseline",
        "rank corr.",
        *[f"{b} (n={int(c)})" for b, c in zip(names, counts, strict=True)],
    ]:
        table.add_column(col)
    for s, r in reports.items():
        cells = ["-" if b["accuracy"] is None else f"{b['accuracy']:.2f}" for b in r["buckets"]]
        rho = f"{r['spearman_expected_length']:.2f}"
        table.add_row(s, f"{r['overall']:.3f}", f"{r['constant_baseline']:.3f}", rho, *cells)
    Console(width=160).print(table)

    best = max(  # accuracy, then rank correlation (what the scheduler uses), then the cheaper signal
        signals,
        key=lambda s: (
            round(reports[s]["overall"], 6),
            round(reports[s]["spearman_expected_length"], 6),
            -SIGNALS.index(s),
        ),
    )
    pred = fit_length_predictor(feats[best], lengths, best, a.edges, a.weight_decay)
    pred.info = {
        "data": str(a.data),
        "target": target,
        "dtype": a.dtype,
        "rows": len(prompts),
        "bucket_counts": counts.tolist(),
        "weight_decay": a.weight_decay,
        "cross_validation": reports,
    }
    pred.save(a.out)
    args = sys.argv[1:] if argv is None else argv
    record = {
        "signal": best,
        "edges": a.edges,
        **pred.info,
        "command": " ".join(["python scripts/train_length_predictor.py", *args]),
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": machine_info(model),
    }
    atomic_write_json(Path(a.out).with_suffix(".json"), record)
    print(f"saved {a.out} (signal {best}, bucket lengths {[round(x) for x in pred.bucket_lengths.tolist()]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
