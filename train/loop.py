"""The training loop: `train(cfg) -> export folder`. Reads top to bottom: build, loop, evaluate, checkpoint, export.

Works for every drafter family through its declared contract (`FamilySpec`, models/family.py: `build`,
`compute_loss`, the target layers it reads, `uses_token_counts`, `low_precision_outputs`), single process or under
`accelerate launch` (DDP over gloo on CPU, NCCL or DeepSpeed ZeRO-2 on GPUs). The frozen target is loaded once,
kept out of `accelerator.prepare` and the optimizer, and only ever run under `torch.no_grad()`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from specdraft.conf.validate import validate_config
from specdraft.data.collate import (
    Collator,
    EpochSampler,
    RowDataset,
    cached_layers_cover,
    label_counts,
    raw_rows,
)
from specdraft.hardware import log_environment, mixed_precision_for, resolve_device, resolve_placement
from specdraft.models.base_llm import load_target, target_fingerprint
from specdraft.models.hub import export_drafter, push_to_hub, warm_start
from specdraft.models.losses import per_slot_accuracy, topk_hits
from specdraft.models.registry import family_spec
from specdraft.train import checkpoint as ckpt
from specdraft.train.evaluate import TargetFeatures, evaluate, replay_estimate
from specdraft.train.logging import make_logger, truncate_metrics
from specdraft.train.rows import distilled_rows
from specdraft.utils import atomic_write_json, seed_everything

log = logging.getLogger(__name__)


def make_accelerator(cfg: DictConfig) -> Accelerator:
    """The accelerator on the target's device: CPU (gloo) when there is no CUDA or `base_model.device` is cpu,
    else the launcher's choice (DDP/DeepSpeed from the accelerate config). `train.mixed_precision: auto` is
    bf16 where the device does bf16 natively, fp16 on CUDA without bf16, else no (specdraft.hardware)."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    on_cpu = resolve_device(cfg.base_model.device).type == "cpu"  # the drafter trains where the target runs
    cpu = on_cpu and not deepspeed  # cpu=True would bypass DeepSpeed entirely
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    # Under a launcher on CPU, force gloo (DeepSpeed on CPU would otherwise pick ccl); never when single-process.
    handlers = [InitProcessGroupKwargs(backend="gloo")] if on_cpu and distributed else []
    device = torch.device("cpu") if on_cpu else resolve_device("auto")
    return Accelerator(
        cpu=cpu,
        mixed_precision=mixed_precision_for(str(cfg.train.mixed_precision), device),
        gradient_accumulation_steps=cfg.train.grad_accum,
        kwargs_handlers=handlers,
    )


def lr_lambda(warmup: int, total: int, kind: str, calls_per_step: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up then cosine (or constant). accelerate steps a prepared scheduler
    `num_processes` times per optimiser step, hence `calls_per_step`."""

    def f(calls: int) -> float:
        step = calls / calls_per_step
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return f


def loss_options(cfg: DictConfig, eval_mode: bool = False) -> dict[str, Any]:
    """Options handed to `family.compute_loss`."""
    t = cfg.train
    return {
        "loss": t.loss,
        "kl_weight": t.kl_weight,
        "lk_weight": t.lk_weight,
        "kl_topk": t.kl_topk,
        "slot_weights": list(t.slot_weights) if t.slot_weights else None,
        "draft_len": int(cfg.drafter.draft_len),
        "max_positions": t.eval_max_positions if eval_mode else t.max_positions,
    }


def train(cfg: DictConfig) -> Path:
    """Train a drafter on the frozen target and export it.

    Args:
        cfg: the composed root config (conf/schema.py `RootConfig`).

    Returns:
        the export folder (`train.export_dir`, default `<run_dir>/export`).
    """
    t0 = time.time()
    validate_config(cfg)
    run_dir = Path(cfg.run_dir)
    resolved = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    ckpt_root = ckpt.checkpoint_dir(run_dir)
    latest = ckpt.latest_checkpoint(ckpt_root) if cfg.train.resume else None
    changed = ckpt.check_resume(latest, resolved) if latest is not None else []  # refuses before any load
    acc = make_accelerator(cfg)
    seed_everything(cfg.train.seed)
    main = acc.is_main_process
    if main:
        log.info(
            "run dir %s | %d process(es) on %s | %s",
            run_dir,
            acc.num_processes,
            acc.device,
            acc.distributed_type,
        )
        if changed:
            log.warning(
                "train.resume: settings changed since %s: %s (the restored optimiser keeps the checkpoint's lr, "
                "betas and weight_decay; the other values apply from here)",
                latest,
                "; ".join(changed),
            )

    # ---- 1. frozen target (never prepared, never optimised) ------------------------------------------------
    target, tokenizer = load_target(cfg.base_model)
    target.to(acc.device)  # the same device (make_accelerator follows base_model.device)
    if main:
        placement = resolve_placement(str(acc.device), cfg.base_model.dtype)
        log_environment("train", placement, f"mixed precision {acc.mixed_precision}")
    fingerprint = target_fingerprint(target, tokenizer)
    family = family_spec(cfg.drafter.family)

    # ---- 2. data ----------------------------------------------------------------------------------------------
    if cfg.train.data_dir:
        train_rows, val_rows, manifest = distilled_rows(cfg, fingerprint)
        feats = manifest.get("features") if cfg.train.use_cached_features else None
        data_info = f"distilled {cfg.train.data_dir} ({manifest.get('num_rows')} rows)"
        if cfg.train.get("val_data_dir"):
            data_info += f", held-out rows from {cfg.train.val_data_dir}"
    else:
        train_rows, val_rows, data_info = raw_rows(cfg, tokenizer)
        feats = None
    if len(train_rows) < cfg.train.batch_size * acc.num_processes or not len(val_rows):
        raise ValueError(
            f"too little data: {len(train_rows)} train / {len(val_rows)} val rows for train.batch_size="
            f"{cfg.train.batch_size} x {acc.num_processes} processes (raise data.num_samples or data.val_fraction)"
        )
    replay_rows = replay_rows_for(cfg, val_rows, manifest if cfg.train.data_dir else None)
    # ---- 3. drafter, optimiser, schedule -------------------------------------------------------------------
    counts = label_counts(train_rows, int(fingerprint["vocab_size"]))
    extra = {"token_counts": counts} if family.uses_token_counts else {}  # reduced draft vocabulary
    model = family.build(cfg.drafter, target, fingerprint, **extra).to(acc.device)
    if cfg.train.init_from:
        n = warm_start(model, str(cfg.train.init_from), fingerprint)
        if main:
            log.info("warm start: %d tensors from %s", n, cfg.train.init_from)
    # Intermediate target layers: per-model (EAGLE-3 `config.target_layers`, depends on the target's depth) or per
    # family; read from distill/'s cache when it holds them all, otherwise the target computes them online.
    layers = family.layers_for(model.config)
    cached = layers if cached_layers_cover(feats, layers) else ()
    if layers and not cached and feats and main:
        log.warning(
            "target layers %s are not all in the distilled cache (%s): the target runs for every batch; "
            "re-distill with distill.hidden_layers covering them to train offline",
            list(layers),
            list(feats.get("layers") or ()),
        )
    copy_ngram = family.copy_ngram_of(model.config)  # declared (ReDrafter's copy gate): lookup candidates
    collate = Collator(int(tokenizer.pad_token_id), int(cfg.drafter.draft_len), copy_ngram=copy_ngram)
    # held-out metrics always score assistant positions only (what decoding sees)
    train_collate = Collator(collate.pad_id, collate.draft_len, bool(cfg.train.context_positions), copy_ngram)
    sampler = EpochSampler(len(train_rows), cfg.train.seed)
    loader = DataLoader(
        RowDataset(train_rows, feats, layers=cached),
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        collate_fn=train_collate,
        drop_last=True,
        num_workers=cfg.train.num_workers,
    )
    val_loader = DataLoader(
        RowDataset(val_rows, feats, layers=cached), batch_size=cfg.train.batch_size, collate_fn=collate
    )
    if main:
        log.info("data: %s | %d train / %d val conversations", data_info, len(train_rows), len(val_rows))

    o = cfg.optim
    trainable = [
        p for p in model.parameters() if p.requires_grad
    ]  # frozen parts (e.g. a fixed head) excluded
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(o.warmup_steps, cfg.train.max_steps, o.scheduler, acc.num_processes)
    )
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    if family.low_precision_outputs:
        _autocast_only(acc, model)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # ---- 4. resume, or move an earlier run's records aside (nothing before this point wrote to the run dir) ----
    step, epoch, batch_in_epoch = 0, 0, 0
    if main:
        ckpt.clean_partial(ckpt_root)
    if latest is not None:
        meta = ckpt.load_checkpoint(acc, latest)
        step, epoch, batch_in_epoch = meta["step"], meta["data"]["epoch"], meta["data"]["batch_in_epoch"]
        if main:
            truncate_metrics(run_dir, step)  # records after the checkpoint (left by a killed run) are redone
            log.info("resumed from %s (step %d, epoch %d, batch %d)", latest, step, epoch, batch_in_epoch)
    elif main:
        if cfg.train.resume:
            log.info("train.resume=true but no checkpoint in %s: starting fresh", ckpt_root)
        moved = ckpt.archive_previous_run(run_dir)
        if moved:
            log.warning(
                "%s held an earlier run: moved %s (delete them to free space; train.resume=true continues a run)",
                run_dir,
                ", ".join(moved),
            )
    acc.wait_for_everyone()  # no rank saves a checkpoint before the earlier run's are moved aside
    logger = make_logger(run_dir, cfg.logger, str(cfg.name), resolved, main)  # type: ignore[arg-type]
    if main:
        log.info("drafter %s: %.2fM trainable parameters", cfg.drafter.family, n_params / 1e6)

    # ---- 5. loop --------------------------------------------------------------------------------------------
    opts, eval_opts = loss_options(cfg), loss_options(cfg, eval_mode=True)
    need_logits = "kl" in cfg.train.loss
    stop_ids: set[int] = set()
    # the benchmark's prompts answered by the target (train/bench_probe.py)
    probe_rows: list[dict[str, Any]] = []
    if replay_rows or cfg.train.eval_bench_rows:
        from specdraft.eval.decode import default_stop_ids  # the decoder's stop rule for the replay

        stop_ids = default_stop_ids(tokenizer, target)
    if cfg.train.eval_bench_rows:
        from specdraft.train.bench_probe import bench_rows

        n_probe, bench = int(cfg.train.eval_bench_rows), str(cfg.train.eval_bench)
        if main:
            log.info(
                "benchmark probe: %d %s first turns answered by the target (cached in the run dir)",
                n_probe,
                bench,
            )
        probe_rows = bench_rows(
            target,
            tokenizer,
            bench,
            n_probe,
            int(cfg.train.eval_replay_tokens),
            stop_ids,
            run_dir / "bench_rows.json",
            fingerprint,
            write=main,
            progress=main,
        )
    train_feats = TargetFeatures(target, cfg.train.cache_target_features, layers)
    val_feats = TargetFeatures(target, cfg.train.cache_target_features, layers)
    bar = _progress(cfg, main, step)
    last_eval: dict[str, float] = {}
    tick, tick_step, tokens, positions = time.time(), step, 0, 0
    out_of_time = time_limit(acc, cfg.train.max_minutes)
    stopped = "max_steps"

    def held_out(at: int) -> dict[str, float]:
        """Evaluate on the held-out rows, log the metrics at step `at` and return them."""
        metrics = evaluate(
            acc.unwrap_model(model),
            family,
            val_feats,
            _on(val_loader, acc.device),
            eval_opts,
            counts,
            cfg.train.topk_acc,
            cfg.train.eval_batches,
        )
        if replay_rows:  # the decoder's own proposer on a few held-out rows: what it would serve
            metrics.update(
                replay_estimate(
                    acc.unwrap_model(model), target, replay_rows, cfg.train.eval_replay_tokens, stop_ids
                )
            )
        if probe_rows:  # the same on the benchmark's own prompts: what the speedup table would see
            metrics.update(
                replay_estimate(
                    acc.unwrap_model(model),
                    target,
                    probe_rows,
                    cfg.train.eval_replay_tokens,
                    stop_ids,
                    prefix="eval/bench_replay",
                )
            )
        logger.log(metrics, at)
        if main:
            log.info("step %d eval: %s", at, _fmt(metrics))
        return metrics

    if cfg.train.eval_at_start and step == 0:
        last_eval = held_out(0)
        tick = time.time()  # rates exclude evaluation
    model.train()
    while step < cfg.train.max_steps and stopped == "max_steps":
        loader.set_epoch(epoch)
        batches = acc.skip_first_batches(loader, batch_in_epoch) if batch_in_epoch else loader
        for batch in batches:
            with acc.accumulate(model):
                tout = train_feats(batch, need_logits and "topk_ids" not in batch)
                gen = torch.Generator().manual_seed(
                    hash((cfg.train.seed, epoch, batch_in_epoch, acc.process_index)) % 2**62
                )
                loss, aux = family.compute_loss(model, batch, tout, {**opts, "generator": gen})
                acc.backward(loss)
                if acc.sync_gradients and cfg.optim.max_grad_norm > 0:
                    acc.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            batch_in_epoch += 1
            tokens += int(batch["attention_mask"].sum())
            positions += int(aux["targets"].shape[0])
            if not acc.sync_gradients:
                continue
            step += 1
            last = step >= cfg.train.max_steps
            if not last and out_of_time():  # every rank stops at this step (one decision, shared)
                last, stopped = True, "max_minutes"
                if main:
                    log.info(
                        "train.max_minutes=%g reached at step %d: finishing here", cfg.train.max_minutes, step
                    )
            if step % cfg.train.log_every == 0 or last:
                dt = max(time.time() - tick, 1e-9)
                acc1 = per_slot_accuracy(topk_hits(aux["logits"], aux["targets"]), aux["targets"] != -100)
                rec = {
                    "train/loss": float(loss.detach()),
                    "train/acc1_s0": float(acc1[0]),
                    "lr": scheduler.get_last_lr()[0],
                    "steps_per_s": (step - tick_step) / dt,
                    "tokens_per_s": tokens * acc.num_processes / dt,
                    "positions_per_s": positions * acc.num_processes / dt,
                    "epoch": epoch,
                }
                logger.log(rec, step)
                bar.set_postfix(
                    loss=f"{rec['train/loss']:.3f}",
                    it_s=f"{rec['steps_per_s']:.2f}",
                    tok_s=f"{rec['tokens_per_s']:.0f}",
                )
                tick, tick_step, tokens, positions = time.time(), step, 0, 0
            bar.update(1)
            if step % cfg.train.eval_every == 0 or last:
                last_eval = held_out(step)
                tick, tick_step, tokens, positions = time.time(), step, 0, 0  # rates exclude evaluation
            if step % cfg.train.ckpt_every == 0 or last:
                meta = {
                    "step": step,
                    "data": {"epoch": epoch, "batch_in_epoch": batch_in_epoch},
                    "config": resolved,
                }
                ckpt.save_checkpoint(acc, ckpt_root, meta, cfg.train.keep_last)
            if cfg.train.crash_at_step is not None and step == cfg.train.crash_at_step:
                os.kill(os.getpid(), signal.SIGKILL)  # testing: die like `kill -9`, no cleanup
            if last:
                break
        else:
            epoch, batch_in_epoch = epoch + 1, 0
    bar.close()
    logger.close()

    # ---- 6. export --------------------------------------------------------------------------------------------
    export_dir = Path(cfg.train.export_dir or run_dir / "export")
    summary = {
        "steps": step,
        "stopped_by": stopped,  # max_steps | max_minutes (train.resume=true goes on towards max_steps)
        "wall_time_s": round(time.time() - t0, 1),
        "data": data_info,
        "split": {"val_fraction": float(cfg.data.val_fraction), "seed": int(cfg.data.seed)},  # held-out rows
        "final_eval": last_eval,
        "target": fingerprint,
        "processes": acc.num_processes,
        "trainable_params": n_params,
        "extra": OmegaConf.to_container(cfg.train.extra),
        "init_from": cfg.train.init_from,
    }
    acc.wait_for_everyone()
    if main:
        atomic_write_json(run_dir / "summary.json", summary)
        if cfg.train.export:
            export_drafter(acc.unwrap_model(model), export_dir, summary)
            if cfg.train.push_to_hub:
                push_to_hub(export_dir, cfg.train.push_to_hub)
        log.info("done in %.0f s: %s | export %s", summary["wall_time_s"], _fmt(last_eval), export_dir)
    acc.wait_for_everyone()
    acc.end_training()
    return export_dir


def replay_rows_for(cfg: DictConfig, val_rows: Any, manifest: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The first `train.eval_replay_rows` held-out rows (`input_ids`, `loss_mask`) for `replay_estimate`; [] when off.

    Replay reads verification off the row, so the rows must hold the target's greedy responses: distilled with
    `distill.regenerate=true distill.do_sample=false`. Anything else is refused in one line.

    Args:
        val_rows: the held-out rows (a `datasets.Dataset` or a list of dicts).
        manifest: the distilled set's manifest (None: raw conversations); `train.val_data_dir`'s is read here.
    """
    n = int(cfg.train.eval_replay_rows)
    if n == 0:
        return []
    if manifest is None:
        raise ValueError(
            f"train.eval_replay_rows={n} replays greedy self-distilled rows but train.data_dir is not set (raw "
            "conversations are not the target's output): set train.data_dir to a distilled set, or "
            "train.eval_replay_rows=0"
        )
    folder = cfg.train.get("val_data_dir") or cfg.train.data_dir
    if folder != cfg.train.data_dir:
        from specdraft.distill.shards import read_manifest

        manifest = read_manifest(Path(folder)) or {}
    gen = manifest.get("generation") or {}
    if not gen.get("regenerate") or gen.get("do_sample"):
        kind = "sampled" if gen.get("do_sample") else "the conversations' own"
        raise ValueError(
            f"train.eval_replay_rows={n}: {folder} holds {kind} responses "
            f"(distill.regenerate={gen.get('regenerate')}, distill.do_sample={gen.get('do_sample')}), not the "
            "target's greedy output: distill with distill.regenerate=true distill.do_sample=false, or set "
            "train.eval_replay_rows=0"
        )
    return [
        {"input_ids": list(val_rows[i]["input_ids"]), "loss_mask": list(val_rows[i]["loss_mask"])}
        for i in range(min(n, len(val_rows)))
    ]


def time_limit(acc: Accelerator, minutes: float) -> Callable[[], bool]:
    """A check, called once per optimiser step by every rank, that turns True once `minutes` of wall time have
    passed since it was made (0: never). The main process's clock decides and every rank gets its answer (one
    tiny all-reduce per step under several processes), so all ranks stop at the same step."""
    if minutes <= 0:
        return lambda: False
    deadline = time.time() + 60.0 * minutes

    def out_of_time() -> bool:
        late = time.time() >= deadline
        if acc.num_processes == 1:
            return late
        flag = torch.tensor([1.0 if late and acc.is_main_process else 0.0], device=acc.device)
        return bool(acc.reduce(flag, reduction="sum").item() > 0)

    return out_of_time


def _autocast_only(acc: Accelerator, model: torch.nn.Module) -> None:
    """Drop the fp32 copy accelerate's native AMP makes of the outputs (forward = fp32(autocast(forward))).

    For families whose loss takes bf16/fp16 outputs and computes in fp32 itself (`low_precision_outputs`:
    ReDrafter, Medusa via `models.losses.distill_loss`, as under DeepSpeed, whose outputs are never converted),
    copying (N, D, V) logits to fp32 and their gradient back costs ~15% of a CPU step and changes no value.
    """
    inner = getattr(model, "module", model)
    original = getattr(inner, "_original_forward", None)  # set by accelerate when it wraps for native AMP
    if not acc.native_amp or original is None:
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        with acc.autocast():
            return original(*args, **kwargs)

    inner.forward = forward


def _on(loader: DataLoader, device: torch.device):
    """Yield `loader`'s batches moved to `device` (the eval loader is not prepared: every rank sees all of it)."""
    for batch in loader:
        yield {k: v.to(device) for k, v in batch.items()}


def _fmt(metrics: dict[str, float]) -> str:
    keys = (
        "eval/loss",
        "eval/acc1_s0",
        "eval/acc1_mean",
        "eval/unigram_acc1_mean",
        "eval/sim_accept_len",
        "eval/chain_accept_len",
        "eval/tree_accept_len",
        "eval/tree_walk_len",
        "eval/replay_accept_len",
        "eval/bench_replay_accept_len",
    )
    return ", ".join(f"{k[5:]}={metrics[k]:.3f}" for k in keys if k in metrics)


def _progress(cfg: DictConfig, main: bool, start: int):
    from tqdm.auto import tqdm

    return tqdm(
        total=cfg.train.max_steps,
        initial=start,
        disable=not (main and cfg.train.progress),
        desc="train",
        dynamic_ncols=True,
    )
