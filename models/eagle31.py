"""EAGLE-3.1 normalisation (`drafter.norm_fused`): an option around the EAGLE-3 core of `models/eagle3.py`.

EAGLE-3 feeds `fc` the raw concatenation of the low/mid/high target layers, whose scales differ a lot (the
residual stream grows with depth), and feeds its own pre-norm output o back as the next step's g, whose scale
drifts from step to step. EAGLE-3.1 (the `fc_norm` + `norm_output` options of the vLLM / SGLang / TensorRT-LLM
EAGLE-3 drafters) normalises both:

    g_t  = fc([rms_0(l_low); rms_1(l_mid); rms_2(l_high)]_t)   one learnt RMSNorm per layer (`fc_norm.i`)
    o'_t = norm(o_t)                                            the next step's g; lm_head reads it as is

so every unroll step (training-time test) and every tree depth (decoding) reads inputs on one scale. The head
applies both inside its own `encode_target` / `step` / `draft_logits`, so `models.eagle_common.unroll` and the
EAGLE-2 proposer (`eval/eagle_tree.py`) need no change. Off (the default), the head is EAGLE-3 unchanged.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class ChunkNorm(nn.ModuleList):
    """One RMSNorm per fused target layer: chunk i of (..., m*H) is normalised by `self[i]`.

    A `ModuleList`, so the weights are `fc_norm.{i}.weight` as in the engines' EAGLE-3.1 checkpoints.

    Args:
        norm: the norm to copy (the head's block norm: the target family's RMSNorm, eps and all).
        m: number of fused target layers.
    """

    def __init__(self, norm: nn.Module, m: int) -> None:
        super().__init__(copy.deepcopy(norm) for _ in range(m))

    def forward(self, feats: Tensor) -> Tensor:
        """(..., m*H) concatenated target layers -> (..., m*H), every H-wide chunk normalised on its own."""
        chunks = feats.chunk(len(self), dim=-1)  # m x (..., H)
        return torch.cat([norm(c) for norm, c in zip(self, chunks)], dim=-1)  # (..., m*H)
