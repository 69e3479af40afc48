"""Small building blocks shared by drafter families."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

T = TypeVar("T")


def rows_per_chunk(rows: int | None, logits: Tensor) -> int:
    """Rows of (R, V) `logits` per chunk for the chunked passes over logits (`models.losses.distill_loss`,
    `copy_lookup.mix_logits`): `rows` when given, else ~1M logits on CPU (they stay in cache; the fastest here for
    V = 16,384) and ~16M on an accelerator (where each chunk is a few kernel launches)."""
    if rows is None:
        rows = (1 << 20 if logits.device.type == "cpu" else 1 << 24) // logits.shape[-1]
    return max(1, int(rows))


class ZeroInitLinear(nn.Linear):
    """A Linear that a drafter's `_init_weights` starts at zero (so a residual block starts as the identity)."""


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W, b zero-initialised: the identity at the start (Medusa / ReDrafter)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = ZeroInitLinear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., dim) -> (..., dim)."""
        return x + F.silu(self.linear(x))


def check_target_layers(layers: list[int], n_layers: int, distinct: bool = False) -> None:
    """Refuse `drafter.target_layers` (HF `hidden_states` indices, 0 = embeddings) outside [0, n_layers], and
    repeated indices when `distinct` (ReDrafter concatenates each once; EAGLE-3 accepts repeats)."""
    if any(not 0 <= i <= n_layers for i in layers) or (distinct and len(set(layers)) != len(layers)):
        what = "indices must be distinct and in" if distinct else "every index must be in"
        raise ValueError(f"drafter.target_layers={layers}: {what} [0, {n_layers}] (0 = embeddings)")


def check_draft_vocab(vd: int, vocab_size: int, field: str = "draft_vocab_size") -> int:
    """`vd` if a draft vocabulary of that size fits the target's (1 <= Vd <= V), else a ValueError naming `field`
    (a config key: `drafter.draft_vocab_size` from a training config, `draft_vocab_size` from an export's)."""
    if not 0 < vd <= vocab_size:
        raise ValueError(f"{field}={vd} must be in [1, vocab_size={vocab_size}]")
    return vd


def draft_vocab_ids(draft_vocab_size: int | None, vocab_size: int, token_counts: Tensor | None) -> Tensor:
    """The target ids of a reduced draft vocabulary (ReDrafter, EAGLE-3): the most frequent training labels.

    Args:
        draft_vocab_size: Vd (`drafter.draft_vocab_size`; None or 0: the full vocabulary).
        vocab_size: V of the target.
        token_counts: (V,) training-label frequencies; required when Vd < V.

    Returns:
        (Vd,) long, ascending (arange(V) for the full vocabulary).
    """
    vd = check_draft_vocab(int(draft_vocab_size or vocab_size), vocab_size, "drafter.draft_vocab_size")
    if vd == vocab_size:
        return torch.arange(vocab_size)
    if token_counts is None:
        raise ValueError(
            f"drafter.draft_vocab_size={vd} < vocab_size={vocab_size} needs training token counts"
        )
    return token_counts.topk(vd).indices.sort().values


def scatter_to_vocab(logits: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    """Draft-vocabulary logits (..., Vd) -> (..., V) for metrics in target ids: tokens outside the draft
    vocabulary are never drafted, so they get the row minimum - 20 (never a top-k hit, finite CE)."""
    full = (logits.min(-1, keepdim=True).values - 20.0).expand(*logits.shape[:-1], vocab_size).clone()
    full[..., ids.to(logits.device)] = logits
    return full


class PrefixAttention(nn.Module):
    """Multi-head attention from a draft slot's state to the committed prefix (a ReDrafter extension).

    Keys and values are computed once per committed position (`memory`), after a zero "sink" slot that every
    query may attend to: it lets a query read nothing (and keeps rows with no visible position finite). The sink
    is part of the memory, so a call copies nothing. The output projection starts at zero, so adding the module
    to a trained drafter leaves its logits unchanged at first.
    """

    def __init__(self, q_dim: int, k_dim: int, v_dim: int, width: int, heads: int, out_dim: int) -> None:
        super().__init__()
        if heads < 1 or width % heads:
            raise ValueError(f"context attention: width={width} must be a positive multiple of heads={heads}")
        self.heads = heads
        self.q = nn.Linear(q_dim, width)
        self.k = nn.Linear(k_dim, width)
        self.v = nn.Linear(v_dim, width)
        self.out = ZeroInitLinear(width, out_dim)

    def memory(self, k_in: Tensor, v_in: Tensor, sink: bool = True) -> tuple[Tensor, Tensor]:
        """k_in (..., M, Kd), v_in (..., M, Vd) -> keys, values (..., 1 + M, A) with the sink first (A = width);
        (..., M, A) with `sink=False`, to append to a memory that has it."""
        keys, values = self.k(k_in), self.v(v_in)  # (..., M, A)
        if not sink:
            return keys, values
        zero = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])  # (..., 1, A)
        return torch.cat([zero, keys], dim=-2), torch.cat([zero.to(values), values], dim=-2)

    def forward(
        self,
        q_in: Tensor,
        keys: Tensor,
        values: Tensor,
        mask: Tensor | None = None,
        rows: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """q_in (..., n, Qd); keys/values (..., 1 + M, A) from `memory` (the sink first); mask (..., n, 1 + M)
        bool (True = visible; column 0, the sink, must be True; None: all) -> (..., n, out_dim).

        With `rows` = (row (N,), rank (N,)) the queries come flat, q_in (1, N, Qd), and query i attends to
        row `row[i]` of keys/values (B, 1 + M, A) under mask[row[i], rank[i]] ((B, n, 1 + M)): training batches
        keep only a subset of each row's positions, so only the attention runs in the padded (B, n) layout.
        """
        q = self.q(q_in)  # (..., n, A)
        if rows is not None:
            assert mask is not None  # the padded layout comes with its mask
            pad = q.new_zeros(*mask.shape[:-1], q.shape[-1])  # (B, n, A)
            pad[rows] = q[0]
            q = pad

        def split(x: Tensor) -> Tensor:  # (..., len, A) -> (B', heads, len, A / heads)
            x = x.unflatten(-1, (self.heads, -1)).transpose(-3, -2)  # (..., heads, len, A / heads)
            # 4-D for the fused CPU kernel: a 3-D call (decoding: no batch dim) takes the math path, ~10x slower
            return x.reshape(-1, *x.shape[-3:]) if x.dim() != 4 else x

        q, k, v = split(q.to(keys.dtype)), split(keys), split(values.to(keys.dtype))
        if mask is not None:
            mask = mask.reshape(-1, 1, *mask.shape[-2:])  # (B', 1, n, 1 + M): one mask for all heads
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B', heads, n, A / heads)
        out = out.transpose(-3, -2).flatten(-2)  # (B', n, A)
        out = (
            out.reshape(*q_in.shape[:-2], *out.shape[-2:]) if rows is None else out[rows][None]
        )  # (..., n, A)
        return self.out(out)  # (..., n, out_dim)


def weights_key(*weights: Tensor) -> tuple[tuple[int, int, torch.dtype], ...]:
    """What identifies the values of `weights` for a cached copy: storage, in-place version and dtype (a copy
    keyed by it is rebuilt after training, a move or a cast). Inference tensors (made under
    `inference_mode`) have no version counter and cannot change in place: version 0."""
    return tuple((w.data_ptr(), 0 if w.is_inference() else w._version, w.dtype) for w in weights)


class CopyCache(Generic[T]):
    """Decode-time copies derived from modules' weights (int8 products, fused blocks), one per module, shared by
    every proposer of it (a batch of B rows makes B proposers) and rebuilt when the copy's `key` (e.g.
    `weights_key` of what it was built from) changes; a module that is freed drops its copy."""

    def __init__(self) -> None:
        self._hits: weakref.WeakKeyDictionary[nn.Module, tuple[Hashable, T]] = weakref.WeakKeyDictionary()

    def get(self, owner: nn.Module, key: Hashable, build: Callable[[], T]) -> T:
        """The copy of `owner` built for `key`: the cached one, else `build()` (then cached)."""
        hit = self._hits.get(owner)
        if hit is None or hit[0] != key:
            hit = (key, build())
            self._hits[owner] = hit
        return hit[1]


def d2t_draft_ids(d2t: Tensor, reduced: bool) -> Tensor:
    """(Vd,) long target id of every draft-vocabulary entry, from the offsets `d2t` (Vd,) (arange when full)."""
    ar = torch.arange(d2t.shape[0], device=d2t.device)
    return d2t + ar if reduced else ar


_D2T_TABLES: CopyCache[Tensor] = CopyCache()


def d2t_to_draft_ids(
    ids: Tensor,
    d2t: Tensor,
    reduced: bool,
    vocab_size: int,
    missing: int = -100,
    owner: nn.Module | None = None,
) -> Tensor:
    """Target ids (...) -> draft ids (...); ids < 0 and tokens outside the draft vocabulary -> `missing`.

    Without a reduced vocabulary a draft id is its target id (no table). With one, the (V,) target -> draft
    table is built per call, or once per `owner` (the drafter holding `d2t`; rebuilt when `d2t` changes), so a
    decode step (the ReDrafter's copy gate maps its candidates every slot) costs a lookup, not a V-sized fill
    and scatter."""
    dev, vd = d2t.device, d2t.shape[0]
    clamped = ids.clamp(0, vocab_size - 1).to(dev)
    if not reduced:  # d2t_draft_ids is arange: the first Vd target ids are their own draft ids
        keep = (ids.to(dev) >= 0) & (clamped < vd)
        return torch.where(keep, clamped, missing).to(ids.device)

    def table() -> Tensor:
        with torch.inference_mode(False):  # an ordinary tensor, usable in training and decoding alike
            lut = torch.full((vocab_size,), missing, dtype=torch.long, device=dev)
            lut[d2t_draft_ids(d2t, reduced)] = torch.arange(vd, device=dev)
        return lut

    lut = table() if owner is None else _D2T_TABLES.get(owner, (weights_key(d2t), vocab_size, missing), table)
    return torch.where(ids.to(dev) < 0, missing, lut[clamped]).to(ids.device)


def replace_linears(
    model: nn.Module,
    make: Callable[[nn.Linear], nn.Module],
    where: Callable[[nn.Linear], bool] = lambda linear: True,
) -> int:
    """Replace, in place, every `nn.Linear` under `model` for which `where(linear)` holds by `make(linear)`
    (the weight layouts of `models.linear_layout` / `models.panel_linear`); returns how many."""
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and where(child):
                setattr(parent, name, make(child))
                done += 1
    return done
