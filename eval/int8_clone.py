"""A decode-time view of a drafter whose small products run as dynamic int8 (CPU drafting, `eval.draft_block`).

ReDrafter's beam search and Medusa's heads make a dozen or more small products per draft (ReDrafter: the
recurrence's U s and W e, the residual blocks and the copy gate at W beams per slot; at 8 rows a bf16
576 x 576 product costs ~34 us on a 2-core Zen 5, its dynamic-int8 copy ~16 us, and in a decode step the
weights are cold, so halving their bytes counts twice). `int8_clone(module, keep, skip)` returns a shallow copy
of `module` that shares every parameter and buffer, with each `nn.Linear` below it replaced by `Int8Product`
(the same product through `proposers.Int8Linear`, in float32), except the children named in `keep` (e.g. the
vocabulary head, which the proposers already swap for their own int8 copy) and the modules in `skip`. The
original is untouched (training and exports never see the clone). Only the drafts change, slightly; the output
never does (verification decides every token).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from specdraft.eval.proposers import Int8Linear, int8_copy
from specdraft.models.layers import CopyCache, weights_key
from specdraft.models.panel_linear import PanelLinear

# what the clone swaps: plain Linears, and those a panel target's layout made `PanelLinear`s
# (`models.linear_layout.match_target_layout`: fp32 panels, 4 bytes a weight, streamed cold every draft)
LINEARS = (nn.Linear, PanelLinear)


class Int8Product(nn.Module):
    """`linear`'s product as a dynamic-int8 fbgemm product (`Int8Linear`: int8 weights per output channel,
    activations quantised per call), returned in float32 (float64 for float64 inputs): the small ops after it
    then run in float32 too (type promotion), so the next product needs no cast (on a CPU a cast of a few rows
    costs about as much as the elementwise op itself)."""

    def __init__(self, linear: nn.Linear | PanelLinear) -> None:
        super().__init__()
        self.q: Int8Linear = int8_copy(linear)  # shared with every clone of the same weights
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., out) float32 (float64 for a float64 x); any number of leading dims (fbgemm takes
        2-D and up)."""
        y = self.q(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)  # (..., out) float32
        return y.double() if x.dtype == torch.float64 else y


def _kept(name: str, child: nn.Module, keep: frozenset[str], skip: frozenset[int]) -> bool:
    """Whether the clone leaves `child` (attribute `name`) as it is: named in `keep`, or one of `skip`."""
    return name in keep or id(child) in skip


def _linears(module: nn.Module, keep: frozenset[str], skip: frozenset[int]) -> list[nn.Linear | PanelLinear]:
    """Every `nn.Linear` (or `PanelLinear`) below `module` that the clone swaps (kept children excluded, at any
    depth)."""
    out: list[nn.Linear | PanelLinear] = []
    for name, child in module.named_children():
        if _kept(name, child, keep, skip):
            continue
        if isinstance(child, LINEARS):
            out.append(child)
        else:
            out.extend(_linears(child, keep, skip))
    return out


def _clone(module: nn.Module, keep: frozenset[str], skip: frozenset[int]) -> nn.Module:
    """A shallow copy of `module` (shared parameters and buffers) with its Linears swapped, recursively."""
    twin = copy.copy(module)
    twin._modules = {}  # a new dict: the original's children stay as they are
    for name, child in module._modules.items():
        if child is None or _kept(name, child, keep, skip):
            twin._modules[name] = child
        elif isinstance(child, LINEARS):
            twin._modules[name] = Int8Product(child)
        else:
            twin._modules[name] = _clone(child, keep, skip)
    return twin


_CLONES: CopyCache[nn.Module] = CopyCache()


def int8_clone(
    module: nn.Module, keep: tuple[str, ...] = ("head",), skip: tuple[nn.Module, ...] = ()
) -> nn.Module:
    """The int8 view of `module` (see the module docstring), built once per module and weights and shared by
    every proposer of it (a batch of B rows makes B proposers); rebuilt when a swapped Linear's weights changed
    (trained, moved or cast). Children named in `keep` (at any depth) and the modules in `skip` stay as they
    are. `module` itself is returned unchanged where int8 products do not apply: off a CPU, without fbgemm, or
    with no Linear to swap."""
    from specdraft.eval.proposers import int8_supported

    keys, skipped = frozenset(keep), frozenset(id(m) for m in skip)
    linears = _linears(module, keys, skipped)
    if not linears or not int8_supported() or any(lin.weight.device.type != "cpu" for lin in linears):
        return module
    key = tuple(weights_key(lin.weight) for lin in linears)
    return _CLONES.get(module, key, lambda: _clone(module, keys, skipped))
