"""Drafter families by name (`config.architecture`): what the trainer and the loader dispatch on.

A family module (e.g. `models/redrafter.py`) exposes:
  * `MODEL`: the `PreTrainedModel` subclass (and `CONFIG`, its `PretrainedConfig`);
  * `build(schema, target, fingerprint) -> model`: a fresh drafter from the `drafter` config group;
  * `attach(model, target) -> model`: reconnect what is borrowed from the target after loading;
  * `compute_loss(model, batch, target_out, opts) -> (loss, aux)` with aux["logits"] (N, D, V) and
    aux["targets"] (N, D), from which the loop computes every metric (so it stays family-agnostic);
  * `TARGET_LAYERS`: intermediate target layers the family needs in `TargetOutput.layers` (() for none);
  * optional `LOW_PRECISION_OUTPUTS = True`: `compute_loss` takes bf16/fp16 outputs (the loop then skips
    accelerate's fp32 copy of them); `USES_TOKEN_COUNTS = True`: `build` takes the training-label counts.
Adding Medusa/EAGLE = one file with those names + one line in FAMILY_MODULES.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from transformers import PreTrainedModel

FAMILY_MODULES: dict[str, str] = {
    "redrafter": "specdraft.models.redrafter",
    "medusa": "specdraft.models.medusa",
    "eagle": "specdraft.models.eagle",
    "eagle3": "specdraft.models.eagle3",
}


def get_family(name: str) -> ModuleType:
    """The module implementing family `name` (clear error for an unknown one)."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown drafter family {name!r}; known: {sorted(FAMILY_MODULES)}")
    return importlib.import_module(FAMILY_MODULES[name])


def drafters() -> dict[str, type[PreTrainedModel]]:
    """`DRAFTERS` of docs/design.md: family name -> PreTrainedModel class."""
    return {name: get_family(name).MODEL for name in FAMILY_MODULES}


def __getattr__(name: str) -> dict[str, type[PreTrainedModel]]:
    # `from specdraft.models.registry import DRAFTERS` works without importing every family at import time.
    if name == "DRAFTERS":
        return drafters()
    raise AttributeError(name)
