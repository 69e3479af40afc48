"""Speedup tables for exported drafters: `python evaluate.py conf=redrafter_smollm2`."""

import hydra
from omegaconf import DictConfig

from specdraft.entry import launch, run_stage


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: compose the config, then hand it to the library."""
    from specdraft.eval.cli import evaluate

    run_stage(evaluate, cfg)


if __name__ == "__main__":
    launch(main)
