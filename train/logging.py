"""Metric sinks: metrics.jsonl always, tensorboard and wandb (offline-capable) when enabled.

metrics.jsonl is appended to: a resumed run first drops the records after its checkpoint (`truncate_metrics`),
a fresh run starts a new file after moving an earlier run's aside (`train.checkpoint.archive_previous_run`).

Only the main process logs; other ranks get a `NullLogger` (the dummy logger), so call sites never branch.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from specdraft.utils import atomic_write_text

log = logging.getLogger(__name__)


class NullLogger:
    """Accepts everything, writes nothing (non-main ranks, or every sink off)."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Drop `metrics`."""

    def close(self) -> None:
        """Nothing to close."""


class MetricLogger:
    """Fan metrics out to metrics.jsonl (+ tensorboard, + wandb)."""

    def __init__(
        self, run_dir: str | os.PathLike[str], cfg: Any, run_name: str, config: dict[str, Any]
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = self.wandb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError as e:  # tensorboard is a declared dependency; degrade with a message
                log.warning("logger.tensorboard=true but tensorboard is unavailable (%s); skipping it", e)
        if cfg.wandb:
            try:
                import wandb

                self.wandb = wandb.init(
                    project=cfg.wandb_project,
                    name=run_name,
                    mode=cfg.wandb_mode,
                    dir=str(run_dir),
                    config=config,
                )
            except ImportError:
                log.warning("logger.wandb=true but wandb is not installed (pip install wandb); skipping it")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append one record {"step": step, **metrics} (floats for tensors)."""
        rec = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and self.tb is not None:
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(rec, step=int(step))

    def close(self) -> None:
        """Flush and close the sinks."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _scalar(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        return float(v.item())
    return v


def make_logger(
    run_dir: str | os.PathLike[str], cfg: Any, run_name: str, config: dict[str, Any], main: bool
) -> MetricLogger | NullLogger:
    """A `MetricLogger` on the main process, a `NullLogger` elsewhere."""
    return MetricLogger(run_dir, cfg, run_name, config) if main else NullLogger()


def truncate_metrics(run_dir: str | os.PathLike[str], last_step: int) -> int:
    """On resume, drop records newer than the checkpoint (left by the killed run); returns how many were kept."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if int(rec.get("step", 0)) <= last_step:
            kept.append(line)
    atomic_write_text(path, "".join(x + "\n" for x in kept))
    return len(kept)


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
