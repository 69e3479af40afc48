"""A decoder layer's elementwise stretches as one compiled kernel each (`torch.compile`), for the lean target
forward on a GPU (`models/fast_target.py`).

Inside a CUDA graph a decode step of a small target is bound by its kernel count, not its arithmetic: SmolLM2-135M's
one-token verify replays ~30 kernels a layer in ~2.9 ms on an H100 (session 43), ~3 us each. Between a layer's
products, eager torch runs every elementwise op as its own kernel (bf16: an RMSNorm is a cast, the fused norm, a
cast back and the weight's product; the rotary embedding four; the gate two). Compiled by inductor, each stretch is
one kernel:

    norm(x)                   w * rms_norm(x in fp32).to(x.dtype)                      4 kernels -> 1
    rotate(heads, n, cos, s)  q and k rotated together (`fast_target.rotate`)          4 kernels -> 1
    add_norm(x, o)            x + o, then norm of it                                  5 kernels -> 1
    silu_mul(gate_up)         SiLU(gate) * up over the stacked gate|up product         2 kernels -> 1

so a layer makes ~13 kernels instead of ~24 (after `stacked_linear`'s merged products). The functions are compiled
once each with a dynamic row count (`dynamic=True`: every node budget and batch reuses them), on their first call,
which the decoders make in a CUDA graph's warm-up runs, never inside a capture. Inductor computes a stretch in fp32
without rounding its intermediates to bf16, so outputs equal eager ones to rounding (the decoders' verify and AR
steps run the same kernels, so decoding stays lossless against their AR).

`SPECDRAFT_FUSED_OPS=on` turns them on (default `off`). Not measured on a GPU yet, so not the default there: the
next GPU run's A/B is `scripts/bench_target_forward.py --device cuda --dtype bf16 --compare fused` (docs/gpu.md).
On a CPU they are slower (bf16 native layout, 2-core EPYC: 1.17-1.20x the eager ops' verify time, each compiled
call's guards cost more than the ops they replace), so `on` is for GPUs and tests. A compile that fails (no Triton,
no C compiler, an inductor error) turns the stretch back to eager for the process, said once on stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ENV = "SPECDRAFT_FUSED_OPS"


def wanted() -> bool:
    """Whether the compiled stretches run: `SPECDRAFT_FUSED_OPS=on` (on any device; default off, see the module
    docstring)."""
    return os.environ.get(ENV, "off").lower() == "on"


def norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm of x (..., H) with weight w (H,): statistics in fp32, the weight in x's dtype."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_norm(x: Tensor, o: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add and the next RMSNorm: (x + o, norm(x + o)), each (..., H)."""
    y = x + o
    return y, norm(y, w, eps)


def rotate_heads(heads: Tensor, n: int, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """The rotary embedding of the first n heads of heads (B, L, heads, d) with tables (B or 1, L, 1, d) (the
    second half of `signed_sin` already negated: `fast_target.rotary_tables`) -> (B, L, n, d)."""
    t = heads.narrow(2, 0, n)
    return t * cos + t.roll(t.shape[-1] // 2, dims=-1) * signed_sin


def silu_mul(gate_up: Tensor, inter: int) -> Tensor:
    """SiLU(gate) * up of a stacked gate|up product (..., 2 I) -> (..., I)."""
    gate, up = gate_up.split((inter, inter), dim=-1)
    return F.silu(gate) * up


class _Compiled:
    """`fn` compiled on its first call (dynamic shapes, one graph); eager from the first failure on."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        self.failed: str | None = None

    def __call__(self, *args: Any) -> Any:
        if self.failed is not None:
            return self.fn(*args)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001  (inductor raises many kinds; any of them means: run eager)
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(
                f"[fused_ops] {self.fn.__name__} runs eagerly: its compile failed ({self.failed})",
                file=sys.stderr,
            )
            return self.fn(*args)


COMPILED: dict[str, Callable[..., Any]] = {
    fn.__name__: _Compiled(fn) for fn in (norm, add_norm, rotate_heads, silu_mul)
}
EAGER: dict[str, Callable[..., Any]] = {fn.__name__: fn for fn in (norm, add_norm, rotate_heads, silu_mul)}


def ops() -> dict[str, Callable[..., Any]]:
    """name -> the stretch to run (read only): the compiled one where `wanted`, else the eager function (the
    same computation op by op)."""
    return COMPILED if wanted() else EAGER
