"""`ReDrafterConfig`: the hyper-parameters of a ReDrafter (`models/redrafter.py`) and the identity of its target.

Kept apart from the model as transformers does (configuration_*.py / modeling_*.py): an export's `config.json`
is this class's fields.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from transformers import PretrainedConfig

FORMAT_VERSION = 1


class ReDrafterConfig(PretrainedConfig):
    """Hyper-parameters plus the identity of the target the drafter was trained for."""

    model_type = "specdraft_redrafter"

    architecture: str = "redrafter"  # family name used by models/registry.py
    format_version: int = FORMAT_VERSION  # export format of specdraft drafters
    base_model_name_or_path: str = ""  # the target (Hub id, folder, gguf, or embedded alias)
    base_revision: str | None = None  # target revision / GGUF hash
    base_hidden_size: int = 64  # H: width of the target's last hidden state
    vocab_size: int = 128  # V: target vocabulary size (drafter head width)
    tokenizer_hash: str = ""  # `base_llm.tokenizer_hash` of the target's tokenizer
    embed_dim: int | None = None  # E: token-embedding / RNN-state width (None: base_hidden_size)
    exit_dim: int | None = (
        None  # width of the ResBlock stack (None: embed_dim + feature width, no projection)
    )
    draft_len: int = 4  # D: tokens drafted after the root
    num_layers: int = 2  # ResBlocks after [s, h]
    rnn: bool = True  # True: s_k = SiLU(U s + W e + b); False: s_k = s_{k-1} + e (no recurrence weights)
    share_embeddings: bool = (
        True  # borrow the target's frozen embeddings (not saved) instead of owning a table
    )
    beam_width: int = 8  # default beam width at decode time
    draft_vocab_size: int | None = None  # Vd: head width, the top training labels (None: vocab_size)
    target_layers: list = field(default_factory=list)  # extra target hidden_states read with h ([]: none)
    feature_dropout: float = 0.0  # dropout on the target features in training mode (0: none; eval: never)
    context_heads: int = 0  # > 0: prefix attention over the committed positions (an extension; 0: the paper)
    context_dim: int = 256  # A: width of the prefix attention (split over context_heads)
    copy_ngram: int = 0  # > 0: copy gate on the prompt-lookup candidate of suffix n-grams up to this (0: off)
    copy_hidden: int = 64  # hidden width of the copy gate
    copy_scale: float = 8.0  # multiplier of the copy gate's log-odds (Adam moves them scale * lr a step)
    training_summary: dict = field(default_factory=dict)  # filled in by the trainer at export

    def __post_init__(self, **kwargs: Any) -> None:
        if self.embed_dim is None:
            self.embed_dim = self.base_hidden_size
        if self.exit_dim is None:
            self.exit_dim = self.embed_dim + self.base_hidden_size * (1 + len(self.target_layers))
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        super().__post_init__(**kwargs)


def feature_dim(config: ReDrafterConfig) -> int:
    """Width F of the drafter's target features: H for h_t alone, H * (1 + m) with m extra `target_layers`."""
    return int(config.base_hidden_size) * (1 + len(config.target_layers or ()))
