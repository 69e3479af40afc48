"""Medusa heads: K independent decoding heads on the frozen target's last hidden state (arXiv 2401.10774).

Alignment (docs/design.md): the target's own LM head on h_t gives the root x_{t+1}; Medusa head k (0-based)
on the same h_t predicts x_{t+2+k}, i.e. draft slot k. Medusa-1: the backbone stays frozen, only the heads
train. Unlike ReDrafter the heads never see any drafted token (nor, unless `root_token`, the root), so every
head's top-k is computed once per step and a *static* tree over their ranks (eval/medusa_tree.py) turns them
into candidates:

    h_t ─┬─> ResBlock^n ─> W_0 ─> logits of slot 0 (x_{t+2})
         ├─> ResBlock^n ─> W_1 ─> logits of slot 1 (x_{t+3})
         ...
         └─> ResBlock^n ─> W_{K-1} ─> logits of slot K-1 (x_{t+1+K})

ResBlock(x) = x + SiLU(A x + b) with A, b zero-initialised (the identity at the start), and every W_k is
initialised from the target's LM head, so before training each head predicts x_{t+1} (a reasonable start).
Loss: sum_k lambda^k CE_k (lambda = `loss_decay`, 0.8 by default), or the soft (top-k KL) variant.

Draft vocabulary: each head ends in a (Vd, H) projection; with `draft_vocab_size` Vd < V only the Vd most frequent
training labels are scored (buffer `d2t` (Vd,): target id = draft id + d2t[draft id], as ReDrafter and EAGLE-3
store it). For SmolLM2 (V = 49,152, H = 576) four full heads cost about one step of the 135M target; the heads
are most of the drafter. Labels outside the draft vocabulary are ignored by the loss (`teacher_forced`) and are
never drafted; `topk_tokens` returns target ids, so trees and verification (lossless) are unchanged.

Root token (`root_token`, models/medusa_root.py): every head's input also reads the root x_{t+1}'s embedding,
which the decoder knows before the heads run; the heads stay parallel and the tree static.

Copy gate (`copy_ngram`, models/medusa_copy.py): each head's distribution mixed with a prompt-lookup candidate of
the node it drafts under, weighted by a learnt gate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from specdraft.models.family import FamilySpec
from specdraft.models.layers import (
    ResBlock,
    ZeroInitLinear,
    check_draft_vocab,
    d2t_draft_ids,
    d2t_to_draft_ids,
)
from specdraft.models.medusa_build import build  # fresh heads from the config group
from specdraft.models.medusa_choices import teacher_forced_tree_accept
from specdraft.models.medusa_copy import MedusaCopy, copy_ngram, mixed_head_logits
from specdraft.models.medusa_copy import build as build_copy
from specdraft.models.medusa_loss import compute_loss  # teacher-forced, heads weighted lambda^k
from specdraft.models.medusa_root import RootInput

FORMAT_VERSION = 1


class MedusaConfig(PretrainedConfig):
    """Hyper-parameters plus the identity of the target the heads were trained for."""

    model_type = "specdraft_medusa"

    architecture: str = "medusa"  # family name used by models/registry.py
    format_version: int = FORMAT_VERSION  # export format of specdraft drafters
    base_model_name_or_path: str = ""  # the target (Hub id, folder, gguf, or embedded alias)
    base_revision: str | None = None  # target revision / GGUF hash
    base_hidden_size: int = 64  # H: width of the target's last hidden state
    vocab_size: int = 128  # V: target vocabulary size
    draft_vocab_size: int | None = None  # Vd: width of every head's projection, the top labels (None: V)
    tokenizer_hash: str = ""  # `base_llm.tokenizer_hash` of the target's tokenizer
    draft_len: int = 4  # K heads; head k predicts draft slot k = x_{t+2+k}
    num_layers: int = 1  # ResBlocks per head before its vocabulary projection
    loss_decay: float = 0.8  # lambda: head k's CE is weighted lambda^k
    topk: int = 10  # candidates per head the static tree may use at decode time
    tree_choices: list | None = None  # static tree as Medusa rank paths (None: eval/medusa_tree.DEFAULT_TREE)
    root_token: bool = False  # every head also reads the root x_{t+1}'s embedding (models/medusa_root.py)
    copy_ngram: int = 0  # > 0: copy gate over prompt-lookup candidates, n-grams up to this (medusa_copy.py)
    copy_hidden: int = 64  # hidden width of the copy gate
    copy_scale: float = 8.0  # multiplier of the gate's log-odds
    training_summary: dict = field(default_factory=dict)  # filled in by the trainer at export

    def __post_init__(self, **kwargs: Any) -> None:
        if self.draft_vocab_size is None:  # exports older than the field: the full vocabulary
            self.draft_vocab_size = self.vocab_size
        super().__post_init__(**kwargs)


class Medusa(PreTrainedModel):
    """K Medusa heads; see the module docstring for the alignment."""

    config_class = MedusaConfig
    base_model_prefix = "medusa"
    _no_split_modules: list[str] = []
    d2t: Tensor  # (Vd,) long buffer, registered in __init__

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__(config)
        h, v, vd = config.base_hidden_size, config.vocab_size, config.draft_vocab_size
        assert vd is not None  # set by MedusaConfig.__post_init__
        check_draft_vocab(vd, v)
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)], nn.Linear(h, vd, bias=False))
            for _ in range(config.draft_len)
        )
        # Saved only with a reduced vocabulary, so full-vocabulary exports keep their original tensors (it is
        # never read then); the shared loss (`teacher_forced`) reads `reduced_vocab`.
        self.reduced_vocab = vd < v
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long), persistent=self.reduced_vocab)
        self.root_input: RootInput | None = RootInput(h, config.draft_len) if config.root_token else None
        self.copy: MedusaCopy | None = build_copy(config)  # its output layer is zero-initialised: lam = 1/2
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            if isinstance(module, ZeroInitLinear):
                nn.init.zeros_(module.weight)
            else:
                nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # ---- draft vocabulary (as ReDrafter's) -------------------------------------------------------------
    def draft_ids(self) -> Tensor:
        """(Vd,) long: the target id of every draft-vocabulary entry (arange(V) for the full vocabulary)."""
        return d2t_draft_ids(self.d2t, self.reduced_vocab)

    def to_target_ids(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (...) -> target ids (...)."""
        return ids + self.d2t[ids] if self.reduced_vocab else ids

    def to_draft_ids(self, ids: Tensor, missing: int = -100) -> Tensor:
        """Target ids (...) -> draft ids (...); ids < 0 and tokens outside the draft vocabulary -> `missing`."""
        return d2t_to_draft_ids(ids, self.d2t, self.reduced_vocab, int(self.config.vocab_size), missing, self)

    def vocab_head_names(self) -> list[str]:
        """State-dict names of the K (Vd, H) vocabulary projections (rows remapped by `hub.warm_start`)."""
        return [f"heads.{k}.{self.config.num_layers}.weight" for k in range(self.config.draft_len)]

    # ---- logits -----------------------------------------------------------------------------------------
    def vocab_heads(self) -> list[tuple[nn.Module, nn.Linear]]:
        """Per head k, (transform, vocabulary Linear) with `heads[k](x) == linear(transform(x))` (a decoder may
        swap in an int8 copy of each Linear: `head_logits(..., linears=...)`)."""
        out = []
        for head in self.heads:
            seq = cast(nn.Sequential, head)
            out.append((seq[:-1], cast(nn.Linear, seq[-1])))
        return out

    def head_logits(
        self,
        hidden: Tensor,
        num_heads: int | None = None,
        linears: Sequence[Callable[[Tensor], Tensor]] | None = None,
        root: Tensor | None = None,
    ) -> Tensor:
        """Logits of the first `num_heads` heads over the draft vocabulary.

        Args:
            hidden: (..., H) target last-layer states h_t (cast to the heads' dtype/device).
            num_heads: how many heads to run (None: all K).
            linears: per head, a replacement of its vocabulary Linear, (..., H) -> (..., Vd) (e.g. int8 copies at
                decode time; their outputs may be float32); None: the heads as they are.
            root: (...) long, the root x_{t+1} of each state; required with `root_token`, ignored without.

        Returns:
            (..., num_heads, Vd) (Vd = V unless `draft_vocab_size` is set; `to_target_ids` maps a column index
            to its token); entry k predicts x_{t+2+k}.
        """
        n = self.config.draft_len if num_heads is None else num_heads
        if n > self.config.draft_len:
            raise ValueError(
                f"Medusa has {self.config.draft_len} heads, {n} requested (lower drafter.draft_len)"
            )
        return self.vocab_logits(self.head_states(hidden, n, root), linears)  # (..., n, Vd)

    def vocab_logits(
        self, states: Tensor, linears: Sequence[Callable[[Tensor], Tensor]] | None = None
    ) -> Tensor:
        """states (..., n, H) of the first n heads -> their logits (..., n, Vd) (`linears`: as `head_logits`)."""
        n, parts = states.shape[-2], self.vocab_heads()
        if linears is None:
            return torch.stack([parts[k][1](states[..., k, :]) for k in range(n)], dim=-2)  # (..., n, Vd)
        flat = states.reshape(-1, n, states.shape[-1])  # int8 products take 2-D inputs: (N, H) per head
        out = torch.stack([linears[k](flat[:, k]) for k in range(n)], dim=-2)  # (N, n, Vd)
        return out.reshape(*states.shape[:-2], n, out.shape[-1])

    def head_states(self, hidden: Tensor, num_heads: int, root: Tensor | None = None) -> Tensor:
        """(..., H) target states -> (..., num_heads, H): what each head's vocabulary projection reads (its
        residual blocks' output; the copy gate's state)."""
        w = cast(nn.Linear, cast(nn.Sequential, self.heads[0])[-1]).weight
        x = hidden.to(device=w.device, dtype=w.dtype)
        if self.root_input is not None:
            if root is None:
                raise ValueError("this Medusa reads the root token (root_token=true): pass `root`")
            xs = self.root_input(x, root, num_heads).unbind(-2)  # n x (..., H)
        else:
            xs = (x,) * num_heads
        return torch.stack([cast(nn.Sequential, self.heads[k])[:-1](xs[k]) for k in range(num_heads)], dim=-2)

    def forward(
        self,
        hidden: Tensor,
        root: Tensor | None = None,
        targets: Tensor | None = None,
        copy: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Teacher-forced logits in the shared drafter signature (docs/design.md).

        Args:
            hidden: (B, L, H) target last-layer states.
            root: (B, L) the root x_{t+1} of each position; read only with `root_token` (plain heads do not
                condition on tokens).
            targets: (B, L, D) ignored except for D, the number of heads run (None: all K).
            copy: with a copy gate, each slot's lookup candidate and match length, (B, L, D) each
                (`data.ngrams.slot_candidates`); the logits are then those of the mixtures.

        Returns:
            logits: (B, L, D, Vd) over the draft vocabulary.
        """
        n = self.config.draft_len if targets is None else targets.shape[-1]
        if self.copy is None or copy is None:
            return self.head_logits(hidden, n, root=root)
        states = self.head_states(hidden, n, root)  # (B, L, D, H)
        return mixed_head_logits(self, states, self.vocab_logits(states), copy[0], copy[1])

    @torch.no_grad()
    def topk_tokens(
        self,
        hidden: Tensor,
        k: int,
        num_heads: int | None = None,
        linears: Sequence[Callable[[Tensor], Tensor]] | None = None,
        root: Tensor | None = None,
    ) -> Tensor:
        """The k most likely tokens of each of the first `num_heads` heads at one position (decode time).

        Args:
            hidden: (..., H) the target's last-layer state at the newest committed position (of each row).
            k: candidates per head.
            num_heads: heads run (None: all K); a shallow tree needs only its depth.
            linears: replacements of the heads' vocabulary Linears (`head_logits`).
            root: (...) long, the root token of each state (read with `root_token`).

        Returns:
            (..., num_heads, k) long target ids, row j sorted by head j's logit (rank 0 first).
        """
        top = (
            self.head_logits(hidden, num_heads, linears, root).topk(k, dim=-1).indices
        )  # (..., num_heads, k) draft ids
        return self.to_target_ids(top)  # (..., num_heads, k) target ids


# ---- family protocol: `FAMILY` (models/family.py) at the end of the module; MODEL, CONFIG for older callers ---
MODEL, CONFIG = Medusa, MedusaConfig


def attach(model: Medusa, target: PreTrainedModel) -> Medusa:
    """Borrow the target's input embeddings for the root token (`root_token`) and the copy gate (`copy_ngram`);
    plain heads borrow nothing (every head owns its projection)."""
    emb = cast(nn.Embedding, target.get_input_embeddings())
    if model.root_input is not None or model.copy is not None:
        shape, want = tuple(emb.weight.shape), (model.config.vocab_size, model.config.base_hidden_size)
        if shape != want:
            raise ValueError(
                f"target embeddings {shape} do not match the Medusa heads (vocab_size, hidden) {want}"
            )
    if model.root_input is not None:
        model.root_input.attach(emb)
    if model.copy is not None:
        model.copy.attach(emb)
    return model


FAMILY = FamilySpec(
    name="medusa",
    model=Medusa,
    config=MedusaConfig,
    build=build,
    attach=attach,
    compute_loss=compute_loss,  # models.teacher_forced with lambda^k head weights: every ce / kl / lk combination
    proposer="medusa_tree",  # eval.medusa_tree.MedusaProposer: the static top-k tree
    features="last",  # h_t only (and the root token's embedding with `root_token`)
    decode_last_hidden=True,
    low_precision_outputs=True,  # compute_loss takes bf16 logits (fp32 inside): no fp32 copy (train/loop)
    uses_token_counts=True,  # reduced draft vocabulary: the Vd most frequent training labels
    tree_accept=teacher_forced_tree_accept,  # its static tree over the heads' label ranks (eval/tree_accept_len)
    copy_ngram=copy_ngram,  # the copy gate's lookup candidates per slot (models/medusa_copy.py; 0: none)
)
