"""The root configuration schema, shared by `train.py`, `distill.py` and `evaluate.py`.

Every YAML under `conf/` is merged onto these dataclasses, so an unknown key or a wrong type fails
at composition time with Hydra's own message; value ranges are declared per field in conf/validate.py and
checked right after composition (`validate_config`). `register_configs()` puts them in the ConfigStore; it
is called by the entry points (nothing happens at import time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from specdraft.distill.config import DistillConfig
from specdraft.eval.config import EvalConfig
from specdraft.train.config import (
    Eagle3Schema,
    EagleSchema,
    LoggerConfig,
    MedusaSchema,
    OptimConfig,
    ReDrafterSchema,
    TrainConfig,
)


@dataclass
class BaseModelConfig:
    """The frozen target LLM."""

    name_or_path: str = "smollm2-135m"  # Hub id, local HF folder, .gguf file, or the embedded `smollm2-135m`
    gguf_file: str | None = None  # GGUF file name inside `name_or_path` (Hub repo or folder)
    revision: str | None = None  # Hub revision (branch, tag or commit)
    dtype: str = "auto"  # auto (bf16 where native but fp32 on panel-kernel CPUs, fp16 on old CUDA, else fp32) | fp32 | bf16 | fp16 | fp64
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attn_implementation: str | None = None  # eager | sdpa | flash_attention_2 (None: transformers' default)
    cache_dir: str | None = None  # where the dequantised GGUF copy is cached (default ~/.cache/specdraft)
    q8_activations: bool = False  # CPU panel layout: 4/8-bit weights times int8 activations (llama.cpp's arithmetic; another target than fp32)
    chat_template: str | None = (
        None  # override: a builtin name (`vicuna`) or a Jinja string (None: the tokenizer's)
    )


@dataclass
class DataConfig:
    """Training conversations."""

    source: str = "sharegpt"  # `sharegpt` (embedded ShareGPT V3), a .json/.jsonl path, or a Hub dataset id
    split: str = "train"  # Hub dataset split
    max_length: int = 512  # tokens per conversation after the chat template (truncated)
    num_samples: int | None = 2000  # conversations kept after filtering (None: all)
    val_fraction: float = 0.05  # held-out fraction (by a hash of the conversation id: stable as data grows)
    seed: int = 0  # shuffle/split seed


@dataclass
class RootConfig:
    """Everything a run needs; presets (`conf=<name>`) overlay it."""

    name: str = "default"  # run name, a plain folder name (no '/'): the run dir is <output_root>/<name>
    output_root: str = "outputs"  # parent of every run dir
    run_dir: str = "${output_root}/${name}"  # deterministic run dir (same on every rank)
    base_model: BaseModelConfig = field(default_factory=BaseModelConfig)  # frozen target
    data: DataConfig = field(default_factory=DataConfig)  # training conversations
    drafter: Any = None  # drafter family hyper-parameters (filled by the `drafter` group: any family schema)
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimiser
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # metric sinks
    train: TrainConfig = field(default_factory=TrainConfig)  # training loop
    distill: DistillConfig = field(default_factory=DistillConfig)  # distillation stage
    eval: EvalConfig = field(default_factory=EvalConfig)  # evaluation stage


DRAFTER_SCHEMAS: dict[str, type] = {
    "redrafter": ReDrafterSchema,
    "medusa": MedusaSchema,
    "eagle": EagleSchema,
    "eagle3": Eagle3Schema,
}


def register_configs() -> None:
    """Register the root schema and the per-family drafter schemas in Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    for family, schema in DRAFTER_SCHEMAS.items():
        cs.store(group="drafter", name=f"{family}_schema", node=schema)
