"""Hydra schema for evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalConfig:
    """Speculative decoding benchmark settings."""

    drafters: list[str] = field(default_factory=list)  # exported drafter folders / Hub ids (empty: <run_dir>/export)
    benches: list[str] = field(default_factory=lambda: ["mt_bench"])  # mt_bench | alpaca_eval | path | Hub id
    limit: int | None = 10  # prompts per benchmark (None: all)
    max_new_tokens: int = 128  # per turn
    temperature: float = 0.0  # 0 = greedy
    beam_width: int | None = None  # ReDrafter beam width (None: the drafter's default)
    beam_length: int | None = None  # ReDrafter beam length incl. root (None: draft_len + 1)
    baselines: list[str] = field(default_factory=lambda: ["prompt_lookup"])  # prompt_lookup | assisted
    assistant_model: str | None = None  # small assistant model for assisted generation
    check_lossless: bool = False  # compare against AR outputs token for token, explain divergences
    warmup: int = 1  # warm-up prompts before timing
    out_dir: str | None = None  # results folder (default <run_dir>/eval)
    seed: int = 0  # sampling seed
