"""The target's Linear weights stored transposed for decoding on a CPU.

`nn.Linear` keeps its weight as (out, in) and computes `x @ W.T`. On the CPUs we measured (2-core Xeon, fp32,
torch's MKL/oneDNN GEMM), that layout is slow for the few rows a decode step feeds the target: a verify forward
of 16 tree nodes through SmolLM2-135M cost 3.4x a one-token step, and 8 nodes 2.2x, while the same product
against a contiguous (in, out) copy of the weight (`x @ Wt`, no transpose at GEMM time) costs about 1.9x and
1.5x (docs/experiments.md, "Session 15"). A tree verify is exactly that small-M product, so the layout decides
whether speculative decoding can pay off on such a CPU at all.

`transpose_linears(model)` swaps every `nn.Linear` of the target (attention, MLP and the LM head) for a
`TransposedLinear` holding `W.T` contiguous. The function computed is the same matrix product (outputs agree
to float rounding; AR and speculative decoding in one run use the same layout, so greedy outputs stay equal
token for token). A tied LM head gets its own transposed copy (the input embedding keeps the original).
`.weight` still reads as the (out, in) matrix (a view), so code borrowing the target's LM head keeps working.
One exception, measured on the same Xeon: the vocabulary-sized LM head over 2-3 rows is faster in the native
layout (7.5 ms against 11.1 ms for 2 rows, 49,152 x 576), so the LM head keeps its native weight too (the
input embedding's, when tied: no copy) and uses it for 2-3 rows; every other row count uses the transposed copy.
Decode-time only: training and distillation keep the native layout (large-M products, gradients).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import PreTrainedModel

Layout = Literal["auto", "transposed", "native"]


class TransposedLinear(nn.Module):
    """`nn.Linear` over a weight stored as (in, out), contiguous: `forward(x) = x @ wt + bias`.

    Args:
        linear: the layer to replace; its weight is copied transposed, its bias shared.
        keep_native: also keep `linear.weight` (shared, not copied) for products over 2-3 rows (the LM head).
    """

    NATIVE_ROWS = (2, 3)  # row counts that keep_native layers compute against the (out, in) weight

    def __init__(self, linear: nn.Linear, keep_native: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.wt = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)  # (in, out)
        self.native = linear.weight if keep_native else None  # (out, in), shared with the original
        self.bias = linear.bias

    @property
    def weight(self) -> Tensor:
        """(out, in) weight as `nn.Linear.weight` reads (a view of the transposed copy unless kept native)."""
        return self.native if self.native is not None else self.wt.t()

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., in) -> (..., out)."""
        if self.native is not None and x.numel() // self.in_features in self.NATIVE_ROWS:
            return F.linear(x, self.native, self.bias)  # (..., out)
        y = torch.matmul(x, self.wt)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout=(in, out)"


def transpose_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a `TransposedLinear`, in place.

    The LM head (`get_output_embeddings()` of a `PreTrainedModel`) also keeps its native weight (see
    `TransposedLinear`).

    Args:
        model: a frozen HF causal LM (the target).

    Returns:
        How many layers were replaced (0 when already transposed).
    """
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, TransposedLinear(child, keep_native=child is head))
                done += 1
    return done


def resolve_layout(layout: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `layout` means transposed weights for a target on `device` in `dtype`.

    `auto` transposes on a CPU in fp32, where it was measured to pay; `transposed` / `native` force.

    Raises:
        ValueError: an unknown layout name.
    """
    if layout not in ("auto", "transposed", "native"):
        raise ValueError(f"linear layout {layout!r}: expected auto, transposed or native")
    if layout == "auto":
        return device.type == "cpu" and dtype == torch.float32
    return layout == "transposed"


def apply_layout(model: nn.Module, layout: str) -> bool:
    """`transpose_linears(model)` when `resolve_layout` says so; returns whether the model is transposed."""
    p = next(model.parameters())
    if not resolve_layout(layout, p.device, p.dtype):
        return False
    transpose_linears(model)
    return True
