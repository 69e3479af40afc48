"""Medusa heads' top-k at one position in one C call (`models/draft_chain.c`, `sd_medusa_heads`), on a CPU.

On a CPU the node budget settles Medusa's static tree on 2-4 nodes, i.e. one or two heads' top one or two tokens.
Through torch that draft is ~20 small calls (the root input's embedding, normalisation and product, the int8
residual block and vocabulary products with their quantisation, top-k, the id map) run with the code and data the
target step just evicted: 0.8-1.0 ms a step for the root-token heads against a 2-node verify of ~4.5 ms (2-core
Zen 5, fp32; docs/experiments.md, "Session 58"). `MedusaNative` keeps int8 copies of the heads' products (one fp32
scale per output row; the root projection's too) and runs the n heads a tree needs as one call: the root input,
the residual blocks, the vocabulary rows and each head's k best draft ids.

Its top-k follow the int8 products (activations quantised per vector where VNNI runs), so they may differ
slightly from the torch heads'; verification decides every token, so the output never does.
`SPECDRAFT_NATIVE_CHAIN=0` turns it off (with the ReDrafter's and EAGLE's chains).
"""

from __future__ import annotations

import ctypes
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from specdraft.eval.native_chain import enabled, kernel, kernel_problem, pin, rows_int8
from specdraft.models.layers import CopyCache, ResBlock, weights_key

if TYPE_CHECKING:
    from specdraft.models.medusa import Medusa


def unsupported(drafter: nn.Module) -> str | None:
    """Why `MedusaNative` cannot draft for `drafter` (None: it can): Medusa heads of residual blocks and a
    vocabulary Linear without bias, in fp32 on the CPU, and the kernel library with `sd_medusa_heads`."""
    from specdraft.models.medusa import Medusa

    if not isinstance(drafter, Medusa):
        return f"not Medusa heads ({type(drafter).__name__})"
    for transform, vocab in drafter.vocab_heads():
        if vocab.bias is not None:
            return "a vocabulary Linear with a bias"
        if not all(isinstance(m, ResBlock) for m in cast(nn.Sequential, transform)):
            return "a head that is not residual blocks + a vocabulary Linear"
    return kernel_problem(drafter.vocab_heads()[0][1].weight, "sd_medusa_heads")


def make_native(drafter: nn.Module) -> MedusaNative | None:
    """The shared `MedusaNative` of `drafter` (one per heads and weights) where `enabled` and not `unsupported`,
    else None (torch drafts)."""
    if not enabled() or unsupported(drafter) is not None:
        return None
    return _HEADS.get(
        drafter, weights_key(*drafter.parameters()), lambda: MedusaNative(cast("Medusa", drafter))
    )


class MedusaNative:
    """Int8 copies of Medusa heads' products and one `sd_medusa_heads` call per draft.

    Args:
        drafter: Medusa heads that `unsupported` accepts, attached to their target where they read the root
            token (the copies are taken once, here).
    """

    def __init__(self, drafter: Medusa) -> None:
        why = unsupported(drafter)
        if why is not None:
            raise ValueError(f"MedusaNative: {why}")
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self.fn = kernel(
            "sd_medusa_heads",
            [ptr, ptr, ptr, ptr, ctypes.c_float, i64, i64, ptr, ptr, ctypes.c_int, ptr, ptr],
        )
        cfg = drafter.config
        heads = drafter.vocab_heads()
        h, nb = int(cfg.base_hidden_size), int(cfg.num_layers)
        vd = int(heads[0][1].weight.shape[0])
        self.keep: list[Tensor] = []  # every tensor the pointers address
        hold = partial(pin, self.keep)
        one = torch.zeros(1)
        root = drafter.root_input
        rq, rs = rows_int8(root.proj.weight) if root is not None else (one.to(torch.int8), one)
        blocks = [cast(ResBlock, b).linear for t, _ in heads for b in cast(nn.Sequential, t)]  # K * NB
        bq = [rows_int8(b.weight) for b in blocks]
        zeros = torch.zeros(h)
        bw = torch.stack([q for q, _ in bq]) if bq else one.to(torch.int8)  # (K * NB, H, H)
        bs = torch.stack([s for _, s in bq]) if bq else one  # (K * NB, H)
        bb = (
            torch.stack([b.bias.detach().float() if b.bias is not None else zeros for b in blocks])
            if bq
            else one
        )
        vq = [rows_int8(lin.weight) for _, lin in heads]
        vw, vs = torch.stack([q for q, _ in vq]), torch.stack([s for _, s in vq])  # (K, Vd, H), (K, Vd)
        addrs = [hold(rq), hold(rs), hold(bw), hold(bs), hold(bb), hold(vw), hold(vs)]
        self.addrs = torch.tensor(addrs, dtype=torch.int64)  # the pointer table `sd_medusa_heads` reads
        self.dims = torch.tensor([h, vd, nb, int(root is not None)], dtype=torch.int64)
        self.eps = float(root.eps) if root is not None else 0.0
        self.heads, self.h = len(heads), h
        self.scratch = torch.empty(3 * h + vd)
        self.ids = torch.zeros(len(heads) * 64, dtype=torch.long)  # (K, <= 64) the draft ids out
        self.to_target = drafter.to_target_ids(torch.arange(vd)).cpu()  # (Vd,) target id of each draft id
        self.states = torch.zeros(len(heads), h)  # (K, H) the heads' states out (`heads_out`)
        self.logits = torch.zeros(len(heads), vd)  # (K, Vd) their logits out (`heads_out`)
        self.table: Tensor | None = None  # (V, H) the root's embedding table, fp32 and contiguous
        if root is not None:
            self.table = root.borrowed.weight("embed", root.proj.weight).detach().float().contiguous()

    @torch.inference_mode()
    def topk(self, hidden: Tensor, root: Tensor, k: int, num_heads: int) -> Tensor:
        """`Medusa.topk_tokens(hidden, k, num_heads, root=root)` through the int8 copies, in one call.

        Args:
            hidden: (H,) the target's last-layer state at the newest committed position.
            root: () long, the root token (read only by root-token heads).
            k: ranks per head (<= 64); num_heads: n <= K heads run.

        Returns:
            (n, k) long target ids, row j head j's best k (rank 0 first).
        """
        return self.to_target[self._run(hidden, root, k, num_heads, False)].view(num_heads, k)  # (n, k)

    @torch.inference_mode()
    def heads_out(
        self, hidden: Tensor, root: Tensor, k: int, num_heads: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`topk` plus what a copy gate reads (`eval/medusa_copy_tree.py`), in the same call.

        Returns:
            ids (n, k) long draft ids (not target ids), states (n, H) each head's last block output, logits (n, Vd)
            float32 (views of buffers the next call overwrites).
        """
        ids = self._run(hidden, root, k, num_heads, True).view(num_heads, k)
        return ids, self.states[:num_heads], self.logits[:num_heads]

    def _run(self, hidden: Tensor, root: Tensor, k: int, num_heads: int, keep: bool) -> Tensor:
        """One `sd_medusa_heads` call -> (n * k,) draft ids; `keep`: the states and logits too."""
        if not 0 < k <= 64 or not 0 < num_heads <= self.heads:
            raise ValueError(
                f"MedusaNative.topk: k={k} must be in [1, 64] and num_heads={num_heads} in [1, {self.heads}]"
            )
        x = hidden.detach().float().contiguous()  # (H,)
        emb = None
        if self.table is not None:  # the root's row, read in place; padding (< 0) reads token 0, as torch
            emb = self.table.data_ptr() + max(int(root), 0) * self.h * 4
        states, logits = (self.states.data_ptr(), self.logits.data_ptr()) if keep else (None, None)
        self.fn(
            self.addrs.data_ptr(), self.dims.data_ptr(), x.data_ptr(), emb, self.eps, num_heads, k,
            self.scratch.data_ptr(), self.ids.data_ptr(), torch.get_num_threads(), states, logits,
        )  # fmt: skip
        return self.ids[: num_heads * k]


_HEADS: CopyCache[MedusaNative] = CopyCache()
