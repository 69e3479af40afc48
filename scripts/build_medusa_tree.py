"""Build a Medusa static tree from the heads' measured per-rank accuracies on held-out data.

Uses the same config as training (so the same target and the same held-out split), measures
a_k(i) = P(head k's rank-i token is right) on the validation conversations, then greedily picks the tree that
maximises the expected tokens/step under a node budget (eval/medusa_tree.build_tree, Medusa paper s3.3.1).

    python scripts/build_medusa_tree.py --drafter outputs/medusa_smollm2/export --nodes 16 --update-export \\
        conf=medusa_smollm2

Writes `<drafter>/medusa_tree.json` (or `--out`) with the tree, its expected tokens/step, the accuracies and
the expected tokens/step of the greedy tree at every smaller budget; `--update-export` also stores the tree in
the export's config.json (`tree_choices`), which the Medusa proposer then uses by default. Trailing
`key=value` arguments are Hydra overrides of conf/config.yaml.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader

from specdraft.conf.schema import register_configs
from specdraft.data.collate import Collator, RowDataset, raw_rows
from specdraft.eval.medusa_tree import build_tree, measure_rank_accuracies
from specdraft.models.base_llm import load_target, target_fingerprint
from specdraft.models.hub import load_drafter
from specdraft.models.medusa_choices import check_tree
from specdraft.models.registry import spec_of
from specdraft.train.rows import distilled_rows
from specdraft.utils import atomic_write_json

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
log = logging.getLogger("build_medusa_tree")


def main() -> None:
    """Parse arguments, measure accuracies, build and write the tree."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True, help="Medusa export folder (or Hub id)")
    p.add_argument("--nodes", type=int, default=16, help="node budget N of the tree, root included")
    p.add_argument(
        "--topk", type=int, default=None, help="ranks measured per head (default: the export's topk)"
    )
    p.add_argument("--max-batches", type=int, default=16, help="held-out batches measured (0: all)")
    p.add_argument("--out", default=None, help="JSON output (default <drafter>/medusa_tree.json)")
    p.add_argument("--update-export", action="store_true", help="store the tree in the export's config.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. conf=medusa_smollm2")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=a.overrides)
    target, tokenizer = load_target(cfg.base_model)
    fingerprint = target_fingerprint(target, tokenizer)
    drafter = load_drafter(a.drafter, target=target, fingerprint=fingerprint)
    if drafter.config.architecture != "medusa":
        raise ValueError(
            f"--drafter {a.drafter}: a {drafter.config.architecture!r} drafter, not a Medusa export"
        )
    heads, topk = int(drafter.config.draft_len), int(a.topk or drafter.config.topk)

    t0 = time.perf_counter()
    if cfg.train.data_dir:
        _, val_rows, _ = distilled_rows(cfg, fingerprint)
    else:
        _, val_rows, _ = raw_rows(cfg, tokenizer)
    loader = DataLoader(
        RowDataset(val_rows, use_features=False),
        batch_size=cfg.train.batch_size,
        # heads with a copy gate rank their mixtures: the collator adds each slot's candidate (models/medusa_copy.py)
        collate_fn=Collator(
            int(tokenizer.pad_token_id), heads, copy_ngram=spec_of(drafter).copy_ngram_of(drafter.config)
        ),
    )
    acc, positions = measure_rank_accuracies(drafter, target, loader, topk, a.max_batches or None)
    paths, expected = build_tree(acc, a.nodes)
    curve, running = [], 1.0
    for n, path in enumerate(paths, start=2):  # greedy order: the first n-1 paths are the best n-node tree
        running += float(torch.prod(torch.stack([acc[j, r] for j, r in enumerate(path)])))
        curve.append({"nodes": n, "expected_tokens_per_step": round(running, 4)})
    result = {
        "drafter": a.drafter,
        "nodes": a.nodes,
        "topk": topk,
        "tree_choices": [list(p) for p in paths],
        "expected_tokens_per_step": expected,
        "curve": curve,
        "rank_accuracy": acc.tolist(),
        "top1_accuracy": acc[:, 0].tolist(),
        f"top{topk}_accuracy": acc.sum(1).tolist(),
        "positions": positions,
        "held_out_rows": len(val_rows),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    check_tree(paths, heads)
    out = Path(a.out) if a.out else Path(a.drafter) / "medusa_tree.json"
    atomic_write_json(out, result)
    log.info(
        "per-head top-1 %s | top-%d %s (%d positions)", _fmt(acc[:, 0]), topk, _fmt(acc.sum(1)), positions
    )
    log.info("tree: %d nodes, expected tokens/step %.3f -> %s", a.nodes, expected, out)
    if a.update_export:
        cfg_path = Path(a.drafter) / "config.json"
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        raw["tree_choices"] = [list(p) for p in paths]
        atomic_write_json(cfg_path, raw)
        log.info("stored tree_choices in %s", cfg_path)


def _fmt(values: torch.Tensor) -> str:
    return "[" + ", ".join(f"{float(v):.3f}" for v in values) + "]"


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
