"""`distill(cfg)`: conversations -> self-distilled, sharded, resumable dataset (see docs/design.md).

    load target + conversations -> plan shards of `shard_size` conversations -> refuse on a mismatch with
    what is on disk -> for every missing shard of this rank: regenerate turns, tokenise, continuations,
    features -> write shard atomically -> rewrite manifest (rank 0) -> final manifest + summary line.

Under `accelerate launch` rank r takes shards r, r+world, ...; rank 0 writes the manifest from the
shards on disk (each shard carries its own stats.json), so ranks never write the same file.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdraft.conf.validate import validate_config
from specdraft.data.conversations import load_conversations
from specdraft.data.features import FeatureSpec
from specdraft.distill.features import (
    capture_wanted,
    check_disk_budget,
    compute_features,
    has_features,
    make_spec,
)
from specdraft.distill.generate import GenerationSettings, stop_token_ids
from specdraft.distill.shards import (
    FORMAT_VERSION,
    build_manifest,
    check_compatible,
    completed_shards,
    ids_digest,
    row_features,
    settings_hash,
    write_manifest,
    write_shard,
)
from specdraft.distill.turns import build_rows
from specdraft.hardware import log_environment, resolve_placement
from specdraft.models.base_llm import load_target, target_fingerprint
from specdraft.models.linear_layout import apply_layout, layout_label
from specdraft.models.panel_linear import int8_activations
from specdraft.utils import clean_stale_tmp

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def _dist_state():
    """(rank, world size, barrier): accelerate's state under a multi-process launch, else a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, lambda: None
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # gloo on CPU-only machines
    return state.process_index, state.num_processes, state.wait_for_everyone


def generation_settings(
    d: Any, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel
) -> GenerationSettings:
    """`GenerationSettings` from the `distill` config and the target's stop/pad tokens."""
    if d.max_new_tokens <= 0:
        raise ValueError(f"distill.max_new_tokens={d.max_new_tokens} must be > 0")
    if d.do_sample and not (d.temperature > 0 and 0 < d.top_p <= 1):
        raise ValueError(
            f"distill.temperature={d.temperature} must be > 0 and distill.top_p={d.top_p} in (0, 1]"
        )
    return GenerationSettings(
        max_new_tokens=int(d.max_new_tokens),
        stop_ids=stop_token_ids(tokenizer, model),
        pad_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0),
        do_sample=bool(d.do_sample),
        temperature=float(d.temperature),
        top_p=float(d.top_p),
        batch_tokens=int(d.batch_tokens),
        max_batch_size=int(d.max_batch_size),
        refill=bool(d.refill),
    )


def make_header(
    cfg: DictConfig,
    fingerprint: dict,
    settings: GenerationSettings,
    spec: FeatureSpec,
    limit: int | None,
    q8: bool = False,
) -> dict:
    """The content-deciding part of the manifest (compared on resume); `q8`: the target's products take int8
    activations (models/qdot.py: another target's arithmetic)."""
    d = cfg.distill
    gen: dict[str, Any] = {
        "regenerate": bool(d.regenerate),
        "do_sample": settings.do_sample,
        "max_new_tokens": settings.max_new_tokens,
        "max_turns": int(d.max_turns),
        "stop_ids": list(settings.stop_ids),
    }
    if settings.do_sample:
        gen.update(temperature=settings.temperature, top_p=settings.top_p, seed=int(d.seed))
    if q8:  # another target's arithmetic (models/qdot.py)
        gen["q8_activations"] = True
    return {
        "format_version": FORMAT_VERSION,
        "target": fingerprint,
        "generation": gen,
        "T": int(d.T),
        "data": {
            "source": str(cfg.data.source),
            "split": str(cfg.data.split),
            "max_length": int(cfg.data.max_length),
            "num_samples": limit,
        },
        "features": spec.to_dict() if spec.enabled else None,
        "shard_size": int(d.shard_size),
    }


def distill(cfg: DictConfig) -> Path:
    """Run the distillation stage; returns the dataset folder (`distill.out_dir` or `<run_dir>/distilled`)."""
    t_start = time.time()
    validate_config(cfg)  # ranges (also checked by the entry point, before the run dir exists)
    d = cfg.distill
    out_dir = Path(d.out_dir) if d.out_dir else Path(cfg.run_dir) / "distilled"
    rank, world, barrier = _dist_state()
    say = print if rank == 0 else (lambda *a, **k: None)

    # conversations first: a bad data.source or num_samples fails before the (slow) target load and any write
    limit = d.num_samples if d.num_samples is not None else cfg.data.num_samples
    limit_field = "distill.num_samples" if d.num_samples is not None else "data.num_samples"
    convs, report = load_conversations(
        cfg.data.source, split=cfg.data.split, limit=limit, limit_field=limit_field
    )
    say(f"[distill] {report.summary()}", flush=True)
    model, tokenizer = load_target(cfg.base_model)
    # decode steps of <= max_batch_size rows, on a CPU (int8 activations where base_model.q8_activations is set)
    layout = apply_layout(model, str(d.linear_layout), q8=bool(cfg.base_model.get("q8_activations", False)))
    if layout != "native":
        say(
            f"[distill] distill.linear_layout: target Linear weights {layout_label(model, layout)} (CPU decode "
            "layout)",
            flush=True,
        )
    log_environment("distill", resolve_placement(cfg.base_model.device, cfg.base_model.dtype))
    fingerprint = target_fingerprint(model, tokenizer)
    settings = generation_settings(d, tokenizer, model)
    spec = make_spec(d, model)
    # int8 activations as laid out (base_model.q8_activations, or SPECDRAFT_Q8_ACTIVATIONS for an A/B run)
    header = make_header(cfg, fingerprint, settings, spec, limit, q8=int8_activations(model))
    S = int(d.shard_size)
    plan = [[c.id for c in convs[i : i + S]] for i in range(0, len(convs), S)]
    done = check_compatible(out_dir, header, plan)
    barrier()  # every rank has compared with the manifest on disk before rank 0 rewrites it
    check_disk_budget(spec, len(convs), int(cfg.data.max_length), float(d.max_disk_gb), show=rank == 0)
    if rank == 0:
        clean_stale_tmp(out_dir)  # leftovers of a killed run; before the barrier, so no rank is writing yet
    need_cont = not (d.regenerate and not d.do_sample)
    capture = spec if spec.enabled and capture_wanted(d.capture_features, model.device) else None
    features = row_features(need_cont, header["features"])
    extra = {
        "columns": list(features),
        "batching": {
            "batch_tokens": settings.batch_tokens,
            "max_batch_size": settings.max_batch_size,
            "refill": settings.refill,
        },
        "planned_conversations": len(convs),
        "load_report": {"source": report.source, "kept": report.kept},
        "world_size": world,
        "config": OmegaConf.to_container(cfg.distill, resolve=True),
    }
    load_skipped = dict(report.reasons)

    def manifest() -> dict:
        timing = {
            "run_wall_seconds": round(time.time() - t_start, 3),
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        return build_manifest(
            header, completed_shards(out_dir), len(plan), load_skipped, {**extra, "timing": timing}
        )

    if rank == 0:
        write_manifest(out_dir, manifest())
    barrier()
    mine = [i for i in range(len(plan)) if i % world == rank and i not in done]
    if done:
        say(f"[distill] resuming {out_dir}: {len(done)}/{len(plan)} shards already complete", flush=True)
    todo_convs = sum(len(plan[i]) for i in mine)
    bar = tqdm(total=todo_convs, unit="conv", desc=f"distill[{rank}]", position=rank, disable=todo_convs == 0)
    gen_tokens, t_loop = 0, time.time()

    def on_tokens(n: int) -> None:
        nonlocal gen_tokens
        gen_tokens += n
        bar.set_postfix_str(f"{gen_tokens / max(time.time() - t_loop, 1e-9):.1f} tok/s", refresh=False)

    for i in mine:
        t0 = time.time()
        shard_convs = convs[i * S : (i + 1) * S]
        seed = int(d.seed) * 1_000_003 + i  # per shard: a resumed run draws the same samples
        gen = torch.Generator(device=model.device).manual_seed(seed)
        rows, skipped, counts = build_rows(
            model, tokenizer, shard_convs, settings, bool(d.regenerate), int(d.max_turns), int(cfg.data.max_length),
            int(d.T), generator=gen, on_tokens=on_tokens, cont_chunk=int(d.continuation_chunk), capture=capture,
        )  # fmt: skip
        if spec.enabled:  # rows the generation pass could not cover: a second forward
            todo = [row for row in rows if not has_features(row, spec)]
            feats = compute_features(model, [r["input_ids"] for r in todo], spec, settings.batch_tokens)
            for row, f in zip(todo, feats):
                row.update(f)
            counts["features_recomputed"] += len(todo)
        stats = {
            "settings_hash": settings_hash(header),
            "ids_digest": ids_digest(plan[i]),
            "skipped": dict(skipped),
            "counts": dict(counts),
            "seconds": round(time.time() - t0, 3),
            "rank": rank,
        }
        write_shard(out_dir, i, rows, features, stats)
        bar.update(len(shard_convs))
        if rank == 0:
            write_manifest(out_dir, manifest())
    bar.close()
    barrier()
    if rank == 0:
        final = manifest()
        write_manifest(out_dir, final)
        c, t = Counter(final["counts"]), final["timing"]
        skipped_text = ", ".join(f"{k}={v}" for k, v in final["skipped"].items()) or "none"
        say(
            f"[distill] done: {final['num_rows']} rows in {len(final['shards'])}/{len(plan)} shards -> {out_dir} | "
            f"{c['turns']} turns (eos {c['finish_eos']}, length {c['finish_length']}), {c['generated_tokens']} generated "
            f"tokens, {t['generated_tokens_per_s']} tok/s | skipped: {skipped_text} | wall {t['run_wall_seconds']:.1f}s",
            flush=True,
        )
        if final["complete"] and final["num_rows"] == 0:
            raise ValueError(
                f"distill made 0 rows from the {len(convs)} conversations of data.source={cfg.data.source!r} "
                f"(skipped: {skipped_text}), so {out_dir} holds nothing to train on; fix the data or the settings "
                f"(e.g. a larger data.max_length), delete {out_dir} and rerun"
            )
    return out_dir
