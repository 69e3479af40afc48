"""Grouped-query attention on the CPU without copying keys and values, for masked multi-token forwards.

transformers' SDPA attention (`sdpa_attention_forward`) runs grouped-query attention natively only without a
mask (prefill) or for one query token; with a mask and several query tokens (a tree verify, a padded batch) it
copies every key/value head `num_key_value_groups` times over the whole cache first (`repeat_kv`). On a CPU
that copy is paid on every layer of every verify: SmolLM2-135M (9 query heads over 3 key/value heads), a
masked attention over a 256-token cache costs 159 / 161 / 177 / 204 us with the copy at 2 / 4 / 8 / 16 query
tokens, and 68 / 70 / 102 / 182 us with `enable_gqa=True`, the very same numbers (bit-identical outputs:
torch's CPU flash kernel maps query head h to key/value head h // groups, as `repeat_kv` lays them out).

Short queries (a few tree nodes, at any batch size, or one new token) go further: the `groups` query heads of
a key/value head are packed into one head of groups x L query rows (the mask, shared by heads, tiled to
match), so every key/value block is read once per key/value head rather than once per query head. Masked
attention at batch 16 over 300 positions, SmolLM2's heads, bf16 on a 2-core Zen 5: 0.58 / 0.68 / 0.77 of
`enable_gqa`'s time at 2 / 4 / 8 query tokens (0.62-0.82 at batch 4; fp32 0.66-0.92); at batch 1, 0.75 /
0.80 / 0.71 in bf16 and 0.81 / 0.83 / 0.94 in fp32. One new token (a decode step, no mask) at batch 1 in bf16
cost 127 us a layer through torch's kernel (transformers' path) and 28 us packed, bit-identical: ~3 ms of
SmolLM2's ~23 ms step; in fp32 that kernel is the faster one (19 against 27 us), so a float32 single query
at batch 1 keeps it. Past 8 tokens x 3 groups (`PACK_MAX_ROWS`) packing stops paying: `enable_gqa`. The
outputs equal `enable_gqa`'s to rounding (the kernel blocks the rows differently): within 1e-6 in fp32.

`use_gqa_sdpa(model)` switches an SDPA model to `gqa_sdpa_forward`, which takes that path for masked
multi-token CPU queries and hands every other call to transformers' own function unchanged (CUDA keeps
`repeat_kv`: its fused kernels do not take a mask with grouped heads).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "specdraft_gqa_sdpa"  # the `config._attn_implementation` it registers as
# batched queries of at most this many (query heads per key/value head) x tokens are packed per key/value head
PACK_MAX_ROWS = 24
# the kwargs it handles (any other one goes to transformers' function): bookkeeping that SDPA ignores;
# `sliding_window` is informational for SDPA too (the mask already encodes the window)
_PLAIN = {
    "dropout", "scaling", "is_causal", "position_ids", "past_key_values", "cache", "use_cache", "cache_position",
    "sliding_window", "output_hidden_states", "output_attentions",
}  # fmt: skip


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' SDPA attention, with masked CPU queries and single new tokens attending to the key/value
    heads directly (see module docstring).

    Args:
        module: the attention layer (`num_key_value_groups`, `training`).
        query: (B, heads, L, d); key, value: (B, kv_heads, S, d).
        attention_mask: (B or 1, 1, L, S) additive or boolean mask, or None.
        kwargs: `scaling`, `dropout`, ... as transformers passes them.

    Returns:
        ((B, L, heads, d) attention output, None).
    """
    groups = int(getattr(module, "num_key_value_groups", 1))
    b, heads, length, d = query.shape
    ours = (
        query.device.type == "cpu"
        and groups > 1
        and not kwargs.get("dropout")
        and not kwargs.get("output_attentions")
        and set(kwargs) <= _PLAIN
    )
    # masked queries (a tree verify, a padded batch, a fixed-shape step) or one new token (every cached
    # position visible); an unmasked multi-token query is a causal prefill: transformers' function
    if ours and (attention_mask is not None or length == 1):
        fits = length * groups <= PACK_MAX_ROWS and (attention_mask is None or attention_mask.shape[1] == 1)
        # one query token at batch 1 in float32: torch's kernel is faster per query head (19 vs 27 us)
        full_one = b == 1 and length == 1 and query.dtype in (torch.float32, torch.float64)
        if fits and not full_one:
            # every key/value head attends once for its `groups` query heads x L tokens (mask shared by heads)
            packed = query.reshape(b, heads // groups, groups * length, d)  # (B, kv_heads, groups * L, d)
            mask = (
                None
                if attention_mask is None
                else attention_mask.expand(-1, groups, -1, -1).reshape(
                    attention_mask.shape[0], 1, -1, key.shape[2]
                )
            )
            out = F.scaled_dot_product_attention(
                packed, key, value, attn_mask=mask, scale=kwargs.get("scaling")
            )
            return out.reshape(b, heads, length, d).transpose(1, 2).contiguous(), None
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True
            )  # (B, heads, L, d)
            return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_gqa_sdpa(model: PreTrainedModel) -> bool:
    """Switch a model that attends with transformers' SDPA to `gqa_sdpa_forward` (registered once as `NAME`,
    with SDPA's mask builder), in place. Returns whether it was switched (other implementations: unchanged)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, gqa_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME


# SDPA backends for eager attention whose shapes change from call to call (see `varying_shape_sdpa`)
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_FIXED = threading.local()  # .on: inside `fixed_shapes()` (per thread: a capture is per thread too)


@contextlib.contextmanager
def fixed_shapes() -> Iterator[None]:
    """Mark the calls inside as one fixed-shape step about to be captured as a CUDA graph (its warm-up runs and
    the capture itself, `eval.graphs.CudaGraph`): `varying_shape_sdpa` keeps torch's SDPA choice there, so the
    warm-ups pick the backends the capture will. A backend that prepares per shape (cuDNN builds a graph for
    each new one) then prepares in a warm-up, never inside the capture, which that preparation invalidates (an
    H200, torch 2.11, bf16 SmolLM2: every verify capture of the first decoder failed and ran eagerly, 15 ms a
    step instead of ~3.5, while its warm-ups ran without cuDNN and its captures with it)."""
    before = getattr(_FIXED, "on", False)
    _FIXED.on = True
    try:
        yield
    finally:
        _FIXED.on = before


def varying_shape_sdpa(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The SDPA backends for an eager forward on `device` whose shapes change from call to call (a prompt's
    prefill, EAGLE's commit of the accepted tokens, the dynamic decode path): on CUDA every backend but
    cuDNN's, which builds a graph for each new shape (torch 2.11 on an H100: EAGLE-3's commit, one layer over
    a few new tokens and a cache one step longer each time, took a median 50 ms eagerly, its graph-replayed
    expansion 2 ms). A fixed-shape step being captured (`fixed_shapes`, its warm-ups included, or any
    capture in progress) and CPU calls keep torch's choice."""
    if device.type != "cuda" or getattr(_FIXED, "on", False):
        return contextlib.nullcontext()
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return contextlib.nullcontext()
    return sdpa_kernel(_NOT_CUDNN)
