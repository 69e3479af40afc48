"""Hydra schema for the distillation stage."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DistillConfig:
    """Self-distillation / continuation targets made with the frozen target."""

    out_dir: str | None = None  # dataset folder (default <run_dir>/distilled)
    num_samples: int | None = 64  # conversations to distill (None: data.num_samples)
    regenerate: bool = True  # regenerate assistant turns with the target (self-distillation)
    do_sample: bool = False  # sample instead of greedy
    temperature: float = 0.7  # sampling temperature (do_sample=true)
    top_p: float = 0.95  # nucleus sampling threshold (do_sample=true)
    max_new_tokens: int = 128  # per assistant turn
    max_turns: int = 2  # assistant turns regenerated per conversation
    T: int = 5  # continuation length (root + T-1 draft targets)
    batch_tokens: int = 4096  # token budget per generation batch: rows * max(prompt + max_new_tokens)
    max_batch_size: int = 32  # sequences per batch at most
    refill: bool = True  # splice waiting prompts into the running batch as sequences finish
    continuation_chunk: int = 256  # positions continued together (original responses; bounds memory)
    shard_size: int = 32  # conversations per shard
    save_hidden: bool = False  # cache last-layer hidden states
    hidden_layers: tuple[int, ...] = ()  # extra intermediate layers to cache (EAGLE-3)
    topk: int = 0  # cache teacher top-k log-probs (0 = off)
    feature_dtype: str = "bf16"  # bf16 | fp16 for cached features
    capture_features: str = "auto"  # features from the generation pass where exact (else 2nd forward): auto (on a CPU, off on a GPU) | true | false
    max_disk_gb: float = 20.0  # refuse to start when the projected feature size exceeds this
    seed: int = 0  # sampling seed
    linear_layout: str = "auto"  # target Linear weights: auto (CPU fp32: panel on x86 AVX2 CPUs with a C compiler, else packed on Intel+MKL, else transposed) | transposed | native | packed | panel
