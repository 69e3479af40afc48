"""Training-state checkpoints (kept apart from the exported drafter).

Layout: `<run_dir>/checkpoints/step-00000100/` = accelerate `save_state` (model, optimizer, scheduler, RNG of
every rank: `random_states_<rank>.pkl`) + `meta.json` (step, data position, resolved config). A checkpoint is
written into `.tmp-step-...` and renamed into place only once complete, so a kill mid-save leaves the previous
one intact; the newest `keep_last` are kept.

The resolved config saved in each meta.json is what `check_resume` compares the current config with before
`train.resume=true` loads anything: a different drafter or base model is refused, changed optimiser or
schedule settings are listed in a warning. A fresh run (no resume) in a run dir that holds an earlier run's
records moves them aside first (`archive_previous_run`: metrics.jsonl -> metrics.1.jsonl, checkpoints/ ->
checkpoints.1/, tb/ -> tb.1/), so nothing of the earlier run is lost and its checkpoints are never resumed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from specdraft.utils import atomic_write_json, clean_stale_tmp

PREFIX = "step-"
REFUSED_ON_RESUME = ("drafter.", "base_model.name_or_path", "base_model.gguf_file", "base_model.revision")
WARNED_ON_RESUME = ("optim.", "train.batch_size", "train.grad_accum", "train.max_steps")
RUN_RECORDS = ("metrics.jsonl", "checkpoints", "tb")  # what `archive_previous_run` moves aside


def checkpoint_dir(run_dir: str | os.PathLike[str]) -> Path:
    """`<run_dir>/checkpoints`."""
    return Path(run_dir) / "checkpoints"


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints (with meta.json), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "meta.json").is_file()]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint, or None."""
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def save_checkpoint(
    accelerator: Any, root: str | os.PathLike[str], meta: dict[str, Any], keep_last: int
) -> Path:
    """Save the full training state atomically; every rank must call this.

    Args:
        accelerator: the `Accelerator` whose prepared objects are saved.
        root: the checkpoints folder.
        meta: JSON-able dict; must hold "step". Written as meta.json (its presence marks completeness).
        keep_last: number of newest checkpoints kept (older ones removed; <= 0 keeps all).

    Returns:
        the checkpoint folder.
    """
    root = Path(root)
    name = f"{PREFIX}{int(meta['step']):08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        meta = {**meta, "rng_files": sorted(p.name for p in tmp.glob("random_states_*"))}
        atomic_write_json(tmp / "meta.json", meta)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last > 0:
            for old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The meta.json of checkpoint `path` (step, data position, resolved config)."""
    return json.loads((Path(path) / "meta.json").read_text(encoding="utf-8"))


def load_checkpoint(accelerator: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore model/optimizer/scheduler/RNG from `path` and return its meta.json."""
    accelerator.load_state(str(path))
    return read_meta(path)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as {"a.b.c": leaf}; lists are leaves."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """`key: old -> new` for every leaf under `keys` (prefixes ending in "." or full keys) that differs.

    Keys missing on either side (a field added or removed since the checkpoint) are not compared.
    """
    old, new = _flatten(saved), _flatten(current)
    picked = [
        k
        for k in old.keys() & new.keys()
        if k in keys or k.startswith(tuple(p for p in keys if p.endswith(".")))
    ]
    return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(picked) if old[k] != new[k]]


def check_resume(path: str | os.PathLike[str], config: dict[str, Any]) -> list[str]:
    """Compare the config saved with checkpoint `path` with the resolved current `config` before resuming.

    Args:
        path: the checkpoint to resume from.
        config: the current resolved config (`OmegaConf.to_container(cfg, resolve=True)`).

    Returns:
        `key: old -> new` lines of the optimiser and schedule settings that changed (to log as a warning).

    Raises:
        ValueError: the drafter (`drafter.*`) or the base model differ: the weights would not fit.
    """
    saved = read_meta(path).get("config")
    if not isinstance(saved, dict):
        return [f"{path}/meta.json holds no config (an older checkpoint): settings not compared"]
    refused = config_changes(saved, config, REFUSED_ON_RESUME)
    if refused:
        raise ValueError(
            f"train.resume=true: the checkpoint {path} was trained with another drafter or base model "
            f"({'; '.join(refused)}): resume with the checkpoint's values, or start a new run "
            f"(train.resume=false moves this run's records aside; or pick another name=)"
        )
    return config_changes(saved, config, WARNED_ON_RESUME)


def archive_previous_run(run_dir: str | os.PathLike[str]) -> list[str]:
    """Move an earlier run's records (`RUN_RECORDS`) aside before a fresh run writes its own.

    `metrics.jsonl` becomes `metrics.N.jsonl`, `checkpoints/` `checkpoints.N/` and `tb/` `tb.N/`, with the
    smallest N free for all of them (renames: nothing is copied or deleted). Empty records are left in place.

    Returns:
        `old -> new` names of what was moved (empty when the run dir held no earlier run).
    """
    run_dir = Path(run_dir)

    def filled(p: Path) -> bool:
        return p.stat().st_size > 0 if p.is_file() else p.is_dir() and any(p.iterdir())

    present = [run_dir / name for name in RUN_RECORDS if (run_dir / name).exists() and filled(run_dir / name)]
    if not present:
        return []

    def aside(p: Path, n: int) -> Path:
        return p.with_name(f"{p.stem}.{n}{p.suffix}")

    n = 1
    while any(aside(run_dir / name, n).exists() for name in RUN_RECORDS):
        n += 1
    moved = []
    for p in present:
        os.replace(p, aside(p, n))
        moved.append(f"{p.name} -> {aside(p, n).name}")
    return moved


def clean_partial(root: str | os.PathLike[str]) -> list[Path]:
    """Remove leftovers of saves interrupted by a kill."""
    return clean_stale_tmp(root)
