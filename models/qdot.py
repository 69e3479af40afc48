"""Q8 activations: a GGUF target's 4- and 8-bit products computed as a GGUF runtime computes them on a CPU.

`exact_panels` multiplies a dequantised GGUF weight in fp32, bit for bit what `nn.Linear` gives; every extra row a
tree verify feeds costs another fp32 FMA per weight. llama.cpp instead quantises each activation row to int8 per
block of 32 inputs and sums integer products (Q4_1 x Q8_1): 4 inputs x 16 outputs per AVX-512 VNNI instruction.
With `SPECDRAFT_Q8_ACTIVATIONS=1` (or `base_model.q8_activations=true`) the target's 4- and 8-bit exact stores
are laid out for that (`to_dot`) and `panel_linear.c` hands them to `qdot.c`, whose arithmetic is spelled out at
its top and by `reference_product` here.

This changes the target: its logits are those of the same weights with int8 activations, as llama.cpp's, not
fp32's (docs/experiments.md, session 51, measures how often the greedy tokens differ). Every decode path of a run
uses the same products (AR, tree verify, batches: a row's result does not depend on the rows beside it), so
speculative decoding stays lossless against this target's own greedy output. Off by default.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from specdraft.models.exact_panels import BLOCK, PANEL, QDOT, ExactPanels, unpair

__all__ = ["QDOT", "enabled", "integers", "quantise", "reference_product", "set_vnni", "to_dot"]


def enabled() -> bool:
    """Whether 4- and 8-bit exact stores take int8 activations (`SPECDRAFT_Q8_ACTIVATIONS`, default off)."""
    return os.environ.get("SPECDRAFT_Q8_ACTIVATIONS", "0").strip().lower() in ("1", "true", "yes", "on")


def integers(store: ExactPanels) -> Tensor:
    """(P, K, 16) uint8: the unsigned integer u of every weight of a "q4" / "q8" store (any layout)."""
    p, k = store.shape
    if store.dot:
        if store.kind == "q8":
            return store.q.view(p, k // 4, PANEL, 4).transpose(2, 3).reshape(p, k, PANEL)
        b = store.q.view(p, k // 8, PANEL, 4)
        lo, hi = b & 15, b >> 4  # (P, K/8, 16, 4): inputs 8h + t and 8h + 4 + t
        return torch.stack([lo, hi], 2).transpose(3, 4).reshape(p, k, PANEL)
    q = unpair(store).q
    if store.kind == "q4":
        return torch.cat([q & 15, q >> 4], -1)  # (P, K, 16): columns 0-7 low nibbles, 8-15 high
    return q


def to_dot(store: ExactPanels) -> ExactPanels:
    """A "q4" / "q8" store (paired or not) in qdot.c's layout, its tables as they are (fp16 where every entry is
    one: `ExactPanels.code` + 1); any other store as it is."""
    if store.dot or store.kind not in ("q4", "q8"):
        return store
    flat = unpair(store)
    p, k = flat.shape
    u = integers(flat)  # (P, K, 16)
    if store.kind == "q8":
        q = u.view(p, k // 4, 4, PANEL).transpose(2, 3)  # (P, K/4, 16, 4): byte [g][c][t] = u[c][4g + t]
    else:
        v = u.view(p, k // 8, 2, 4, PANEL)  # [h][half][t][c]
        q = (v[:, :, 0] | (v[:, :, 1] << 4)).transpose(2, 3)  # (P, K/8, 16, 4)
    q = q.reshape(p, k, -1).contiguous()  # (P, K, 16) or (P, K, 8): the store's own shapes
    return ExactPanels(q, flat.d.contiguous(), flat.m.contiguous(), store.kind, dot=True)


def quantise(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (M, K) fp32 -> (q (M, K/32, 32) int64 within +-127, dx (M, K/32) fp32, sx (M, K/32) fp32): per block of
    32 inputs dx = amax / 127, q = round-half-even(x * (1 / dx)) (0 where amax is 0), sx = sum(q) * dx."""
    m, k = x.shape
    xb = x.view(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)  # (M, K/32)
    dx = amax / 127.0
    inv = torch.where(amax > 0, 1.0 / dx, torch.zeros_like(dx))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    sx = q.sum(-1) * dx  # sums of at most 32 x 127: exact in fp32
    return q.long(), dx, sx


def reference_product(x: Tensor, store: ExactPanels, out_features: int, bias: Tensor | None) -> Tensor:
    """qdot.c's arithmetic in torch: x (M, K) fp32 @ W.T + bias -> (M, out_features), the kernel's bits (slow;
    for tests)."""
    q, dx, sx = quantise(x)
    u = integers(store).long()  # (P, K, 16)
    p, k = store.shape
    w = u.permute(0, 2, 1).reshape(p * PANEL, k // BLOCK, BLOCK)[:out_features]  # (N, K/32, 32)
    isum = torch.einsum("mjt,njt->mnj", q, w).float()  # (M, N, K/32): exact (|I| < 2^24)
    d, mn = (t.float().permute(0, 2, 1).reshape(p * PANEL, -1)[:out_features] for t in (store.d, store.m))
    acc = torch.zeros(x.shape[0], out_features)
    for j in range(k // BLOCK):
        acc = acc + isum[:, :, j] * (d[None, :, j] * dx[:, j, None])
        acc = acc + mn[None, :, j] * sx[:, j, None]
    return acc + bias if bias is not None else acc


def set_vnni(on: bool) -> bool:
    """Run the kernel library's AVX-512 paths, qdot.c's VNNI one among them, where the CPU has them (`on`, the
    default; `SPECDRAFT_AVX512=0` starts a process without them) or its AVX2 paths (the same bits): one switch,
    `exact_panels.set_avx512`. Returns whether the VNNI path runs now."""
    from specdraft.models.exact_panels import set_avx512
    from specdraft.models.panel_linear import panel_lib

    set_avx512(on)
    lib = panel_lib()
    return bool(lib.sd_qdot_vnni()) if lib is not None else False
