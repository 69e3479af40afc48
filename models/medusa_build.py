"""Fresh Medusa heads from the `drafter` config group (`models/medusa.py` declares `build` as `FAMILY.build`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from specdraft.models.layers import draft_vocab_ids

if TYPE_CHECKING:
    from specdraft.models.medusa import Medusa


def build(
    schema: Any,
    target: PreTrainedModel,
    fingerprint: dict[str, Any],
    token_counts: Tensor | None = None,
    **_: Any,
) -> Medusa:
    """Fresh Medusa heads for `target` from the `drafter` config group.

    Args:
        schema: `cfg.drafter` (fields of `train.config.MedusaSchema`).
        target: the frozen target; its LM head (the draft vocabulary's rows) initialises every head's projection.
        fingerprint: `base_llm.target_fingerprint(target, tokenizer)`.
        token_counts: (V,) training-label frequencies; required when `draft_vocab_size` < V (the draft
            vocabulary is the Vd most frequent labels).
    """
    # imported here, not above: models/medusa.py imports this module
    from specdraft.models.medusa import Medusa, MedusaConfig, attach

    tree = getattr(schema, "tree_choices", None)
    v = int(fingerprint["vocab_size"])
    want = getattr(schema, "draft_vocab_size", None)
    # `draft_vocab_ids` reads 0 as "full"; the schema says null for that, so 0 is refused here
    if want is not None and int(want) < 1:
        raise ValueError(
            f"drafter.draft_vocab_size={want} must be in [1, vocab_size={v}] (null: full vocabulary)"
        )
    ids = draft_vocab_ids(want, v, token_counts)  # (Vd,) ascending target ids
    vd = int(ids.numel())
    config = MedusaConfig(
        base_model_name_or_path=str(fingerprint["name_or_path"]),
        base_revision=fingerprint.get("revision"),
        base_hidden_size=int(fingerprint["hidden_size"]),
        vocab_size=v,
        draft_vocab_size=vd,
        tokenizer_hash=str(fingerprint["tokenizer_hash"]),
        draft_len=int(schema.draft_len),
        num_layers=int(schema.num_layers),
        loss_decay=float(schema.loss_decay),
        topk=int(schema.topk),
        tree_choices=[list(map(int, p)) for p in tree] if tree else None,
        root_token=bool(getattr(schema, "root_token", False)),
        copy_ngram=int(getattr(schema, "copy_ngram", 0) or 0),
        copy_hidden=int(getattr(schema, "copy_hidden", 64)),
        copy_scale=float(getattr(schema, "copy_scale", 8.0)),
    )
    model = attach(Medusa(config), target)
    with torch.no_grad():
        if vd < v:
            model.d2t.copy_(ids - torch.arange(vd))
        if schema.init_from_lm_head:
            lm_head = target.get_output_embeddings().weight  # (V, H)
            rows = lm_head.detach()[ids.to(lm_head.device)].float()  # (Vd, H) the draft vocabulary's rows
            for head in model.heads:  # (Vd, H) each
                cast(nn.Linear, cast(nn.Sequential, head)[-1]).weight.copy_(rows)
    return model
