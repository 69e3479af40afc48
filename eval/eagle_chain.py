"""An EAGLE head's one-chain draft, one C call per position (`models/draft_chain.c`, `sd_eagle_slot`), on a CPU.

On a CPU the node budget mostly settles on trees of 2-4 nodes, where an EAGLE-2 draft through torch costs ~3.3 ms
(the gated EAGLE-3 at 4 nodes, session 56): a commit pass, ~1.4 expansion passes and ~2.4 vocabulary heads, each
dozens of small ops run with the code and data the target step just evicted, against ~1.0 ms for the ReDrafter's
native chain (`eval/native_chain.py`). `EagleChain` keeps int8 copies of the head's products (one fp32 scale per
output row), its own fp32 KV cache and rotary tables, and runs every committed position and every drafted slot as
one call: the fused-feature projection (EAGLE-3) or input projection (EAGLE-1), the decoder layer, and at the
last committed position and each drafted slot the vocabulary head's argmax and logsumexp with the copy gate's
mixture. The copy gate's n-gram lookup stays in Python (`NgramIndex.lookup`).

It drafts one chain (the top token of every slot, as a one-beam search), not EAGLE-2's tree: the tree of a
budget of n nodes keeps the n - 1 best nodes, the chain the n - 1 deepest. Its drafts follow the int8 products
(activations quantised per vector), so they may differ slightly from the torch head's; verification decides every
token, so the output never does. `SPECDRAFT_NATIVE_CHAIN=0` turns it off (with the ReDrafter's).
"""

from __future__ import annotations

import ctypes
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from specdraft.eval.native_chain import (
    chain_tree,
    draft_id_maps,
    enabled,
    kernel,
    kernel_problem,
    pin,
    rows_int8,
)
from specdraft.eval.tree import DraftTree
from specdraft.models.layers import CopyCache, weights_key

if TYPE_CHECKING:
    from specdraft.data.ngrams import NgramIndex


def unsupported(drafter: nn.Module) -> str | None:
    """Why `EagleChain` cannot draft for `drafter` (None: it can): an EAGLE-1 or EAGLE-3 head (not EAGLE-3.1's
    normalised fusion) over a Llama-family layer with a SiLU gate and no MLP biases, in fp32 on the CPU, and the
    kernel library with `sd_eagle_slot`."""
    from specdraft.models.eagle import EagleDrafter
    from specdraft.models.eagle3 import Eagle3Drafter
    from specdraft.models.fast_target import unsupported_layer

    if not isinstance(drafter, (EagleDrafter, Eagle3Drafter)):
        return f"not an EAGLE head ({type(drafter).__name__})"
    if isinstance(drafter, Eagle3Drafter) and drafter.config.norm_fused:
        return "EAGLE-3.1's normalised fusion drafts in torch"
    layer: Any = drafter.draft_layer()[0]
    why = unsupported_layer(layer)
    if why is not None:
        return why
    if type(layer.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(layer.mlp.act_fn).__name__} is not SiLU"
    if any(getattr(layer.mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
        return "MLP biases"
    return kernel_problem(drafter.fc.weight, "sd_eagle_slot")


def make_chain(drafter: nn.Module) -> EagleChain | None:
    """An `EagleChain` for `drafter` where `enabled` and not `unsupported`, else None (torch drafts)."""
    return EagleChain(drafter) if enabled() and unsupported(drafter) is None else None


class _HeadCopy:
    """What every `EagleChain` of one head shares: the int8 copies of its products (one fp32 scale per output
    row), its norms, gate and embedding table, the slot kernel, and the draft-id maps (built once per head and
    weights: a batch's proposers share them; each chain has its own cache, tables and scratch)."""

    def __init__(self, drafter: nn.Module) -> None:
        from specdraft.models.eagle3 import Eagle3Drafter

        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self.fn = kernel("sd_eagle_slot", [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, ctypes.c_int, i64, i64, ptr,
                                           f32, f32, ptr, ptr, ptr, ctypes.c_int])  # fmt: skip
        d: Any = drafter
        self.drafter = weakref.proxy(d)  # not a strong reference: the cache holds its head weakly
        self.eagle3 = isinstance(drafter, Eagle3Drafter)
        layer: Any = d.draft_layer()[0]
        attn, mlp = layer.self_attn, layer.mlp
        h, dim = int(d.config.base_hidden_size), int(attn.head_dim)
        nq, nkv = attn.q_proj.out_features // dim, attn.k_proj.out_features // dim
        inter = int(mlp.gate_proj.out_features)
        _, head = d.draft_head()  # (Vd, H) vocabulary rows (EAGLE-1: the target LM head's draft rows)
        vd = int(head.weight.shape[0])
        kin = int(attn.q_proj.in_features)  # 2H (EAGLE-3: [e; g]) or H (EAGLE-1: fc's output)
        f = int(d.fc.weight.shape[1])
        self.keep: list[Tensor] = []  # every tensor the pointers address
        hold = partial(pin, self.keep)

        def product(*linears: nn.Linear) -> list[int]:
            """(weights, row scales, bias) addresses of the Linears stacked along their outputs."""
            w = torch.cat([lin.weight.detach().float() for lin in linears])
            q, s = rows_int8(w)
            b = torch.cat([lin.bias.detach().float() if lin.bias is not None else torch.zeros(lin.out_features)
                           for lin in linears])  # fmt: skip
            return [hold(q), hold(s), hold(b)]

        def norm_w(m: nn.Module | None) -> tuple[int, float]:
            if m is None or isinstance(m, nn.Identity):
                return hold(torch.ones(h)), 0.0
            return hold(cast(Tensor, m.weight)), float(cast(Any, m).variance_epsilon)

        gate = d.copy_gate
        hc = int(gate.fc.weight.shape[0]) if gate is not None else 0
        one = torch.zeros(1)
        n_in, e_in = norm_w(layer.input_layernorm if self.eagle3 else None)
        n_hid, e_hid = norm_w(getattr(layer, "hidden_norm", None))
        n_post, e_post = norm_w(layer.post_attention_layernorm)
        n_fin, e_fin = norm_w(d.norm if self.eagle3 else None)
        fc = product(d.fc)
        qkv = product(attn.q_proj, attn.k_proj, attn.v_proj)
        o = product(attn.o_proj)
        gu, down, hd = product(mlp.gate_proj, mlp.up_proj), product(mlp.down_proj), product(head)
        addrs = [
            *fc, *qkv, *o, gu[0], gu[1], down[0], down[1], n_in, n_hid, n_post, n_fin, hd[0], hd[1],
            hold(gate.fc.weight if gate is not None else one), hold(gate.fc.bias if gate is not None else one),
            hold(gate.out.weight.reshape(-1) if gate is not None else one),
            hold(gate.out.bias if gate is not None and gate.out.bias is not None else one),
            hold(gate.length_bias if gate is not None else one),
            0, 0, hold(torch.tensor([e_in, e_hid, e_post, e_fin])),  # 24, 25: each chain's rotary tables
        ]  # fmt: skip
        self.addrs = torch.tensor(addrs, dtype=torch.int64)  # the pointer table `sd_eagle_slot` reads
        self.dims = torch.tensor([h, kin, f, nq, nkv, dim, inter, vd, hc, int(gate is not None),
                                  int(self.eagle3), 0], dtype=torch.int64)  # fmt: skip
        self.h, self.nq, self.nkv, self.dim, self.inter, self.vd, self.kin = h, nq, nkv, dim, inter, vd, kin
        self.gate_scale = float(gate.scale) if gate is not None else 0.0
        self.attn_scale = float(attn.scaling)
        self.has_gate = gate is not None
        # the candidate embedding read where there is no candidate (never, in fact)
        self.zero = torch.zeros(h)
        emb = d.borrowed.weight("embed", d.fc.weight)  # (V, H) the target's embeddings, fp32
        self.table = emb.detach().contiguous()
        self.row_bytes = h * 4
        self.to_target, self.to_draft = draft_id_maps(d, vd, int(d.config.vocab_size))


_HEADS: CopyCache[_HeadCopy] = CopyCache()


class EagleChain:
    """One proposer's chain drafts: the head's shared int8 copies (`_HeadCopy`), its own KV cache, rotary tables
    and scratch, and one `sd_eagle_slot` call per position.

    Args:
        drafter: an EagleDrafter or Eagle3Drafter that `unsupported` accepts, attached to its target (its copies
            are taken once per head and weights, shared by every chain of it).
        capacity: positions the KV cache and rotary tables hold at first (doubled when a prompt needs more).
    """

    def __init__(self, drafter: nn.Module, capacity: int = 256) -> None:
        why = unsupported(drafter)
        if why is not None:
            raise ValueError(f"EagleChain: {why}")
        self.head = _HEADS.get(drafter, weights_key(*drafter.parameters()), lambda: _HeadCopy(drafter))
        # the head's pointer table and sizes, + this chain's rotary tables and capacity (`_alloc`)
        self.addrs, self.dims = self.head.addrs.clone(), self.head.dims.clone()
        self.g = torch.zeros(self.head.h)  # (H,) the input feature in, the head's output out (in place)
        self.out_id, self.out_logp = ctypes.c_int64(), ctypes.c_float()
        self.length = 0  # committed positions in the KV cache
        self.cap = 0
        self.kc = self.vc = torch.zeros(0)
        self._alloc(capacity)

    def _alloc(self, cap: int) -> None:
        """KV cache, rotary tables and scratch for `cap` positions (the cached entries copied over)."""
        w = self.head
        kc, vc = torch.zeros(w.nkv, cap, w.dim), torch.zeros(w.nkv, cap, w.dim)  # (NKV, cap, D)
        if self.cap:  # the entries cached so far
            kc[:, : self.cap] = self.kc
            vc[:, : self.cap] = self.vc
        self.kc, self.vc, self.cap = kc, vc, cap
        cos, sin = w.drafter.rotary(torch.zeros(1, cap, w.h), torch.arange(cap)[None])  # (1, cap, D) each
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        self.addrs[24], self.addrs[25] = self.cos.data_ptr(), self.sin.data_ptr()
        self.dims[11] = cap
        size = w.kin + 2 * (w.nq + 2 * w.nkv) * w.dim + w.nq * cap + 6 * w.h + 3 * w.inter + w.vd + 128
        self.scratch = torch.zeros(size)

    def reset(self) -> None:
        """Forget the previous prompt's positions."""
        self.length = 0

    def _emb(self, token: int) -> int:
        """The address of the target embedding row of `token`."""
        return self.head.table.data_ptr() + token * self.head.row_bytes

    def _slot(self, feats: Tensor | None, token: int, pos: int, want: bool, cand: int, clen: int) -> None:
        """One position through the head (its entry written at cache index `pos`); `want`: the head too."""
        if pos + 1 > self.cap:
            self._alloc(2 * (pos + 1))
        w = self.head
        cand_emb = self._emb(cand) if clen > 0 else w.zero.data_ptr()
        draft_cand = w.to_draft[cand] if clen > 0 else -1
        if draft_cand < 0:
            clen = 0
        w.fn(
            self.addrs.data_ptr(), self.dims.data_ptr(), None if feats is None else feats.data_ptr(),
            self.g.data_ptr(), self._emb(token), pos, self.kc.data_ptr(), self.vc.data_ptr(), pos, int(want),
            draft_cand, clen, cand_emb, w.gate_scale, w.attn_scale, self.scratch.data_ptr(),
            ctypes.byref(self.out_id), ctypes.byref(self.out_logp), torch.get_num_threads(),
        )  # fmt: skip

    @torch.inference_mode()
    def propose(
        self, hidden: Tensor, tokens: list[int], draft_len: int, copy: NgramIndex | None
    ) -> tuple[list[int], list[float]]:
        """Commit the new positions, then draft one chain from the newest.

        Args:
            hidden: (n, F) target features of the newly committed positions (EAGLE-3: the fused layers; EAGLE-1:
                the last layer), n >= 1.
            tokens: the n tokens each position predicts; tokens[-1] is the root.
            draft_len: D tokens to draft after the root.
            copy: the copy gate's index of the committed tokens before the root (None: no gate).

        Returns:
            the chain's 1 + D target ids (root first) and cumulative log-probs (0 first).
        """
        feats = hidden.detach().float().contiguous()  # (n, F)
        root, n = tokens[-1], len(tokens)
        gate = copy if self.head.has_gate else None
        chain = [root]

        def lookup() -> tuple[int, int]:
            return gate.lookup(chain) if gate is not None else (-1, 0)

        # committed positions: EAGLE-3 fuses their features; EAGLE-1 reads them as they are
        for i in range(n):
            last = i == n - 1
            cand, clen = lookup() if last else (-1, 0)
            if self.head.eagle3:
                self._slot(feats[i], tokens[i], self.length, last, cand, clen)
            else:
                self.g.copy_(feats[i])
                self._slot(None, tokens[i], self.length, last, cand, clen)
            self.length += 1
        cum, total = [0.0], 0.0
        for k in range(draft_len):
            if k > 0:  # the previous drafted token at depth k, its entry after the committed ones
                cand, clen = lookup()
                self._slot(None, chain[-1], self.length - 1 + k, True, cand, clen)
            chain.append(self.head.to_target[self.out_id.value])
            total += self.out_logp.value
            cum.append(total)
        return chain, cum

    def tree(self, tokens: list[int], cum: list[float]) -> DraftTree:
        """The chain as a tree with per-node scores (`native_chain.chain_tree`)."""
        return chain_tree(tokens, cum)


class ChainLog:
    """The committed positions (target features, next tokens) of the current prompt, for the two caches of one
    head: the torch expansion's (`EagleTreeProposer.commit`) and the native chain's. Whichever drafts takes what
    it has not seen yet, so the proposer can switch between them (a node budget's refits) without either cache
    missing a position; what both have seen is dropped."""

    def __init__(self) -> None:
        self.chunks: list[tuple[Tensor, Tensor]] = []  # (n_i, F) features, (n_i,) tokens
        self.at = {"torch": 0, "native": 0}  # chunks each cache holds

    def reset(self) -> None:
        """A new prompt: nothing committed."""
        self.chunks.clear()
        self.at = {"torch": 0, "native": 0}

    def add(self, hidden: Tensor, tokens: Tensor, seen_by: str | None = None) -> None:
        """The newly committed positions: hidden (n, F), tokens (n,); `seen_by`: the cache ("torch" | "native")
        that has them already (it has taken every earlier position: call right after its `take`)."""
        self.chunks.append((hidden, tokens))
        if seen_by is not None:
            self.at[seen_by] = len(self.chunks)

    def take(self, who: str) -> tuple[Tensor, Tensor] | None:
        """Every position `who` ("torch" | "native") has not seen, in order: (m, F) features, (m,) tokens; None
        when it has seen them all."""
        new = self.chunks[self.at[who] :]
        self.at[who] = len(self.chunks)
        done = min(self.at.values())
        if done:  # seen by both
            self.chunks = self.chunks[done:]
            self.at = {k: v - done for k, v in self.at.items()}
        if len(new) <= 1:
            return new[0] if new else None
        return torch.cat([h for h, _ in new]), torch.cat([t for _, t in new])
