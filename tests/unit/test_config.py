"""Every preset composes against the schemas; unknown presets/keys fail with Hydra's message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from specdraft.conf.schema import register_configs

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
PRESETS = sorted(p.stem for p in (CONF / "conf").glob("*.yaml"))


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_presets_exist() -> None:
    assert {"redrafter_smollm2", "redrafter_vicuna7b"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes(preset: str) -> None:
    cfg = _compose([f"conf={preset}"])
    OmegaConf.resolve(cfg)  # every interpolation resolves
    assert cfg.name == preset
    assert cfg.run_dir == f"outputs/{preset}"  # deterministic run dir: no timestamp
    assert cfg.drafter.family in {"redrafter", "medusa", "eagle", "eagle3"}


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_with_debug(preset: str) -> None:
    cfg = _compose([f"conf={preset}", "debug=cpu"])
    assert cfg.train.max_steps <= 20


def test_vicuna_preset_is_real() -> None:
    cfg = _compose(["conf=redrafter_vicuna7b"])
    assert cfg.base_model.name_or_path == "lmsys/vicuna-7b-v1.3"
    assert cfg.base_model.dtype == "auto" and cfg.train.mixed_precision == "auto"  # bf16 on its GPUs


def test_unknown_key_and_preset_fail_clearly() -> None:
    with pytest.raises(ConfigCompositionException, match="no_such_key"):
        _compose(["conf=redrafter_smollm2", "drafter.no_such_key=1"])
    with pytest.raises(ConfigCompositionException, match="no_such_preset"):
        _compose(["conf=no_such_preset"])
    with pytest.raises(ConfigCompositionException):
        _compose(["train.max_steps=not_a_number"])


def test_cli_prints_composed_config() -> None:
    out = subprocess.run(
        [sys.executable, "train.py", "conf=redrafter_smollm2", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "name: redrafter_smollm2" in out.stdout and "name_or_path: smollm2-135m" in out.stdout
    bad = subprocess.run(
        [sys.executable, "train.py", "conf=nope"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "nope" in bad.stderr and "Traceback" not in bad.stderr
