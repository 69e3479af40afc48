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
    exit_dim: int | None = None  # ResBlock width (None: embed + hidden, no projection; hidden: cheaper)
    freeze_head: bool = False  # keep the vocab head fixed (the target LM head, with init_from_lm_head)
    draft_vocab_size: int | None = None  # head over the most frequent training labels only (None: full vocab)
    target_layers: list[int] = field(default_factory=list)  # extra target layers read with h ([]: h only)
    feature_dropout: float = 0.0  # dropout on [h; layers] while training (a regulariser; 0: none)
    context_heads: int = 0  # > 0: prefix attention over the committed positions (an extension; 0: the paper)
    context_dim: int = 256  # width of that attention, split over context_heads
    copy_ngram: int = 0  # > 0: learnt copy of the prompt-lookup candidate, n-grams up to this (an extension)
    copy_hidden: int = 64  # hidden width of the copy gate
    copy_scale: float = 8.0  # multiplier of the gate's log-odds (an Adam step moves them this many times lr)


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
    max_minutes: float = 0.0  # stop earlier after this much loop wall time (eval, checkpoint, export); 0: off
    batch_size: int = 4  # sequences per device per micro-batch
    grad_accum: int = 1  # micro-batches per optimiser step
    eval_every: int = 50  # held-out evaluation every N steps
    eval_at_start: bool = False  # also evaluate before step 1 (logged as step 0: a warm start's baseline)
    eval_batches: int = 8  # batches per evaluation
    eval_replay_rows: int = 0  # held-out rows decoded by the drafter's own proposer at each eval (0: off)
    eval_replay_tokens: int = 64  # tokens replayed per row (at most its response)
    eval_bench_rows: int = 0  # also replay on N benchmark first turns answered by the target (0: off)
    eval_bench: str = "mt_bench"  # eval_bench_rows' benchmark: mt_bench | alpaca_eval | a .jsonl/.json file
    ckpt_every: int = 100  # training-state checkpoint every M steps
    keep_last: int = 2  # checkpoints kept (0: all)
    resume: bool = False  # continue from the newest checkpoint (false: move an earlier run's records to *.N)
    seed: int = 0  # global seed
    mixed_precision: str = "auto"  # accelerate AMP: auto (bf16/fp16 where native, else no) | no | bf16 | fp16
    data_dir: str | None = None  # distilled dataset dir (None: raw conversations from `data`)
    val_data_dir: str | None = None  # held-out rows: this distilled dataset's val split (None: data_dir's)
    allow_incomplete_data: bool = False  # train on the finished shards of a distill run still in progress
    init_from: str | None = None  # start from this drafter export's weights (same family; head rows remapped)
    export_dir: str | None = None  # where to export the drafter (default <run_dir>/export)
    push_to_hub: str | None = None  # Hub repo id to publish the export to (token from HF_TOKEN)
    extra: dict = field(default_factory=dict)  # free-form notes recorded in the export's training summary
    loss: str = "ce"  # ce (hard teacher tokens) | kl (soft top-k teacher) | ce+kl; lk, +lk: acceptance
    kl_weight: float = 1.0  # weight of the KL term when loss has "kl"
    lk_weight: float = 1.0  # weight of the acceptance term -E[accepted length] when loss has "lk"
    kl_topk: int = 20  # teacher top-k used for online soft targets (cached top-k is used when present)
    slot_weights: list[float] | None = None  # per draft-slot loss weights (None: all 1)
    context_positions: bool = (
        False  # also train prompt positions on the target's greedy chain (needs distill.topk)
    )
    max_positions: int | None = 512  # trained positions per micro-batch, sampled at random (None: all)
    eval_max_positions: int | None = 512  # positions per eval batch, a fixed sample (None: all)
    topk_acc: int = 5  # k of the reported top-k accuracy
    log_every: int = 10  # training metrics to the loggers every N steps
    progress: bool = True  # progress bar on rank 0
    use_cached_features: bool = True  # use hidden states cached by distill/ when present
    cache_target_features: bool = False  # memoise online target hidden states per row in RAM
    num_workers: int = 0  # DataLoader worker processes
    export: bool = True  # export the drafter at the end
    crash_at_step: int | None = None  # testing only: SIGKILL this process right after step N (resume tests)


@dataclass
class MedusaSchema:
    """Medusa heads hyper-parameters (`drafter=medusa`)."""

    family: str = "medusa"  # drafter family: redrafter | medusa | eagle
    draft_len: int = 4  # K heads; head k predicts draft slot k (x_{t+2+k})
    num_layers: int = 1  # ResBlocks per head before its vocabulary projection
    loss_decay: float = 0.8  # lambda: head k's loss is weighted lambda^k (unless train.slot_weights is set)
    init_from_lm_head: bool = True  # initialise every head's projection from the target's LM head
    topk: int = 10  # candidates per head available to the static tree at decode time
    draft_vocab_size: int | None = (
        None  # heads over the most frequent training labels only (None: full vocab)
    )
    tree_choices: list[list[int]] | None = (
        None  # static tree (Medusa rank paths) saved in the export (None: default)
    )
    root_token: bool = False  # every head also reads the root x_{t+1}'s embedding (models/medusa_root.py)
    copy_ngram: int = (
        0  # > 0: copy gate over the prompt-lookup candidate, n-grams up to this (models/medusa_copy.py)
    )
    copy_hidden: int = 64  # hidden width of the copy gate
    copy_scale: float = 8.0  # multiplier of the gate's log-odds (an Adam step moves them this many times lr)


@dataclass
class EagleSchema:
    """EAGLE-1 feature head + EAGLE-2 dynamic tree (`drafter=eagle`)."""

    family: str = "eagle"  # drafter family: redrafter | medusa | eagle | eagle3
    draft_len: int = 4  # draft slots scored at evaluation (the head is unrolled on its own features)
    fc_bias: bool = True  # bias of fc([e; f]) (as the public EAGLE-1 checkpoints)
    draft_vocab_size: int | None = (
        None  # decode: draft over the most frequent training labels only (None: full)
    )
    feature_weight: float = 1.0  # smooth-L1 feature-regression weight
    token_weight: float = 0.1  # soft cross-entropy token weight
    noise: float = 0.0  # half-width of uniform noise added to input features in training (0: off)
    tree_total_tokens: int = 24  # EAGLE-2 decode: draft nodes kept after reranking (root excluded)
    tree_depth: int = 5  # EAGLE-2 decode: maximum draft depth
    tree_top_k: int = 6  # EAGLE-2 decode: children per node / nodes expanded per depth
    copy_ngram: int = 0  # > 0: copy gate over the prompt-lookup candidate, n-grams up to this (an extension)
    copy_hidden: int = 64  # hidden width of the copy gate
    copy_scale: float = 8.0  # multiplier of the gate's log-odds (an Adam step moves them this many times lr)


@dataclass
class Eagle3Schema:
    """EAGLE-3 fused-feature head with training-time test (`drafter=eagle3`)."""

    family: str = "eagle3"  # drafter family
    draft_len: int = 5  # training-time-test unroll steps (= draft slots trained and scored), 1..7
    ttt_decay: float = 0.8  # loss weight of unroll step i is ttt_decay ** i
    norm_fused: bool = False  # EAGLE-3.1: RMSNorm each fused layer before fc, feed the post-norm state back
    target_layers: list[int] | None = None  # fused target hidden_states indices (None: 2, L // 2, L - 3)
    draft_vocab_size: int | None = None  # reduced draft vocabulary of the most frequent tokens (None: full)
    tree_total_tokens: int = 24  # EAGLE-2 decode: draft nodes kept after reranking (root excluded)
    tree_depth: int = 5  # EAGLE-2 decode: maximum draft depth
    tree_top_k: int = 6  # EAGLE-2 decode: children per node / nodes expanded per depth
    copy_ngram: int = 0  # > 0: copy gate over the prompt-lookup candidate, n-grams up to this (an extension)
    copy_hidden: int = 64  # hidden width of the copy gate
    copy_scale: float = 8.0  # multiplier of the gate's log-odds (an Adam step moves them this many times lr)
