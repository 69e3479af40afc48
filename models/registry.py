"""Drafter families by name (`config.architecture`): what the trainer, the loader and the decoder dispatch on.

A family module (e.g. `models/redrafter.py`) declares its contract once, as `FAMILY = FamilySpec(...)`
(`models/family.py`): name, model/config classes, `build` / `attach` / `compute_loss`, the target features it
reads (last hidden state, intermediate `target_layers`, or none; whether decoding needs h_t), the `train.loss`
values it implements, `low_precision_outputs`, `uses_token_counts` and the name of its proposer builder. The
module also keeps `MODEL` and `CONFIG` (the same classes) for older callers.

Adding a fifth family = one module declaring `FAMILY` + one line in `FAMILY_MODULES` (or `register_family`)
+ one preset (tests/unit/test_family_contract.py plugs in a toy one).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from transformers import PreTrainedModel

from specdraft.models.family import FamilySpec

FAMILY_MODULES: dict[str, str] = {
    "redrafter": "specdraft.models.redrafter",
    "medusa": "specdraft.models.medusa",
    "eagle": "specdraft.models.eagle",
    "eagle3": "specdraft.models.eagle3",
}


def register_family(name: str, module: str) -> None:
    """Register family `name`, implemented by the importable `module` (which declares `FAMILY`)."""
    FAMILY_MODULES[name] = module


def get_family(name: str) -> ModuleType:
    """The module implementing family `name` (clear error for an unknown one)."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown drafter family {name!r}; known: {sorted(FAMILY_MODULES)}")
    return importlib.import_module(FAMILY_MODULES[name])


def family_spec(name: str) -> FamilySpec:
    """The declared contract of family `name` (its module's `FAMILY`).

    Raises:
        ValueError: an unknown family, or a module whose `FAMILY` is missing or declares another name.
    """
    module = get_family(name)
    spec = module.__dict__.get("FAMILY")
    if not isinstance(spec, FamilySpec):
        raise ValueError(f"{module.__name__} declares no `FAMILY = FamilySpec(...)` (models/family.py)")
    if spec.name != name:
        raise ValueError(f"{module.__name__} declares FAMILY.name={spec.name!r}, registered as {name!r}")
    return spec


def spec_of(drafter: Any) -> FamilySpec:
    """The contract of a built or loaded drafter, from its config's declared `architecture`.

    Args:
        drafter: a drafter model (`drafter.config.architecture` names its family).

    Raises:
        ValueError: no `config.architecture` (not a specdraft drafter), or an unknown family.
    """
    name = getattr(getattr(drafter, "config", None), "architecture", None)
    if not name:
        raise ValueError(
            f"cannot tell the drafter family of {type(drafter).__name__}: no config.architecture"
        )
    return family_spec(str(name))


def drafters() -> dict[str, type[PreTrainedModel]]:
    """`DRAFTERS` of docs/design.md: family name -> PreTrainedModel class."""
    return {name: family_spec(name).model for name in FAMILY_MODULES}


def __getattr__(name: str) -> dict[str, type[PreTrainedModel]]:
    # `from specdraft.models.registry import DRAFTERS` works without importing every family at import time.
    if name == "DRAFTERS":
        return drafters()
    raise AttributeError(name)
