"""Every decoder layer of a CPU decode step in one kernel call (`layer_rows.c`): `fast_target._layer_rows`'s
work without its Python.

`_layer_rows` runs a layer as ~11 kernel calls (norms, stacked panel products, rotary embedding, attention, the
gate) and ~30 torch views, splits and allocations. On a 2-core AMD EPYC a SmolLM2-135M one-token step spent ~13
of ~29 ms in that Python (docs/experiments.md, "Session 48"). `sd_decoder_layers` loops over the layers in C,
calling the same kernels in the same order on the same inputs, so its outputs are `_layer_rows`' bit for bit,
and writes each layer's keys and values into the decoder's preallocated cache (`RowsCache`).

It applies (`plan` is not None and `fits` gives a `Step`) where every layer takes the row kernels
(`fast_target._rows_ok`) and its attention and MLP outputs are PanelLinears too, over the decoders' own caches:
one sequence over an eager `eval/static_kv.StaticKVCache`, or a batch (its padding packed out, as `_layer_rows`
does) over an `eval/batch_kv.BatchKVCache`; elsewhere (transformers' caches, CUDA) `fast_forward` runs its layer
loop as before.
`SPECDRAFT_LAYER_ROWS=0` turns it off (A/B runs).
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from specdraft.models.exact_panels import ExactPanels
from specdraft.models.panel_linear import PanelLinear, StackedPanels, panel_lib

ENV = "SPECDRAFT_LAYER_ROWS"  # "0": the per-layer Python loop of fast_target (an A/B, a way out)
KIND_F32 = 32  # layer_rows.c: fp32 panels


def wanted() -> bool:
    """Whether the one-call layer loop may be used (`SPECDRAFT_LAYER_ROWS` is not "0")."""
    return os.environ.get(ENV, "1") != "0"


@runtime_checkable
class RowsCache(Protocol):
    """The KV cache layout `sd_decoder_layers` writes (eval/static_kv.StaticKVCache, eager).

    Attributes:
        buffer: (layers, 2, 1, kv_heads, max_len, head_dim) fp32 contiguous: keys then values per layer.
        length: committed positions (the new ones go after them).
        static: False (the eager layout; a static cache's whole-buffer attention is for CUDA graphs).
        max_len: positions a head holds.
    """

    buffer: Tensor
    length: int
    static: bool
    max_len: int


@runtime_checkable
class BatchRowsCache(Protocol):
    """The batched KV cache layout `sd_decoder_layers` writes (eval/batch_kv.BatchKVCache).

    Attributes:
        buffer: (layers, 2, rows, kv_heads, max_len, head_dim) fp32 contiguous: keys then values per layer.
        rows: the rows the next forward runs (a slice, or (R,) long indices), set by `prepare_write`.
        write_index: (R * kv_heads * L,) rows of one layer's keys (viewed (rows * kv_heads * max_len, d)) the
            new positions go to, laid out (R, kv_heads, L).
        span: positions attention reads per row.
        max_len: positions a head holds.
    """

    buffer: Tensor
    rows: slice | Tensor
    write_index: Tensor
    span: int
    max_len: int


class _Prod(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n_out", ctypes.c_int64),
        ("kind", ctypes.c_int32),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("qkv", _Prod),
        ("o", _Prod),
        ("gate_up", _Prod),
        ("down", _Prod),
    ]


@dataclass
class Plan:
    """A decoder's layers as `sd_decoder_layers` reads them.

    Attributes:
        table: one `_Layer` per layer (pointers into the model's own weights).
        held: every tensor the table points into, kept alive with it.
        heads, kv_heads, head_dim, inter: the geometry.
        scale: the attention score scale.
    """

    table: ctypes.Array
    held: list[Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    scale: float


# per decoder: (the modules its plan was built from, the plan or None where the loop does not apply, the
# registration count when they were last checked)
_PLANS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[nn.Module | Tensor, ...], Plan | None, int]] = (
    weakref.WeakKeyDictionary()
)
_REGISTERED = [0]  # submodules and parameters registered by any module in this process (torch's global hooks)


def _count_registration(*_: object) -> None:
    """torch's global registration hook: a module assigned a submodule or a parameter (returns None: the value
    stays as it is)."""
    _REGISTERED[0] += 1


# Replacing a Linear or a norm weight goes through these hooks (`setattr`, `register_module`,
# `register_parameter`), so a plan whose count has not moved needs no identity check (0.3 ms of a ~13 ms step).
nn.modules.module.register_module_module_registration_hook(_count_registration)
nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def _prod(panels: Tensor | ExactPanels, n_out: int, bias: Tensor | None, held: list[Tensor]) -> _Prod:
    """A product's entry: fp32 panels or exact panels, with its bias (contiguous fp32) or none; the tensors it
    points into are appended to `held`."""
    b = bias.detach() if bias is not None else None
    bp = b.data_ptr() if b is not None else None
    held.extend([b] if b is not None else [])
    if isinstance(panels, ExactPanels):
        held.extend([panels.q, panels.d, panels.m])
        return _Prod(panels.q.data_ptr(), panels.d.data_ptr(), panels.m.data_ptr(), bp, n_out, panels.code)
    held.append(panels)
    return _Prod(panels.data_ptr(), None, None, bp, n_out, KIND_F32)


def _modules(decoder: Any) -> tuple[nn.Module | Tensor, ...]:
    """The modules and norm weights a plan reads, in order (their identity is checked on every forward, so read
    from the modules' own `_modules` / `_parameters` dicts: `nn.Module.__getattr__` made this 1.2 ms a step)."""
    out: list[nn.Module | Tensor] = []
    for layer in decoder.layers:
        sub = layer._modules
        attn, mlp = sub["self_attn"]._modules, sub["mlp"]._modules
        out += (attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"])
        out += (mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
        out += (
            sub["input_layernorm"]._parameters["weight"],
            sub["post_attention_layernorm"]._parameters["weight"],
        )
    return tuple(out)


def plan(decoder: Any, layer_rows: Callable[[nn.Module], tuple[Any, bool]]) -> Plan | None:
    """The decoder's plan (built once, again when its Linears were replaced), or None where a layer does not
    take the row kernels or its o / down product is not a PanelLinear.

    Args:
        decoder: the HF decoder (`model.get_decoder()`), every layer accepted by `fast_target.unsupported`.
        layer_rows: layer -> (its q/k/v and gate/up StackedPanels or None, whether it takes the row kernels):
            `fast_target`'s `_stacks` and `_rows_ok`, called only when the plan is (re)built.
    """
    seen = _PLANS.get(decoder)
    count = _REGISTERED[0]
    if seen is not None and seen[2] == count:
        return seen[1]  # nothing registered anywhere since the last check
    mods = _modules(decoder)
    if (
        seen is None
        or len(seen[0]) != len(mods)
        or any(a is not b for a, b in zip(seen[0], mods, strict=True))
    ):
        seen = (mods, _build(decoder, [layer_rows(layer) for layer in decoder.layers]), count)
    _PLANS[decoder] = (seen[0], seen[1], count)
    return seen[1]


def _build(decoder: Any, info: list[tuple[Any, bool]]) -> Plan | None:
    """The plan of `decoder` from each layer's (stacks, takes the row kernels), or None (`plan`)."""
    if not all(ok for _, ok in info) or _lib() is None:  # (a GPU's layers never build the CPU kernels)
        return None
    layers = list(decoder.layers)
    first = layers[0].self_attn
    d = int(first.head_dim)
    entries = []
    geometry = set()
    held: list[Tensor] = []
    for layer, (st, _) in zip(layers, info, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = st
        if not isinstance(qkv, StackedPanels) or not isinstance(gate_up, StackedPanels):
            return None
        if not isinstance(attn.o_proj, PanelLinear) or not isinstance(mlp.down_proj, PanelLinear):
            return None
        wq, wk, wv = qkv.sizes
        inter = gate_up.sizes[0]
        if wk != wv or gate_up.sizes[1] != inter or wq % d or wk % d:
            return None
        geometry.add((wq // d, wk // d, inter, float(attn.scaling)))
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        held.extend([n1.weight, n2.weight])
        entries.append(
            _Layer(
                n1.weight.data_ptr(),
                n2.weight.data_ptr(),
                float(n1.variance_epsilon),
                float(n2.variance_epsilon),
                _prod(qkv.panels, sum(qkv.sizes), qkv.bias, held),
                _prod(attn.o_proj.panels, attn.o_proj.out_features, attn.o_proj.bias, held),
                _prod(gate_up.panels, 2 * inter, gate_up.bias, held),
                _prod(mlp.down_proj.panels, mlp.down_proj.out_features, mlp.down_proj.bias, held),
            )
        )
    if len(geometry) != 1:
        return None  # layers of different shapes: not this loop's
    heads, kv_heads, inter, scale = geometry.pop()
    table = (_Layer * len(entries))(*entries)
    return Plan(table, held, heads, kv_heads, d, inter, scale)


@dataclass
class Step:
    """Where `run` writes and reads this step's keys and values (`fits`).

    Attributes:
        rows: B, the rows of the step; n: new positions a row.
        cache_rows: rows the cache buffer holds.
        widx: (B * kv_heads * n,) long rows of one layer's keys viewed (cache_rows * kv_heads * max_len, d),
            laid out (B, kv_heads, n): where each new key and value goes.
        krow: (B,) long, each row's cache row (None: row b is cache row b).
        span: positions attention reads per row.
    """

    rows: int
    n: int
    cache_rows: int
    widx: Tensor
    krow: Tensor | None
    span: int


def fits(p: Plan, x: Tensor, mask: Tensor | None, cache: Any, packed: Any = None) -> Step | None:
    """The `Step` when `run` computes this forward, else None: x fp32 on the CPU, (B, n, H) or with `packed`
    (`fast_target.Packing`) (T, H); a cache of this geometry, eager `RowsCache` (B = 1, room for n more) or
    `BatchRowsCache` (its `prepare_write` done); mask None (n = 1 over a `RowsCache`) or fp32 (B or 1, 1, n or 1,
    the keys attention reads) with a contiguous last dimension."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if packed is not None:
        b, n = packed.shape
        if x.dim() != 2 or packed.rows.dtype != torch.long:
            return None
    elif x.dim() == 3:
        b, n = x.shape[0], x.shape[1]
    else:
        return None
    kind = _cache_kind(cache)
    buf = cache.buffer if kind else None
    if buf is None or buf.dtype != torch.float32 or not buf.is_contiguous() or buf.dim() != 6:
        return None
    if (
        buf.shape[0] != len(p.table)
        or buf.shape[1] != 2
        or tuple(buf.shape[3:]) != (p.kv_heads, cache.max_len, p.head_dim)
    ):
        return None
    if kind == 1:  # a RowsCache
        if cache.static or b != 1 or buf.shape[2] != 1 or cache.length + n > cache.max_len:
            return None
        if mask is None and n != 1:
            return None
        start = cache.length
        pos = torch.arange(start, start + n)  # (n,)
        heads = torch.arange(p.kv_heads)[:, None] * cache.max_len  # (kv, 1)
        step = Step(1, n, 1, (heads + pos[None]).reshape(-1), None, start + n)
    else:
        rows = cache.rows
        krow = torch.arange(rows.start or 0, (rows.start or 0) + b) if isinstance(rows, slice) else rows
        if krow.numel() != b or cache.write_index.numel() != b * p.kv_heads * n or b == 0:
            return None
        cells = int(buf.shape[2]) * p.kv_heads * cache.max_len  # rows of one layer's keys: the C side trusts
        if not 0 < int(cache.span) <= cache.max_len or int(krow.min()) < 0 or int(krow.max()) >= buf.shape[2]:
            return None  # what it is told (the per-layer loop's index_copy_ would raise)
        if int(cache.write_index.min()) < 0 or int(cache.write_index.max()) >= cells:
            return None
        step = Step(
            b, n, int(buf.shape[2]), cache.write_index, krow.to(torch.long).contiguous(), int(cache.span)
        )
    if mask is None:
        return step
    ok = (
        mask.dtype == torch.float32
        and mask.dim() == 4
        and mask.shape[0] in (1, b)
        and mask.shape[1] == 1
        and mask.shape[2] in (1, n)
        and mask.shape[3] == step.span
        and mask.stride(3) == 1
    )
    return step if ok else None


def _cache_kind(cache: Any) -> int:
    """1 for a `RowsCache`, 2 for a `BatchRowsCache`, 0 for neither: decided once per cache class (a runtime
    protocol check reads every attribute, ~0.1 ms; the caches set theirs in `__init__`)."""
    cls = type(cache)
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = (
            1 if isinstance(cache, RowsCache) else 2 if isinstance(cache, BatchRowsCache) else 0
        )
    return kind


_KINDS: dict[type, int] = {}  # cache class -> `_cache_kind`


def run(
    p: Plan,
    step: Step,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    mask: Tensor | None,
    cache: Any,
    keep_layers: tuple[int, ...] | list[int] = (),
    packed: Any = None,
) -> tuple[Tensor, dict[int, Tensor]]:
    """Every layer on x ((B, n, H), or (T, H) with `packed`), writing its keys and values into `cache` where
    `step` (from `fits`) says.

    Args:
        rope: `fast_target.rotary_tables` (B or 1, 1, n, d) each.
        keep_layers: layer outputs to return (i = output of layer i, 1-based, as transformers numbers them).
        packed: the `fast_target.Packing` of x, or None.

    Returns:
        (x after the last layer, {i: output of layer i} for i in keep_layers), each shaped as x.
    """
    h = x.shape[-1]
    out = x.contiguous().clone()  # (B, n, H) | (T, H): the residual stream, updated in place
    t = out.numel() // h
    count = len(p.table)
    keep = {i: torch.empty_like(out) for i in keep_layers if 1 <= i <= count}
    ptrs = (ctypes.c_void_p * count)(
        *[keep[i + 1].data_ptr() if i + 1 in keep else None for i in range(count)]
    )
    cos, ssin = (r.reshape(-1, p.head_dim).contiguous() for r in rope)  # (B * n | n, d)
    pack = packed.rows.contiguous() if packed is not None else None
    widx = step.widx.contiguous()
    mp, mb, mrow = (None, 0, 0) if mask is None else (
        mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2) if mask.shape[2] > 1 else 0
    )  # fmt: skip
    _lib().sd_decoder_layers(
        p.table, count, step.rows, step.n, t, pack.data_ptr() if pack is not None else None,
        h, p.heads, p.kv_heads, p.head_dim, p.inter,
        cache.buffer.data_ptr(), step.cache_rows, cache.max_len, widx.data_ptr(),
        step.krow.data_ptr() if step.krow is not None else None, step.span,
        cos.data_ptr(), ssin.data_ptr(), cos.shape[0], mp, mb, mrow, p.scale, out.data_ptr(), ptrs,
        torch.get_num_threads(),
    )  # fmt: skip
    return out, keep


def _lib() -> Any:
    """The kernel library (`panel_lib`: the one an A/B swapped in, if any) with `sd_decoder_layers` declared, or
    None where the panel kernel does not build."""
    lib = panel_lib()
    if lib is None:
        return None
    if id(lib) not in _DECLARED:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn = lib.sd_decoder_layers
        fn.argtypes = [
            ptr, i64, i64, i64, i64, ptr,  # table, layers, B, n, T, pack
            i64, i64, i64, i64, i64,  # H, heads, kv_heads, d, inter
            ptr, i64, i64, ptr, ptr, i64,  # cache, cache rows, max_len, widx, krow, span
            ptr, ptr, i64, ptr, i64, i64,  # cos, ssin, rope rows, mask, mask batch stride, mask row stride
            ctypes.c_float, ptr, ptr, ctypes.c_int,  # scale, x, keep, threads
        ]  # fmt: skip
        fn.restype = None
        _DECLARED.add(id(lib))
    return lib


_DECLARED: set[int] = set()  # ids of the libraries `_lib` declared (each stays loaded for the process)
