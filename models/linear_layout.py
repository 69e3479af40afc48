"""The target's Linear weights laid out for decoding on a CPU: transposed, or MKL-packed per row count.

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

`packed` (the `auto` choice on an Intel CPU in fp32 with MKL, when the copies fit in memory) goes one step
further: a tree verify of 2-16 nodes still streamed every weight at about half the one-row speed, because the
GEMM packs its operand on every call. `PackedLinear` packs the weight once per row count in `PACK_ROWS` (MKL's
`cblas_sgemm_pack`, through `torch.ops.mkl._mkl_reorder_linear_weight`), pads a product's rows up to the next
packed count and runs `cblas_sgemm_compute`; one row (AR) and more rows than the largest pack (prefill) use the
transposed copy, and 2-3 rows the native weight (as fast as a pack there, and no copy). Streaming
microbenchmark on the Xeon (100 different 576x1536 weights, us per product at 1 / 2 / 4 / 8 / 16 rows):
transposed 209 / 375 / 398 / 420 / 505, packed for the row count 237 / 229 / 241 / 269 / 349; a SmolLM2-135M
verify forward of 2 / 4 / 8 / 16 nodes went from 78 / 90 / 96 / 107 ms transposed to 68 / 73 / 76 / 93 ms
packed (scripts/bench_layouts.py; docs/experiments.md, "Session 19"). The cost: one packed copy of every weight
per entry of `PACK_ROWS` plus the transposed copy (4 x 540 MB for SmolLM2-135M in fp32), which is why `auto`
checks the free memory. A drafter over a packed target is packed too (`match_target_layout`).
`panel` (the `auto` choice on other x86 CPUs with AVX2, e.g. AMD, in fp32) runs specdraft's own kernel
(`models/panel_linear.py`): one copy of each weight in 16-column panels, read once per product whatever the
row count; on a 2-core AMD EPYC (Zen 3), where MKL's few-row GEMM is slow, it is faster than every layout
above at every row count (docs/experiments.md, "Session 20").
For decoding only (evaluation, the benchmarks, distill's generation); training keeps `nn.Linear`.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from specdraft.hardware import cpu_model
from specdraft.models.layers import replace_linears
from specdraft.models.panel_linear import (
    PanelLinear,
    fp32_cpu,
    panel_available,
    panel_bytes,
    panel_linears,
    panel_status,
    storage_summary,
    store_bytes,
)

Layout = Literal["auto", "transposed", "native", "packed", "panel"]
LAYOUTS: tuple[str, ...] = ("auto", "transposed", "native", "packed", "panel")
PACK_ROWS: tuple[int, ...] = (4, 8, 16)  # row counts with a packed weight: tree budgets, small batches
PACK_MEMORY_SHARE = 0.25  # `auto` packs only when the copies take at most this share of the free memory


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


def mkl_packing_available() -> bool:
    """Whether this torch has MKL's packed fp32 GEMM (`torch.ops.mkl._mkl_linear`; x86 builds)."""
    try:
        return bool(torch.backends.mkl.is_available()) and callable(torch.ops.mkl._mkl_reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


class _Packs(dict):
    """Row count -> MKL-packed weight. The packs are opaque (no storage to copy) and never written after
    packing, so a deep copy of the model shares them."""

    def __deepcopy__(self, memo: dict) -> _Packs:
        return self


class PackedLinear(nn.Module):
    """`nn.Linear` for CPU decode steps: the weight packed by MKL once per row count in `rows`.

    A product over r rows runs against the native weight for r in `NATIVE_ROWS`, else against the pack of the
    smallest count >= r (rows zero-padded up to it); one row and more rows than the largest pack run `x @ wt` on
    the transposed copy (`TransposedLinear`'s fast cases). fp32 only (MKL's sgemm). The packs are plain
    attributes: not in `state_dict`, never moved by `.to()`.

    Args:
        linear: the fp32 layer to replace; its weight is kept (shared), copied transposed and packed, its bias
            shared.
        rows: the row counts to pack for (each > 3).
    """

    NATIVE_ROWS = TransposedLinear.NATIVE_ROWS  # row counts computed against the (out, in) weight

    def __init__(self, linear: nn.Linear, rows: tuple[int, ...] = PACK_ROWS) -> None:
        super().__init__()
        if not fp32_cpu(linear):  # MKL's sgemm
            raise ValueError(
                f"PackedLinear needs an fp32 CPU weight, got {linear.weight.dtype} on {linear.weight.device}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()  # (out, in)
        self.native = w  # shared with the original (the input embedding's, for a tied LM head)
        self.wt = nn.Parameter(w.t().contiguous(), requires_grad=False)  # (in, out)
        self.bias = linear.bias
        self.rows = tuple(sorted(set(rows)))
        self.packs = _Packs({m: torch.ops.mkl._mkl_reorder_linear_weight(w, m) for m in self.rows})  # opaque

    @property
    def weight(self) -> Tensor:
        """(out, in) weight as `nn.Linear.weight` reads (the native one, shared)."""
        return self.native

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., in) -> (..., out)."""
        r = x.numel() // self.in_features
        if r in self.NATIVE_ROWS:
            return F.linear(x, self.native, self.bias)  # (..., out)
        m = next((m for m in self.rows if m >= r), 0)
        if r <= 1 or m == 0:  # one row (a GEMV) or a prefill: the transposed copy
            y = torch.matmul(x, self.wt)  # (..., out)
            return y if self.bias is None else y + self.bias
        x2 = x.reshape(r, self.in_features)  # (r, in)
        if m > r:
            x2 = torch.cat([x2, x2.new_zeros(m - r, self.in_features)])  # (m, in)
        y = torch.ops.mkl._mkl_linear(x2.contiguous(), self.packs[m], self.native, self.bias, m)  # (m, out)
        return y[:r].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed_rows={self.rows}"


def pack_linears(model: nn.Module, rows: tuple[int, ...] = PACK_ROWS) -> int:
    """Replace every fp32 CPU `nn.Linear` under `model` by a `PackedLinear`, in place (other dtypes and devices
    are left as they are); returns how many."""
    return replace_linears(model, lambda linear: PackedLinear(linear, rows), fp32_cpu)


def match_target_layout(drafter: nn.Module, target: nn.Module) -> int:
    """Lay out the drafter's fp32 CPU Linear layers as the target's are, when those are packed or in panels:
    its draft steps are the same few-row products (a beam, a tree level). On the 2-core Xeon, packing took
    whole-tree draft time per step 59-70 -> 39-43 ms (EAGLE-3) and 101-111 -> 53-60 ms (ReDrafter); EAGLE-1 and
    Medusa were within noise. Returns how many layers were laid out (0 for any other target layout)."""
    head = target.get_output_embeddings() if isinstance(target, PreTrainedModel) else None
    if isinstance(head, PanelLinear):
        return panel_linears(drafter)
    return pack_linears(drafter) if isinstance(head, PackedLinear) else 0


def weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights as laid out: every parameter once, plus the plain-tensor weights of the layouts
    (a `PackedLinear`'s native weight where it is not a parameter, and one weight-sized copy per pack)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in model.parameters()}
    packs = 0
    for m in model.modules():
        if isinstance(m, (PackedLinear, PanelLinear)):
            size = m.native.numel() * m.native.element_size()
            seen.setdefault(m.native.data_ptr(), size)
            packs += len(m.packs) * size if isinstance(m, PackedLinear) else store_bytes(m.panels)
    return sum(seen.values()) + packs


def pack_bytes(model: nn.Module, rows: tuple[int, ...] = PACK_ROWS) -> int:
    """The memory `pack_linears(model, rows)` adds: a copy of every Linear weight per packed row count, plus the
    transposed copy."""
    weights = sum(
        m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear)
    )
    return weights * (len(rows) + 1)


def free_memory_bytes() -> int:
    """Memory available to a new allocation now: Linux `MemAvailable` (free plus reclaimable page cache), else
    the free pages from `sysconf`; 0 where neither can be read, which turns `auto` packing off."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0


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
    return replace_linears(model, lambda linear: TransposedLinear(linear, keep_native=linear is head))


def resolve_layout(
    layout: str, device: torch.device, dtype: torch.dtype, packs: int = 0, panels: int = 0
) -> str:
    """What `layout` means for a target on `device` in `dtype`: "native", "transposed", "packed" or "panel".

    `auto` on a CPU in fp32: panel where the panel kernel runs and its copy (`panels` bytes, `panel_bytes`)
    takes at most `PACK_MEMORY_SHARE` of the free memory (measured on AMD EPYCs and an AMX Xeon); else packed on
    an Intel CPU with MKL when the packs (`packs` bytes, `pack_bytes`) fit the same share (measured on a Xeon
    against transposed); else transposed. Native elsewhere. `transposed` / `native` / `packed` / `panel` force.

    Raises:
        ValueError: an unknown layout name, `packed` where MKL's packed fp32 GEMM cannot run, or `panel` where
            the panel kernel cannot (the reason named).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"linear layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if layout == "packed" and not (cpu_fp32 and mkl_packing_available()):
        raise ValueError(
            f"linear layout 'packed' needs an fp32 target on a CPU and a torch with MKL (got {dtype} on "
            f"{device.type}, MKL {mkl_packing_available()}): use linear_layout=transposed or auto"
        )
    if layout == "panel" and not (cpu_fp32 and panel_available()):
        why = panel_status()[1] if cpu_fp32 else f"it computes fp32 on a CPU, got {dtype} on {device.type}"
        raise ValueError(f"linear layout 'panel': {why}; use linear_layout=transposed or auto")
    if layout != "auto":
        return layout
    if not cpu_fp32:
        return "native"
    room = PACK_MEMORY_SHARE * free_memory_bytes()  # bytes a layout's copies may take
    if panel_available() and panels <= room:
        return "panel"
    if "intel" in cpu_model().lower() and mkl_packing_available() and packs <= room:
        return "packed"
    return "transposed"


def layout_label(model: nn.Module, layout: str) -> str:
    """`layout` as a run's log shows it: panels also say how they store the weights (fp32 or exact panels,
    `panel_linear.storage_summary`), e.g. "panel (stored q4:210 q8:1)"."""
    stored = storage_summary(model) if layout == "panel" else ""
    return f"{layout} (stored {stored})" if stored else layout


def apply_layout(model: nn.Module, layout: str, q8: bool = False) -> str:
    """Lay out the target's Linear weights as `resolve_layout` says (in place); returns the layout applied.
    `q8` (`base_model.q8_activations`): its 4- and 8-bit weights multiplied with int8 activations
    (`models/qdot.py`), which needs the panel layout.

    Raises:
        ValueError: `q8` where the layout is not "panel" (one line naming the setting and what to do).
    """
    p = next(model.parameters())
    auto = layout == "auto"
    chosen = resolve_layout(
        layout, p.device, p.dtype, pack_bytes(model) if auto else 0, panel_bytes(model) if auto else 0
    )
    if q8 and chosen != "panel":
        raise ValueError(
            f"base_model.q8_activations=true needs the CPU panel layout, but the target's Linear layout resolved "
            f"to {chosen!r} (layout {layout!r}, {p.dtype} on {p.device.type}): run a GGUF target on a CPU in "
            "fp32 with linear_layout auto or panel, or set base_model.q8_activations=false"
        )
    if chosen == "transposed":
        transpose_linears(model)
    elif chosen == "packed":
        pack_linears(model)
    elif chosen == "panel":
        panel_linears(model, q8=q8 or None)
    return chosen
