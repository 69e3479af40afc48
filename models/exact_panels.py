"""Exact panels: a dequantised (or 16-bit) weight stored as what it holds, rebuilt bit for bit in the kernel.

A GGUF target (the embedded SmolLM2 is Q4_1, its LM head Q8_0) is dequantised once to fp32 (`base_llm`), so its
weights are exactly W[n][32j + t] = fma(u, d[n][j], m[n][j]) in fp32, with u a 4-bit (Q4_0 / Q4_1) or 8-bit
(Q8_0) integer and d, m per block of 32 inputs. A decode step of a 135M target is bound by streaming those
fp32 weights (the panel kernel reads ~20 GB/s on a 2-core EPYC), 4 bytes a weight for 0.5-1 bytes of content.

`exact_panels(weight)` finds (u, d, m) for every block and checks that rebuilding them gives the fp32 panels bit
for bit; `sd_qpanel_linear` (panel_linear.c) then rebuilds each weight in registers and feeds the same FMA chain
in the same order, so the outputs are the fp32 panel kernel's bits with 0.75 (4-bit) or 1.25 (8-bit) bytes
streamed per weight. A weight whose values are all bf16 (or fp16), as a 16-bit checkpoint run in fp32 is, is
stored as those 2 bytes. Any other weight (a trained drafter's) gets None and keeps the fp32 panels. Set
`SPECDRAFT_EXACT_PANELS=0` to keep fp32 panels everywhere (A/B runs).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = {"q4": 4, "q8": 8, "bf16": 16, "f16": 17}  # panel_linear.c's kind codes
HALF_TABLES = 1  # added to a "q4" / "q8" code when d and m are held as fp16 (panel_linear.c's kinds 5 and 9)
PAIRED = 64  # or-ed into a "q4" / "q8" code for a paired store (panel_linear.c's KIND_PAIRED)
QDOT = 128  # or-ed into 4 / 8 for a store in models/qdot.c's layout, its activations quantised (KIND_QDOT)
BLOCK = 32  # inputs per block (GGUF's Q4_0 / Q4_1 / Q8_0 block size); panel_linear.c's QBLK
PANEL = 16  # output columns per panel; panel_linear.c's PW
ROWS_PER_CHUNK = 2048  # weight rows searched at once (bounds the float64 working memory to ~0.6 GB at K=4096)


def enabled() -> bool:
    """Whether panel layouts store exact panels where they can (`SPECDRAFT_EXACT_PANELS`, default on)."""
    return os.environ.get("SPECDRAFT_EXACT_PANELS", "1").strip().lower() not in ("0", "false", "no", "off")


def pairing() -> bool:
    """Whether 4- and 8-bit stores with an even panel count are paired (`SPECDRAFT_PAIRED_PANELS`): panels 2g and
    2g + 1 side by side, so a product of up to 8 rows runs twice the FMA chains from one stream of bytes (the same
    bits). `auto` (the default): where the kernel's AVX-512 paths run (AVX-512 F, BW and VL; on a 2-core Zen 5 a
    1-8-node verify took 0.70-0.92x the time); the AVX2 code gains at 1-2 rows there but loses 13-18% at 3-6, so
    AVX2-only CPUs (or `SPECDRAFT_AVX512=0`) keep single panels unless `1`; `0` never pairs."""
    from specdraft.hardware import cpu_flags

    value = os.environ.get("SPECDRAFT_PAIRED_PANELS", "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    # the kernel's own switch of its AVX-512 code (panel_linear.c)
    avx512 = os.environ.get("SPECDRAFT_AVX512", "1").strip() != "0"
    return avx512 and {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags()


@dataclass
class ExactPanels:
    """A weight (N, K) as exact panels (`exact_panels`).

    Attributes:
        q: (P, K, 8) uint8 for "q4" (byte c: column c in the low nibble, column c + 8 in the high one),
            (P, K, 16) uint8 for "q8", (P, K, 16) int16 for "bf16" (the weights' upper halves) and "f16";
            P = ceil(N / 16) panels of 16 output columns.
        d, m: (P, K / 32, 16) float32, or float16 where every entry is an fp16 (a GGUF's are: 2 bytes an entry
            instead of 4, for the bytes a decode step streams): block j's scale and offset for each column of the
            panel ("q4", "q8"; empty (P, 0, 16) float32 for the 16-bit kinds).
        kind: "q4" | "q8" | "bf16" | "f16".
        paired: "q4" / "q8" with an even P only: panels 2g and 2g + 1 side by side (`pair`): q (P / 2, K, 2 QB)
            (input row i: panel 2g's bytes, then 2g + 1's), d, m (P / 2, K / 32, 32) (block j: 2g's 16, then 2g + 1's).
        dot: "q4" / "q8" in models/qdot.c's layout (`qdot.to_dot`: the same shapes, the bytes of a panel in another
            order), multiplied with the activations quantised to int8 per block (not paired).
    """

    q: Tensor
    d: Tensor
    m: Tensor
    kind: str
    paired: bool = False
    dot: bool = False

    @property
    def code(self) -> int:
        """The kind as panel_linear.c numbers it (fp16 tables: `HALF_TABLES` more)."""
        if self.dot:
            return QDOT | KINDS[self.kind] | (HALF_TABLES if self.d.dtype == torch.float16 else 0)
        code = KINDS[self.kind] + (HALF_TABLES if self.d.dtype == torch.float16 else 0)
        return (code | PAIRED) if self.paired else code

    @property
    def shape(self) -> tuple[int, int]:
        """(P, K): panels and input features (as an fp32 panel tensor's first two dimensions)."""
        return int(self.q.shape[0]) * (2 if self.paired else 1), int(self.q.shape[1])

    def nbytes(self) -> int:
        """Bytes held: the integers and the two block tables."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m))

    def __getitem__(self, panels: slice) -> ExactPanels:
        """Panels `panels` (a slice of the first dimension; a paired store's at even bounds) as views."""
        if not self.paired:
            return ExactPanels(self.q[panels], self.d[panels], self.m[panels], self.kind, dot=self.dot)
        start, stop, step = panels.indices(self.shape[0])
        if step != 1 or start % 2 or stop % 2:
            raise ValueError(f"a paired store's panels {start}:{stop}:{step}: take whole pairs")
        pairs = slice(start // 2, stop // 2)
        return ExactPanels(self.q[pairs], self.d[pairs], self.m[pairs], self.kind, True)

    @staticmethod
    def cat(stores: list[ExactPanels]) -> ExactPanels:
        """Several weights of one input width and one kind, panels one after the other (paired if all of them are)."""
        if len({(s.kind, s.dot) for s in stores}) != 1 or len({s.shape[1] for s in stores}) != 1:
            raise ValueError("ExactPanels.cat needs one kind, one layout and one input width")
        if len({s.paired for s in stores}) != 1:  # some paired, some not: all unpaired
            stores = [unpair(s) for s in stores]
        return ExactPanels(
            torch.cat([s.q for s in stores]),
            torch.cat([s.d for s in stores]),
            torch.cat([s.m for s in stores]),
            stores[0].kind,
            stores[0].paired,
            stores[0].dot,
        )


def unpair(store: ExactPanels) -> ExactPanels:
    """A paired store laid out as panels one after the other again (`pair`'s inverse); any other as it is."""
    if not store.paired:
        return store
    p, k = store.shape
    q = store.q.view(p // 2, k, 2, -1).transpose(1, 2).reshape(p, k, -1)  # (P, K, QB)
    d, m = (
        t.view(p // 2, k // BLOCK, 2, PANEL).transpose(1, 2).reshape(p, k // BLOCK, PANEL)
        for t in (store.d, store.m)
    )
    return ExactPanels(q.contiguous(), d.contiguous(), m.contiguous(), store.kind)


def pair(store: ExactPanels) -> ExactPanels:
    """A "q4" / "q8" store of an even panel count as a paired one (`ExactPanels.paired`); any other as it is."""
    p, k = store.shape
    if store.paired or store.kind not in ("q4", "q8") or p % 2:
        return store
    q = store.q.view(p // 2, 2, k, -1).transpose(1, 2).reshape(p // 2, k, -1)  # (P/2, K, 2 QB)
    d, m = (
        t.view(p // 2, 2, k // BLOCK, PANEL).transpose(1, 2).reshape(p // 2, k // BLOCK, -1)
        for t in (store.d, store.m)
    )
    return ExactPanels(q.contiguous(), d.contiguous(), m.contiguous(), store.kind, True)


def _fp16(t: Tensor) -> Tensor:
    """float64 values rounded through fp16 (GGUF stores d and m as fp16), back in float64."""
    return t.to(torch.float16).to(torch.float64)


def _candidates(lo: Tensor, hi: Tensor, bits: int) -> list[tuple[Tensor, Tensor]]:
    """(m, d) guesses per block, (R, nb, 1) float64 each, from the block's min `lo` and max `hi` of the fp32
    values: GGUF Q4_1 (m = min, d = (max - min) / 15 as fp16), Q4_0 (u = 0 at the extreme of either sign:
    d = -extreme / 8), Q8_0 (symmetric: d = absmax / 127, m = -128 d), and plain affine grids in fp32."""
    levels = (1 << bits) - 1
    out = [(lo, _fp16((hi - lo) / levels)), (lo, ((hi - lo) / levels).float().double())]
    if bits == 4:
        out += [(lo, _fp16(-lo / 8)), (hi, _fp16(-hi / 8))]
    else:
        d = _fp16(torch.maximum(lo.abs(), hi.abs()) / 127)
        out.append((-128 * d, d))
    return out


def _search(w: Tensor, bits: int, only: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """(u (R, K) uint8, d (R, K/32) float32, m (R, K/32) float32, which (R, K/32) candidate index) with
    fp32(u * d + m) == w for every weight (as values: `same_panels`), or None when some block fits none of
    `_candidates` (w: (R, K) fp32, K a multiple of 32). `only`: try that candidate alone and do not check the
    fit (the caller checks the rebuilt panels: `exact_panels`' fast path)."""
    r, k = w.shape
    b = w.view(r, k // BLOCK, BLOCK)  # (R, nb, 32)
    b64 = b.double()
    lo, hi = b64.amin(-1, keepdim=True), b64.amax(-1, keepdim=True)  # (R, nb, 1)
    cands = _candidates(lo, hi, bits)
    if only is not None:
        m, d = cands[only]
        safe = torch.where(d == 0, torch.ones_like(d), d).float()
        u = torch.round((b - m.float()) / safe).clamp(0, (1 << bits) - 1).to(torch.uint8)
        which = torch.full((r, k // BLOCK), only, dtype=torch.long)
        return u.view(r, k), d[..., 0].float(), m[..., 0].float(), which
    u_out = torch.zeros(r, k // BLOCK, BLOCK, dtype=torch.uint8)
    d_out = torch.zeros(r, k // BLOCK, 1, dtype=torch.float64)
    m_out = torch.zeros_like(d_out)
    which = torch.full((r, k // BLOCK, 1), -1, dtype=torch.long)
    for i, (m, d) in enumerate(cands):
        safe = torch.where(d == 0, torch.ones_like(d), d)
        u = torch.round((b64 - m) / safe).clamp(0, (1 << bits) - 1)  # (R, nb, 32)
        rebuilt = (u * d + m).float()  # u * d is exact in float64; one rounding to fp32
        ok = (which < 0) & (rebuilt == b).all(-1, keepdim=True)  # (R, nb, 1); -0.0 == 0.0: see `same_panels`
        u_out = torch.where(ok, u.to(torch.uint8), u_out)
        d_out, m_out = torch.where(ok, d, d_out), torch.where(ok, m, m_out)
        which = torch.where(ok, i, which)
        if not bool((which < 0).any()):
            return u_out.view(r, k), d_out[..., 0].float(), m_out[..., 0].float(), which[..., 0]
    return None


def _half_panels(w: Tensor) -> ExactPanels | None:
    """`w` (N, K) as "bf16" panels where every value is a bf16 (its low 16 bits zero), else as "f16" where every
    value is an fp16, else None."""
    bits = w.view(torch.int32)
    if bool(((bits & 0xFFFF) == 0).all()):
        kind, half = "bf16", (bits >> 16).to(torch.int16)  # (N, K) the upper halves
    elif bool((w.half().float() == w).all()):
        kind, half = "f16", w.half().view(torch.int16)
    else:
        return None
    n, k = w.shape
    p = -(-n // PANEL)
    half = torch.nn.functional.pad(half, (0, 0, 0, p * PANEL - n)).view(p, PANEL, k).transpose(1, 2)
    empty = torch.zeros(p, 0, PANEL)
    return ExactPanels(half.contiguous(), empty, empty.clone(), kind)  # q: (P, K, 16) int16


def _to_panels(u: Tensor, d: Tensor, m: Tensor, bits: int) -> ExactPanels:
    """Row-major (N, K) integers and (N, K/32) tables -> panel layout (zero rows past N: u = d = m = 0)."""
    n, k = u.shape
    p = -(-n // PANEL)
    pad = p * PANEL - n
    u = torch.nn.functional.pad(u, (0, 0, 0, pad)).view(p, PANEL, k).transpose(1, 2)  # (P, K, 16)
    if bits == 4:
        u = u[..., :8] | (u[..., 8:] << 4)  # (P, K, 8): column c low nibble, column c + 8 high
    tables = [
        torch.nn.functional.pad(t, (0, 0, 0, pad)).view(p, PANEL, k // BLOCK).transpose(1, 2).contiguous()
        for t in (d, m)
    ]  # (P, K/32, 16) each
    if all(bool((t.half().float() == t).all()) for t in tables):  # fp16 values (a GGUF's): held in 2 bytes
        tables = [t.half() for t in tables]
    return ExactPanels(u.contiguous(), tables[0], tables[1], f"q{bits}")


def exact_panels(weight: Tensor, fp32_panels: Tensor) -> ExactPanels | None:
    """`weight` (N, K) fp32 CPU as exact panels: 4- or 8-bit blocks of 32 inputs (K a multiple of 32), else
    bf16 or fp16 values; None where it is none of these (or the kernel is not available).

    Args:
        weight: (N, K) fp32 on the CPU.
        fp32_panels: (ceil(N/16), K, 16) its `pack_panels` layout: the rebuilt panels must equal it (`same_panels`).
    """
    from specdraft.models.panel_linear import panel_lib

    lib = panel_lib()
    n, k = weight.shape
    if lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    w = weight.detach().contiguous()
    for bits in (4, 8) if k % BLOCK == 0 else ():
        probe = _search(w[: min(n, 64)], bits)  # most weights that are not of this form fail on their rows
        if probe is None:
            continue
        # Fast path: the candidate the probe's blocks fit most, for every row, checked on the rebuilt panels;
        # else every candidate per block (float64, ~10x slower).
        common = int(torch.bincount(probe[3].flatten()).argmax())
        for only in (common, None):
            parts = [_search(w[s : s + ROWS_PER_CHUNK], bits, only) for s in range(0, n, ROWS_PER_CHUNK)]
            if any(p is None for p in parts):
                break
            u, d, m, _ = (torch.cat(t) for t in zip(*parts, strict=True))
            store = _to_panels(u, d, m, bits)
            if pairing():
                store = pair(store)
            if same_panels(unpack(store), fp32_panels):
                return store
    half = _half_panels(w)
    return half if half is not None and same_panels(unpack(half), fp32_panels) else None


def same_panels(rebuilt: Tensor, panels: Tensor) -> bool:
    """Whether the panel kernel gives the same bits with `rebuilt` as with `panels`: the same fp32 values, where a
    zero may have the other sign (a dequantised Q4_0 holds -0.0 where u = 8 and d < 0). A zero's sign never
    reaches an output: every sum starts at +0.0 and adds products x * w with one FMA in round-to-nearest, so a
    +-0 product leaves a non-zero sum as it is and a zero sum at +0.0. NaN weights never compare equal."""
    return torch.equal(rebuilt, panels)


def unpack(store: ExactPanels) -> Tensor:
    """(P, K, 16) fp32 panels rebuilt by the kernel's own code (`sd_qpanel_unpack`)."""
    from specdraft.models.panel_linear import panel_lib

    lib = panel_lib()
    if lib is None:
        raise RuntimeError("the panel kernel is not available")
    if store.dot:
        raise ValueError("a q8-activation store (qdot) has no fp32 panels: its products differ from theirs")
    p, k = store.shape
    out = torch.empty(p, k, PANEL, dtype=torch.float32)
    lib.sd_qpanel_unpack(
        store.q.data_ptr(), store.d.data_ptr(), store.m.data_ptr(), store.code, p, k, out.data_ptr()
    )
    return out


def exact_product(x2: Tensor, store: ExactPanels, out_features: int, bias: Tensor | None) -> Tensor:
    """x2 (M, K) fp32 contiguous @ W.T + bias with W as `store` -> (M, out_features), the fp32 panel kernel's
    bits."""
    from specdraft.models.panel_linear import panel_lib

    y = torch.empty(x2.shape[0], out_features, dtype=torch.float32)  # (M, out)
    lib = panel_lib()
    if x2.shape[0] and lib is not None:
        lib.sd_qpanel_linear(
            x2.data_ptr(),
            x2.shape[0],
            x2.shape[1],
            store.q.data_ptr(),
            store.d.data_ptr(),
            store.m.data_ptr(),
            store.code,
            out_features,
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            torch.get_num_threads(),
        )
    return y


def declare(lib: ctypes.CDLL) -> None:
    """Argument types of the exact-panel entry points of the kernel library."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sd_qpanel_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int, i64, ptr, ptr, ctypes.c_int]
    lib.sd_qpanel_linear.restype = None
    lib.sd_qpanel_unpack.argtypes = [ptr, ptr, ptr, ctypes.c_int, i64, i64, ptr]
    lib.sd_qpanel_unpack.restype = None
    lib.sd_set_avx512.argtypes = [ctypes.c_int]
    lib.sd_set_avx512.restype = ctypes.c_int
    if hasattr(lib, "sd_set_vbmi"):  # a baseline library built from an older source (A/B runs) has none
        lib.sd_set_vbmi.argtypes = [ctypes.c_int]
        lib.sd_set_vbmi.restype = ctypes.c_int
    lib.sd_qdot_vnni.argtypes = []
    lib.sd_qdot_vnni.restype = ctypes.c_int


def set_avx512(on: bool) -> bool:
    """Run the kernel's AVX-512 paths where the CPU has them (`on`, the default; `SPECDRAFT_AVX512=0` starts a
    process without them) or never (the AVX2 paths, the same bits: for A/B runs and tests). Returns whether they
    run now."""
    from specdraft.models.panel_linear import panel_lib

    lib = panel_lib()
    return bool(lib.sd_set_avx512(int(on))) if lib is not None else False


def set_vbmi(on: bool) -> bool:
    """Rebuild paired 4-bit weights through AVX512-VBMI's multishift where the CPU has it and the AVX-512 paths
    run (`on`, the default; `SPECDRAFT_VBMI=0` starts a process without it), or through plain AVX-512 byte
    shuffles (the same bits: for A/B runs and tests). Returns whether the VBMI rebuild runs now."""
    from specdraft.models.panel_linear import panel_lib

    lib = panel_lib()
    return bool(lib.sd_set_vbmi(int(on))) if lib is not None else False
