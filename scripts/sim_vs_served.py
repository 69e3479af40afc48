"""Simulated vs served tokens/step: does the offline number predict what the decoder delivers?

    # every export (or training checkpoint step-*/) against the held-out rows of the distilled set it trained on
    python scripts/sim_vs_served.py --data outputs/redrafter_smollm2/distilled \\
        --exports outputs/redrafter_smollm2/export outputs/redrafter_smollm2/checkpoints/step-00000080 \\
        --prompts 8 --max-new-tokens 64 --json docs/results/sim_vs_served.json

For each export, on the same held-out conversations (the training split: `data.val_fraction` / `data.seed`
hashed over the conversation ids, `data.conversations.split_indices`):
  * served: the static decoder (greedy, no node budget, no fallback: the tree is the drafter's own) from the
    conversation's prompt, `max_new_tokens` tokens (at most the row's first run of trained tokens,
    `train.evaluate.greedy_span`: `data.max_length` or a retokenisation mismatch may cut it); tokens/step =
    accepted drafts + 1 per target forward.
  * simulated: `train.evaluate.replay_estimate` (`replay_decode` per row): the same proposer (same tree/beam
    settings) drafting from one teacher-forced target forward over the distilled row, verified against the
    row's own greedy response; the function `train.eval_replay_rows` logs during training as
    `eval/replay_accept_len`.
  * chain: the training-time `eval/sim_accept_len` (1 + sum_k prod_i acc1_i, one greedy chain, every
    position) from `train.evaluate.evaluate`, for reference: it ignores the tree.
  * logged replay: `eval/replay_accept_len` as the training run logged it for those weights
    (`train.eval_replay_rows`; an export's final eval, a checkpoint's eval at its step), where it did.
  * tree: the training-time `eval/tree_accept_len` where the family declares `tree_accept` (Medusa: what its
    served static tree accepts at every position that trains, averaged over positions) and `eval/tree_walk_len`
    (those counts walked along each row as the decoder steps: tokens/step); the "train est." ratio uses the
    walk, else the chain.
Prints one row per export with the simulated/served ratio, then the Pearson correlation over exports; `--json`
writes the rows with the machine info atomically. A checkpoint folder (`meta.json` + `model.safetensors`) is
loaded with its run's export config.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor


def as_export(path: Path, scratch: Path) -> tuple[Path, str]:
    """(a loadable export folder, a label) for an export folder or a training checkpoint `step-N/`."""
    if (path / "config.json").is_file():
        return path, str(path)
    meta = path / "meta.json"
    if not (meta.is_file() and (path / "model.safetensors").is_file()):
        raise FileNotFoundError(f"{path}: neither an export (config.json) nor a checkpoint (meta.json)")
    cfg = json.loads(meta.read_text())["config"]
    run_export = Path(cfg["train"].get("export_dir") or Path(cfg["run_dir"]) / "export")
    if not (run_export / "config.json").is_file():
        raise FileNotFoundError(f"{path}: its run's export {run_export} (for config.json) is missing")
    out = scratch / f"{Path(cfg['run_dir']).name}-{path.name}"
    out.mkdir(parents=True)
    shutil.copy(run_export / "config.json", out / "config.json")  # same architecture settings as the run
    (out / "model.safetensors").symlink_to((path / "model.safetensors").resolve())
    return out, str(path)


def logged_replay(path: Path) -> float | None:
    """`eval/replay_accept_len` as its training run logged it for these weights (`train.eval_replay_rows`): an
    export's `training_summary.final_eval`, a checkpoint's record at its step in the run's metrics.jsonl; None
    where the run did not replay."""
    if (path / "config.json").is_file():
        summary = json.loads((path / "config.json").read_text()).get("training_summary") or {}
        value = (summary.get("final_eval") or {}).get("eval/replay_accept_len")
        return None if value is None else float(value)
    meta = json.loads((path / "meta.json").read_text())
    metrics = Path(meta["config"]["run_dir"]) / "metrics.jsonl"
    if not metrics.is_file():
        return None
    from specdraft.train.logging import read_metrics

    at_step = [r for r in read_metrics(metrics.parent) if r.get("step") == meta["step"]]
    found = [r["eval/replay_accept_len"] for r in at_step if r.get("eval/replay_accept_len") is not None]
    return float(found[-1]) if found else None


def serve_rows(
    dec: Any, tok: Any, prop: Any, rows: list[dict[str, Any]], max_new_tokens: int, stop: set[int]
) -> tuple[list[int], int, int]:
    """The static decoder from each row's prompt: (accepted drafts per step over all rows, rows whose served
    output equals the row's greedy tokens, tokens emitted)."""
    from specdraft.train.evaluate import greedy_span

    accepted, same, emitted = [], 0, 0
    for row in rows:
        span = greedy_span(row["loss_mask"])
        if span is None:
            continue
        start, end = span  # ids[:start]: the templated prompt; ids[start:end]: greedy tokens
        ids = torch.tensor(row["input_ids"][:end], dtype=torch.long)
        new = min(max_new_tokens, end - start)  # data.max_length or retokenisation may cut it
        out, stats = dec.speculative_generate(tok, ids[:start], prop, new, stop_ids=stop)
        accepted += stats.accepted
        emitted += len(out)
        same += out == ids[start : start + len(out)].tolist()  # row == the served greedy output
    return accepted, same, emitted


def recorded_split(path: Path) -> tuple[float, int] | None:
    """(data.val_fraction, data.seed) the training run of an export or checkpoint split its rows with: the
    export's `training_summary.split`, a checkpoint's config; None where not recorded (exports before it was)."""
    if (path / "config.json").is_file():
        split = (json.loads((path / "config.json").read_text()).get("training_summary") or {}).get("split")
        return None if not split else (float(split["val_fraction"]), int(split["seed"]))
    meta = path / "meta.json"
    if meta.is_file():
        data = json.loads(meta.read_text())["config"].get("data") or {}
        if "val_fraction" in data:
            return float(data["val_fraction"]), int(data.get("seed", 0))
    return None


def held_out_split(paths: list[Path], val_fraction: float | None, seed: int | None) -> tuple[float, int]:
    """The split whose held-out rows are scored: the flags where given, else what the runs recorded (they must
    agree), else 0.05 and seed 0 (`data.val_fraction`, `data.seed` defaults), said in one line.

    Raises:
        ValueError: the runs recorded different splits and no flag settles it.
    """
    recorded = {s for s in (recorded_split(p) for p in paths) if s is not None}
    if len(recorded) > 1 and (val_fraction is None or seed is None):
        raise ValueError(
            f"the exports were trained with different held-out splits {sorted(recorded)}: compare exports of one "
            "split, or pass --val-fraction and --seed"
        )
    known = next(iter(recorded)) if recorded else None
    if known is None and (val_fraction is None or seed is None):
        print("the exports did not record their split: data.val_fraction 0.05 and data.seed 0 unless given")
    vf = val_fraction if val_fraction is not None else (known[0] if known else 0.05)
    sd = seed if seed is not None else (known[1] if known else 0)
    return vf, sd


def chain_sim(
    drafter: Any, target: Any, rows: Any, feats: Any, pad_id: int, counts: Tensor
) -> tuple[float, float | None, float | None]:
    """The training-time `eval/sim_accept_len` of `drafter` on `rows` (every position that trains), and its
    `eval/tree_accept_len` and `eval/tree_walk_len` where the family declares a tree estimate (Medusa's served
    tree; else None). `batch_size=1`, so the walk covers every row."""
    from torch.utils.data import DataLoader

    from specdraft.data.collate import Collator, RowDataset
    from specdraft.models.registry import spec_of
    from specdraft.train.evaluate import TargetFeatures, evaluate

    spec = spec_of(drafter)
    layers = spec.layers_for(drafter.config)
    d = int(drafter.config.draft_len)
    collate = Collator(pad_id, d, copy_ngram=int(getattr(drafter.config, "copy_ngram", 0) or 0))
    loader = DataLoader(RowDataset(rows, feats, use_features=not layers), batch_size=1, collate_fn=collate)
    opts = {"loss": "ce", "draft_len": d, "max_positions": None}
    metrics = evaluate(drafter, spec, TargetFeatures(target, False, layers), loader, opts, counts)
    tree, walk = metrics.get("eval/tree_accept_len"), metrics.get("eval/tree_walk_len")
    return (
        float(metrics.get("eval/sim_accept_len", float("nan"))),
        None if tree is None else float(tree),
        None if walk is None else float(walk),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the distilled dataset folder the exports trained on")
    p.add_argument("--exports", nargs="+", required=True, help="export folders or checkpoint step-N folders")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--prompts", type=int, default=8, help="held-out conversations (at most all of them)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="data.val_fraction of the training runs (default: what the exports recorded, else 0.05)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="data.seed of the training runs (default: as recorded, else 0)"
    )
    p.add_argument(
        "--split",
        default="val",
        choices=["val", "train"],
        help="val: the held-out rows (default); train: rows the exports trained on (more tokens, optimistic)",
    )
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="read a distilled set whose run has not finished (its complete shards; train.allow_incomplete_data)",
    )
    p.add_argument(
        "--bench",
        default=None,
        help="also on this benchmark's first turns (mt_bench, alpaca_eval or a file; --prompts of them, one per "
        "category in turn) answered by the target: simulated (what train.eval_bench_rows logs) vs served",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the rows and the machine info to this JSON file")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from rich.console import Console
    from rich.table import Table

    from specdraft.data.collate import label_counts
    from specdraft.data.conversations import split_indices
    from specdraft.distill.shards import load_distilled
    from specdraft.eval.cli import machine_info
    from specdraft.eval.decode import default_stop_ids
    from specdraft.eval.proposers import drafter_family, make_proposer
    from specdraft.eval.static_decode import make_decoder
    from specdraft.models.base_llm import load_target, target_fingerprint
    from specdraft.models.hub import load_drafter
    from specdraft.train.evaluate import pearson, replay_estimate
    from specdraft.utils import atomic_write_json

    target, tok = load_target(SimpleNamespace(name_or_path=a.target, dtype=a.dtype, device="cpu"))
    fingerprint = target_fingerprint(target, tok)
    dec = make_decoder(target, "static", "off")
    assert dec is not None
    stop = default_stop_ids(tok, target)
    ds, manifest = load_distilled(a.data, allow_incomplete=a.allow_incomplete)
    val_fraction, seed = held_out_split([Path(e) for e in a.exports], a.val_fraction, a.seed)
    train_idx, val_idx = split_indices(list(ds["id"]), val_fraction, seed)
    counts = label_counts(ds.select(train_idx), int(fingerprint["vocab_size"]))
    pool = ds.select(val_idx if a.split == "val" else train_idx)
    picked = pool.select(
        range(min(a.prompts, len(pool)))
    )  # the rows decoded (and scored by the chain metric)
    rows = [picked[i] for i in range(len(picked))]
    print(f"{len(val_idx)} held-out rows of {len(ds)} in {a.data}; using {len(rows)} {a.split} rows")
    probe: list[dict[str, Any]] = []
    if a.bench:  # the benchmark's first turns answered by this target (train/bench_probe.py)
        from specdraft.train.bench_probe import bench_rows

        probe = bench_rows(target, tok, a.bench, a.prompts, a.max_new_tokens, stop, progress=True)

    results = []
    with tempfile.TemporaryDirectory(prefix="sim_vs_served_") as scratch:
        for raw in a.exports:
            folder, label = as_export(Path(raw), Path(scratch))
            drafter = load_drafter(str(folder), target, fingerprint).float()
            prop = make_proposer(drafter)  # the drafter's own decode settings, no node budget
            t0 = time.perf_counter()
            # simulated: the replay `train.eval_replay_rows` logs during training, on the same rows
            replay = replay_estimate(drafter, target, rows, a.max_new_tokens, stop)
            sim, sim_steps = replay["eval/replay_accept_len"], int(replay["eval/replay_steps"])
            served_acc, same, emitted = serve_rows(dec, tok, prop, rows, a.max_new_tokens, stop)
            t_sim_served = time.perf_counter() - t0
            served = 1.0 + sum(served_acc) / max(len(served_acc), 1)
            bench: dict[str, Any] = {}
            if probe:  # the same on the benchmark's prompts (train.eval_bench_rows logs the simulated side)
                b_replay = replay_estimate(
                    drafter, target, probe, a.max_new_tokens, stop, "eval/bench_replay"
                )
                b_acc, b_same, _ = serve_rows(dec, tok, prop, probe, a.max_new_tokens, stop)
                b_served = 1.0 + sum(b_acc) / max(len(b_acc), 1)
                bench = dict(
                    bench_simulated=b_replay["eval/bench_replay_accept_len"], bench_served=b_served,
                    bench_ratio=b_replay["eval/bench_replay_accept_len"] / b_served,
                    held_out_over_bench=served / b_served, bench_rows_equal_served=f"{b_same}/{len(probe)}",
                )  # fmt: skip
            chain, tree, walk = chain_sim(
                drafter, target, picked, manifest.get("features"), int(tok.pad_token_id), counts
            )
            estimate = walk if walk is not None else chain  # the trainer's cheap estimate for this family
            logged = logged_replay(Path(raw))  # what the run logged with train.eval_replay_rows, if it did
            results.append(
                dict(
                    export=label, family=drafter_family(drafter), tree_nodes=prop.spec.node_budget,
                    max_depth=prop.spec.max_depth, simulated=sim, served=served, ratio=sim / served,
                    chain_sim_accept_len=chain, tree_accept_len=tree, tree_walk_len=walk,
                    train_estimate=estimate, train_ratio=estimate / served, logged_replay=logged,
                    logged_ratio=None if logged is None else logged / served,
                    sim_steps=sim_steps, served_steps=len(served_acc),
                    served_tokens=emitted,
                    rows_equal_served=f"{same}/{len(rows)}", seconds=round(t_sim_served, 1), **bench,
                )
            )  # fmt: skip
            print(json.dumps(results[-1]))

    corr = pearson([r["simulated"] for r in results], [r["served"] for r in results])
    corr_chain = pearson([r["chain_sim_accept_len"] for r in results], [r["served"] for r in results])
    corr_train = pearson([r["train_estimate"] for r in results], [r["served"] for r in results])
    table = Table(
        title=f"simulated vs served tokens/step, {len(rows)} {a.split} rows, <= {a.max_new_tokens} tokens"
    )
    for col in (
        "export",
        "family",
        "nodes",
        "simulated",
        "served",
        "sim/served",
        "chain sim",
        "tree sim",
        "tree walk",
        "train est./served",
        "logged replay/served",
        "rows = served",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            r["export"], r["family"], str(r["tree_nodes"]), f"{r['simulated']:.3f}", f"{r['served']:.3f}",
            f"{r['ratio']:.3f}", f"{r['chain_sim_accept_len']:.3f}",
            "-" if r["tree_accept_len"] is None else f"{r['tree_accept_len']:.3f}",
            "-" if r["tree_walk_len"] is None else f"{r['tree_walk_len']:.3f}", f"{r['train_ratio']:.3f}",
            "-" if r["logged_ratio"] is None else f"{r['logged_ratio']:.3f}", r["rows_equal_served"],
        )  # fmt: skip
    Console(width=200).print(table)
    worst = max(abs(r["ratio"] - 1.0) for r in results)
    print(f"Pearson(simulated, served) = {corr:.3f}; Pearson(chain sim, served) = {corr_chain:.3f}; ", end="")
    print(f"worst |ratio - 1| = {worst:.3f} (target: <= 0.10, correlation >= 0.9)")
    worst_train = max(abs(r["train_ratio"] - 1.0) for r in results)
    print(
        f"training-time estimate without train.eval_replay_rows (tree walk where the family has one, else chain "
        f"sim): Pearson {corr_train:.3f}, worst |ratio - 1| = {worst_train:.3f}; with it, the run logs the "
        "simulated column (eval/replay_accept_len)"
    )
    if probe:
        for r in results:
            print(
                f"{r['export']}: on {len(probe)} {a.bench} first turns simulated {r['bench_simulated']:.3f}, served "
                f"{r['bench_served']:.3f} (ratio {r['bench_ratio']:.3f}, rows = served {r['bench_rows_equal_served']});"
                f" held-out served / {a.bench} served = {r['held_out_over_bench']:.3f}"
            )
    logged = [r for r in results if r["logged_replay"] is not None]
    corr_logged = pearson([r["logged_replay"] for r in logged], [r["served"] for r in logged])
    if logged:
        worst_logged = max(abs(r["logged_ratio"] - 1.0) for r in logged)
        print(
            f"logged by training (eval/replay_accept_len, {len(logged)} of {len(results)}): Pearson "
            f"{corr_logged:.3f}, worst |ratio - 1| = {worst_logged:.3f}"
        )
    if a.json:
        atomic_write_json(
            a.json,
            {
                "command": " ".join(sys.argv),
                "machine": machine_info(target),
                "data": a.data,
                "held_out_rows": len(val_idx),
                "split": a.split,
                "prompts": len(rows),
                "max_new_tokens": a.max_new_tokens,
                "pearson_simulated_served": corr,
                "pearson_chain_served": corr_chain,
                "pearson_train_estimate_served": corr_train,
                "pearson_logged_replay_served": corr_logged,
                "worst_abs_train_ratio_minus_1": worst_train,
                "worst_abs_ratio_minus_1": worst,
                "rows": results,
            },
        )


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
