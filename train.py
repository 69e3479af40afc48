"""Train a drafter on top of the frozen target: `accelerate launch train.py conf=redrafter_smollm2`."""

import hydra
from omegaconf import DictConfig

from specdraft.conf.schema import register_configs
from specdraft.utils import quiet_hydra_on_nonzero_rank


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: compose the config, then hand it to the library."""
    from specdraft.train.loop import train

    train(cfg)


if __name__ == "__main__":
    register_configs()
    quiet_hydra_on_nonzero_rank()
    main()
