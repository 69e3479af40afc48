"""Console scripts (`specdraft-train`, `specdraft-distill`, `specdraft-eval`) for an installed package.

They are the repo-root entry points (`train.py`, `distill.py`, `evaluate.py`) with the configs read from
the installed `specdraft.conf` package instead of the checkout's `conf/` folder.
"""

from __future__ import annotations

from collections.abc import Callable

import hydra
from omegaconf import DictConfig

from specdraft.entry import launch, run_stage


def _run(stage: Callable[[DictConfig], object]) -> None:
    @hydra.main(version_base="1.3", config_path="pkg://specdraft.conf", config_name="config")
    def main(cfg: DictConfig) -> None:
        run_stage(stage, cfg)

    launch(main)


def train_main() -> None:
    """`specdraft-train conf=<preset>`: see `specdraft.train.loop.train`."""
    from specdraft.train.loop import train

    _run(train)


def distill_main() -> None:
    """`specdraft-distill conf=<preset>`: see `specdraft.distill.run.distill`."""
    from specdraft.distill.run import distill

    _run(distill)


def eval_main() -> None:
    """`specdraft-eval conf=<preset>`: see `specdraft.eval.cli.evaluate`."""
    from specdraft.eval.cli import evaluate

    _run(evaluate)
