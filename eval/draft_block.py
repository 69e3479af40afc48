"""A decode-time copy of an EAGLE head's decoder layer for CPU drafting (`eval.draft_block`).

An EAGLE head drafts with one decoder layer of the target's own type (`models.eagle_common.target_block`),
run through transformers' modules: on a CPU each head pass at 4 rows was ~60% matrix products and ~40% small
ops (the RMSNorms' casts, three separate q/k/v products, two gate/up products, rotary bookkeeping, the
attention interface). `FastBlock` computes the same layer with fewer, larger ops:

    q, k, v = split(x @ [Wq; Wk; Wv]^T)      one product instead of three
    gate, up = split(h @ [Wg; Wu]^T)        one product instead of two
    rms(x) = w * F.rms_norm(x in fp32)      as transformers' RMSNorm, in one kernel

and, with `int8`, every product of the block (and the head's `fc`) as a dynamic-int8 fbgemm product
(`proposers.Int8Linear`), halving the weight bytes a pass streams. In fp32 without int8 it equals the HF
layer exactly (tests); int8 changes the drafts slightly, never the output (verify decides every token).

Only Llama-family layers are copied (`supported`: Llama, Mistral, Qwen2: q/k/v/o projections with optional
biases, a gated MLP, RMSNorms, a dropped norm as Identity), and only on a CPU (on CUDA the graphs remove the launch cost); any other
layer keeps the HF modules (`draft_block` returns None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache

from specdraft.models.fast_target import rms_norm, rotary_tables, rotate, unsupported_layer
from specdraft.models.layers import CopyCache, weights_key

if TYPE_CHECKING:
    from specdraft.models.family import FamilySpec


def supported(layer: nn.Module) -> str | None:
    """None when `FastBlock` reproduces `layer`, else why not (one line): the layers the target's fast forward
    runs (`models.fast_target.unsupported_layer`)."""
    return unsupported_layer(layer)


class _Product(nn.Module):
    """y = x @ W^T + b over one or more Linears stacked along the outputs, in the head's dtype or int8."""

    def __init__(self, linears: list[nn.Linear], int8: bool) -> None:
        super().__init__()
        w = torch.cat([lin.weight.detach() for lin in linears])  # (sum out, in)
        b: Tensor | None = None
        if any(lin.bias is not None for lin in linears):
            b = torch.cat(
                [w.new_zeros(lin.out_features) if lin.bias is None else lin.bias.detach() for lin in linears]
            )
        self.dtype = w.dtype
        self.int8 = None
        if int8:  # the int8 copy replaces the stacked weights (only it is kept)
            from specdraft.eval.proposers import Int8Linear

            stacked = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
            stacked.weight.data = w.float()
            if b is not None:
                cast(Tensor, stacked.bias).data = b.float()
            self.int8 = Int8Linear(stacked)
            w, b = w.new_empty(0, w.shape[1]), None  # not a view: the stacked weights' memory is freed
        self.weight, self.bias = w, b

    def forward(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., sum out) in the head's dtype."""
        if self.int8 is not None:
            return self.int8(x).to(self.dtype)
        return F.linear(x.to(self.dtype), self.weight, self.bias)


class FastBlock:
    """One decoder layer (and the head's named extra Linears) as fused, optionally int8, products.

    Args:
        layer: a `supported` HF decoder layer (the head's `midlayer` / `layers[0]`).
        extra: the head's other Linears by name (`fc`), run by `linear(name, x)`.
        int8: every product as a dynamic-int8 fbgemm product (CPU).
    """

    def __init__(self, layer: nn.Module, extra: dict[str, nn.Linear], int8: bool) -> None:
        attn: Any = layer.self_attn
        mlp: Any = layer.mlp
        self.qkv = _Product([attn.q_proj, attn.k_proj, attn.v_proj], int8)
        self.o = _Product([attn.o_proj], int8)
        self.gate_up = _Product([mlp.gate_proj, mlp.up_proj], int8)
        self.down = _Product([mlp.down_proj], int8)
        self.extra = {name: _Product([lin], int8) for name, lin in extra.items()}
        self.act = mlp.act_fn
        self.split = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
        self.inter = mlp.gate_proj.out_features
        self.head_dim, self.scaling, self.layer_idx = int(attn.head_dim), float(attn.scaling), attn.layer_idx
        # name -> (weight, eps) of every RMSNorm of the layer (input_layernorm, post_attention_layernorm, ...);
        # None for a norm the head dropped (EAGLE-1's input_layernorm is an Identity)
        self.norms: dict[str, tuple[Tensor, float] | None] = {
            n: None
            if isinstance(m, nn.Identity)
            else (cast(Tensor, m.weight).detach(), float(cast(Any, m).variance_epsilon))
            for n, m in layer.named_children()
            if n.endswith("norm")
        }

    def norm(self, name: str, x: Tensor) -> Tensor:
        """The layer's RMSNorm `name` of x (..., H), as transformers computes it (fp32 statistics)."""
        norm = self.norms[name]
        if norm is None:
            return x
        return rms_norm(x, *norm)

    def linear(self, name: str, x: Tensor) -> Tensor:
        """The head's extra Linear `name` (e.g. `fc`): (..., in) -> (..., out)."""
        return self.extra[name](x)

    def attention(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: Cache) -> Tensor:
        """Self-attention of n new positions appended to `cache`, o_proj included.

        Args:
            x: (B, n, X) normed inputs; rope: (cos, sin) each (B, n, head_dim);
            mask: (B or 1, 1, n, S) bool, True = attend, S = the keys `cache.update` returns.
            cache: the head's KV cache (`update(k, v, layer_idx)`).

        Returns:
            (B, n, H) attention output after o_proj (before the residual).
        """
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q, k, v = (t.view(b, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, heads, n, d)
        cos, sin = rotary_tables(*(t[:, None].to(q.dtype) for t in rope))  # (B, 1, n, d) each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys, values = cache.update(k, v, self.layer_idx)  # (B, kv_heads, S, d)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True
        )  # (B, heads, n, d)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))

    def mlp(self, h: Tensor) -> Tensor:
        """Gated MLP of normed h (B, n, H) -> (B, n, H) (before the residual)."""
        gate, up = self.gate_up(h).split((self.inter, self.inter), dim=-1)
        return self.down(self.act(gate) * up)

    def layer(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, cache: Cache) -> Tensor:
        """The whole pre-norm decoder layer on x (B, n, H) -> (B, n, H), as the HF layer's forward."""
        h = x + self.attention(self.norm("input_layernorm", x), rope, mask, cache)
        return h + self.mlp(self.norm("post_attention_layernorm", h))


_BLOCKS: CopyCache[FastBlock] = CopyCache()


def resolve_kind(kind: str, spec: FamilySpec) -> str:
    """`eval.draft_block` for a drafter of family `spec`: "auto" -> "int8" where the family declares
    `int8_draft_layer`, else "fused"; any other kind as given."""
    if kind != "auto":
        return kind
    return "int8" if spec.int8_draft_layer else "fused"


def draft_block(
    drafter: nn.Module, layer: nn.Module, extra: dict[str, nn.Linear], int8: bool
) -> FastBlock | None:
    """The `FastBlock` of a head's `layer` on a CPU, built once per head and weights (the B proposers of a
    batch share it; rebuilt when the weights were trained, moved or cast); None when `supported` refuses
    the layer or the head is not on a CPU (the head's HF modules are used)."""
    params = list(drafter.parameters())
    if not params or params[0].device.type != "cpu" or supported(layer) is not None:
        return None
    from specdraft.eval.proposers import int8_supported

    int8 = int8 and int8_supported()
    return _BLOCKS.get(drafter, (int8, weights_key(*params)), lambda: FastBlock(layer, extra, int8))
