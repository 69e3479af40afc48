"""EAGLE-1 feature head (arXiv 2401.15077); shared pieces live in `models/eagle_common.py`.

Alignment (docs/design.md): the head's input at position t is the pair (f_t, x_{t+1}): the target's last-layer
feature f_t (post final norm, the LM-head input) and the token the target committed after it. It predicts the
*next feature* f_{t+1}; the target's frozen LM head turns that into a distribution over x_{t+2} (draft slot 0):

    f_t ─┐
         ├─ fc([e(x_{t+1}); f_t]) ─> decoder layer (target's block type, causal, own KV cache) ─> f̂_{t+1}
    x_{t+1} ─ e (borrowed) ─┘                                                                     │
                                                                 target LM head (borrowed) <──────┘ -> x_{t+2}

Drafting deeper feeds f̂ back as the next input feature (f̂_{t+1}, x̂_{t+2}) -> f̂_{t+2} ... (EAGLE-2 tree in
`eval/eagle_tree.py`). `forward` runs this as a *training-time-test unroll* over whole sequences: step 0 is the
teacher-forced pass (every position sees the real features of its prefix), step i feeds each position the head's
own step i-1 output plus the true token x_{t+1+i}; its queries see the step-0 keys of the prefix and the keys of
steps 1..i at the same position only, exactly what a depth-i draft node sees at decode time (positions t + i).

Loss (EAGLE-1): smooth-L1(f̂_{t+1}, f_{t+1}) * feature_weight + soft CE(head(f̂), softmax(head(f_{t+1}))) *
token_weight, optional uniform noise on the input features. Embeddings and LM head are borrowed from the target
(`attach`), kept out of `state_dict()`, never trained and never exported.

Draft vocabulary (`draft_vocab_size` Vd < V, a decoding option): drafts are scored over only the Vd most
frequent training labels, the LM head's rows `draft_ids()` (buffer `d2t` (Vd,): target id = draft id +
d2t[draft id], as EAGLE-3's). The head's weights do not depend on it (training still regresses features and
matches the full-vocabulary distribution); each expansion level's vocabulary projection, softmax and top-k
shrink by V / Vd. Held-out metrics score the drafts the decoder makes (tokens outside never drafted).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from specdraft.models.eagle_common import (  # noqa: F401  (re-exported for eagle3 / tests)
    FORMAT_VERSION,
    Borrowed,
    DraftBlock,
    block_config_of,
    chain_labels,
    common_config,
    next_tokens,
    select_positions,
    smooth_l1_feature_loss,
    soft_cross_entropy,
    target_block,
    unroll,
)
from specdraft.models.eagle_copy import build_gate, copy_ngram, reset_gate
from specdraft.models.eagle_loss import compute_loss  # feature smooth-L1 + soft CE (+ LK)
from specdraft.models.family import FamilySpec
from specdraft.models.hf_compat import cache_kwargs
from specdraft.models.layers import (
    check_draft_vocab,
    d2t_draft_ids,
    d2t_to_draft_ids,
    draft_vocab_ids,
    weights_key,
)


# ---- EAGLE-1 ---------------------------------------------------------------------------------------------------
class EagleConfig(PretrainedConfig):
    """EAGLE-1 head hyper-parameters plus the identity of its target."""

    model_type = "specdraft_eagle"

    architecture: str = "eagle"  # family name used by models/registry.py
    format_version: int = FORMAT_VERSION  # export format of specdraft drafters
    base_model_name_or_path: str = ""  # the target (Hub id, folder, gguf, or embedded alias)
    base_revision: str | None = None  # target revision / GGUF hash
    base_hidden_size: int = 64  # H: the target's feature width
    vocab_size: int = 128  # V: target vocabulary
    tokenizer_hash: str = ""  # `base_llm.tokenizer_hash` of the target's tokenizer
    block_config: dict = field(default_factory=dict)  # the target's text config; the head is one such block
    fc_bias: bool = True  # bias of fc([e; f]) (True in the public EAGLE-1 checkpoints)
    draft_vocab_size: int | None = None  # Vd: drafts over the Vd most frequent labels (None: all V)
    draft_len: int = 4  # unrolled slots scored by held-out evaluation
    feature_weight: float = 1.0  # smooth-L1 feature loss weight
    token_weight: float = 0.1  # soft CE token loss weight
    noise: float = 0.0  # half-width of uniform noise added to input features in training
    tree_total_tokens: int = 24  # EAGLE-2: draft nodes kept after reranking (root excluded)
    tree_depth: int = 5  # EAGLE-2: maximum draft depth
    tree_top_k: int = 6  # EAGLE-2: children per expanded node / nodes expanded per depth
    copy_ngram: int = 0  # > 0: copy gate over the lookup candidate, n-grams up to this (models/eagle_copy.py)
    copy_hidden: int = 64  # hidden width of the copy gate
    copy_scale: float = 8.0  # multiplier of the gate's log-odds
    training_summary: dict = field(default_factory=dict)  # filled in by the trainer at export


class EagleDrafter(PreTrainedModel):
    """fc([e(x_{t+1}); f_t]) -> one target-type decoder layer (no input norm) -> f̂_{t+1}."""

    config_class = EagleConfig
    base_model_prefix = "eagle"
    _no_split_modules: list[str] = []

    def __init__(self, config: EagleConfig) -> None:
        super().__init__(config)
        h = config.base_hidden_size
        layer, self.rotary = target_block(config.block_config)
        layer.input_layernorm = nn.Identity()  # EAGLE-1 drops the first block's input norm
        self.layers = nn.ModuleList([layer])
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.borrowed = Borrowed()
        vd = check_draft_vocab(int(config.draft_vocab_size or config.vocab_size), config.vocab_size)
        self.reduced = vd < config.vocab_size
        if self.reduced:  # saved with the head; absent (the full vocabulary) in older exports
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # target id - draft id
        self.copy_gate = build_gate(config)  # the copy gate (extension), last: the head's init draws the same
        self.post_init()
        reset_gate(self.copy_gate)  # lam = 1/2 at first (post_init drew its output layer)

    def embed(self, ids: Tensor) -> Tensor:
        """ids (...) long -> (..., H) borrowed target embeddings in the head's dtype."""
        return F.embedding(ids, self.borrowed.weight("embed", self.fc.weight))

    def encode_target(self, feats: Tensor, block: DraftBlock | None = None) -> Tensor:
        """Target features of committed positions (..., H) -> the head's input features (identity for EAGLE-1)."""
        return feats.to(self.fc.weight.dtype)

    def step(
        self,
        feats: Tensor,
        tokens: Tensor,
        cache: DynamicCache,
        positions: Tensor,
        mask: Tensor,
        block: DraftBlock | None = None,
    ) -> Tensor:
        """One pass of the head over n new inputs appended to `cache`.

        Args:
            feats: (B, n, H) input features (target's or the head's own outputs).
            tokens: (B, n) long, the token paired with each feature.
            cache: the head's KV cache, extended by n.
            positions: (B, n) long rotary positions.
            mask: (n, C + n) or (B, 1, n, C + n) bool, True = attend (C = cached length).
            block: a decode-time copy of `layers[0]` and `fc` (`eval/draft_block.py`); None: the HF modules.

        Returns:
            (B, n, H) predicted next features.
        """
        x = torch.cat([self.embed(tokens), feats.to(self.fc.weight.dtype)], dim=-1)  # (B, n, 2H)
        x = self.fc(x) if block is None else block.linear("fc", x)  # (B, n, H)
        rope = self.rotary(x, positions)
        mask = mask if mask.ndim == 4 else mask[None, None]
        if block is not None:
            return block.layer(x, rope, mask, cache)
        out = self.layers[0](
            x,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            position_embeddings=rope,
            **cache_kwargs(self.layers[0], cache),
        )
        return out[0] if isinstance(out, tuple) else out

    def draft_layer(self) -> tuple[nn.Module, dict[str, nn.Linear]]:
        """(the decoder layer `step` runs, its other Linears by name) for a decode-time `DraftBlock` copy."""
        return self.layers[0], {"fc": self.fc}

    def draft_ids(self) -> Tensor:
        """(Vd,) ascending target ids of the draft vocabulary (arange(V) without one)."""
        if not self.reduced:
            return torch.arange(self.config.vocab_size, device=self.fc.weight.device)
        return d2t_draft_ids(cast(Tensor, self.d2t), True)

    def full_logits(self, out: Tensor) -> Tensor:
        """(..., H) head outputs -> (..., V) logits through the borrowed target LM head (the training loss)."""
        return F.linear(out, self.borrowed.weight("lm_head", out))

    def draft_logits(self, out: Tensor) -> Tensor:
        """(..., H) head outputs -> (..., Vd) logits over the draft vocabulary (V without one)."""
        if not self.reduced:
            return self.full_logits(out)
        return F.linear(
            out, self.borrowed.rows("lm_head", out, self.draft_ids, weights_key(cast(Tensor, self.d2t)))
        )

    def draft_head(self) -> tuple[nn.Module, nn.Linear]:
        """(transform, vocabulary Linear) with `draft_logits(out) == linear(transform(out))` (for int8 copies)."""
        head = cast(nn.Linear, self.borrowed.modules["lm_head"])
        if not self.reduced:
            return nn.Identity(), head
        rows = self.borrowed.rows(
            "lm_head", head.weight, self.draft_ids, weights_key(cast(Tensor, self.d2t))
        )  # (Vd, H), cached by `Borrowed`
        # one Linear per cached rows tensor (int8 copies are shared by identity), kept out of the submodules
        hit = self.__dict__.get("_rows_head")
        if hit is None or hit[0] is not rows:
            linear = nn.Linear(head.in_features, rows.shape[0], bias=False)
            linear.weight = nn.Parameter(rows, requires_grad=False)
            hit = self.__dict__["_rows_head"] = (rows, linear)  # never saved
        return nn.Identity(), hit[1]

    def to_target_ids(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (...) -> target ids (identity without a draft vocabulary)."""
        return ids + cast(Tensor, self.d2t)[ids] if self.reduced else ids

    def to_draft_ids(self, ids: Tensor, missing: int = -100) -> Tensor:
        """Target ids (...) -> draft ids (...); ids < 0 and tokens outside the draft vocabulary -> `missing`."""
        v = int(self.config.vocab_size)
        if not self.reduced:
            return torch.where((ids >= 0) & (ids < v), ids, missing)
        return d2t_to_draft_ids(ids, cast(Tensor, self.d2t), True, v, missing, self)

    def forward(
        self,
        feats: Tensor,
        tokens: Tensor,
        steps: int = 1,
        grad_steps: int | None = None,
        noise: float = 0.0,
        at: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Training-time-test unroll over whole sequences: see `unroll`; (B, L, H), (B, L+S-1) -> (B, L, S, H);
        with `at` = (b, t), (N,) each: only those positions past step 0, (N, S, H)."""
        return unroll(self, feats, tokens, steps, grad_steps, noise, at)


# ---- family protocol: `FAMILY` (models/family.py) at the end of the module; MODEL, CONFIG for older callers ---
MODEL, CONFIG = EagleDrafter, EagleConfig


def attach(model: EagleDrafter, target: PreTrainedModel) -> EagleDrafter:
    """Borrow the target's input embeddings and LM head (after construction or `from_pretrained`)."""
    emb, head = cast(nn.Embedding, target.get_input_embeddings()), target.get_output_embeddings()
    h, v = model.config.base_hidden_size, model.config.vocab_size
    if tuple(emb.weight.shape) != (v, h) or tuple(head.weight.shape) != (v, h):
        raise ValueError(
            f"target embeddings {tuple(emb.weight.shape)} / LM head {tuple(head.weight.shape)} do not "
            f"match the EAGLE head (vocab_size={v}, base_hidden_size={h})"
        )
    model.borrowed.set("embed", emb)
    model.borrowed.set("lm_head", head)
    return model


def build(
    schema: Any,
    target: PreTrainedModel,
    fingerprint: dict[str, Any],
    token_counts: Tensor | None = None,
    **_: Any,
) -> EagleDrafter:
    """A fresh EAGLE-1 head for `target` from the `drafter` config group (`train.config.EagleSchema`).

    Args:
        token_counts: (V,) training-label frequencies; required when `draft_vocab_size` < V.
    """
    v = int(fingerprint["vocab_size"])
    ids = draft_vocab_ids(getattr(schema, "draft_vocab_size", None), v, token_counts)  # (Vd,) ascending
    vd = int(ids.numel())
    config = EagleConfig(
        **common_config(schema, target, fingerprint),
        fc_bias=bool(schema.fc_bias),
        draft_vocab_size=vd if vd < v else None,
        feature_weight=float(schema.feature_weight),
        token_weight=float(schema.token_weight),
        noise=float(schema.noise),
        copy_ngram=int(getattr(schema, "copy_ngram", 0) or 0),
        copy_hidden=int(getattr(schema, "copy_hidden", 64) or 64),
        copy_scale=float(getattr(schema, "copy_scale", 8.0) or 8.0),
    )
    model = attach(EagleDrafter(config), target)
    if model.reduced:
        with torch.no_grad():
            cast(Tensor, model.d2t).copy_(ids - torch.arange(vd))
    return model


FAMILY = FamilySpec(
    name="eagle",
    model=EagleDrafter,
    config=EagleConfig,
    build=build,
    attach=attach,
    compute_loss=compute_loss,
    proposer="eagle_tree",  # eval.eagle_tree.EagleTreeProposer: the EAGLE-2 dynamic tree
    features="last",  # f_t = h_t (the feature it regresses and drafts from)
    decode_last_hidden=True,
    # its own loss (feature smooth-L1 + soft CE) is "ce"; "+lk" adds the acceptance term; no kl variant
    losses=("ce", "ce+lk"),
    uses_token_counts=True,  # an optional draft vocabulary: the Vd most frequent training labels
    # int8 layer products with 8-bit activations: 2.10 -> 2.18 tokens/step, 5.6 -> 3.9 ms (Session 31; with
    # 7-bit ones they drafted worse, 2.08 -> 1.95, Session 29)
    int8_draft_layer=True,
    copy_ngram=copy_ngram,  # the copy gate's loss reads the slots' lookup candidates (`copy_ids`, `copy_len`)
)
