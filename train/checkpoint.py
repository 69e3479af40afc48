"""Training-state checkpoints (kept apart from the exported drafter).

Layout: `<run_dir>/checkpoints/step-00000100/` = accelerate `save_state` (model, optimizer, scheduler, RNG of
every rank: `random_states_<rank>.pkl`) + `meta.json` (step, data position, resolved config). A checkpoint is
written into `.tmp-step-...` and renamed into place only once complete, so a kill mid-save leaves the previous
one intact; the newest `keep_last` are kept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from specdraft.utils import atomic_write_json, clean_stale_tmp

PREFIX = "step-"


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


def load_checkpoint(accelerator: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore model/optimizer/scheduler/RNG from `path` and return its meta.json."""
    import json

    path = Path(path)
    accelerator.load_state(str(path))
    return json.loads((path / "meta.json").read_text(encoding="utf-8"))


def clean_partial(root: str | os.PathLike[str]) -> list[Path]:
    """Remove leftovers of saves interrupted by a kill."""
    return clean_stale_tmp(root)
