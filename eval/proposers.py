"""Proposers: turn the newest committed target state into a `DraftTree` (see design.md).

`ReDrafterProposer` runs the drafter's beam search from the last committed hidden state and packs the
W beams into a compact tree with `pack_beams` (tensor-only prefix dedup); `last_compression` reports
W*(1+D) / N for the latest tree. `make_proposer` dispatches on the drafter family.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from specdraft.eval.tree import DraftTree, pack_beams


class Int8Linear(torch.nn.Module):
    """Dynamic-int8 copy of a `Linear` for CPU drafting (fbgemm: int8 weights per output channel, activations
    quantised per call). The drafter's vocabulary head is a (V, X) matmul per beam step that is bound by
    streaming its weights; int8 makes it ~4-10x cheaper. Only the drafts change (slightly), never the output.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (V, X)
        scales = (w.abs().amax(1) / 127.0).clamp_min(1e-8).double()  # (V,)
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated upstream but still the fbgemm path
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w.cpu(), scales, zeros, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        self.packed = torch.ops.quantized.linear_prepack(qw, bias)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., X) -> (..., V) float32."""
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)


def int8_supported() -> bool:
    """Whether the fbgemm int8 dynamic linear ops exist in this torch build."""
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")
    except (AttributeError, RuntimeError):
        return False


@torch.inference_mode()
def redrafter_beam_search(drafter, head, hidden: Tensor, root: int, beam_width: int, draft_len: int) -> tuple[Tensor, Tensor]:
    """`ReDrafter.beam_search` with a replaceable vocabulary head (same algorithm and result for the same head).

    Step 1 scores only the live root beam (the other W-1 rows would be LOG_0 fillers).

    Args:
        drafter: a ReDrafter (`init_state`, `next_state`, `input_proj`, `blocks`).
        head: callable (W, X) -> (W, V) logits (the drafter's `head` or an `Int8Linear`).
        hidden: (H,) target state at the newest committed position.
        root, beam_width, draft_len: as in `ReDrafter.beam_search`.

    Returns:
        beams (W', 1 + D) long sorted by score (W' = W unless V < W), scores (W',).
    """
    dev = drafter.blocks[0].linear.weight.device if len(drafter.blocks) else hidden.device
    h = hidden.reshape(1, -1)  # (1, H)
    root_t = torch.tensor([root], dtype=torch.long, device=dev)
    state = drafter.init_state(root_t)  # (1, E)
    beams = root_t[:, None]  # (1, 1)
    scores = torch.zeros(1, dtype=torch.float32, device=dev)
    for k in range(draft_len):
        if k > 0:
            state = drafter.next_state(state, beams[:, -1])  # (W, E)
        g = torch.cat([state, h.to(device=state.device, dtype=state.dtype).expand(state.shape[0], -1)], dim=-1)
        if drafter.input_proj is not None:
            g = drafter.input_proj(g)  # (W, X)
        for block in drafter.blocks:
            g = block(g)
        logp = torch.log_softmax(head(g).float(), dim=-1)  # (W, V)
        vocab = logp.shape[-1]
        scores, idx = (scores[:, None] + logp).reshape(-1).topk(min(beam_width, logp.numel()))  # (W,)
        parent, token = idx // vocab, idx % vocab
        beams = torch.cat([beams[parent], token[:, None]], dim=1)  # (W, k + 2)
        state = state[parent]  # (W, E)
    return beams, scores


class ReDrafterProposer:
    """Beam search with a ReDrafter RNN drafter + dynamic tree attention (prefix dedup).

    Args:
        drafter: exposes `beam_search(hidden (H,), root_token: int, beam_width, draft_len)
            -> (beams (W, 1+draft_len) long, scores (W,))` with `beams[:, 0] == root_token`.
        beam_width: W.
        beam_length: 1 + draft_len (root included).
        int8_head: draft with an int8 copy of the vocabulary head (CPU only; ignored where unsupported)
            via `redrafter_beam_search`; False calls `drafter.beam_search` itself.
    """

    def __init__(self, drafter: torch.nn.Module, beam_width: int, beam_length: int, int8_head: bool = False) -> None:
        if beam_width < 1 or beam_length < 1:
            raise ValueError(f"ReDrafterProposer: beam_width={beam_width}, beam_length={beam_length} must be >= 1")
        self.drafter = drafter
        self.beam_width = beam_width
        self.draft_len = beam_length - 1
        self.last_compression: float | None = None
        on_cpu = drafter.head.weight.device.type == "cpu" if hasattr(drafter, "head") else False
        self.head = Int8Linear(drafter.head) if int8_head and on_cpu and int8_supported() else None

    def reset(self) -> None:
        """No state across prompts."""
        self.last_compression = None

    @torch.inference_mode()
    def propose(self, hidden: Tensor, tokens: Tensor) -> DraftTree:
        """Beams from the newest position (hidden[-1], root tokens[-1]) packed into a tree.

        Args:
            hidden: (n, H) target states of the newly committed positions.
            tokens: (n,) the token each predicts; tokens[-1] is the root.

        Returns:
            The packed tree (N <= W * (1 + D) nodes).
        """
        root = int(tokens[-1])
        if self.draft_len == 0:
            self.last_compression = 1.0
            return DraftTree(tokens[-1:].clone(), torch.full((1,), -1, dtype=torch.long, device=tokens.device))
        if self.head is not None:
            beams, _ = redrafter_beam_search(self.drafter, self.head, hidden[-1], root, self.beam_width, self.draft_len)
        else:
            beams, _ = self.drafter.beam_search(hidden[-1], root, self.beam_width, self.draft_len)  # (W, 1+D)
        tree, self.last_compression = pack_beams(beams.to(tokens.device))
        return tree


def drafter_family(drafter: torch.nn.Module) -> str:
    """Family name from the drafter config (`architecture`, else `model_type`)."""
    cfg = getattr(drafter, "config", None)
    family = getattr(cfg, "architecture", None) or getattr(cfg, "model_type", None)
    if not family:
        raise ValueError(f"cannot tell the drafter family of {type(drafter).__name__}: no config.architecture")
    return str(family)


def make_proposer(
    drafter: torch.nn.Module,
    beam_width: int | None = None,
    beam_length: int | None = None,
    tree_nodes: int | None = None,
    int8_head: bool = False,
):
    """The proposer for `drafter`'s family, with decode settings (None: the drafter's defaults).

    Args:
        drafter: a loaded drafter (`specdraft.models.hub.load_drafter`).
        beam_width: ReDrafter W (None: `config.beam_width`, else 8).
        beam_length: ReDrafter 1 + D (None: `config.draft_len + 1`).
        tree_nodes: Medusa node budget / EAGLE-2 `total_tokens` (None: the drafter's default).
        int8_head: ReDrafter drafts with an int8 vocabulary head on CPU (`Int8Linear`).
    """
    family = drafter_family(drafter)
    cfg = drafter.config
    if family == "redrafter":
        w = beam_width or getattr(cfg, "beam_width", None) or 8
        length = beam_length or getattr(cfg, "draft_len", 4) + 1
        return ReDrafterProposer(drafter, int(w), int(length), int8_head)
    if family == "medusa":
        from specdraft.eval.medusa_tree import MedusaProposer

        return MedusaProposer(drafter, max_nodes=tree_nodes)
    if family in ("eagle", "eagle3"):
        from specdraft.eval.eagle_tree import EagleTreeProposer

        total = tree_nodes or int(cfg.tree_total_tokens)
        return EagleTreeProposer(drafter, total, int(cfg.tree_depth), int(cfg.tree_top_k))
    raise NotImplementedError(f"no proposer for drafter family {family!r} (supported: redrafter, medusa, eagle, eagle3)")
