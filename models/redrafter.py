"""ReDrafter: a recurrent drafter over the frozen target's last hidden state (arXiv 2403.09919, s3.1).

Alignment (docs/design.md): at position t the drafter gets h_t (target last-layer state, post norm) and the
root token x_{t+1}; draft slot k (0-based) predicts x_{t+2+k}. The recurrence runs over token embeddings e(.)
taken from the target:

    s_1 = e(root)                                   (slot 0)
    s_k = SiLU(U s_{k-1} + W e(tok_k) + b)          (slot k-1; tok_k = the token drafted at slot k-2)
    g_k = [s_k, h_t] -> input_proj? -> ResBlock x num_layers -> vocab head -> logits for slot k-1

Embedding choice: with `share_embeddings=True` (default) the drafter *borrows* the target's frozen input
embedding module. It is attached with `attach_embeddings(target)` after construction or loading, is kept out
of `state_dict()`/`parameters()` (so it is never trained, never handed to the optimizer and never exported),
and an export is therefore only usable next to its target. `share_embeddings=False` gives the drafter its own
trainable table (copied from the target at build time) that is saved with it.

Extra target layers (an extension of the paper, off by default): with `target_layers` = [i_1..i_m] (HF
`hidden_states` indices, 0 = embeddings) h_t is widened to [h_t; l_{i_1,t}; ...; l_{i_m,t}] (width H * (1 + m)),
as EAGLE-3 fuses low/mid/high layers: a small target's last layer is specialised for x_{t+1}, while earlier layers
still carry the context the later draft slots need. The decoder then returns those layers with h (`keep_last_hidden`
of the proposer), and distill/ caches them (`distill.hidden_layers`) so training stays offline.

Prefix attention (an extension of the paper, off by default): with `context_heads` > 0 every slot also attends
to the committed positions 2 <= j <= t (`models/redrafter_context.py`).

Copy gate (an extension of the paper, off by default): with `copy_ngram` = n > 0 each slot mixes a learnt weight of
its prompt-lookup candidate into its distribution (the token after the newest earlier occurrence of the context's suffix
m-gram, m <= n), so the drafter can copy the repetitions a small target makes (`models/copy_lookup.py`).

Draft vocabulary: with `draft_vocab_size` Vd < V the head scores only the Vd most frequent training labels
(buffer `d2t` (Vd,): target id = draft id + d2t[draft id], as EAGLE-3 exports it). The head is most of the
drafter's compute (V = 49,152 for SmolLM2, 128,256 for Llama 3): Vd = 16,384 trains ~3x faster here and drafts
faster at decode time; tokens outside the draft vocabulary are never drafted (counted as misses in metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from specdraft.models import redrafter_beam
from specdraft.models.copy_lookup import CopyGate, mix_log_probs, mix_logits
from specdraft.models.family import FamilySpec
from specdraft.models.layers import (
    ResBlock,
    ZeroInitLinear,
    check_draft_vocab,
    d2t_draft_ids,
    d2t_to_draft_ids,
)
from specdraft.models.redrafter_build import build  # a fresh one from the config group
from specdraft.models.redrafter_config import FORMAT_VERSION, ReDrafterConfig, feature_dim
from specdraft.models.redrafter_context import context_memory, prefix_attention, training_context
from specdraft.models.teacher_forced import compute_loss  # the family's loss (shared with Medusa)


class ReDrafter(PreTrainedModel):
    """The recurrent drafter; see the module docstring for the maths and the alignment."""

    config_class = ReDrafterConfig
    base_model_prefix = "redrafter"
    _no_split_modules: list[str] = []
    d2t: Tensor  # (Vd,) long buffer, registered in __init__

    def __init__(self, config: ReDrafterConfig) -> None:
        super().__init__(config)
        e, x, vd = config.embed_dim, config.exit_dim, config.draft_vocab_size
        assert e is not None and x is not None and vd is not None  # set by ReDrafterConfig.__post_init__
        h = feature_dim(config)  # H * (1 + m): h_t and the m extra target layers
        check_draft_vocab(vd, config.vocab_size)
        if config.rnn:
            self.rnn_u = nn.Linear(e, e, bias=True)  # U s + b
            self.rnn_w = nn.Linear(e, e, bias=False)  # W e
        self.input_proj = nn.Linear(e + h, x) if x != e + h else None
        self.blocks = nn.ModuleList(ResBlock(x) for _ in range(config.num_layers))
        self.head = nn.Linear(x, vd, bias=False)
        # Saved only with a reduced vocabulary, so full-vocabulary exports keep their original tensors; it is
        # never read then (`from_pretrained` leaves a non-persistent buffer uninitialised).
        self.reduced_vocab = vd < config.vocab_size
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long), persistent=self.reduced_vocab)
        self.embed = None if config.share_embeddings else nn.Embedding(config.vocab_size, e)
        self.ctx = prefix_attention(config, e, h, x)  # prefix attention (an extension; None by default)
        n_copy = int(config.copy_ngram or 0)  # 0 for exports older than the field
        gate_args = (int(config.copy_hidden), float(config.copy_scale))
        self.copy_gate = CopyGate(x, e, n_copy, *gate_args) if n_copy else None
        self._borrowed: list[nn.Embedding] = []  # the target's embedding, hidden from state_dict/parameters
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            if isinstance(module, ZeroInitLinear):
                nn.init.zeros_(module.weight)
            else:
                nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    # ---- embeddings -------------------------------------------------------------------------------------
    def attach_embeddings(self, target: PreTrainedModel | nn.Module) -> ReDrafter:
        """Borrow the target's (frozen) input embeddings; a no-op when the drafter owns its table."""
        has_getter = hasattr(target, "get_input_embeddings")
        emb = cast(
            nn.Embedding, cast(PreTrainedModel, target).get_input_embeddings() if has_getter else target
        )
        if emb.weight.shape != (self.config.vocab_size, self.config.embed_dim):
            raise ValueError(
                f"target embeddings {tuple(emb.weight.shape)} do not match the drafter's "
                f"(vocab_size={self.config.vocab_size}, embed_dim={self.config.embed_dim})"
            )
        self._borrowed = [emb]
        return self

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """ids (...) long -> (..., E) in the drafter's dtype; ids < 0 (ignored slots) embed as token 0."""
        emb: nn.Embedding
        if self.embed is not None:
            emb = self.embed
        elif self._borrowed:
            emb = self._borrowed[0]
        else:
            raise RuntimeError("ReDrafter has no embeddings: call `attach_embeddings(target)` after loading")
        out = emb(ids.clamp_min(0).to(emb.weight.device))
        return out.to(device=self.head.weight.device, dtype=self.head.weight.dtype)

    # ---- draft vocabulary -------------------------------------------------------------------------------
    def draft_ids(self) -> Tensor:
        """(Vd,) long: the target id of every draft-vocabulary entry (arange(V) for the full vocabulary)."""
        return d2t_draft_ids(self.d2t, self.reduced_vocab)

    def to_target_ids(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (...) -> target ids (...)."""
        return ids + self.d2t[ids] if self.reduced_vocab else ids

    def to_draft_ids(self, ids: Tensor, missing: int = -100) -> Tensor:
        """Target ids (...) -> draft ids (...); ids < 0 and tokens outside the draft vocabulary -> `missing`."""
        return d2t_to_draft_ids(ids, self.d2t, self.reduced_vocab, int(self.config.vocab_size), missing, self)

    # ---- step-level helpers (used by forward, beam_search and decoders) ---------------------------------
    def init_state(self, root: Tensor) -> Tensor:
        """root (...) long -> s_1 = e(root) (..., E)."""
        return self.embed_tokens(root)

    def next_state(self, state: Tensor, token: Tensor) -> Tensor:
        """state (..., E), token (...) long -> s_{k+1} (..., E)."""
        e = self.embed_tokens(token)  # (..., E)
        if self.config.rnn:
            return F.silu(self.rnn_u(state) + self.rnn_w(e))
        return state + e

    def features(self, hidden: Tensor) -> Tensor:
        """Target features (..., F) -> the drafter's input (..., F) in its dtype and on its device, once per
        position (every slot reuses it): h_t as is, each extra `target_layers` chunk (a raw residual stream, any
        scale) RMS-normalised; then, in training mode only, `feature_dropout`. F = `feature_dim(config)`."""
        w = self.head.weight
        hidden = hidden.to(device=w.device, dtype=w.dtype)  # (..., F)
        if self.config.target_layers:
            h = int(self.config.base_hidden_size)
            extra = hidden[..., h:].unflatten(-1, (-1, h))  # (..., m, H)
            extra = F.rms_norm(extra.to(torch.promote_types(extra.dtype, torch.float32)), (h,)).flatten(-2)
            hidden = torch.cat([hidden[..., :h], extra.to(w.dtype)], dim=-1)  # (..., F)
        p = float(self.config.feature_dropout)  # 0.0 for exports older than the field (the config default)
        return F.dropout(hidden, p, training=True) if p > 0 and self.training else hidden

    def context_memory(
        self, last: Tensor, prev: Tensor, cur: Tensor, nxt: Tensor, sink: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Prefix-attention keys, values (..., 1 + M, A) of committed positions: `redrafter_context.context_memory`
        (last (..., M, H) h_j; prev, cur, nxt (..., M) x_{j-1}, x_j, x_{j+1})."""
        return context_memory(self, last, prev, cur, nxt, sink)

    def state_logits(
        self,
        state: Tensor,
        feats: Tensor,
        head: Callable[[Tensor], Tensor] | None = None,
        context: tuple | None = None,
        copy: tuple[Tensor, Tensor] | None = None,
        log_probs: bool = False,
    ) -> Tensor:
        """state (..., n, E), feats (..., n, F) from `features` -> logits (..., n, Vd) over the draft vocabulary
        for this state's slot (`log_probs`: their float32 log-softmax instead, the beam search's scores, with
        the copy gate's mixture taken in log space: `copy_lookup.mix_log_probs`).

        `head` replaces the vocabulary head, (..., X) -> (..., Vd) (e.g. an int8 copy at decode time).
        `context` (prefix attention only): keys, values (..., 1 + M, A) from `context_memory`, a visibility mask
        (..., n, 1 + M) bool (column 0: the sink, always visible; None: every position visible) and optionally
        `rows` (see `PrefixAttention.forward`).
        `copy` (copy gate only): the slot's lookup candidates (..., n) target ids (-1: none) and their match
        lengths (..., n) (0: none); the logits become those of the gate's mixture with each candidate.
        """
        g_in = torch.cat([state, feats.to(state.dtype)], dim=-1)  # (..., E + F); bf16 state under autocast
        g = self.input_proj(g_in) if self.input_proj is not None else g_in  # (..., X)
        if self.ctx is not None and context is not None:
            g = g + self.ctx(g_in, *context).to(g.dtype)  # (..., n, X)
        for block in self.blocks:
            g = block(g)
        logits = (self.head if head is None else head)(g)  # (..., Vd)
        if self.copy_gate is None or copy is None:
            return torch.log_softmax(logits.float(), dim=-1) if log_probs else logits
        cand, length = copy
        draft = self.to_draft_ids(cand, missing=-1)  # (..., n); tokens outside the draft vocabulary: no copy
        length = length.to(draft.device).masked_fill(draft < 0, 0)
        lam = self.copy_gate(g, self.embed_tokens(cand), length)  # (..., n), 0 without a candidate
        if log_probs:  # float32 scores, as without a candidate
            return mix_log_probs(logits.float(), draft.clamp_min(0), lam)  # (..., Vd)
        return mix_logits(logits, draft.clamp_min(0), lam)  # (..., Vd)

    # ---- training ---------------------------------------------------------------------------------------
    def forward(
        self,
        hidden: Tensor,
        root: Tensor,
        targets: Tensor,
        context: dict[str, Tensor] | None = None,
        copy: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Teacher-forced logits of every draft slot at every position.

        The recurrence unrolled over D slots for one position t (targets[t] = x_{t+2} .. x_{t+1+D}):

            h_t ────────────┬──────────────────┬─────────────── ... ──┐
                            v                  v                      v
            e(x_{t+1}) ─> s_1 ──U──> s_2 ──U──> s_3 ...          s_D
                            │  W e(x_{t+2})─^  W e(x_{t+3})─^       │
                            v                  v                      v
                      MLP([s_1,h_t])     MLP([s_2,h_t])         MLP([s_D,h_t])
                            v                  v                      v
                      slot 0: x_{t+2}    slot 1: x_{t+3}        slot D-1: x_{t+1+D}

        Args:
            hidden: (B, L, F) target features: last-layer states h_t (F = H), or [h_t; extra layers].
            root: (B, L) long, the root token x_{t+1} of each position.
            targets: (B, L, D) long target ids, the draft labels (-100 = ignored); slot k-1's label is fed to
                slot k.
            context: prefix attention only (`context_heads` > 0): `last` (B', M, H) h_j, `input_ids` (B', M) x_j,
                `next` (B', M) x_{j+1} of the rows, `mask` (B', n, 1 + M) bool (column 0: the attention's sink,
                always True; column 1 + j: position t sees j when 2 <= j <= t) and
                optionally `row`, `rank` (L,): with B = 1, position i belongs to row `row[i]` of the context and is
                query `rank[i]` of that row's mask (`PrefixAttention.forward`).
            copy: copy gate only (`copy_ngram` > 0): the lookup candidates (B, L, D) target ids (-1: none) and
                match lengths (B, L, D) of every slot (`data.ngrams.slot_candidates`).

        Returns:
            logits: (B, L, D, Vd) over the draft vocabulary (Vd = V unless `draft_vocab_size` is set).
        """
        feats = self.features(hidden)  # (B, L, F)
        state = self.init_state(root)  # (B, L, E)
        if self.copy_gate is not None and copy is None:
            raise ValueError("a drafter with copy_ngram > 0 needs the slots' lookup candidates (`copy`)")
        ctx = training_context(self, context)  # prefix attention's keys/values (None without it)
        logits = []
        for k in range(targets.shape[-1]):
            if k > 0:
                state = self.next_state(state, targets[..., k - 1])  # (B, L, E)
            slot_copy = None if copy is None else (copy[0][..., k], copy[1][..., k])  # (B, L) each
            logits.append(self.state_logits(state, feats, context=ctx, copy=slot_copy))  # (B, L, Vd)
        return torch.stack(logits, dim=2)  # (B, L, D, Vd)

    # ---- decoding ---------------------------------------------------------------------------------------
    # `drafter.beam_search(hidden (F,), root, beam_width, draft_len, context=None, head=None, copy=None,
    # min_logp=None)
    # -> (beams, cum)`: the one beam search (models/redrafter_beam.py), bound as a method.
    beam_search = redrafter_beam.beam_search


# ---- family protocol: `FAMILY` (models/family.py) at the end of the module; MODEL, CONFIG for older callers ---
MODEL, CONFIG = ReDrafter, ReDrafterConfig
__all__ = [
    "FORMAT_VERSION",
    "ReDrafter",
    "ReDrafterConfig",
    "attach",
    "build",
    "compute_loss",
]


def attach(model: ReDrafter, target: PreTrainedModel) -> ReDrafter:
    """Re-borrow the target's embeddings after `from_pretrained` (no-op for an owned table)."""
    return model.attach_embeddings(target) if model.config.share_embeddings else model


def _copy_ngram(config: PretrainedConfig) -> int:
    """`config.copy_ngram`: the copy gate's n-gram order (0: no gate, and exports older than the field)."""
    return int(cast(ReDrafterConfig, config).copy_ngram or 0)


FAMILY = FamilySpec(
    name="redrafter",
    model=ReDrafter,
    config=ReDrafterConfig,
    build=build,
    attach=attach,
    compute_loss=compute_loss,  # models.teacher_forced: every ce / kl / lk combination
    proposer="redrafter_beams",  # eval.proposers.ReDrafterProposer: beam search + prefix dedup
    features="last",  # h_t, plus the optional extra `config.target_layers`
    target_layers="config",
    decode_last_hidden=True,
    low_precision_outputs=True,  # compute_loss takes bf16 logits (fp32 inside): no fp32 copy (train/loop)
    uses_token_counts=True,  # reduced draft vocabulary: the Vd most frequent training labels
    int8_draft_layer=True,  # int8 recurrence/blocks/copy gate: 2.39 -> 2.44 tokens/step, 6.1 -> 4.7 ms (Session 31)
    copy_ngram=_copy_ngram,  # the copy gate (an extension) reads the slots' lookup candidates
)
