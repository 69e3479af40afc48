"""The drafter family contract: what a family declares once, as `FAMILY = FamilySpec(...)` in its module.

The trainer (`train/loop.py`), the held-out evaluation, the config check (`conf/validate.py`) and the decoder's
proposer dispatch (`eval/proposers.make_proposer`) read these fields; none of them probes a family module or
model with getattr. A fifth family is one module declaring `FAMILY` + one line in
`models/registry.FAMILY_MODULES` (or `registry.register_family`) + one preset.

Dependencies point down: this module imports nothing from `train/` or `eval/`; the proposer is named, not
imported (`proposer`), and `eval/` resolves the name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

# Every `train.loss` value (conf/validate.py checks the spelling; a family declares the ones it implements).
ALL_LOSSES: tuple[str, ...] = ("ce", "kl", "ce+kl", "lk", "ce+lk", "kl+lk", "ce+kl+lk")
# Proposers built into `eval/proposers.make_proposer`; any other name is "package.module:callable", called as
# `callable(drafter, **decode settings) -> Proposer` (the keyword arguments of `make_proposer`).
BUILTIN_PROPOSERS: tuple[str, ...] = ("redrafter_beams", "medusa_tree", "eagle_tree")
FEATURES: tuple[str, ...] = ("last", "layers", "none")

# build(schema, target, fingerprint, [token_counts=(V,) counts]) -> a fresh drafter
BuildFn = Callable[..., PreTrainedModel]
# attach(model, target) -> model with what it borrows from the target reconnected
AttachFn = Callable[[Any, PreTrainedModel], Any]
# compute_loss(model, batch, target_out, opts) -> (loss, aux) with aux["logits"] (N, D, V), aux["targets"] (N, D)
LossFn = Callable[
    [nn.Module, dict[str, Tensor], Any, "dict[str, Any] | None"], tuple[Tensor, dict[str, Tensor]]
]
# tree_accept(model, logits (N, D, V), targets (N, D)) -> (N,) long drafts the decoder's own draft tree accepts
TreeAcceptFn = Callable[[Any, Tensor, Tensor], Tensor]
# copy_ngram(config) -> n: the longest n-gram whose prompt-lookup candidates `compute_loss` reads (0: none)
CopyNgramFn = Callable[[PretrainedConfig], int]


@dataclass(frozen=True)
class FamilySpec:
    """One drafter family's declared capabilities (read, never probed).

    Args:
        name: the family name, `config.architecture` of its exports and `drafter.family` of its presets.
        model: its `PreTrainedModel` subclass (what `from_pretrained` loads an export with).
        config: its `PretrainedConfig` subclass (carries `architecture == name`).
        build: `build(schema, target, fingerprint, token_counts=None) -> model`, a fresh drafter from the
            `drafter` config group (`token_counts` (V,) only when `uses_token_counts`).
        attach: `attach(model, target) -> model`, reconnect what the drafter borrows from the target after loading.
        compute_loss: `compute_loss(model, batch, target_out, opts) -> (loss, aux)` with aux["logits"] (N, D, V)
            and aux["targets"] (N, D), from which the loop computes every metric.
        proposer: the decoder-side builder: one of `BUILTIN_PROPOSERS`, or "package.module:callable".
        features: the drafter's main per-position input from the target: "last" (the last-layer hidden state
            h_t), "layers" (intermediate layers only, `target_layers`), "none" (tokens only).
        target_layers: intermediate target `hidden_states` indices read per position in training and decoding:
            fixed indices, or "config" for the built model's `config.target_layers` (depends on the target's depth).
        decode_last_hidden: the proposer needs h_t of every committed position at decode time.
        losses: the `train.loss` values `compute_loss` implements (a subset of `ALL_LOSSES`); any other fails
            config validation.
        low_precision_outputs: `compute_loss` takes bf16/fp16 model outputs and computes in fp32 itself (the loop
            then skips accelerate's fp32 copy of them).
        uses_token_counts: `build` takes the training-label counts (a reduced draft vocabulary).
        int8_draft_layer: drafting through int8 products of its layers keeps its acceptance (measured:
            `eval.draft_block=auto` runs int8 for such a family, else the fused layer in the head's dtype;
            ReDrafter: its recurrence, blocks and copy gate, `eval/int8_clone.py`).
        tree_accept: where the decoder's drafts at a position follow from that position's teacher-forced slot
            logits alone (a static tree over per-slot ranks: Medusa), `tree_accept(model, logits (N, D, V),
            targets (N, D)) -> (N,)` drafts its served tree accepts there; held-out evaluation reports
            `eval/tree_accept_len` from it. None (beam search, dynamic trees): only the chain estimates.
        copy_ngram: where `compute_loss` reads the prompt-lookup candidates of each draft slot (a copy gate:
            `batch["copy_ids"]`, `batch["copy_len"]`), `copy_ngram(config) -> n`, the longest n-gram they are
            looked up with (0: none for this model); the trainer's collator computes them. None: never.
    """

    name: str
    model: type[PreTrainedModel]
    config: type[PretrainedConfig]
    build: BuildFn
    attach: AttachFn
    compute_loss: LossFn
    proposer: str
    features: Literal["last", "layers", "none"] = "last"
    target_layers: tuple[int, ...] | Literal["config"] = ()
    decode_last_hidden: bool = True
    losses: tuple[str, ...] = ALL_LOSSES
    low_precision_outputs: bool = False
    uses_token_counts: bool = False
    int8_draft_layer: bool = False
    tree_accept: TreeAcceptFn | None = None
    copy_ngram: CopyNgramFn | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("an empty name")
        if not (isinstance(self.model, type) and issubclass(self.model, PreTrainedModel)):
            problems.append(f"model={self.model!r} is not a PreTrainedModel subclass")
        if not (isinstance(self.config, type) and issubclass(self.config, PretrainedConfig)):
            problems.append(f"config={self.config!r} is not a PretrainedConfig subclass")
        elif getattr(self.config, "architecture", None) != self.name:
            problems.append(f"config.architecture={getattr(self.config, 'architecture', None)!r} != name")
        for field in ("build", "attach", "compute_loss"):
            if not callable(getattr(self, field)):
                problems.append(f"{field} is not callable")
        for name in ("tree_accept", "copy_ngram"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                problems.append(f"{name} is not callable")
        if self.proposer not in BUILTIN_PROPOSERS and ":" not in self.proposer:
            problems.append(
                f"proposer={self.proposer!r}: expected one of {BUILTIN_PROPOSERS} or 'module:callable'"
            )
        if self.features not in FEATURES:
            problems.append(f"features={self.features!r}: expected one of {FEATURES}")
        if self.features == "layers" and not self.target_layers:
            problems.append("features='layers' needs target_layers (indices or 'config')")
        if self.features == "none" and (self.target_layers or self.decode_last_hidden):
            problems.append("features='none' reads no target_layers and no decode_last_hidden")
        if not isinstance(self.target_layers, tuple) and self.target_layers != "config":
            problems.append(f"target_layers={self.target_layers!r}: expected a tuple of ints or 'config'")
        unknown = [loss for loss in self.losses if loss not in ALL_LOSSES]
        if not self.losses or unknown:
            problems.append(f"losses={self.losses!r}: expected a non-empty subset of {ALL_LOSSES}")
        if problems:
            raise ValueError(f"FamilySpec {self.name!r}: " + "; ".join(problems))

    def layers_for(self, config: PretrainedConfig) -> tuple[int, ...]:
        """The intermediate target layers a built drafter with `config` reads (() for none)."""
        if self.target_layers == "config":
            return tuple(int(i) for i in (config.target_layers or ()))
        return self.target_layers

    def copy_ngram_of(self, config: PretrainedConfig) -> int:
        """The n-gram order of the lookup candidates a built drafter with `config` trains on (0: none)."""
        return 0 if self.copy_ngram is None else int(self.copy_ngram(config))

    def check_loss(self, loss: str) -> str | None:
        """None when `train.loss=loss` is implemented by this family, else the one-line problem."""
        if loss in self.losses:
            return None
        return (
            f"train.loss={loss}: drafter family {self.name} implements {', '.join(self.losses)}; "
            f"pass e.g. train.loss={self.losses[0]}"
        )
