"""A decoder layer's q/k/v (or gate/up) `nn.Linear`s as ONE product, with no second copy of their weights.

On a GPU every product of a decode step is a kernel launch, inside a CUDA graph too (~3 us each on an H100 for
SmolLM2's 576-wide layers; a one-token verify graph of its 30 layers took 2.9 ms, session 43). Three q/k/v
products and two gate/up products become two (`models/fast_target.py` runs them), as `StackedPanels` already
does for the CPU's panel kernel:

    W = [Wq; Wk; Wv]        one (sum out, in) buffer; q_proj.weight, k_proj.weight, v_proj.weight become its
                            row slices (views), so the target holds its weights once
    q|k|v = x @ W^T (+ b)   one product: the same sums, in the order one GEMM of that width picks (so equal
                            to the separate products up to rounding, as any change of GEMM shape is)

Only plain `nn.Linear`s of one input width, dtype and device, frozen, with all or none biased, stack
(`stackable`): the CPU's panel, packed and transposed layouts keep their own modules (the panel layout has
`StackedPanels`). Whatever replaces a member's weight afterwards (`.to()`, `load_state_dict(assign=True)`)
breaks the view: `current` says so and the caller builds the stack again. `SPECDRAFT_STACKED_LINEARS=0` makes
the lean forward run the members one by one again (an A/B; their weights stay where the stack put them, so a
CUDA graph captured either way keeps reading live memory).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ENV = "SPECDRAFT_STACKED_LINEARS"


def wanted() -> bool:
    """`SPECDRAFT_STACKED_LINEARS` (default on; "0": the lean forward runs the Linears one by one)."""
    return os.environ.get(ENV, "1") != "0"


class StackedLinear:
    """Several plain `nn.Linear`s of one input as one product over one weight buffer (module docstring).

    Args:
        linears: `stackable` Linears; from here on each one's weight (and bias) is a view into the stack.

    Attributes:
        weight: (sum out_i, in); bias: (sum out_i,) or None; sizes: each member's out_features.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        if not self.stackable(linears):
            raise ValueError("StackedLinear: the Linears do not stack (see `stackable`)")
        self.members = list(linears)
        self.sizes = [m.out_features for m in linears]
        # a normal tensor even when built inside `torch.inference_mode()` (the members' weights stay usable
        # by transformers' own forward and by training code outside it)
        with torch.inference_mode(False), torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in linears])  # (sum out, in)
            biased = linears[0].bias is not None
            self.bias = (
                torch.cat([m.bias.detach() for m in linears if m.bias is not None]) if biased else None
            )
            for m, w in zip(linears, self.weight.split(self.sizes), strict=True):
                m.weight.data = w  # the member reads its rows of the stack (the old buffer is freed)
            if self.bias is not None:
                for m, b in zip(linears, self.bias.split(self.sizes), strict=True):
                    assert m.bias is not None
                    m.bias.data = b
        self._ptrs = self._pointers()

    @staticmethod
    def stackable(linears: Sequence[nn.Module]) -> bool:
        """Whether `linears` stack: exactly `nn.Linear` (no subclass: the CPU layouts' modules keep their
        kernels), one input width, dtype and device (not meta), frozen weights, all or none with a bias, and
        no accelerate offload hook (its weights may live elsewhere)."""
        if not linears or any(type(m) is not nn.Linear for m in linears):
            return False
        lins = [m for m in linears if isinstance(m, nn.Linear)]
        w = [m.weight for m in lins]
        return (
            len({(m.in_features, t.dtype, t.device) for m, t in zip(lins, w, strict=True)}) == 1
            and w[0].device.type != "meta"
            and not any(t.requires_grad for t in w)
            and len({m.bias is None for m in lins}) == 1
            and not any(m.bias is not None and m.bias.requires_grad for m in lins)
            and not any(hasattr(m, "_hf_hook") for m in lins)
        )

    def _pointers(self) -> tuple[int, ...]:
        """Each member's weight (and bias) address: views of the stack while `current`."""
        out = [m.weight.data_ptr() for m in self.members]
        out += [m.bias.data_ptr() for m in self.members if m.bias is not None]
        return tuple(out)

    def current(self) -> bool:
        """Whether every member still reads its weights from this stack (a move or reload replaces them)."""
        return self._pointers() == self._ptrs

    def whole(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., sum out_i): the members' outputs side by side, from one product."""
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """x (..., in) -> each member's output (..., out_i)."""
        return self.whole(x).split(self.sizes, dim=-1)
