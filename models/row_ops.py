"""A decoder layer's per-row steps on a CPU in fp32 as one kernel call each (`row_ops.c`, built with the panel
kernel): the RMSNorm, the residual add with the norm after it, the rotary embedding of q and k in place, the
gated activation silu(gate) * up, and a decode step's attention over the cache (every query alone over its
visible keys in order: a tree node and the AR step at its position get the same bits).

A decode step's torch ops are mostly dispatch on a CPU: on a 2-core EPYC an RMSNorm of one 576-wide row took
~25-40 us (six ops in torch's composite), a rotary embedding ~23 us, while the arithmetic is well under a
microsecond. `models/fast_target.py` calls these where the target's products run the panel kernel (its
`_stacks`), unless `SPECDRAFT_ROW_OPS=0`. Each row is computed alone in a fixed order, so a row's outputs do not
depend on the other rows (AR, tree verify and batches agree bit for bit); the rotary embedding equals
transformers' bit for bit, the norm and the activation to rounding (another summation order, libm's expf).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

ENV = "SPECDRAFT_ROW_OPS"  # "0": torch's ops (an A/B, a way out)
MAX_HEAD_DIM = 1024  # row_ops.c rotates a head through a stack buffer of this many floats


def wanted() -> bool:
    """Whether the row kernels may be used (`SPECDRAFT_ROW_OPS` is not "0")."""
    return os.environ.get(ENV, "1") != "0"


@lru_cache(maxsize=1)
def row_lib() -> ctypes.CDLL | None:
    """The kernel library with the row functions declared, or None where the panel kernel does not build."""
    from specdraft.models.panel_linear import panel_lib

    lib = panel_lib()
    if lib is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.sd_rms_norm.argtypes = [ptr, i64, i64, ptr, f32, ptr]
    lib.sd_add_rms_norm.argtypes = [ptr, ptr, i64, i64, ptr, f32, ptr, ptr]
    lib.sd_rope_rows.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64]
    lib.sd_silu_mul.argtypes = [ptr, ptr, i64, i64, i64, ptr]
    lib.sd_attention.argtypes = [ptr, *[i64] * 3, ptr, *[i64] * 3, ptr, *[i64] * 3, ptr, *[i64] * 8, f32, ptr]
    lib.sd_attention.argtypes.append(ctypes.c_int)
    for fn in (lib.sd_rms_norm, lib.sd_add_rms_norm, lib.sd_rope_rows, lib.sd_silu_mul, lib.sd_attention):
        fn.restype = None
    return lib


def _lib() -> ctypes.CDLL:
    lib = row_lib()
    if lib is None:
        raise RuntimeError("the row kernels need the panel kernel library, which is not available here")
    return lib


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / sqrt(mean(x^2) + eps) per row: x (..., H) fp32 contiguous, weight (H,) -> (..., H)."""
    h = x.shape[-1]
    y = torch.empty_like(x)
    _lib().sd_rms_norm(x.data_ptr(), x.numel() // h, h, weight.data_ptr(), eps, y.data_ptr())
    return y


def add_rms_norm(x: Tensor, a: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(s, rms_norm(s)) with s = x + a: x, a (..., H) fp32 contiguous of one shape, weight (H,)."""
    h = x.shape[-1]
    s, y = torch.empty_like(x), torch.empty_like(x)
    _lib().sd_add_rms_norm(
        x.data_ptr(), a.data_ptr(), x.numel() // h, h, weight.data_ptr(), eps, s.data_ptr(), y.data_ptr()
    )
    return s, y


def rope_(t: Tensor, heads: int, head_dim: int, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate the first `heads` heads of every row of t (M, W) fp32 in place: t * cos + roll(t, d/2) *
    signed_sin (`fast_target.rotate`, bit for bit), with tables (R, head_dim) contiguous, row r of t using table
    row r % R (R = M: a table per row; R = L: one per position, shared by a batch's rows). Returns t."""
    if t.dim() != 2 or t.stride(1) != 1 or heads * head_dim > t.shape[1]:
        raise ValueError(
            f"rope_: t must be (M, W >= heads * head_dim) with unit column stride, got {tuple(t.shape)}"
        )
    if head_dim > MAX_HEAD_DIM or head_dim % 2:
        raise ValueError(f"rope_: head_dim {head_dim} (even, at most {MAX_HEAD_DIM})")
    _lib().sd_rope_rows(
        t.data_ptr(),
        t.shape[0],
        t.stride(0),
        heads,
        head_dim,
        cos.data_ptr(),
        signed_sin.data_ptr(),
        cos.shape[0],
    )
    return t


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up: gate, up (M, N) fp32 with unit column stride and one row stride (e.g. the two halves of
    one gate/up product) -> (M, N) contiguous."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.stride() != up.stride() or gate.stride(1) != 1:
        raise ValueError(
            "silu_mul: gate and up must be (M, N) of one shape and one stride, columns contiguous"
        )
    out = torch.empty(gate.shape, dtype=gate.dtype)
    _lib().sd_silu_mul(
        gate.data_ptr(), up.data_ptr(), gate.shape[0], gate.shape[1], gate.stride(0), out.data_ptr()
    )
    return out


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor | None:
    """softmax(q k^T * scale + mask) v per query, each query alone over its visible keys in order (row_ops.c);
    None where the kernel does not take these inputs (the caller runs torch's attention).

    Args:
        q: (B, Hq, L, d) fp32, d a multiple of 8, the last dimension contiguous (any other strides).
        k, v: (B, Hkv, S, d) fp32 likewise, Hq a multiple of Hkv (query head h reads key/value head
            h // (Hq / Hkv)).
        mask: None (every key visible) or (B or 1, 1, L or 1, S) fp32 additive, last dimension contiguous; a
            value at or below -1e30 hides the key.
        scale: the score scale (1 / sqrt(d) unless the model says otherwise).

    Returns:
        (B, L, Hq, d) contiguous (zeros for a query that sees no key), or None.
    """
    b, hq, n, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qs, kst, vst = q.stride(), k.stride(), v.stride()  # one call each: this runs ~30 times a decode step
    if qs[3] != 1 or kst[3] != 1 or vst[3] != 1 or d % 8 or hq % hkv or q.dtype != torch.float32:
        return None
    if k.dtype != torch.float32 or v.dtype != torch.float32:
        return None
    mp, mb, ml = None, 0, 0
    if mask is not None:
        ms = mask.stride()
        mshape = mask.shape
        if mask.dtype != torch.float32 or ms[3] != 1 or mshape[1] != 1 or mshape[3] != s:
            return None
        if mshape[0] not in (1, b) or mshape[2] not in (1, n):
            return None
        mp, mb, ml = mask.data_ptr(), ms[0] if mshape[0] > 1 else 0, ms[2] if mshape[2] > 1 else 0
    out = torch.empty(b, n, hq, d, dtype=torch.float32)
    _attention()(
        q.data_ptr(), qs[0], qs[1], qs[2], k.data_ptr(), kst[0], kst[1], kst[2],
        v.data_ptr(), vst[0], vst[1], vst[2], mp, mb, ml,
        b, hq, hkv, n, s, d, scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


@lru_cache(maxsize=1)
def _attention() -> Any:
    """The kernel's `sd_attention` (looked up once: a decode step calls it once per layer)."""
    return _lib().sd_attention
