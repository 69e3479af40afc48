"""Hydra schemas for training: drafter hyper-parameters, optimiser, logger and the loop itself."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReDrafterSchema:
    """ReDrafter hyper-parameters (`drafter=redrafter`)."""

    family: str = "redrafter"  # drafter family: redrafter | medusa | eagle
    draft_len: int = 4  # tokens drafted after the root (beam length - 1)
    num_layers: int = 2  # ResBlock layers after the RNN
    rnn: bool = True  # use the recurrent state s_t (False: ablate to a Medusa-like MLP over [e, h])
    share_embeddings: bool = True  # reuse the target's (frozen) token embeddings
    beam_width: int = 8  # default beam width at decode time
    init_from_lm_head: bool = True  # initialise the vocabulary head from the target's LM head


@dataclass
class OptimConfig:
    """AdamW + warmup/cosine schedule."""

    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    warmup_steps: int = 50  # linear warm-up steps
    scheduler: str = "cosine"  # cosine | constant
    max_grad_norm: float = 1.0  # gradient clipping (0 disables)


@dataclass
class LoggerConfig:
    """Where metrics go; the jsonl file is always written."""

    jsonl: bool = True  # metrics.jsonl in the run dir (always on in practice)
    tensorboard: bool = False  # tensorboard event files under <run_dir>/tb
    wandb: bool = False  # Weights & Biases (set wandb_mode=offline without network)
    wandb_project: str = "specdraft"  # wandb project name
    wandb_mode: str = "offline"  # online | offline | disabled


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = 200  # optimiser steps
    batch_size: int = 4  # sequences per device per micro-batch
    grad_accum: int = 1  # micro-batches per optimiser step
    eval_every: int = 50  # held-out evaluation every N steps
    eval_batches: int = 8  # batches per evaluation
    ckpt_every: int = 100  # training-state checkpoint every M steps
    keep_last: int = 2  # checkpoints kept
    resume: bool = False  # continue from the newest checkpoint in the run dir
    seed: int = 0  # global seed
    mixed_precision: str = "no"  # accelerate mixed precision: no | bf16 | fp16
    data_dir: str | None = None  # distilled dataset dir (None: raw conversations from `data`)
    export_dir: str | None = None  # where to export the drafter (default <run_dir>/export)
    push_to_hub: str | None = None  # Hub repo id to publish the export to (token from HF_TOKEN)
    extra: dict = field(default_factory=dict)  # free-form notes recorded in the export's training summary
