"""A lean decode-time forward of a Llama-family target's decoder (Llama, Mistral, Qwen2), for the decoders.

transformers' decoder forward pays, on every decode step, for what a decode step does not need: keyword
plumbing and decorators on every module call, output-capture hooks for `output_hidden_states`, mask
preprocessing, and an RMSNorm of nine small ops (cast, pow, mean = sum + div, add, rsqrt, mul, cast, mul).
On a 2-core AMD EPYC (Zen 3, fp32, panel products) a SmolLM2-135M AR step spent ~40% of its time outside the
210 Linear products (docs/experiments.md, "Session 34"); on a GPU every small op is a kernel launch, inside
a CUDA graph too. `fast_forward` computes the same layers:

    x = embed(ids);  cos, sin = rotary(x, positions)                         transformers' own modules
    per layer:  h = x + o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))    the layer's own Linears
                x = h + down(act(gate(n2(h))) * up(n2(h)))                   (any weight layout)
    n(x) = w * F.rms_norm(x in fp32)                                        one fused op
    attn: the model's configured attention function (transformers' SDPA, or `models/attention.py`'s)

so outputs equal transformers' to rounding (the same products and attention; the norm fused), and the weights
are the model's own (no copy). A layer's q/k/v and gate/up products run as one product each over their stacked
weights (`StackedLinear` on plain Linears: GPUs, native-layout CPUs; `StackedPanels` on the CPU's panels), of
which the Linears keep views, and q and k are rotated together: ~7 fewer ops (kernels on a GPU) a layer.
Where it does not apply (`fast_forward` returns None) the caller runs transformers' forward: another layer type
(`unsupported`) or attention than SDPA's, no explicit 4D mask over several new tokens (a causal prefill, a padding
mask: transformers builds the mask), or a sliding window the keys would exceed. `SPECDRAFT_TARGET_FORWARD=hf`
turns it off (`wanted`).

A batched tree verify pads every row to the widest tree of the step (`eval/batch_decode.py`): at batch 16 a
single row drafting 10 tokens makes all 16 rows carry 11 positions. With `packed` (`Packing`) only the wanted
positions go through the embeddings, norms, projections and MLPs (the products are most of a small model's
per-token cost, and on a CPU their cost follows the rows they get); the padding positions join only the
attention, as zeros, so every (B, L) shape of the attention and the cache stays as it is.

Where a layer's products run the CPU panel kernel (fp32), `_layer_rows` runs the norms, residual adds, rotary
embedding, SiLU gate and attention as the row kernels of `models/row_ops.py` (six calls a layer instead of ~40
torch ops; `SPECDRAFT_ROW_OPS=0` turns them off): every per-token computation is then row-invariant, so a tree
verify's logits equal the AR steps' bit for bit.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdraft.models import fused_ops, layer_rows, row_ops, stacked_linear
from specdraft.models.attention import NAME
from specdraft.models.panel_linear import StackedPanels
from specdraft.models.stacked_linear import StackedLinear

# "hf": the decoders run transformers' forward everywhere (an A/B, a way out)
ENV = "SPECDRAFT_TARGET_FORWARD"
SDPA = ("sdpa", NAME)  # attention implementations the lean forward calls (transformers' SDPA and ours)
# decoder layers whose forward `fast_forward` reproduces (attention without q/k norms, gated MLP, RMSNorms)
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


def unsupported_layer(layer: nn.Module) -> str | None:
    """None when `layer` is a pre-norm decoder layer these fast forwards reproduce, else why not (one line)."""
    kind = type(layer).__name__
    if kind not in LAYERS:
        return f"{kind} is not one of {', '.join(LAYERS)}"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
        return f"{kind}: attention with q/k norms or without self_attn/mlp"
    norms = [m for n, m in layer.named_children() if n.endswith("norm")]
    if any(type(m).__name__ not in NORMS and not isinstance(m, nn.Identity) for m in norms):
        return f"{kind}: a norm that is neither an RMSNorm nor dropped (Identity)"
    if getattr(mlp, "down_proj", None) is None or getattr(mlp, "gate_proj", None) is None:
        return f"{kind}: not a gated MLP"
    return None


def wanted() -> bool:
    """Whether the decoders use `fast_forward` (unless `SPECDRAFT_TARGET_FORWARD=hf`)."""
    return os.environ.get(ENV, "fast") != "hf"


def unsupported(model: nn.Module) -> str | None:
    """None when `fast_forward` runs `model`'s decoder, else why not (one line)."""
    decoder: Any = cast(Any, model).get_decoder()
    for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
        if getattr(decoder, name, None) is None:
            return f"{type(decoder).__name__} has no {name}"
    if type(decoder.norm).__name__ not in NORMS:
        return f"final norm {type(decoder.norm).__name__} is not an RMSNorm"
    return next((why for why in map(unsupported_layer, decoder.layers) if why is not None), None)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm of x (..., H) with `weight` (H,): statistics in fp32, one fused op where the device
    has one (CUDA; a CPU runs its composite)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _norm(norm: Any, x: Tensor) -> Tensor:
    """An HF RMSNorm module's output on x (..., H)."""
    return rms_norm(x, norm.weight, float(norm.variance_epsilon))


def rotary_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' (cos, sin) (..., d) -> (cos, sin with its first half negated), the tables `rotate` takes:
    the sign of rotate_half folded in once per forward instead of a negation per tensor and layer."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate(t: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding of t (B, heads, n, d) with `rotary_tables` (B, 1, n, d): transformers'
    t * cos + rotate_half(t) * sin, bit for bit (a sign moved between the factors of a product)."""
    return t * cos + t.roll(t.shape[-1] // 2, dims=-1) * signed_sin


# per decoder layer: (its q/k/v and gate/up modules when last seen, their stacked products or None, whether the
# row kernels fit the layer: `_row_fit`, checked once with the stacks)
_STACKS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[nn.Module, ...], Any, bool]] = (
    weakref.WeakKeyDictionary()
)


def _projections(layer: Any) -> tuple[Any, ...]:
    """The layer's q, k, v, gate and up modules: the two groups the stacks merge."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj


def _replaced(seen: tuple[nn.Module, ...], mods: tuple[nn.Module, ...]) -> bool:
    """Whether a layout (or anything else) replaced any of the modules a stack was built from."""
    return any(a is not b for a, b in zip(seen, mods, strict=True))


def _stacks(layer: Any) -> tuple[StackedPanels, StackedPanels] | None:
    """The layer's q/k/v and gate/up products as one panel-kernel call each (`StackedPanels`, on the CPU's
    panel layout: the same bits, ~1.7x / ~1.3x less time for the few rows of a decode step on a 2-core EPYC);
    None for any other layout. Built on first use, again when a layout replaced the modules."""
    mods = _projections(layer)
    seen = _STACKS.get(layer)
    if seen is None or _replaced(seen[0], mods):
        qkv, gate_up = list(mods[:3]), list(mods[3:])
        ok = StackedPanels.stackable(qkv) and StackedPanels.stackable(gate_up)
        stacks = (StackedPanels(qkv), StackedPanels(gate_up)) if ok else None
        seen = _STACKS[layer] = (mods, stacks, stacks is not None and _row_fit(layer))
    return seen[1]


# per decoder layer: (its q/k/v and gate/up modules when last seen, their `StackedLinear`s or None)
_LINEAR_STACKS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[nn.Module, ...], Any]] = (
    weakref.WeakKeyDictionary()
)


def _linear_stacks(layer: Any) -> tuple[StackedLinear, StackedLinear] | None:
    """The layer's q/k/v and gate/up plain Linears as one product each (`models/stacked_linear.py`: their weights
    become views of one buffer); None where they do not stack (the CPU layouts' modules). Built on first use
    (`stack_linears` does it when a decoder is built), again when the modules or their weights were replaced."""
    mods = _projections(layer)
    seen = _LINEAR_STACKS.get(layer)
    # stale: new modules, or a move or reload replaced the weights of the stacked ones
    if seen is None or _replaced(seen[0], mods) or not all(s.current() for s in seen[1] or ()):
        qkv, gate_up = list(mods[:3]), list(mods[3:])
        ok = StackedLinear.stackable(qkv) and StackedLinear.stackable(gate_up)
        seen = _LINEAR_STACKS[layer] = (mods, (StackedLinear(qkv), StackedLinear(gate_up)) if ok else None)
    return seen[1]


def stack_linears(model: nn.Module) -> int:
    """Move every decoder layer's q/k/v and gate/up plain Linears into their stacks now (`_linear_stacks`), where
    the lean forward runs `model`. The decoders call it when they are built: a CUDA graph keeps the weight
    addresses it captured, so the weights must sit in their stacks before any graph (transformers' forward
    included) reads them. Returns how many layers are stacked."""
    if not wanted() or unsupported(model) is not None:
        return 0
    layers = cast(Any, model).get_decoder().layers
    return sum(_linear_stacks(layer) is not None for layer in layers)


@dataclass(frozen=True)
class Packing:
    """The positions of a (B, L) step whose outputs are wanted (the others: a batch's padding).

    Attributes:
        rows: (T,) long, ascending flat indices into the B * L positions.
        shape: (B, L).
    """

    rows: Tensor
    shape: tuple[int, int]

    @staticmethod
    def of(valid: Tensor) -> Packing | None:
        """From a (B, L) bool mask of the wanted positions; None when every position is wanted (one host read
        of the count: for the eager CPU path only)."""
        flat = valid.reshape(-1)
        rows = flat.nonzero().squeeze(1)  # (T,)
        return None if rows.numel() == flat.numel() else Packing(rows, (valid.shape[0], valid.shape[1]))

    def spread(self, t: Tensor, zeros: bool = True) -> Tensor:
        """(T, C) -> (B, L, C), zeros at the other positions (`zeros=False`: left unset, for callers that never
        read them: no fill of the whole buffer)."""
        b, n = self.shape
        out = t.new_zeros(b * n, t.shape[-1]) if zeros else t.new_empty(b * n, t.shape[-1])
        return out.index_copy_(0, self.rows, t).view(b, n, -1)

    def gather(self, t: Tensor) -> Tensor:
        """(B, L, C) -> (T, C), the wanted positions in order."""
        return t.reshape(-1, t.shape[-1]).index_select(0, self.rows)


def _row_fit(layer: Any) -> bool:
    """Whether the row kernels (`models/row_ops.py`) compute `layer` (its products stacked on the panel kernel):
    RMSNorms both, a SiLU gate, a head the kernel rotates, the kernel library built."""
    d = int(layer.self_attn.head_dim)
    return (
        all(type(n).__name__ in NORMS for n in (layer.input_layernorm, layer.post_attention_layernorm))
        and type(layer.mlp.act_fn).__name__ in ("SiLU", "SiLUActivation")
        and d % 2 == 0
        and d <= row_ops.MAX_HEAD_DIM
        and row_ops.row_lib() is not None
    )


def _rows_ok(layer: Any, stacks: tuple[StackedPanels, StackedPanels] | None) -> bool:
    """Whether `_layer` takes the row kernels for `layer` (`stacks`: `_stacks(layer)`, which checked the fit
    once): a stacked panel layer they fit, unless `SPECDRAFT_ROW_OPS=0`."""
    return stacks is not None and _STACKS[layer][2] and row_ops.wanted()


def _attend(
    attn: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, cache: Any, rows: bool = False
) -> Tensor:
    """Attention of rotated q (B, heads, n, d) over the cache after appending k, v (B, kv_heads, n, d) to it
    -> (B, n, heads x d). `rows`: the row kernel (`row_ops.attention`: every query alone, the same bits for a
    position whatever the step's shape) where it takes the inputs (fp32, a mask shared by the heads)."""
    b, n = q.shape[0], q.shape[2]
    k, v = cache.update(k, v, attn.layer_idx)  # (B, kv_heads, S, d)
    out = row_ops.attention(q, k, v, mask, float(attn.scaling)) if rows else None
    if out is not None:
        return out.view(b, n, -1)
    fn = ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]  # an SDPA one (`fast_forward` checks)
    # Mistral / Qwen2 attention layers hand their window to the function as transformers does (SDPA: the mask
    # already encodes it); Llama layers have none
    window = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
    out, _ = fn(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **window)  # (B, n, heads, d)
    return out.reshape(b, n, -1)


def _layer(
    layer: Any,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    mask: Tensor | None,
    cache: Any,
    pack: Packing | None = None,
) -> Tensor:
    """One pre-norm decoder layer on x (B, n, H), or (T, H) with `pack`, appending n positions to `cache`
    -> x's shape. rope: `rotary_tables` (B or 1, 1, n, d) each."""
    attn, mlp = layer.self_attn, layer.mlp
    b, n = pack.shape if pack is not None else x.shape[:2]
    stacks = _stacks(layer)
    if _rows_ok(layer, stacks):
        return _layer_rows(layer, cast(tuple, stacks), x, rope, mask, cache, pack)
    one = stacks if stacks is not None else _linear_stacks(layer) if stacked_linear.wanted() else None
    if one is not None:
        return _layer_stacked(layer, one, x, rope, mask, cache, pack)
    h = _norm(layer.input_layernorm, x)
    qkv: tuple[Tensor, ...] = (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
    if pack is not None:
        qkv = tuple(pack.spread(t) for t in qkv)  # (B, n, out): the padding positions attend as zeros
    q, k, v = (t.view(b, n, -1, attn.head_dim).transpose(1, 2) for t in qkv)  # (B, heads | kv_heads, n, d)
    out = _attend(attn, rotate(q, *rope), rotate(k, *rope), v, mask, cache)
    x = x + attn.o_proj(pack.gather(out) if pack is not None else out)
    h = _norm(layer.post_attention_layernorm, x)
    return x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))


def _layer_stacked(
    layer: Any,
    stacks: tuple[StackedPanels, StackedPanels] | tuple[StackedLinear, StackedLinear],
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    mask: Tensor | None,
    cache: Any,
    pack: Packing | None,
) -> Tensor:
    """`_layer` over stacked products (`StackedPanels` on the CPU's panels, `StackedLinear` over plain Linears):
    q|k|v and gate|up one product each, and q and k rotated together in the product's own layout, so a layer
    makes ~7 fewer ops (kernels on a GPU). The rotary embedding and every elementwise op compute the same bits
    as `_layer`'s; the stacked products equal the separate ones up to the rounding of a wider GEMM (bit for bit
    on the panels)."""
    attn, mlp = layer.self_attn, layer.mlp
    b, n = pack.shape if pack is not None else x.shape[:2]
    d = int(attn.head_dim)
    # each elementwise stretch one compiled kernel (`SPECDRAFT_FUSED_OPS=on`), else op by op
    f = fused_ops.ops()
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    qkv = stacks[0].whole(f["norm"](x, n1.weight, float(n1.variance_epsilon)))  # (B, n | T, Wq + Wk + Wv)
    if pack is not None:
        qkv = pack.spread(qkv)  # (B, n, W): the padding positions attend as zeros
    heads = qkv.view(b, n, -1, d)  # (B, n, heads + 2 kv_heads, d)
    nq, nk = stacks[0].sizes[0] // d, stacks[0].sizes[1] // d
    cos, ssin = (t.transpose(1, 2) for t in rope)  # (B or 1, n, 1, d) each
    qk = f["rotate_heads"](heads, nq + nk, cos, ssin)  # (B, n, heads + kv_heads, d)
    q, k, v = (t.transpose(1, 2) for t in (qk.narrow(2, 0, nq), qk.narrow(2, nq, nk), heads[:, :, nq + nk :]))
    out = _attend(attn, q, k, v, mask, cache)  # (B, n, heads x d); q, k, v (B, heads | kv_heads, n, d)
    o = attn.o_proj(pack.gather(out) if pack is not None else out)
    x, h = f["add_norm"](x, o, n2.weight, float(n2.variance_epsilon))  # the residual, the MLP's input
    if type(mlp.act_fn).__name__ in ("SiLU", "SiLUActivation"):
        act = f["silu_mul"](stacks[1].whole(h), stacks[1].sizes[0])
    else:
        gate, up = stacks[1](h)
        act = mlp.act_fn(gate) * up
    return x + mlp.down_proj(act)


def _layer_rows(
    layer: Any,
    stacks: tuple[StackedPanels, StackedPanels],
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    mask: Tensor | None,
    cache: Any,
    pack: Packing | None,
) -> Tensor:
    """`_layer` with its norms, residual adds, rotary embedding and gate as row kernels (`models/row_ops.py`):
    the same products, six calls instead of ~40 torch ops a layer."""
    attn, mlp = layer.self_attn, layer.mlp
    b, n = pack.shape if pack is not None else x.shape[:2]
    d = int(attn.head_dim)
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    x = x.contiguous()
    qkv = stacks[0].whole(row_ops.rms_norm(x, n1.weight, float(n1.variance_epsilon)))  # (B, n | T, Wq+Wk+Wv)
    if pack is not None:
        qkv = pack.spread(qkv)  # (B, n, W): the padding positions attend as zeros
    sizes = stacks[0].sizes
    cos, ssin = (t.reshape(-1, d) for t in rope)  # (B*n | n, d): row r of qkv takes table row r % rows
    row_ops.rope_(qkv.view(-1, qkv.shape[-1]), (sizes[0] + sizes[1]) // d, d, cos, ssin)  # q, k in place
    q, k, v = (t.view(b, n, -1, d).transpose(1, 2) for t in qkv.split(sizes, dim=-1))  # (B, heads, n, d)
    out = _attend(attn, q, k, v, mask, cache, rows=True)
    o = attn.o_proj(pack.gather(out) if pack is not None else out)
    x, h = row_ops.add_rms_norm(x, o.reshape(x.shape), n2.weight, float(n2.variance_epsilon))
    gate, up = stacks[1].whole(h).view(-1, sum(stacks[1].sizes)).split(stacks[1].sizes, dim=-1)
    return x + mlp.down_proj(row_ops.silu_mul(gate, up).view(*x.shape[:-1], -1))


def _layer_info(layer: nn.Module) -> tuple[tuple[StackedPanels, StackedPanels] | None, bool]:
    """(the layer's stacked products, whether it takes the row kernels): what `layer_rows.plan` builds from."""
    stacks = _stacks(layer)
    return stacks, stacks is not None and bool(_STACKS[layer][2])


def one_call_layers(model: nn.Module) -> bool:
    """Whether a step of `model` with an explicit mask over the decoders' own eager cache runs every layer in
    one kernel call (`models/layer_rows.py`): a CPU panel target with the row kernels and the loop on. A caller
    may then give a prompt as masked chunks instead of transformers' causal forward (`eval/static_decode.py`)."""
    if unsupported(model) is not None:
        return False
    decoder: Any = cast(Any, model).get_decoder()
    return _fused_plan(decoder) is not None


def _fused_plan(decoder: Any) -> layer_rows.Plan | None:
    """`layer_rows`' plan of the decoder where its one-call layer loop may run (row kernels wanted, the loop
    not turned off), else None."""
    if not (layer_rows.wanted() and row_ops.wanted()):
        return None
    return layer_rows.plan(decoder, _layer_info)


def fast_forward(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    cache: Any,
    layers: tuple[int, ...] | list[int] = (),
    packed: Packing | None = None,
) -> tuple[Tensor, Tensor | None] | None:
    """The decoder forward of a decode step (module docstring); None where transformers' forward must run.

    Args:
        model: an HF causal LM that `unsupported` accepts (the caller checks once).
        input_ids: (B, L) new tokens.
        attention_mask: (B or 1, 1, L, S) additive or boolean mask over the keys `cache.update` returns, or
            None for one new token per row seeing every cached position.
        position_ids: (B, L) rotary positions, or None (consecutive after the cache).
        cache: the decoder's KV cache (`update(k, v, layer_idx)`, `get_seq_length()`).
        layers: `hidden_states` indices to return as transformers numbers them (0 = embeddings, i = output of
            layer i, num_layers = the final normed states).
        packed: the positions whose outputs are wanted (a batch's padding left out of every per-token
            product); the others' outputs are zeros, their cache entries written but meant never to be read
            by a wanted position. None: all.

    Returns:
        (hidden (B, L, H) after the final norm, (B, L, m, H) the requested layers | None), or None.
    """
    decoder: Any = cast(Any, model).get_decoder()
    if decoder.config._attn_implementation not in SDPA:
        return None  # eager attention (a function per model), flash attention (its own mask handling)
    if attention_mask is not None and attention_mask.ndim != 4:
        return None  # a (B, S) padding mask: transformers turns it into the 4D mask
    n = input_ids.shape[1]
    if attention_mask is None and n > 1:
        return None  # a causal prefill: transformers builds the mask
    past = int(cache.get_seq_length()) if attention_mask is None or position_ids is None else 0
    window = getattr(decoder.config, "sliding_window", None)
    if attention_mask is None and window is not None and past + n > int(window):
        return None  # transformers' mask would hide the keys past the window
    ids = input_ids.reshape(-1).index_select(0, packed.rows) if packed is not None else input_ids
    x = decoder.embed_tokens(ids)  # (B, L, H) | (T, H)
    if position_ids is None:
        position_ids = torch.arange(past, past + n, device=x.device)[None]  # (1, L)
    cos, sin = decoder.rotary_emb(x, position_ids)  # (B, L, d) each
    rope = rotary_tables(cos[:, None], sin[:, None])  # (B, 1, L, d) each
    keep: dict[int, Tensor] = {0: x} if 0 in layers else {}
    count = len(decoder.layers)
    fused = _fused_plan(decoder)
    step = layer_rows.fits(fused, x, attention_mask, cache, packed) if fused is not None else None
    if fused is not None and step is not None:  # every layer in one call
        x, kept = layer_rows.run(fused, step, x, rope, attention_mask, cache, layers, packed)
        keep.update(kept)
    else:
        for i, layer in enumerate(decoder.layers):
            x = _layer(layer, x, rope, attention_mask, cache, packed)
            if i + 1 in layers:
                keep[i + 1] = x
    last = decoder.layers[count - 1]
    if _rows_ok(last, _stacks(last)):  # the layers ran on the row kernels: the final norm too (row-invariant)
        x = row_ops.rms_norm(x.contiguous(), decoder.norm.weight, float(decoder.norm.variance_epsilon))
    else:
        x = _norm(decoder.norm, x)
    if count in layers:
        keep[count] = x  # transformers numbers the final normed states as the last layer's
    if packed is not None:
        x, keep = packed.spread(x), {i: packed.spread(t) for i, t in keep.items()}
    extra = torch.stack([keep[i] for i in layers], dim=2) if layers else None  # (B, L, m, H)
    return x, extra
