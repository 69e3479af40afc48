"""specdraft's own fp32 CPU kernel for the products of a decode step (`eval.linear_layout=panel`).

On a 2-core AMD EPYC (Zen 3: AVX2, no AVX-512) torch's MKL GEMM is slow for the few rows a decode step
feeds the target: one 576x1536 product (weights streamed from DRAM) takes 301 / 429 / 713 / 1,104 us at
1 / 2 / 4 / 16 rows (`x @ W.T`, transposed weight), MKL's packed GEMM 260 / 400 / 686 / 762, and a SmolLM2-135M
verify forward of 2 nodes cost 1.6x a one-token step, 16 nodes 2.3x (docs/experiments.md, "Session 20").
Nothing a drafter proposes can pay at those prices.

`panel_linear.c` (next to this file) computes the same product with the weight packed once in 16-column panels
(`pack_panels`: each panel K x 16 floats, contiguous), so every weight is read exactly once and in order, and
up to 6 rows share each load (12 AVX2 accumulators); whole panels go to torch's OpenMP threads. Measured on
the same EPYC: 172 / 202 / 249 / 361 us at 1 / 2 / 4 / 16 rows, and the 49,152 x 576 LM head 5.1 / 4.9 / 5.5 /
9.0 ms against 6.3 / 12.8 / 36.0 / 38.0 ms transposed.

Every output element is a sum over the input features in order, one FMA per term, so a row's result has the
same bits whatever the row count and the other rows (`row-invariant`): an AR step, a tree verify and a
batched step compute the same Linear outputs for the same row.

The kernel is compiled on first use with the system C compiler (`$CC`, else `cc`; gcc or clang, x86-64 with
AVX2, FMA and F16C) and cached in `$SPECDRAFT_CACHE/kernels/` (written atomically, keyed by the source, flags and
compiler). Where it cannot be built, `panel_status()` says why and `eval.linear_layout=auto` keeps the
`transposed` layout. It links OpenMP by soname, so it runs on the libgomp torch already loaded.
For decoding only (no autograd); training keeps `nn.Linear`.

Where a weight is exactly a dequantised GGUF block format (Q4_0 / Q4_1 / Q8_0) or holds only bf16 / fp16
values, `PanelLinear` stores it as exact panels instead (`models/exact_panels.py`): the same outputs bit for
bit from 2-5x fewer bytes streamed per product.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor, nn

from specdraft.hardware import panel_kernel_blocker
from specdraft.models.exact_panels import KINDS, ExactPanels, exact_panels, exact_product
from specdraft.models.exact_panels import enabled as exact_enabled
from specdraft.models.layers import replace_linears
from specdraft.models.qdot import enabled as q8_enabled
from specdraft.models.qdot import to_dot
from specdraft.utils import cache_root

PANEL = 16  # output columns per packed panel (two AVX2 vectors); panel_linear.c's PW
SOURCE = Path(__file__).with_name("panel_linear.c")
# built into the same library: a decoder layer's per-row steps (models/row_ops.py) and the one-call layer loop
# over them (models/layer_rows.py)
SOURCES = (
    SOURCE,
    Path(__file__).with_name("row_ops.c"),
    Path(__file__).with_name("layer_rows.c"),
    Path(__file__).with_name("qdot.c"),  # int8-activation products of exact panels (models/qdot.py)
    Path(__file__).with_name("draft_chain.c"),  # one ReDrafter draft slot in one call (eval/native_chain.py)
)
# -ffp-contract=off: no FMA the sources do not write (row_ops.c's rotary embedding is torch's bit for bit)
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


def _build(cc: str, sources: tuple[Path, ...] = SOURCES) -> Path:
    """Compile `sources` (default `SOURCES`) into the kernel cache (once per sources, flags and compiler);
    returns the .so path.

    Raises:
        RuntimeError: the compiler failed (its first error line in the message).
    """
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    texts = [src.read_text() for src in sources]
    key = hashlib.sha1("\n".join([*texts, " ".join(CFLAGS), cc, version]).encode()).hexdigest()
    out = cache_root() / "kernels" / f"panel_linear-{key[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run(
            [cc, *CFLAGS, *map(str, sources), "-o", tmp, "-lm"], capture_output=True, text=True, check=False
        )
        if res.returncode != 0:
            first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:200])
            raise RuntimeError(f"{cc} failed to build {' + '.join(src.name for src in sources)}: {first}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@lru_cache(maxsize=1)
def panel_status() -> tuple[Callable[..., None] | None, str]:
    """(the kernel's C function, "ok") where it runs here, else (None, why not): an x86-64 CPU with AVX2, FMA
    and F16C and a working C compiler with OpenMP. Builds (or loads the cached build) once per process."""
    global _LIB
    _LIB, why = _library()
    return (_LIB.sd_panel_linear if _LIB is not None else None), why


_LIB: ctypes.CDLL | None = None  # the library `panel_status` last loaded


def panel_lib() -> ctypes.CDLL | None:
    """The kernel library (`sd_panel_linear`, and the exact block panels' `sd_qpanel_linear`,
    `sd_qpanel_unpack`) where it runs here, else None (`panel_status` says why)."""
    return _LIB if panel_status()[0] is not None else None


def _library(sources: tuple[Path, ...] = SOURCES) -> tuple[ctypes.CDLL | None, str]:
    """(the library built from `sources` with its argument types declared, "ok"), else (None, why not)."""
    from specdraft.models.exact_panels import declare

    blocker, cc = panel_kernel_blocker()
    if blocker is not None or cc is None:
        return None, blocker or "no C compiler"
    try:
        # after torch: its libgomp.so.1 serves the kernel's OpenMP
        lib = ctypes.CDLL(str(_build(cc, sources)))
    except (OSError, RuntimeError) as e:
        return None, str(e)
    fn = lib.sd_panel_linear
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    fn.restype = None
    declare(lib)
    return lib, "ok"


def baseline_library(source: Path, replaces: str | None = None) -> ctypes.CDLL:
    """The kernel library built with `source` in place of one of `SOURCES` (the others as they are), declared:
    the baseline of an A/B run of a kernel change (`scripts/bench_target_forward.py --compare kernel`).

    Args:
        source: a C file to build.
        replaces: the name of the source it stands for ("panel_linear.c", "row_ops.c", "layer_rows.c" or
            "qdot.c");
            None: the one `source` is named after, else panel_linear.c.

    Raises:
        RuntimeError: the kernel does not run here, `replaces` names no source, or `source` does not build
            (the compiler's first error).
    """
    if panel_lib() is None:
        raise RuntimeError(f"the panel kernel does not run here: {panel_status()[1]}")
    names = [src.name for src in SOURCES]
    name = replaces or (Path(source).name if Path(source).name in names else SOURCE.name)
    if name not in names:
        raise RuntimeError(f"{name!r} is not a kernel source; pick one of {', '.join(names)}")
    lib, why = _library(tuple(Path(source) if src.name == name else src for src in SOURCES))
    if lib is None:
        raise RuntimeError(why)
    return lib


def swap_library(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Make `lib` the library every exact-panel product calls from now on (`panel_lib`); returns the one it
    replaces. fp32 panels keep the built library's `sd_panel_linear`, the row kernels the first one loaded."""
    global _LIB
    if panel_lib() is None:
        raise RuntimeError(f"the panel kernel does not run here: {panel_status()[1]}")
    old, _LIB = _LIB, lib
    assert old is not None
    return old


def kernel_identity() -> str:
    """What a CPU step's cost depends on in the kernel library, e.g. "panel_linear-3f2a...so avx512=1 vbmi=1
    vnni=1": the build (its file name hashes the sources, flags and compiler) and the run-time switches
    (`SPECDRAFT_AVX512`, `SPECDRAFT_VBMI`); "" where the kernel does not run. A cached cost curve is keyed by it
    (`eval/budget.machine_key`), so a new kernel or another switch setting measures its own curve."""
    lib = panel_lib()
    if lib is None:
        return ""
    switches = [("avx512", "sd_avx512_on"), ("vbmi", "sd_vbmi_on"), ("vnni", "sd_qdot_vnni")]
    on = " ".join(f"{name}={int(getattr(lib, fn)())}" for name, fn in switches if hasattr(lib, fn))
    return f"{Path(lib._name).name} {on}"


def panel_available() -> bool:
    """Whether the panel kernel runs on this machine (see `panel_status`)."""
    return panel_status()[0] is not None


def pack_panels(weight: Tensor) -> Tensor:
    """(out, in) fp32 weight -> (panels, in, PANEL) contiguous, zero-padded past `out` (panel b holds output
    columns PANEL*b .. PANEL*b + PANEL-1, each input feature's 16 weights side by side)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)  # (panels * PANEL, in)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()  # (panels, in, PANEL)


def panel_bytes(model: nn.Module) -> int:
    """The memory `panel_linears(model)` adds: one panel copy of every fp32 CPU Linear weight."""
    return sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear) and fp32_cpu(m))


def fp32_cpu(linear: nn.Linear) -> bool:
    """Whether `linear` has an fp32 weight on the CPU (what the panel kernel and MKL's sgemm compute)."""
    return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"


class PanelLinear(nn.Module):
    """`nn.Linear` for CPU decode steps through the panel kernel: `forward(x) = x @ W.T + bias`, row-invariant.

    Args:
        linear: the fp32 CPU layer to replace; its weight is kept (shared) and packed (`pack_panels`), its bias
            shared.
    """

    def __init__(self, linear: nn.Linear, exact: bool | None = None, q8: bool | None = None) -> None:
        super().__init__()
        if not panel_available() or not fp32_cpu(linear):
            raise ValueError(
                f"PanelLinear needs an fp32 CPU weight and the panel kernel (got {linear.weight.dtype} on "
                f"{linear.weight.device.type}; kernel: {panel_status()[1]})"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.native = linear.weight.detach()  # (out, in), shared (the input embedding's, for a tied LM head)
        panels = pack_panels(self.native)  # (panels, in, PANEL)
        store = exact_panels(self.native, panels) if (exact_enabled() if exact is None else exact) else None
        if store is not None and (q8_enabled() if q8 is None else q8):  # int8 activations (models/qdot.py)
            store = to_dot(store)
        # (panels, in, PANEL) fp32, or the same weights as exact block panels: plain tensors, not in state_dict
        self.panels: Tensor | ExactPanels = panels if store is None else store
        self.bias = linear.bias

    @property
    def weight(self) -> Tensor:
        """(out, in) weight as `nn.Linear.weight` reads (the native one, shared)."""
        return self.native

    def forward(self, x: Tensor) -> Tensor:
        """x: (..., in) fp32 -> (..., out)."""
        return panel_product(x, self.panels, self.out_features, self.bias)

    def extra_repr(self) -> str:
        kind = f", exact {store_kind(self.panels)}" if isinstance(self.panels, ExactPanels) else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, layout=panels of {PANEL}{kind}"


def panel_product(x: Tensor, panels: Tensor | ExactPanels, out_features: int, bias: Tensor | None) -> Tensor:
    """x @ W.T + bias through the panel kernel: x (..., in) fp32, panels (ceil(out / PANEL), in, PANEL) of W
    (or W as `ExactPanels`: the same bits) -> (..., out)."""
    if x.dtype != torch.float32:
        raise TypeError(f"PanelLinear computes in fp32, got {x.dtype} input")
    k = panels.shape[1]
    x2 = x.reshape(-1, k).contiguous()  # (M, in)
    if isinstance(panels, ExactPanels):
        return exact_product(x2, panels, out_features, bias).reshape(*x.shape[:-1], out_features)
    y = torch.empty(x2.shape[0], out_features, dtype=torch.float32)  # (M, out)
    fn = panel_status()[0]
    if x2.shape[0] and fn is not None:
        b = bias.data_ptr() if bias is not None else None
        fn(
            x2.data_ptr(),
            x2.shape[0],
            k,
            panels.data_ptr(),
            out_features,
            b,
            y.data_ptr(),
            torch.get_num_threads(),
        )
    return y.reshape(*x.shape[:-1], out_features)


class StackedPanels:
    """Several `PanelLinear`s of one input as ONE kernel call (a decoder layer's q/k/v, its gate/up): their
    panels moved into one buffer, of which each keeps a view (no extra memory; each still runs alone). Every
    output column is summed as before, so the outputs are bit for bit the separate calls'.

    Args:
        linears: PanelLinears of the same input width, each `out_features` a multiple of PANEL (no padding
            between them: `stackable`).
    """

    def __init__(self, linears: list[PanelLinear]) -> None:
        self.members = list(linears)
        exact = [m.panels for m in linears if isinstance(m.panels, ExactPanels)]
        plain = [m.panels for m in linears if not isinstance(m.panels, ExactPanels)]
        if exact and plain:
            raise ValueError("StackedPanels: exact and fp32 panels do not stack (see `stackable`)")
        # (sum panels, in, PANEL), or ExactPanels of as many panels (one kind: `stackable`)
        self.panels: Tensor | ExactPanels = ExactPanels.cat(exact) if exact else torch.cat(plain)
        start = 0
        for m in linears:  # each member reads its slice of the one buffer from now on
            n = m.panels.shape[0]
            m.panels, start = self.panels[start : start + n], start + n
        self.sizes = [m.out_features for m in linears]
        biases = [m.bias for m in linears]
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b.detach() if b is not None else torch.zeros(n)
                    for b, n in zip(biases, self.sizes, strict=True)
                ]
            )
        )

    @staticmethod
    def stackable(linears: list[nn.Module]) -> bool:
        """Whether `linears` can be stacked: PanelLinears of one input width and one storage (fp32 panels, or
        exact panels of one kind), every output width a multiple of PANEL."""
        panels = [m for m in linears if isinstance(m, PanelLinear)]
        kinds = {store_kind(m.panels) for m in panels}  # one storage
        return len(panels) == len(linears) and (
            len({m.in_features for m in panels}) == 1
            and all(m.out_features % PANEL == 0 for m in panels)
            and len(kinds) == 1
        )

    def whole(self, x: Tensor) -> Tensor:
        """x (..., in) -> (..., sum out_i): the members' outputs side by side, from one kernel call."""
        return panel_product(x, self.panels, sum(self.sizes), self.bias)

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """x (..., in) -> each member's output (..., out_i), from one kernel call."""
        return self.whole(x).split(self.sizes, dim=-1)


def panel_linears(model: nn.Module, exact: bool | None = None, q8: bool | None = None) -> int:
    """Replace every fp32 CPU `nn.Linear` under `model` by a `PanelLinear`, in place (other dtypes and devices
    are left as they are); `exact`: store exact block panels where a weight is one (None:
    `SPECDRAFT_EXACT_PANELS`, default on); `q8`: multiply the 4- and 8-bit ones with int8 activations
    (`models/qdot.py`; None: `SPECDRAFT_Q8_ACTIVATIONS`, default off). Returns how many."""
    return replace_linears(model, lambda linear: PanelLinear(linear, exact, q8), fp32_cpu)


def store_kind(panels: Tensor | ExactPanels) -> str:
    """The storage of `PanelLinear.panels`: "fp32", an exact store's kind ("q4", "q8", "bf16", "f16"), or
    "q4xq8" / "q8xq8" for one multiplied with int8 activations (`models/qdot.py`)."""
    if not isinstance(panels, ExactPanels):
        return "fp32"
    return f"{panels.kind}xq8" if panels.dot else panels.kind


def int8_activations(model: nn.Module) -> bool:
    """Whether any `PanelLinear` under `model` multiplies with int8 activations (`models/qdot.py`)."""
    return any(
        isinstance(m, PanelLinear) and isinstance(m.panels, ExactPanels) and m.panels.dot
        for m in model.modules()
    )


def store_bytes(panels: Tensor | ExactPanels) -> int:
    """Bytes a `PanelLinear.panels` holds (fp32 panels or exact block panels)."""
    return panels.nbytes() if isinstance(panels, ExactPanels) else panels.numel() * panels.element_size()


def storage_summary(model: nn.Module) -> str:
    """How `model`'s PanelLinears store their weights, e.g. "q4:210 q8:1" ("" without any): the cost of a step
    depends on it."""
    kinds = [store_kind(m.panels) for m in model.modules() if isinstance(m, PanelLinear)]
    return " ".join(
        f"{k}:{kinds.count(k)}" for k in dict.fromkeys(["fp32", *KINDS, "q4xq8", "q8xq8"]) if k in kinds
    )
