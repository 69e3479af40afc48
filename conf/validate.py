"""Declared value ranges of every config field, checked right after composition (before any model loads).

Hydra already rejects unknown keys and wrong types; `validate_config(cfg)` checks the values: one table per
schema (field -> `Rule`), every field listed (`ANY` where every value of the type is fine, so a new field
without a decision fails `tests/unit/test_config_ranges.py`). The `drafter` group is checked against the
table of its family (`drafter.family`). All problems are reported in one line, each naming the full key, the
value, what is allowed and a value to pass instead:

    train.batch_size=0: expected an integer >= 1; pass e.g. train.batch_size=4 (the default)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdraft.conf.schema import DRAFTER_SCHEMAS, BaseModelConfig, DataConfig, RootConfig
from specdraft.data.features import FEATURE_DTYPES
from specdraft.distill.config import DistillConfig
from specdraft.eval.config import CURVE_BUDGETS, EvalConfig, fixed_node_cap
from specdraft.hardware import DTYPES
from specdraft.train.config import (
    Eagle3Schema,
    EagleSchema,
    LoggerConfig,
    MedusaSchema,
    OptimConfig,
    ReDrafterSchema,
    TrainConfig,
)


@dataclass(frozen=True)
class Rule:
    """The allowed values of one field: `ok(value)` decides, `allowed` says it in words for the error."""

    ok: Callable[[Any], bool]  # True when the (resolved, plain Python) value is allowed
    allowed: str  # e.g. "an integer >= 1"
    hint: Callable[[str, Any], str] | None = None  # (key, value) -> the fix (None: "pass e.g. <default>")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def at_least(lo: float) -> Rule:
    """A number >= `lo`."""
    return Rule(lambda v: _number(v) and v >= lo, f">= {lo}")


def above(lo: float) -> Rule:
    """A number > `lo`."""
    return Rule(lambda v: _number(v) and v > lo, f"> {lo}")


def within(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = True) -> Rule:
    """A number in the interval from `lo` to `hi` (closed at `lo`, open at `hi` by default)."""

    def ok(v: Any) -> bool:
        return _number(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return Rule(ok, f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")


def one_of(*choices: str) -> Rule:
    """One of `choices`."""
    return Rule(lambda v: v in choices, f"one of {', '.join(choices)}")


def optional(rule: Rule) -> Rule:
    """`rule`, or null."""
    return Rule(lambda v: v is None or rule.ok(v), f"null or {rule.allowed}", rule.hint)


def each(rule: Rule) -> Rule:
    """A list whose every item satisfies `rule`."""
    return Rule(
        lambda v: isinstance(v, list) and all(rule.ok(x) for x in v), f"a list of items {rule.allowed}"
    )


ANY = Rule(lambda v: True, "any value")  # every value of the field's type is meaningful
NON_EMPTY = Rule(lambda v: bool(v) and (not isinstance(v, str) or bool(v.strip())), "a non-empty value")
SEED = within(0, 2**32 - 1, hi_open=False)  # numpy's seed range
DTYPE_NAMES = ("auto", *DTYPES)  # what specdraft.hardware.resolve_dtype accepts
DTYPE = one_of(*DTYPE_NAMES)
DEVICE = Rule(
    lambda v: isinstance(v, str) and re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) is not None,
    "auto, cpu, cuda, cuda:N or mps",
)
# a budget priced on the cost curve, none, or a fixed node cap (`eval.config.fixed_node_cap`)
NODE_BUDGET = Rule(
    lambda v: v in (*CURVE_BUDGETS, "off") or (fixed_node_cap(v) or 0) >= 1,
    "auto, bandit, fit, off or a node count >= 1 (every tree cut to that many nodes, no fitting)",
)
POSITIVE = at_least(1)  # counts where zero is meaningless
COUNT = at_least(0)  # counts where zero means "off"
FRACTION = within(0, 1)  # [0, 1)
DECAY = within(0, 1, lo_open=True, hi_open=False)  # (0, 1]


def is_probability(v: Any) -> bool:
    """A number (or its string) strictly between 0 and 1."""
    try:
        return 0.0 < float(v) < 1.0
    except (TypeError, ValueError):
        return False


def _plain_name_ok(v: Any) -> bool:
    return (
        isinstance(v, str)
        and v.strip() == v
        and v not in ("", ".", "..")
        and not any(c in v for c in "/\\\0")
        and v.isprintable()
    )


def _plain_name_hint(key: str, value: Any) -> str:
    base = re.sub(r"[/\\\0]+", "_", str(value)).strip("._ ") or "my_run"
    return f"pass e.g. {key}={base}, and output_root=<folder> to put the run dir elsewhere"


PLAIN_NAME = Rule(
    _plain_name_ok,
    "a plain folder name (no '/', '\\', '..': the run dir is <output_root>/<name>)",
    _plain_name_hint,
)


def _assistant_ok(v: Any) -> bool:
    if v is None or not str(v).startswith("layers:"):
        return True
    n = str(v)[len("layers:") :]
    return n.isdigit() and int(n) >= 1


ASSISTANT = Rule(_assistant_ok, "null, a model path or Hub id, or layers:N with N >= 1")

Table = Mapping[str, Rule]

ROOT: Table = {
    "name": PLAIN_NAME,
    "output_root": NON_EMPTY,
    "run_dir": NON_EMPTY,
}
BASE_MODEL: Table = {
    "name_or_path": NON_EMPTY,
    "gguf_file": ANY,
    "revision": ANY,
    "dtype": DTYPE,
    "device": DEVICE,
    "attn_implementation": optional(
        one_of("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
    ),
    "cache_dir": ANY,
    "q8_activations": ANY,
    "chat_template": ANY,
}
DATA: Table = {
    "source": NON_EMPTY,
    "split": NON_EMPTY,
    "max_length": at_least(2),
    "num_samples": optional(POSITIVE),
    "val_fraction": FRACTION,
    "seed": SEED,
}
REDRAFTER: Table = {
    "family": ANY,  # checked by `validate_config` (it picks this table)
    "draft_len": POSITIVE,
    "num_layers": COUNT,
    "rnn": ANY,
    "share_embeddings": ANY,
    "beam_width": POSITIVE,
    "init_from_lm_head": ANY,
    "exit_dim": optional(POSITIVE),
    "freeze_head": ANY,
    "draft_vocab_size": optional(POSITIVE),
    "target_layers": ANY,  # indices into the target's hidden states (checked against the target when built)
    "feature_dropout": FRACTION,
    "context_heads": COUNT,
    "context_dim": POSITIVE,
    "copy_ngram": COUNT,
    "copy_hidden": POSITIVE,
    "copy_scale": above(0),
}
MEDUSA: Table = {
    "family": ANY,
    "draft_len": POSITIVE,
    "num_layers": COUNT,
    "loss_decay": DECAY,
    "init_from_lm_head": ANY,
    "topk": POSITIVE,
    "draft_vocab_size": optional(POSITIVE),  # <= the target's vocab_size: checked when the heads are built
    "tree_choices": ANY,  # checked by eval/medusa_tree.py when the tree is built
    "root_token": ANY,
    "copy_ngram": COUNT,
    "copy_hidden": POSITIVE,
    "copy_scale": above(0),
}
EAGLE_TREE: Table = {"tree_total_tokens": POSITIVE, "tree_depth": POSITIVE, "tree_top_k": POSITIVE}
EAGLE: Table = {
    "family": ANY,
    "draft_len": POSITIVE,
    "fc_bias": ANY,
    "draft_vocab_size": optional(POSITIVE),
    "feature_weight": at_least(0),
    "token_weight": at_least(0),
    "noise": at_least(0),
    "copy_ngram": COUNT,
    "copy_hidden": POSITIVE,
    "copy_scale": above(0),
    **EAGLE_TREE,
}
TTT_DEPTH = (
    Rule(  # EAGLE-3 training-time-test unroll steps (models/eagle3.py: memory and time grow with them)
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 7,
        "an integer in [1, 7] (training-time-test unroll steps)",
    )
)
EAGLE3: Table = {
    "family": ANY,
    "draft_len": TTT_DEPTH,
    "ttt_decay": DECAY,
    "norm_fused": ANY,
    "target_layers": ANY,
    "draft_vocab_size": optional(POSITIVE),
    "copy_ngram": COUNT,
    "copy_hidden": POSITIVE,
    "copy_scale": above(0),
    **EAGLE_TREE,
}
OPTIM: Table = {
    "lr": above(0),
    "weight_decay": at_least(0),
    "betas": Rule(lambda v: len(v) == 2 and all(FRACTION.ok(b) for b in v), "two numbers in [0, 1)"),
    "warmup_steps": COUNT,
    "scheduler": one_of("cosine", "constant"),
    "max_grad_norm": at_least(0),
}
LOGGER: Table = {
    "jsonl": ANY,
    "tensorboard": ANY,
    "wandb": ANY,
    "wandb_project": NON_EMPTY,
    "wandb_mode": one_of("online", "offline", "disabled"),
}
TRAIN: Table = {
    "max_steps": POSITIVE,
    "max_minutes": at_least(0),
    "batch_size": POSITIVE,
    "grad_accum": POSITIVE,
    "eval_every": POSITIVE,
    "eval_at_start": ANY,
    "eval_batches": POSITIVE,
    "eval_replay_rows": COUNT,
    "eval_replay_tokens": POSITIVE,
    "eval_bench_rows": COUNT,
    "eval_bench": NON_EMPTY,
    "ckpt_every": POSITIVE,
    "keep_last": COUNT,
    "resume": ANY,
    "seed": SEED,
    "mixed_precision": one_of("auto", "no", "bf16", "fp16"),
    "data_dir": ANY,
    "val_data_dir": ANY,
    "allow_incomplete_data": ANY,
    "init_from": ANY,
    "export_dir": ANY,
    "push_to_hub": ANY,
    "extra": ANY,
    "loss": one_of("ce", "kl", "ce+kl", "lk", "ce+lk", "kl+lk", "ce+kl+lk"),
    "kl_weight": at_least(0),
    "lk_weight": at_least(0),
    "kl_topk": POSITIVE,
    "slot_weights": optional(each(at_least(0))),
    "context_positions": ANY,
    "max_positions": optional(POSITIVE),
    "eval_max_positions": optional(POSITIVE),
    "topk_acc": POSITIVE,
    "log_every": POSITIVE,
    "progress": ANY,
    "use_cached_features": ANY,
    "cache_target_features": ANY,
    "num_workers": COUNT,
    "export": ANY,
    "crash_at_step": optional(POSITIVE),
}
DISTILL: Table = {
    "out_dir": ANY,
    "num_samples": optional(POSITIVE),
    "regenerate": ANY,
    "do_sample": ANY,
    "temperature": above(0),
    "top_p": DECAY,
    "max_new_tokens": POSITIVE,
    "max_turns": POSITIVE,
    "T": POSITIVE,
    "batch_tokens": POSITIVE,
    "max_batch_size": POSITIVE,
    "refill": ANY,
    "continuation_chunk": POSITIVE,
    "shard_size": POSITIVE,
    "save_hidden": ANY,
    "hidden_layers": ANY,  # indices into the target's hidden states (checked against the target)
    "topk": COUNT,
    "feature_dtype": one_of(*FEATURE_DTYPES),
    "capture_features": Rule(lambda v: str(v).lower() in {"auto", "true", "false"}, "auto | true | false"),
    "linear_layout": one_of("auto", "transposed", "native", "packed", "panel"),
    "max_disk_gb": above(0),
    "seed": SEED,
}
EVAL: Table = {
    "drafters": ANY,
    "benches": Rule(lambda v: bool(v) and all(NON_EMPTY.ok(b) for b in v), "a non-empty list of benchmarks"),
    "limit": optional(POSITIVE),
    "max_new_tokens": POSITIVE,
    "temperature": at_least(0),
    "top_k": COUNT,
    "top_p": DECAY,
    "beam_width": optional(POSITIVE),
    "beam_length": optional(POSITIVE),
    "int8_draft_head": ANY,
    "draft_block": one_of("auto", "hf", "fused", "int8"),
    "draft_dtype": optional(DTYPE),
    "draft_min_prob": FRACTION,
    "lookup_tokens": COUNT,
    "tree_nodes": optional(POSITIVE),
    "acceptance": one_of("exact", "typical"),
    "typical_epsilon": FRACTION,
    "typical_delta": at_least(0),
    "baselines": each(one_of("prompt_lookup", "assisted", "tree_lookup", "hf_static")),
    "prompt_lookup_num_tokens": POSITIVE,
    "assistant_model": ASSISTANT,
    "dtype": optional(DTYPE),
    "device": optional(DEVICE),
    "num_threads": optional(POSITIVE),
    "check_lossless": ANY,
    "near_tie_gap": optional(at_least(0)),
    "warmup": COUNT,
    "warmup_tokens": POSITIVE,
    "fallback": ANY,
    "adaptive": one_of("off", "on"),
    "adaptive_threshold": FRACTION,
    "decode_path": one_of("static", "dynamic"),
    "cuda_graphs": one_of("auto", "on", "off"),
    "node_budget": NODE_BUDGET,
    "node_budget_refit": COUNT,
    "node_budget_refit_scale": COUNT,
    "node_budget_confidence": at_least(0),
    "node_budget_memory": at_least(0),
    "node_budget_refit_on_call": ANY,
    "linear_layout": one_of("auto", "transposed", "native", "packed", "panel"),
    "batch_sizes": each(POSITIVE),
    "prefill_rows": COUNT,
    "refill_rows": COUNT,
    "batch_min_prob": Rule(
        lambda v: v in ("off", "auto") or is_probability(v), "off, auto or a probability in (0, 1)"
    ),
    "batch_width": one_of("off", "auto"),
    "scheduler": one_of("fifo", "length", "both", "groups", "all"),
    "length_predictor": ANY,  # a file path, checked when the throughput table loads it
    "reserve_quantile": DECAY,  # (0, 1]
    "profile": ANY,
    "plots": ANY,
    "out_dir": ANY,
    "seed": SEED,
}

TABLES: dict[type, Table] = {
    RootConfig: ROOT,
    BaseModelConfig: BASE_MODEL,
    DataConfig: DATA,
    ReDrafterSchema: REDRAFTER,
    MedusaSchema: MEDUSA,
    EagleSchema: EAGLE,
    Eagle3Schema: EAGLE3,
    OptimConfig: OPTIM,
    LoggerConfig: LOGGER,
    TrainConfig: TRAIN,
    DistillConfig: DISTILL,
    EvalConfig: EVAL,
}
SECTIONS: dict[str, type] = {  # RootConfig's groups with a fixed schema (`drafter` depends on its family)
    "base_model": BaseModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "logger": LoggerConfig,
    "train": TrainConfig,
    "distill": DistillConfig,
    "eval": EvalConfig,
}


def _show(v: Any) -> str:
    """A value as it would be typed on the command line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_show(x) for x in v) + "]"
    if isinstance(v, str) and (v == "" or v != v.strip()):
        return repr(v)
    return str(v)


def _default(schema: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(schema) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]


def check_section(values: Mapping[str, Any], schema: type, prefix: str) -> list[str]:
    """Check the plain values of one group against its schema's table.

    Args:
        values: the group as plain Python values (interpolations resolved).
        schema: its dataclass (a key of `TABLES`).
        prefix: the group's key with a trailing dot (`train.`), or "" for the root.

    Returns:
        one message per out-of-range field (empty: all fine).
    """
    problems = []
    for name, rule in TABLES[schema].items():
        if name not in values:
            continue
        value, key = values[name], f"{prefix}{name}"
        if rule.ok(value):
            continue
        if rule.hint is not None:
            fix = rule.hint(key, value)
        else:
            fix = f"pass e.g. {key}={_show(_default(schema, name))} (the default)"
        problems.append(f"{key}={_show(value)}: expected {rule.allowed}; {fix}")
    return problems


def validate_config(cfg: DictConfig) -> None:
    """Check every declared range of a composed root config (a `hydra` key, if present, is ignored).

    Call right after composition, before anything is loaded or written.

    Raises:
        ValueError: one line listing every out-of-range field (`train.batch_size=0: expected ...; pass ...`).
    """
    problems: list[str] = []

    def plain(node: DictConfig) -> dict[str, Any]:
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]

    root = {k: cfg[k] for k in ROOT if k in cfg}
    problems += check_section(root, RootConfig, "")
    for section, schema in SECTIONS.items():
        if section in cfg and cfg[section] is not None:
            problems += check_section(plain(cfg[section]), schema, f"{section}.")
    drafter = cfg.get("drafter")
    if drafter is not None:
        family = drafter.get("family")
        family_schema = DRAFTER_SCHEMAS.get(str(family))
        group = OmegaConf.get_type(drafter)
        if family_schema is None:
            problems.append(
                f"drafter.family={_show(family)}: expected one of {', '.join(DRAFTER_SCHEMAS)}; "
                f"pick the family with drafter=<family>"
            )
        elif group in TABLES and group is not family_schema:
            named = next(f for f, s in DRAFTER_SCHEMAS.items() if s is group)
            problems.append(
                f"drafter.family={family} does not match the drafter group ({named}); "
                f"pick the family with drafter={family}, not drafter.family"
            )
        else:
            problems += check_section(plain(drafter), family_schema, "drafter.")
            train = cfg.get("train")
            loss = None if train is None else train.get("loss")
            if loss is not None and TRAIN["loss"].ok(loss):  # spelt right: does the family implement it?
                from specdraft.models.registry import family_spec  # lazy: imports the family's module

                problem = family_spec(str(family)).check_loss(str(loss))
                problems += [problem] if problem else []
    if problems:
        raise ValueError("; ".join(problems))
