"""A fresh ReDrafter from the `drafter` config group (`models/redrafter.py` declares `build` as `FAMILY.build`),
and its optional start from the target's LM head."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from specdraft.models.layers import check_target_layers, draft_vocab_ids
from specdraft.models.redrafter_config import ReDrafterConfig

if TYPE_CHECKING:
    from specdraft.models.redrafter import ReDrafter


def build(
    schema: Any,
    target: PreTrainedModel,
    fingerprint: dict[str, Any],
    token_counts: Tensor | None = None,
    **_: Any,
) -> ReDrafter:
    """A fresh ReDrafter for `target` from the `drafter` config group.

    Args:
        schema: `cfg.drafter` (fields of `train.config.ReDrafterSchema`).
        target: the frozen target (embeddings borrowed or copied, LM head used for the optional init).
        fingerprint: `base_llm.target_fingerprint(target, tokenizer)`.
        token_counts: (V,) training-label frequencies; required when `draft_vocab_size` < V (the draft
            vocabulary is the Vd most frequent labels).
    """
    # imported here, not above: models/redrafter.py imports this module
    from specdraft.models.redrafter import ReDrafter

    hidden, v = int(fingerprint["hidden_size"]), int(fingerprint["vocab_size"])
    layers = [int(i) for i in (getattr(schema, "target_layers", None) or ())]
    n_layers = int(target.config.get_text_config(decoder=True).num_hidden_layers)
    check_target_layers(layers, n_layers, distinct=True)
    dropout = float(getattr(schema, "feature_dropout", 0.0) or 0.0)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"drafter.feature_dropout={dropout} must be in [0, 1)")
    ids = draft_vocab_ids(getattr(schema, "draft_vocab_size", None), v, token_counts)  # (Vd,) ascending
    vd = int(ids.numel())
    share = bool(schema.share_embeddings)
    config = ReDrafterConfig(
        base_model_name_or_path=str(fingerprint["name_or_path"]),
        base_revision=fingerprint.get("revision"),
        base_hidden_size=hidden,
        vocab_size=v,
        draft_vocab_size=vd,
        tokenizer_hash=str(fingerprint["tokenizer_hash"]),
        embed_dim=hidden,  # the target's embedding width (borrowed or copied)
        exit_dim=getattr(schema, "exit_dim", None),
        draft_len=int(schema.draft_len),
        num_layers=int(schema.num_layers),
        rnn=bool(schema.rnn),
        share_embeddings=share,
        beam_width=int(schema.beam_width),
        target_layers=layers,
        feature_dropout=dropout,
        context_heads=int(getattr(schema, "context_heads", 0) or 0),
        context_dim=int(getattr(schema, "context_dim", 256) or 256),
        copy_ngram=int(getattr(schema, "copy_ngram", 0) or 0),
        copy_hidden=int(getattr(schema, "copy_hidden", 64) or 64),
        copy_scale=float(getattr(schema, "copy_scale", 8.0) or 8.0),
    )
    model = ReDrafter(config)
    emb = cast(nn.Embedding, target.get_input_embeddings()).weight
    with torch.no_grad():
        if vd < v:
            model.d2t.copy_(ids - torch.arange(vd))
        if share:
            model.attach_embeddings(target)
        else:
            assert model.embed is not None  # share_embeddings=False: the drafter owns its table
            model.embed.weight.copy_(emb.float())
        if schema.init_from_lm_head:
            init_from_lm_head(model, target.get_output_embeddings().weight[model.draft_ids().to(emb.device)])
    # A fixed head (the target's LM head) leaves the MLP to predict a next-next *state* in the target's own
    # output space, as EAGLE does: 25x fewer trainable parameters, less overfitting on small distilled sets.
    model.head.weight.requires_grad_(not getattr(schema, "freeze_head", False))
    return model


@torch.no_grad()
def init_from_lm_head(model: ReDrafter, lm_head: Tensor) -> None:
    """Start from the target's next-token head applied to h (Medusa-style): logits = W_lm h at step 0.

    Args:
        model: the drafter; with no input projection the head becomes [0 | W_lm | 0], with a projection to width
            H the projection becomes [small noise | I | small noise] and the head W_lm (the trailing block: the
            extra `target_layers`); other widths keep the random init.
        lm_head: (Vd, H) the target's output embedding rows of the draft vocabulary (`model.draft_ids()`).
    """
    e, h, x = model.config.embed_dim, model.config.base_hidden_size, model.config.exit_dim
    w = lm_head.detach().to(model.head.weight)  # (Vd, H)
    if model.input_proj is None:
        model.head.weight.zero_()
        model.head.weight[:, e : e + h] = w
    elif x == h:
        model.input_proj.weight.normal_(std=0.02)
        model.input_proj.weight[:, e : e + h] = torch.eye(h, dtype=w.dtype, device=w.device)
        model.input_proj.bias.zero_()
        model.head.weight.copy_(w)
