"""Building blocks shared by the EAGLE-1 (`models/eagle.py`) and EAGLE-3 (`models/eagle3.py`) heads.

A head exposes `encode_target(target feats) -> g`, `step(g, tokens, cache, positions, mask) -> out`,
`draft_logits(out)` and `to_target_ids(ids)`; `unroll` (training-time test) and the EAGLE-2 proposer
(`eval/eagle_tree.py`) only use those. The target's embeddings / LM head are `Borrowed` (never saved).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, DynamicCache, PreTrainedModel

from specdraft.data.ngrams import follows_own_text
from specdraft.models.attention import use_gqa_sdpa

if TYPE_CHECKING:
    from specdraft.models.eagle import EagleDrafter
    from specdraft.models.eagle3 import Eagle3Drafter

FORMAT_VERSION = 1


class DraftBlock(Protocol):
    """A decode-time stand-in for a head's decoder layer (`eval/draft_block.py`'s `FastBlock`): the same
    functions of the same weights, computed with fewer (optionally int8) products. `step(..., block=)` runs
    the head through it; None runs the HF modules."""

    def norm(self, name: str, x: Tensor) -> Tensor:
        """The layer's RMSNorm child `name` of x (..., H)."""
        ...

    def linear(self, name: str, x: Tensor) -> Tensor:
        """The head's own Linear `name` (`fc`) of x (..., in) -> (..., out)."""
        ...

    def attention(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: Any) -> Tensor:
        """Normed x (B, n, X), rope (cos, sin), mask (B|1, 1, n, S) bool -> (B, n, H) after o_proj."""
        ...

    def mlp(self, h: Tensor) -> Tensor:
        """Normed h (B, n, H) -> (B, n, H)."""
        ...

    def layer(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: Any) -> Tensor:
        """The whole pre-norm layer on x (B, n, H) -> (B, n, H)."""
        ...


DROP_BLOCK_KEYS = (
    "architectures",
    "layer_types",
    "specdraft_source",
    "quantization_config",
    "auto_map",
    "dtype",
    "torch_dtype",
    "id2label",
    "label2id",
)


def block_config_of(target: PreTrainedModel) -> dict[str, Any]:
    """The target's text config as a plain dict (model_type + sizes), from which one decoder block is rebuilt."""
    cfg = target.config.get_text_config(decoder=True).to_dict()
    return {k: v for k, v in cfg.items() if k not in DROP_BLOCK_KEYS and not k.startswith("_")}


def target_block(block_config: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
    """One decoder layer of the target's own type (GQA, biases, norms as the target) and its rotary embedding.

    Built through `AutoModel.from_config` on a 1-layer, 1-token copy of the config, so any HF decoder family
    with `layers[0]` and `rotary_emb` works. Attention is SDPA (`models/attention.py`'s grouped-query variant),
    which takes our boolean tree masks.
    """
    kwargs = dict(block_config)
    kwargs.update(
        num_hidden_layers=1,
        vocab_size=1,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        use_sliding_window=False,
    )
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    base = AutoModel.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    use_gqa_sdpa(base)  # grouped heads without repeat_kv for masked multi-token queries (models/attention.py)
    return base.layers[0], base.rotary_emb


def causal_tree_mask(n_queries: int, n_keys: int, device: torch.device) -> Tensor:
    """Boolean (n_queries, n_keys) mask where the last n_queries keys are the queries themselves (causal)."""
    past = n_keys - n_queries
    q = torch.arange(n_queries, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    return k <= q + past


def unroll_mask(length: int, step: int, device: torch.device) -> Tensor:
    """TTT attention mask of unroll step `step`: (L, L*(step+1)) = [causal | eye | ... | eye] (True = attend)."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def smooth_l1_feature_loss(pred: Tensor, target: Tensor) -> Tensor:
    """EAGLE-1 feature regression: mean smooth-L1 between predicted and true features, (N, H) -> scalar."""
    return F.smooth_l1_loss(pred.float(), target.float())


def soft_cross_entropy(logits: Tensor, target_probs: Tensor, valid: Tensor | None = None) -> Tensor:
    """-sum_v p(v) log q(v), averaged over valid rows.

    Args:
        logits: (N, V) drafter logits q.
        target_probs: (N, V) teacher probabilities p (rows sum to 1).
        valid: (N,) bool rows that count (None: all).

    Returns:
        scalar float32 (0 when no row is valid).
    """
    ce = -(target_probs.float() * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # (N,)
    if valid is None:
        return ce.mean()
    vf = valid.float()
    return (ce * vf).sum() / vf.sum().clamp_min(1.0)


def select_positions(batch: dict[str, Tensor], opts: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """Trainable (b, t) pairs: `pos_mask`, x_{t+1} in the sequence and equal to the root; random cap.

    Returns:
        b, t: (N,) long each.
    """
    ids, pos = batch["input_ids"], batch["pos_mask"].clone()  # (B, L)
    pos[:, -1] = False
    pos[:, :-1] &= batch["root"][:, :-1] == ids[:, 1:]  # EAGLE reads the sequence's own next token
    sel = pos.nonzero()  # (N, 2)
    cap = opts.get("max_positions")
    if cap and sel.shape[0] > cap:
        keep = torch.randperm(sel.shape[0], generator=opts.get("generator"))[:cap].sort().values
        sel = sel[keep.to(sel.device)]
    return sel[:, 0], sel[:, 1]


def chain_labels(batch: dict[str, Tensor], b: Tensor, t: Tensor, steps: int) -> Tensor:
    """Labels of the S unrolled slots for the acceptance (LK) loss: `targets`, with -100 from the first slot
    whose inputs leave the label chain (the unroll feeds the sequence's own tokens x_{t+1+i}; labels may be
    greedy continuations of other text, `distill.regenerate=false`) or whose token lies past the sequence.

    Args:
        batch: `input_ids` (B, L), `root` (B, L), `targets` (B, L, D); b, t: (N,) selected positions.

    Returns:
        (N, S) long.
    """
    ids, targets = batch["input_ids"], batch["targets"][b, t, :steps]  # (B, L), (N, S)
    pos = t[:, None] + 1 + torch.arange(steps, device=t.device)  # (N, S) position of x_{t+1+i}
    text = ids[b[:, None], pos.clamp_max(ids.shape[1] - 1)]  # (N, S)
    ok = follows_own_text(text, batch["root"][b, t], targets) & (pos < ids.shape[1])
    return targets.masked_fill(~ok, -100)


def next_tokens(input_ids: Tensor, steps: int) -> Tensor:
    """(B, L) -> (B, L + steps - 1) with column t = x_{t+1} (0-padded past the end): step i reads [:, i:i+L]."""
    b, n = input_ids.shape
    out = input_ids.new_zeros(b, n + steps - 1)
    out[:, : n - 1] = input_ids[:, 1:]
    return out


class Borrowed:
    """The target's embedding / LM head, hidden from `state_dict` and cached per dtype for the drafter."""

    def __init__(self) -> None:
        self.modules: dict[str, nn.Module] = {}
        self._cast: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        # per cached `rows`: the ids it holds and what they derive from (`rows(..., source=)`)
        self._rows: dict[tuple[str, torch.dtype, torch.device], tuple[Tensor, Hashable | None]] = {}

    def set(self, name: str, module: nn.Module) -> None:
        self.modules[name] = module
        self._cast = {k: v for k, v in self._cast.items() if not k[0].startswith(name)}

    def weight(self, name: str, like: Tensor) -> Tensor:
        """The borrowed module's weight in `like`'s dtype/device (cast once, then cached)."""
        if name not in self.modules:
            raise RuntimeError(
                f"the drafter has no borrowed `{name}` of the target: call `attach(model, target)` after loading"
            )
        key = (name, like.dtype, like.device)
        if key not in self._cast:
            self._cast[key] = (
                cast(Tensor, self.modules[name].weight).detach().to(device=like.device, dtype=like.dtype)
            )
        return self._cast[key]

    def rows(
        self, name: str, like: Tensor, ids: Tensor | Callable[[], Tensor], source: Hashable | None = None
    ) -> Tensor:
        """`weight(name, like)[ids]`, cached for a fixed `ids` (e.g. EAGLE's draft vocabulary).

        With `source` (what `ids` derives from, e.g. `layers.weights_key` of the `d2t` buffer) the cache is kept while the
        source is the same, without reading `ids` (`ids` may then be a callable, called on a miss only): no host
        sync, so a CUDA graph can capture the draft step. Without it `ids` is compared with the cached one (a
        host read on a GPU)."""
        key = (f"{name}[rows]", like.dtype, like.device)
        hit, (had, had_source) = self._cast.get(key), self._rows.get(key, (None, None))
        if hit is not None and source is not None and had_source == source:
            return hit
        wanted = ids() if callable(ids) else ids
        if hit is None or had is None or not torch.equal(had, wanted):
            self._cast[key] = hit = self.weight(name, like)[wanted.to(like.device)]
        self._rows[key] = (wanted.clone(), source)
        return hit


def row_slots(b: Tensor, bsz: int) -> tuple[Tensor, int]:
    """Slot of every selected position within its row, and the most positions any row has.

    Args:
        b: (N,) long row of each selected position (any order).
        bsz: B, the number of rows.

    Returns:
        slot: (N,) long, 0..count(row)-1 in the order the positions appear; M: max count over rows.
    """
    counts = torch.bincount(b, minlength=bsz)  # (B,)
    order = torch.sort(b, stable=True).indices  # (N,) grouped by row, original order inside a row
    starts = torch.cumsum(counts, 0) - counts  # (B,)
    slot = torch.empty_like(b)
    slot[order] = torch.arange(b.shape[0], device=b.device) - starts[b[order]]
    return slot, int(counts.max()) if b.numel() else 0


def _step0_inputs(head: EagleDrafter | Eagle3Drafter, feats: Tensor, noise: float) -> Tensor:
    """(B, L, F) target features -> (B, L, H) step-0 inputs: `encode_target`, plus uniform noise of half-width
    `noise` when > 0."""
    h = head.encode_target(feats)  # (B, L, H)
    return h + (torch.rand_like(h) * 2 - 1) * noise if noise > 0 else h


def _grad_for_step(i: int, grad_steps: int | None) -> torch.autograd.grad_mode.set_grad_enabled:
    """Autograd for unroll step i: on when it is on outside and i < grad_steps (None: every step)."""
    return torch.set_grad_enabled(torch.is_grad_enabled() and (grad_steps is None or i < grad_steps))


def unroll(
    head: EagleDrafter | Eagle3Drafter,
    feats: Tensor,
    tokens: Tensor,
    steps: int = 1,
    grad_steps: int | None = None,
    noise: float = 0.0,
    at: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Training-time-test unroll of an EAGLE head over whole sequences (see the module docstring).

    Args:
        head: exposes `encode_target` and `step` (EagleDrafter, Eagle3Drafter).
        feats: (B, L, F) target features of every position (F = H for EAGLE-1, the fused width for EAGLE-3).
        tokens: (B, L + steps - 1) long, column j = x_{j+1} (`next_tokens`).
        steps: unroll steps S (1 = teacher forcing only).
        grad_steps: steps run with autograd (None: all); later ones run under no_grad (metrics only).
        noise: uniform noise half-width added to the step-0 input features.
        at: (b, t), (N,) long each: unroll only these positions past step 0 (`unroll_at`), same values.

    Returns:
        (B, L, S, H): the output of step i at position t predicts the feature at t + 1 + i;
        with `at`: (N, S, H), row n = position (b[n], t[n]).
    """
    if at is not None:
        return unroll_at(head, feats, tokens, at, steps, grad_steps, noise)
    bsz, length = feats.shape[:2]
    h = _step0_inputs(head, feats, noise)  # (B, L, H)
    cache, outs = DynamicCache(), []
    pos = torch.arange(length, device=h.device)[None].expand(bsz, -1)  # (B, L)
    for i in range(steps):
        with _grad_for_step(i, grad_steps):
            mask = unroll_mask(length, i, h.device)  # (L, L*(i+1))
            h = head.step(h, tokens[:, i : i + length], cache, pos + i, mask)  # (B, L, H)
        outs.append(h)
    return torch.stack(outs, dim=2)


def unroll_at(
    head: EagleDrafter | Eagle3Drafter,
    feats: Tensor,
    tokens: Tensor,
    at: tuple[Tensor, Tensor],
    steps: int = 1,
    grad_steps: int | None = None,
    noise: float = 0.0,
) -> Tensor:
    """`unroll(...)[b, t]` without unrolling the positions nobody scores.

    Step 0 runs causally over whole sequences (every later step reads its keys). Under the TTT mask a step
    i >= 1 query at t sees step 0's keys <= t and only its own keys of steps 1..i, so steps >= 1 run on the
    selected positions alone: per row its M query slots (padded; a pad query sits at t = 0 and is dropped),
    keys [step 0: L | step 1: M | ... | step i: M] under a (B, 1, M, L + M*i) mask. Attention and MLP cost
    of those steps falls from L to M queries per row and the keys from L*(i+1) to L + M*i.

    Args:
        at: (b, t), (N,) long each: the selected positions; other arguments as `unroll`.

    Returns:
        (N, S, H): row n = `unroll(...)[b[n], t[n]]` (equal up to floating-point summation order).
    """
    b, t = at
    bsz, length = feats.shape[:2]
    dev = feats.device
    h = _step0_inputs(head, feats, noise)  # (B, L, H)
    cache = DynamicCache()
    pos = torch.arange(length, device=dev)[None].expand(bsz, -1)  # (B, L)
    with _grad_for_step(0, grad_steps):
        h = head.step(h, tokens[:, :length], cache, pos, unroll_mask(length, 0, dev))  # (B, L, H)
    outs = [h[b, t]]  # (N, H) each
    if steps == 1:
        return torch.stack(outs, dim=1)
    slot, m = row_slots(b, bsz)  # (N,), M
    qt = torch.zeros(bsz, m, dtype=torch.long, device=dev)  # (B, M) query positions (pads: 0)
    qt[b, slot] = t
    rows = torch.arange(bsz, device=dev)[:, None]  # (B, 1)
    past = torch.arange(length, device=dev)[None, None, :] <= qt[:, :, None]  # (B, M, L) step 0, causal
    eye = torch.eye(m, dtype=torch.bool, device=dev)[None].expand(bsz, -1, -1)  # (B, M, M)
    h = h[rows, qt]  # (B, M, H) step 0's outputs at the query positions: step 1's inputs
    for i in range(1, steps):
        with _grad_for_step(i, grad_steps):
            mask = torch.cat([past] + [eye] * i, dim=2)[:, None]  # (B, 1, M, L + M*i)
            tok = tokens.gather(1, qt + i)  # (B, M) column t + i = x_{t+1+i}
            h = head.step(h, tok, cache, qt + i, mask)  # (B, M, H)
        outs.append(h[b, slot])
    return torch.stack(outs, dim=1)


def common_config(schema: Any, target: PreTrainedModel, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Config fields shared by EAGLE-1 and EAGLE-3 heads, from the `drafter` schema and the target."""
    return dict(
        base_model_name_or_path=str(fingerprint["name_or_path"]),
        base_revision=fingerprint.get("revision"),
        base_hidden_size=int(fingerprint["hidden_size"]),
        vocab_size=int(fingerprint["vocab_size"]),
        tokenizer_hash=str(fingerprint["tokenizer_hash"]),
        block_config=block_config_of(target),
        draft_len=int(schema.draft_len),
        tree_total_tokens=int(schema.tree_total_tokens),
        tree_depth=int(schema.tree_depth),
        tree_top_k=int(schema.tree_top_k),
    )
