"""A ReDrafter's one-beam search (a greedy chain) drafted one slot per C call on a CPU (`models/draft_chain.c`).

On a CPU the node budget mostly settles on one-beam trees of 2-4 nodes, and a drafted token through torch is ~60
small calls (copy-gate lookup, recurrence, input projection, blocks, int8 head, log-softmax mixture, top-k): a
one-token draft took ~0.6 ms warm but ~1.55 ms inside a decode loop, where every call runs with the code and data
the target step just evicted (docs/experiments.md, "Session 52"). `NativeChain` keeps int8 copies of the
drafter's products (one fp32 scale per output row) and runs each slot as one call: the recurrence, the input
projection (its feature columns once per draft), the residual blocks, the head's argmax and logsumexp, and the copy
gate's mixture. The copy gate's n-gram lookup stays in Python (`NgramIndex.lookup`, a few dict reads).

It drafts what `beam_search` with one beam drafts, up to the int8 rounding (the torch view quantises the
activations too), so drafts may differ slightly; verification decides every token, so the output never does.
`SPECDRAFT_NATIVE_CHAIN=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from specdraft.data.ngrams import NO_CANDIDATE
from specdraft.eval.tree import DraftTree, chain_topology
from specdraft.models.layers import ResBlock

if TYPE_CHECKING:
    from specdraft.data.ngrams import NgramIndex
    from specdraft.models.redrafter import ReDrafter


def enabled() -> bool:
    """`SPECDRAFT_NATIVE_CHAIN` (default on; "0" turns the native chain off)."""
    return os.environ.get("SPECDRAFT_NATIVE_CHAIN", "1") != "0"


def unsupported(drafter: torch.nn.Module) -> str | None:
    """Why `NativeChain` cannot draft for `drafter` (None: it can): it needs a ReDrafter with the recurrence and an
    input projection, without prefix attention, in fp32 on the CPU, and the kernel library."""
    from specdraft.models.redrafter import ReDrafter

    if not isinstance(drafter, ReDrafter):
        return f"not a ReDrafter ({type(drafter).__name__})"
    if not drafter.config.rnn or drafter.input_proj is None:
        return "needs the recurrence and an input projection"
    if drafter.ctx is not None:
        return "prefix attention drafts in torch"
    return kernel_problem(drafter.head.weight, "sd_redrafter_slot")


def kernel_problem(weight: Tensor, symbol: str) -> str | None:
    """Why a drafter whose products are like `weight` cannot draft through the kernel `symbol` (None: it can):
    it needs fp32 weights on the CPU and the kernel library with that symbol (a library built before the kernel
    lacks it)."""
    from specdraft.models.panel_linear import panel_lib

    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return f"needs fp32 on the CPU, got {weight.dtype} on {weight.device.type}"
    lib = panel_lib()
    if lib is None or not hasattr(lib, symbol):
        return "no kernel library"
    return None


def kernel(symbol: str, argtypes: list[Any]) -> Any:
    """The kernel library's function `symbol` with its ctypes argument types declared, returning nothing
    (`kernel_problem` said it is there)."""
    from specdraft.models.panel_linear import panel_lib

    lib = panel_lib()
    assert lib is not None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, None
    return fn


def rows_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> int8 (N, K) and fp32 row scales (N,): w ~ q * s, s = max|w_row| / 127."""
    w = weight.detach().float().cpu()
    s = (w.abs().amax(1) / 127.0).clamp_min(1e-12)  # (N,)
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), s.contiguous()


def _offset(q: Tensor) -> Tensor:
    """int8 weights -> uint8 q + 128, the form `sd_redrafter_slot` reads (VNNI's unsigned operand)."""
    return (q.to(torch.int16) + 128).to(torch.uint8).contiguous()


def pin(keep: list[Tensor], t: Tensor) -> int:
    """The address of `t` in the form the slot kernels read (int8 weights as uint8 + 128, anything else fp32,
    contiguous), the tensor kept alive in `keep` (a chain's pointer table addresses it)."""
    t = _offset(t) if t.dtype == torch.int8 else t.detach().float().contiguous()
    keep.append(t)
    return t.data_ptr()


def draft_id_maps(drafter: torch.nn.Module, vd: int, vocab: int) -> tuple[list[int], list[int]]:
    """(draft id -> target id, target id -> draft id with -1 outside the draft vocabulary) of a drafter with
    `to_target_ids` over its `vd` draft ids and `vocab` target ids, as lists (the chains read them on the host)."""
    draft_ids = cast(Any, drafter).to_target_ids(torch.arange(vd)).cpu()  # (Vd,)
    lut = torch.full((vocab,), -1, dtype=torch.long)  # (V,)
    lut[draft_ids] = torch.arange(vd)
    return draft_ids.tolist(), lut.tolist()


def chain_tree(tokens: list[int], cum: list[float], min_logp: float | None = None) -> DraftTree:
    """A chain `tokens` (root first) drafted as a tree with per-node scores (exp of the cumulative log-probs
    `cum`), cut before the first node below `min_logp`: what `pack_beams` and `beam_scores` make of one beam,
    without their tensor work (one topology per length, cached)."""
    n = len(tokens)
    if min_logp is not None:
        n = next((i for i in range(1, n) if cum[i] < min_logp), n)
    parents, depth, ancestors, nodes = chain_topology(n)
    tree = DraftTree(
        torch.tensor(tokens[:n], dtype=torch.long, device="cpu"), parents, depth, ancestors, nodes
    )
    tree.scores = torch.tensor(cum[:n], dtype=torch.float32, device="cpu").exp()  # (n,), root 1
    return tree


class NativeChain:
    """Int8 copies of a ReDrafter's products and one `sd_redrafter_slot` call per drafted token.

    Args:
        drafter: a ReDrafter `unsupported` accepts (the copies are taken once, here).
    """

    def __init__(self, drafter: ReDrafter) -> None:
        why = unsupported(drafter)
        if why is not None:
            raise ValueError(f"NativeChain: {why}")
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fn = kernel("sd_redrafter_slot", [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_float, ptr,
                                               ptr, ptr, ctypes.c_int])  # fmt: skip
        self.drafter = weakref.proxy(drafter)  # not a strong reference: the cache holds its drafter weakly
        cfg = drafter.config
        assert drafter.input_proj is not None
        e, x = int(drafter.rnn_u.weight.shape[0]), int(drafter.input_proj.weight.shape[0])
        f = int(drafter.input_proj.weight.shape[1]) - e
        vd = int(drafter.head.weight.shape[0])
        blocks = [cast(ResBlock, b).linear for b in drafter.blocks]
        self.keep: list[Tensor] = []  # every tensor the pointers address
        hold = partial(pin, self.keep)
        u, us = rows_int8(drafter.rnn_u.weight)
        w, ws = rows_int8(drafter.rnn_w.weight)
        p, ps = rows_int8(drafter.input_proj.weight)
        h, hs = rows_int8(drafter.head.weight)
        bq = [rows_int8(b.weight) for b in blocks]
        zeros_x = torch.zeros(x)
        bw = torch.stack([q for q, _ in bq]) if bq else torch.zeros(1, dtype=torch.int8)
        bs = torch.stack([s for _, s in bq]) if bq else zeros_x
        bb = (
            torch.stack([b.bias.detach().float() if b.bias is not None else zeros_x for b in blocks])
            if bq
            else zeros_x
        )
        gate = drafter.copy_gate
        hc = int(gate.fc.weight.shape[0]) if gate is not None else 0
        one = torch.zeros(1)
        addrs = [
            hold(u), hold(us), hold(drafter.rnn_u.bias if drafter.rnn_u.bias is not None else torch.zeros(e)),
            hold(w), hold(ws),
            hold(p), hold(ps), hold(drafter.input_proj.bias if drafter.input_proj.bias is not None else zeros_x),
            hold(bw), hold(bs), hold(bb),
            hold(h), hold(hs),
            hold(gate.fc.weight if gate is not None else one), hold(gate.fc.bias if gate is not None else one),
            hold(gate.out.weight.reshape(-1) if gate is not None else one),
            hold(gate.out.bias if gate is not None and gate.out.bias is not None else one),
            hold(gate.length_bias if gate is not None else one),
        ]  # fmt: skip
        self.addrs = torch.tensor(addrs, dtype=torch.int64)  # the pointer table `sd_redrafter_slot` reads
        self.dims = torch.tensor([e, x, f, vd, len(blocks), hc, int(gate is not None)], dtype=torch.int64)
        self.gate_scale = float(gate.scale) if gate is not None else 0.0
        self.has_gate = gate is not None
        self.state = torch.empty(e)  # (E,) the recurrence state, in place
        self.fproj = torch.empty(x)  # (X,) input_proj's feature columns x features + bias, once per draft
        self.scratch = torch.empty(2 * x + max(e, x) + vd + 128)
        # a slot's results, read without torch
        self.out_id, self.out_logp = ctypes.c_int64(), ctypes.c_float()
        self.zero_e = torch.zeros(e)
        emb = drafter.embed if drafter.embed is not None else drafter._borrowed[0]
        w_emb = emb.weight.detach()
        fits = w_emb.dtype == torch.float32 and w_emb.device.type == "cpu" and w_emb.is_contiguous()
        self.table: Tensor | None = w_emb if fits else None  # (V, E): rows addressed directly
        self.row_bytes = e * 4
        self._rows: list[Tensor] = []  # embedding copies of the current call (a table that does not fit)
        self.to_target, self.to_draft = draft_id_maps(drafter, vd, int(cfg.vocab_size))

    def _embedding(self, token: int) -> int:
        """The address of the (E,) fp32 embedding of a target id (`ReDrafter.embed_tokens`): a row of the
        embedding table itself where it is fp32 and contiguous on the CPU, else a copy held until the next call."""
        if self.table is not None:
            return self.table.data_ptr() + token * self.row_bytes
        row = self.drafter.embed_tokens(torch.tensor([token], dtype=torch.long))[0].float().contiguous()
        self._rows.append(row)
        return row.data_ptr()

    def tree(self, tokens: list[int], cum: list[float], min_logp: float | None = None) -> DraftTree:
        """The chain `tokens` (root first) as a tree with per-node scores (`chain_tree`)."""
        return chain_tree(tokens, cum, min_logp)

    @torch.inference_mode()
    def chain(
        self, hidden: Tensor, root: int, draft_len: int, copy: NgramIndex | None
    ) -> tuple[list[int], list[float]]:
        """The one-beam search from the newest committed position, one C call per slot.

        Args:
            hidden: (F_raw,) target features at the newest committed position (`ReDrafter.features` input).
            root: the token the target just committed.
            draft_len: D tokens to draft after the root.
            copy: the copy gate's index of the committed tokens before the root (None: no copy gate).

        Returns:
            the beam's 1 + D target ids (root first) and cumulative log-probs (0 first), as `beam_search` with
            one beam returns them (`tree` packs them).
        """
        feats = self.drafter.features(hidden.reshape(1, -1))[0].float().contiguous()  # (F,)
        self._rows.clear()
        root_row = self._embedding(root)
        ctypes.memmove(self.state.data_ptr(), root_row, self.row_bytes)  # s_1 = e(root)
        tokens, cum, total = [root], [0.0], 0.0
        prev: int | None = None
        threads = torch.get_num_threads()
        gate = self.has_gate and copy is not None
        for k in range(draft_len):
            cand, length = copy.lookup(tokens) if gate and copy is not None else (NO_CANDIDATE, 0)
            cand_draft = self.to_draft[cand] if cand >= 0 else -1
            if cand_draft < 0:
                length = 0
            cand_emb = self._embedding(cand) if length > 0 else self.zero_e.data_ptr()
            self.fn(
                self.addrs.data_ptr(), self.dims.data_ptr(), self.state.data_ptr(), prev,
                feats.data_ptr() if k == 0 else None, self.fproj.data_ptr(), cand_draft, length, cand_emb,
                self.gate_scale, self.scratch.data_ptr(), ctypes.byref(self.out_id), ctypes.byref(self.out_logp),
                threads,
            )  # fmt: skip
            token = self.to_target[self.out_id.value]
            total += self.out_logp.value
            tokens.append(token)
            cum.append(total)
            prev = self._embedding(token) if k + 1 < draft_len else None
        return tokens, cum
