"""Hydra schema for evaluation (`python evaluate.py conf=<preset> eval.<field>=...`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def fixed_node_cap(node_budget: Any) -> int | None:
    """`eval.node_budget` as a fixed node cap (a count: every tree cut to that many nodes, no fitting; 0 is read
    as 0 and refused by the validator), or None for `auto` / `off` / anything not a count."""
    value = str(node_budget)
    return int(value) if value.isdigit() else None


# `eval.node_budget` settings that price caps on the measured verify cost curve (a fixed count and `off` do not)
CURVE_BUDGETS = ("auto", "bandit", "fit")


def budget_kind(node_budget: Any, device_type: str) -> str:
    """What `eval.node_budget` runs for a single-prompt decoder on `device_type`: `bandit` (a cap per step from the
    loop's measured tokens per second), `fit` (the fitted `NodeBudget`), `off` or `fixed` (a count). `auto` is the
    bandit on a CPU, where it was ahead of the fitted budget in 14 of 18 alternated pairs on a 2-core Zen 4 (the
    trained drafter in 11 of 12, by 1-5% on average; tree prompt lookup behind in fp32 until session 68's arms
    and draws lifted it 2.9%; docs/experiments.md, sessions 67-68), and the fitted budget elsewhere (a GPU: the
    bandit is unmeasured there)."""
    value = str(node_budget)
    if value == "auto":
        return "bandit" if device_type == "cpu" else "fit"
    return "fixed" if value.isdigit() else value


@dataclass
class EvalConfig:
    """Speculative decoding benchmark settings."""

    drafters: list[str] = field(default_factory=list)  # export folders / Hub ids (empty: <run_dir>/export)
    benches: list[str] = field(default_factory=lambda: ["mt_bench"])  # mt_bench | alpaca_eval | path | Hub id
    limit: int | None = 10  # prompts per benchmark, round-robin over categories (None: all)
    max_new_tokens: int = 128  # per turn
    temperature: float = 0.0  # 0 = greedy; > 0 = lossless recursive rejection sampling
    top_k: int = 0  # sampling: keep the k most likely tokens (0: off); same for every method
    top_p: float = 1.0  # sampling: nucleus threshold (1.0: off); same for every method
    beam_width: int | None = None  # ReDrafter beam width (None: the drafter's default)
    beam_length: int | None = None  # ReDrafter beam length incl. root (None: draft_len + 1)
    int8_draft_head: bool = (
        True  # CPU: ReDrafter / Medusa / EAGLE draft with int8 vocab heads (output unchanged)
    )
    draft_block: str = "auto"  # CPU drafting layers: auto|int8|fused|hf (EAGLE layer, ReDrafter products)
    draft_dtype: str | None = None  # None: the target's dtype, else auto|fp32|bf16|fp16; same output
    draft_min_prob: float = 0.0  # ReDrafter: prune beam positions whose drafter probability is below this
    lookup_tokens: int = 0  # > 0: also run each drafter with a prompt-lookup chain this long merged in
    tree_nodes: int | None = None  # Medusa/EAGLE node budget (None: the drafter's default)
    acceptance: str = "exact"  # exact (lossless) | typical (Medusa typical acceptance: LOSSY, needs T > 0)
    typical_epsilon: float = 0.09  # typical acceptance: posterior threshold epsilon
    typical_delta: float = 0.3  # typical acceptance: entropy-dependent threshold scale (sqrt(eps) in Medusa)
    baselines: list[str] = field(
        default_factory=lambda: ["prompt_lookup"]
    )  # or assisted, tree_lookup, hf_static
    prompt_lookup_num_tokens: int = 10  # prompt lookup (transformers' and tree_lookup): candidate length
    assistant_model: str | None = None  # `assisted`: same-tokenizer model, or layers:N (target cut)
    dtype: str | None = None  # override base_model.dtype (auto | fp32 | bf16 | fp16)
    device: str | None = None  # override base_model.device (cpu | cuda | cuda:N | auto)
    num_threads: int | None = None  # torch CPU threads (None: torch's default)
    check_lossless: bool = False  # compare every method's tokens with AR's, explain divergences by near-ties
    near_tie_gap: float | None = None  # top-2 logit gap counted as a numeric near-tie (None: by dtype)
    warmup: int = 1  # warm-up prompts per method before timing (not recorded)
    warmup_tokens: int = 32  # new tokens per warm-up prompt
    fallback: bool = False  # draft only while it pays, else plain target steps (LLMCad); output unchanged
    adaptive: str = "off"  # on: also run each drafter confidence-adaptive (eval/adaptive.py); same output
    adaptive_threshold: float = 0.1  # adaptive: cumulative draft probability a tree node needs to be verified
    decode_path: str = "static"  # static (preallocated cache, one host sync/step) | dynamic (pre-0.2 path)
    cuda_graphs: str = "auto"  # auto (on when the target is on CUDA) | on | off: fixed-shape verify (single and batched) as CUDA graphs
    linear_layout: str = "auto"  # target Linear weights: auto (CPU fp32: panel on x86 AVX2 CPUs with a C compiler, else packed on Intel+MKL, else transposed) | transposed | native | packed | panel
    node_budget: str = "auto"  # auto: bandit on a CPU, fit on a GPU | bandit: a cap per step from measured tok/s | fit: fitted on the cost curve | off | N: every tree cut to N nodes
    node_budget_refit: int = 128  # steps after settling on no drafting before a refit (0: no refits at all)
    node_budget_refit_scale: int = (
        4  # a refit drafts <= this x the settled cap, >= 4 nodes (0: full-size trees)
    )
    node_budget_refit_on_call: bool = True  # a new prompt refits a budget settled on no drafting (new text)
    node_budget_confidence: float = 1.0  # draft only if the best size beats plain steps with its gain this many standard errors lower (0: mean)
    node_budget_memory: int = 192  # probe steps of all fits so far that rate the caps (0: the newest 48)
    batch_sizes: list[int] = field(default_factory=list)  # throughput table at these batch sizes ([]: off)
    prefill_rows: int = (
        0  # throughput: admitted rows prefilled per forward (0: auto, all on CUDA, 1 on a CPU)
    )
    refill_rows: int = (
        0  # throughput: free rows before queued requests are admitted (0: auto, B/4 on CUDA, 1 on a CPU)
    )
    batch_min_prob: str = "off"  # throughput: also each ReDrafter pruned below off | auto (break-even per batch) | a probability
    batch_width: str = "off"  # throughput: also each drafter with one verify width per step from calibrated confidence: off | auto
    scheduler: str = "fifo"  # throughput: fifo | length (longest predicted first) | both | groups (S3) | all
    reserve_quantile: float = (
        0.9  # groups: reserve each response's predicted-bucket bound at this quantile (0, 1]
    )
    length_predictor: str | None = None  # scripts/train_length_predictor.py file (scheduler=length)
    profile: bool = False  # per-phase time breakdown of the speculative loop (adds device syncs)
    plots: bool = True  # write PNG plots (accepted-length histogram, per-category speedup)
    out_dir: str | None = None  # results folder (default <run_dir>/eval)
    seed: int = 0  # sampling seed
