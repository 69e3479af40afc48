"""Root-conditioned Medusa heads: every head also reads the root token x_{t+1} (a Medusa extension).

A Medusa head k predicts x_{t+2+k} from h_t alone, so head 0 guesses the token after a root it never sees; at
decode time that root is known before the heads run (the target's own next token at the newest committed
position). Hydra (arXiv 2402.05109) feeds each head the tokens drafted before it; this extension keeps Medusa's
parallel heads and its static tree and gives every head the root only:

    x_k = h_t + W_k rms(E[x_{t+1}])        E: the target's input embeddings (borrowed, never saved)
    head_k(x_k) = W_vocab,k ResBlock^n(x_k)

W (K*H, H) starts at zero, so a fresh extension (or one added to a trained export by `train.init_from`) computes
exactly the plain heads, and it costs one (K*H, H) product per step next to the K (Vd, H) vocabulary products.
`rms` is a weightless RMS normalisation: the embedding's scale is the target's, not the hidden state's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.models.eagle_common import Borrowed
from specdraft.models.layers import ZeroInitLinear


class RootInput(nn.Module):
    """Per-head additive input from the root token's embedding.

    Args:
        hidden: H, width of the target's last hidden state (= its embedding width).
        heads: K, the number of Medusa heads.
        eps: the RMS normalisation's epsilon.
    """

    def __init__(self, hidden: int, heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden, self.heads, self.eps = hidden, heads, eps
        self.proj = ZeroInitLinear(hidden, heads * hidden, bias=False)  # (K*H, H), zero at the start
        self.borrowed = Borrowed()  # the target's input embeddings (`attach`), not in the state dict

    def attach(self, embed: nn.Module) -> None:
        """Borrow the target's input embeddings, an (V, H) `nn.Embedding` (after building or loading)."""
        self.borrowed.set("embed", embed)

    def forward(self, hidden: Tensor, root: Tensor, num_heads: int) -> Tensor:
        """Each head's input.

        Args:
            hidden: (..., H) target last-layer states h_t, in the heads' dtype and device.
            root: (...) long, the root x_{t+1} of each state (ids < 0, i.e. padding, read token 0).
            num_heads: n <= K, the heads run.

        Returns:
            (..., n, H): h_t + W_k rms(E[root]) for k < n.
        """
        w = self.proj.weight  # (K*H, H)
        e = F.embedding(root.to(hidden.device).clamp_min(0), self.borrowed.weight("embed", w))  # (..., H)
        wide = e.to(torch.promote_types(e.dtype, torch.float32))  # fp32 at least (fp64 stays fp64)
        # (..., H): the weightless RMS normalisation ReDrafter's target layers use
        e = F.rms_norm(wide, (self.hidden,), eps=self.eps).to(e.dtype)
        delta = F.linear(e, w[: num_heads * self.hidden])  # (..., n*H)
        return hidden[..., None, :] + delta.unflatten(-1, (num_heads, self.hidden))  # (..., n, H)
