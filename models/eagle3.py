"""EAGLE-3 head (arXiv 2503.01840): fused low/mid/high target features, token-level training-time test.

Differences from EAGLE-1 (`models/eagle.py`, whose alignment, unroll and masks this file reuses):

    g_t = fc([l_low; l_mid; l_high]_t)                      (target layers, e.g. HF hidden_states 2, L/2, L-3)
    a   = attn([input_norm(e(x_{t+1})); hidden_norm(g_t)])  (q/k/v take 2H; residual = g_t)
    o_t = a + g_t;  o_t = o_t + mlp(post_norm(o_t))         -> fed back as the next step's g (pre-norm)
    logits = lm_head(norm(o_t))                             (own head over a draft vocabulary of Vd tokens)

No feature-regression loss: training unrolls the head S = draft_len steps on its own outputs (training-time test)
with the soft-target CE of step i (target distribution at t+1+i, restricted to the draft vocabulary) weighted
`ttt_decay ** i`. The optional reduced draft vocabulary keeps the Vd most frequent training tokens, with EAGLE-3's
mapping buffers `d2t` (Vd,) (target id = draft id + d2t[draft id]) and `t2d` (V,) bool (target token is drafted).

Unroll depth and memory: step i attends to its position's causal prefix at step 0 plus its own outputs of
steps 1..i (`unroll_mask`, (L, L*(i+1))): the KV cache ends at S*L positions, autograd keeps S steps'
activations (linear in S) and the attention scores of all steps sum to L^2 * S(S+1)/2. `drafter.draft_len`
allows S = 1..7.

`config.norm_fused` (off by default) is the EAGLE-3.1 normalisation of `models/eagle31.py`: per-layer RMSNorm
of the fused features before fc, and the post-norm state fed back as the next step's g. `config.copy_ngram` > 0
(off by default) adds a copy gate (`models/eagle_copy.py`): each step's distribution mixed with the prompt-lookup
candidate of its context.
"""

from __future__ import annotations

import copy
from dataclasses import field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from specdraft.models.eagle3_loss import compute_loss  # the training-time-test soft CE (+ LK)
from specdraft.models.eagle31 import ChunkNorm
from specdraft.models.eagle_common import (
    FORMAT_VERSION,
    Borrowed,
    DraftBlock,
    common_config,
    target_block,
    unroll,
)
from specdraft.models.eagle_copy import build_gate, copy_ngram, reset_gate
from specdraft.models.family import FamilySpec
from specdraft.models.hf_compat import cache_kwargs
from specdraft.models.layers import check_target_layers, d2t_to_draft_ids, draft_vocab_ids


def default_target_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers as HF `hidden_states` indices: (2, L // 2, L - 3), deduplicated."""
    return sorted({min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)})


class Eagle3Config(PretrainedConfig):
    """EAGLE-3 head hyper-parameters plus the identity of its target."""

    model_type = "specdraft_eagle3"

    architecture: str = "eagle3"  # family name used by models/registry.py
    format_version: int = FORMAT_VERSION  # export format of specdraft drafters
    base_model_name_or_path: str = ""  # the target (Hub id, folder, gguf, or embedded alias)
    base_revision: str | None = None  # target revision / GGUF hash
    base_hidden_size: int = 64  # H: the target's hidden width
    vocab_size: int = 128  # V: target vocabulary
    tokenizer_hash: str = ""  # `base_llm.tokenizer_hash` of the target's tokenizer
    block_config: dict = field(default_factory=dict)  # the target's text config; the head is one such block
    target_layers: list = field(default_factory=list)  # fused HF hidden_states indices (0 = embeddings)
    draft_vocab_size: int | None = None  # Vd (None: the full vocabulary)
    draft_len: int = 5  # training-time-test unroll steps = draft slots scored
    ttt_decay: float = 0.8  # weight of unroll step i is ttt_decay ** i
    norm_fused: bool = (
        False  # EAGLE-3.1 (models/eagle31.py): RMSNorm per fused layer, post-norm state fed back
    )
    tree_total_tokens: int = 24  # EAGLE-2 tree: draft nodes kept after reranking (root excluded)
    tree_depth: int = 5  # EAGLE-2 tree: maximum draft depth
    tree_top_k: int = 6  # EAGLE-2 tree: children per expanded node / nodes expanded per depth
    copy_ngram: int = 0  # > 0: copy gate over the lookup candidate, n-grams up to this (models/eagle_copy.py)
    copy_hidden: int = 64  # hidden width of the copy gate
    copy_scale: float = 8.0  # multiplier of the gate's log-odds
    training_summary: dict = field(default_factory=dict)  # filled in by the trainer at export

    def __post_init__(self, **kwargs: Any) -> None:
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        super().__post_init__(**kwargs)


class Eagle3Drafter(PreTrainedModel):
    """fc(fused layers) -> midlayer over [norm(e); norm(g)] -> norm -> lm_head (draft vocabulary)."""

    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    _no_split_modules: list[str] = []
    d2t: Tensor  # (Vd,) long buffer, registered in __init__
    t2d: Tensor  # (V,) bool buffer, registered in __init__

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        assert config.draft_vocab_size is not None  # set by Eagle3Config.__post_init__
        h, vd, m = config.base_hidden_size, int(config.draft_vocab_size), max(len(config.target_layers), 1)
        layer, self.rotary = target_block(config.block_config)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [e; g]: 2H inputs
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        layer.hidden_norm = copy.deepcopy(layer.input_layernorm)
        self.midlayer = layer
        self.fc = nn.Linear(m * h, h, bias=False)
        self.norm = copy.deepcopy(cast(nn.Module, layer.post_attention_layernorm))
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # target id - draft id
        self.register_buffer(
            "t2d", torch.ones(config.vocab_size, dtype=torch.bool)
        )  # target id is in the draft vocab
        self.borrowed = Borrowed()
        # EAGLE-3.1 option, built last so the EAGLE-3 weights draw the same random numbers with it on or off
        self.fc_norm = ChunkNorm(cast(nn.Module, layer.input_layernorm), m) if config.norm_fused else None
        self.copy_gate = build_gate(config)  # the copy gate (extension), last for the same reason
        self.post_init()
        reset_gate(self.copy_gate)  # lam = 1/2 at first (post_init drew its output layer)

    def draft_ids(self) -> Tensor:
        """(Vd,) long: the target id of every draft-vocabulary entry."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def embed(self, ids: Tensor) -> Tensor:
        """ids (...) long -> (..., H) borrowed target embeddings in the head's dtype."""
        return F.embedding(ids, self.borrowed.weight("embed", self.fc.weight))

    def encode_target(self, feats: Tensor, block: DraftBlock | None = None) -> Tensor:
        """Concatenated target layers of committed positions (..., m*H) -> g (..., H) (`block`: its `fc`)."""
        feats = feats.to(self.fc.weight.dtype)  # (..., m*H)
        if self.fc_norm is not None:  # EAGLE-3.1: every fused layer on one scale before fc
            feats = self.fc_norm(feats)
        return self.fc(feats) if block is None else block.linear("fc", feats)

    def step(
        self,
        feats: Tensor,
        tokens: Tensor,
        cache: DynamicCache,
        positions: Tensor,
        mask: Tensor,
        block: DraftBlock | None = None,
    ) -> Tensor:
        """One pass over n new inputs appended to `cache` (same contract as `EagleDrafter.step`).

        Args:
            feats: (B, n, H) g (fused target features after fc, or the head's previous outputs).
            tokens: (B, n) long.
            cache: the head's KV cache.
            positions: (B, n) long.
            mask: (n, C + n) or (B, 1, n, C + n) bool, True = attend.
            block: a decode-time copy of `midlayer` (`eval/draft_block.py`); None: the HF modules.

        Returns:
            (B, n, H) outputs: pre-norm o (EAGLE-3), or norm(o) with `config.norm_fused` (EAGLE-3.1).
        """
        lay: Any = self.midlayer  # an HF decoder layer: its submodules depend on the target's family
        g = feats.to(self.fc.weight.dtype)  # (B, n, H)
        mask = mask if mask.ndim == 4 else mask[None, None]
        rope = self.rotary(g, positions)
        # the layer's pieces: its HF modules, or the same functions from a decode-time `block`
        norm = block.norm if block is not None else (lambda name, t: getattr(lay, name)(t))
        mlp = block.mlp if block is not None else lay.mlp
        attend = (
            block.attention
            if block is not None
            else lambda x, rope, mask, cache: lay.self_attn(
                hidden_states=x,
                position_embeddings=rope,
                attention_mask=mask,
                **cache_kwargs(lay.self_attn, cache),
            )[0]
        )
        x = torch.cat(
            [norm("input_layernorm", self.embed(tokens)), norm("hidden_norm", g)], dim=-1
        )  # (B, n, 2H)
        o = g + attend(x, rope, mask, cache)
        o = o + mlp(norm("post_attention_layernorm", o))  # (B, n, H)
        return self.norm(o) if self.config.norm_fused else o  # EAGLE-3.1 feeds the post-norm state back

    def draft_logits(self, out: Tensor) -> Tensor:
        """(..., H) outputs of `step` -> (..., Vd) draft-vocabulary logits (EAGLE-3.1: already normed)."""
        return self.lm_head(out if self.config.norm_fused else self.norm(out))

    def draft_layer(self) -> tuple[nn.Module, dict[str, nn.Linear]]:
        """(the decoder layer `step` runs, its other Linears by name) for a decode-time `DraftBlock` copy."""
        return self.midlayer, {"fc": self.fc}

    def draft_head(self) -> tuple[nn.Module, nn.Linear]:
        """(transform, vocabulary Linear) with `draft_logits(out) == linear(transform(out))` (for int8 copies)."""
        return (nn.Identity() if self.config.norm_fused else self.norm), self.lm_head

    def to_target_ids(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (...) -> target ids (...)."""
        return ids + self.d2t[ids]

    def to_draft_ids(self, ids: Tensor, missing: int = -100) -> Tensor:
        """Target ids (...) -> draft ids (...); ids < 0 and tokens outside the draft vocabulary -> `missing`."""
        v = int(self.config.vocab_size)
        return d2t_to_draft_ids(ids, self.d2t, int(self.d2t.shape[0]) < v, v, missing, self)

    def forward(
        self,
        feats: Tensor,
        tokens: Tensor,
        steps: int = 1,
        grad_steps: int | None = None,
        noise: float = 0.0,
        at: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Training-time-test unroll (`models.eagle_common.unroll`): (B, L, m*H), (B, L+S-1) -> (B, L, S, H);
        with `at` = (b, t), (N,) each: only those positions past step 0, (N, S, H)."""
        return unroll(self, feats, tokens, steps, grad_steps, noise, at)


# ---- family protocol: `FAMILY` (models/family.py) at the end of the module; MODEL, CONFIG for older callers ---
MODEL, CONFIG = Eagle3Drafter, Eagle3Config


def attach(model: Eagle3Drafter, target: PreTrainedModel) -> Eagle3Drafter:
    """Borrow the target's input embeddings (drafting) and LM head (training teacher only)."""
    emb, head = cast(nn.Embedding, target.get_input_embeddings()), target.get_output_embeddings()
    h, v = model.config.base_hidden_size, model.config.vocab_size
    if tuple(emb.weight.shape) != (v, h) or tuple(head.weight.shape) != (v, h):
        raise ValueError(
            f"target embeddings {tuple(emb.weight.shape)} / LM head {tuple(head.weight.shape)} do not "
            f"match the EAGLE-3 head (vocab_size={v}, base_hidden_size={h})"
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
) -> Eagle3Drafter:
    """A fresh EAGLE-3 head from the `drafter` config group (`train.config.Eagle3Schema`).

    Args:
        schema: `cfg.drafter`.
        target: the frozen target (block type, embeddings, LM head for the draft head's initialisation).
        fingerprint: `base_llm.target_fingerprint(target, tokenizer)`.
        token_counts: (V,) training-label frequencies; required when `draft_vocab_size` < V.
    """
    v = int(fingerprint["vocab_size"])
    n_layers = int(target.config.get_text_config(decoder=True).num_hidden_layers)
    layers = list(schema.target_layers) if schema.target_layers else default_target_layers(n_layers)
    check_target_layers(layers, n_layers)
    ids = draft_vocab_ids(schema.draft_vocab_size, v, token_counts)  # (Vd,) ascending
    vd = int(ids.numel())
    config = Eagle3Config(
        **common_config(schema, target, fingerprint),
        target_layers=layers,
        draft_vocab_size=vd,
        ttt_decay=float(schema.ttt_decay),
        norm_fused=bool(getattr(schema, "norm_fused", False)),
        copy_ngram=int(getattr(schema, "copy_ngram", 0) or 0),
        copy_hidden=int(getattr(schema, "copy_hidden", 64) or 64),
        copy_scale=float(getattr(schema, "copy_scale", 8.0) or 8.0),
    )
    model = attach(Eagle3Drafter(config), target)
    with torch.no_grad():
        model.d2t.copy_(ids - torch.arange(vd))
        model.t2d.zero_()
        model.t2d[ids] = True
        model.lm_head.weight.copy_(
            target.get_output_embeddings().weight[ids.to(model.lm_head.weight.device)].float()
        )
    return model


FAMILY = FamilySpec(
    name="eagle3",
    model=Eagle3Drafter,
    config=Eagle3Config,
    build=build,
    attach=attach,
    compute_loss=compute_loss,
    proposer="eagle_tree",  # eval.eagle_tree.EagleTreeProposer: the EAGLE-2 dynamic tree
    features="layers",  # the fused low/mid/high layers (`config.target_layers`, set from the target's depth)
    target_layers="config",
    decode_last_hidden=False,  # decoding reads the fused layers only (h_t is the training teacher)
    # its own loss (training-time-test soft CE) is "ce"; "+lk" adds the acceptance term; no kl variant
    losses=("ce", "ce+lk"),
    uses_token_counts=True,  # reduced draft vocabulary: the Vd most frequent training labels
    int8_draft_layer=True,  # int8 layer products: 2.43 -> 2.48 tokens/step, 6.5 -> 4.3 ms a draft (Session 29)
    copy_ngram=copy_ngram,  # the copy gate's loss reads the slots' lookup candidates (`copy_ids`, `copy_len`)
)
