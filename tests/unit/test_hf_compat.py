"""models/hf_compat.py: the cache keyword each module takes, and no deprecated keyword on specdraft's paths."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from specdraft.distill.continuations import greedy_continuations
from specdraft.distill.generate import GenerationSettings, generate_batched
from specdraft.models.base_llm import forward_with_hidden
from specdraft.models.hf_compat import cache_keyword, cache_kwargs, returned_cache
from specdraft.testing import tiny_llama


class OldStyle(torch.nn.Module):
    def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
        return x


class NewStyle(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        return x


@dataclass
class OldOutput:
    logits: Any = None
    past_key_values: Any = None


@dataclass
class NewOutput:
    logits: Any = None
    cache: Any = None


def test_keyword_follows_the_signature():
    assert cache_kwargs(OldStyle(), 1) == {"past_key_values": 1}
    assert cache_kwargs(NewStyle(), 2) == {"cache": 2}
    assert returned_cache(OldOutput(past_key_values=3)) == 3 and returned_cache(NewOutput(cache=4)) == 4
    model = tiny_llama()  # whatever this transformers release names it
    params = inspect.signature(type(model.model).forward).parameters
    want = "cache" if "cache" in params else "past_key_values"
    assert {cache_keyword(m) for m in (model, model.model, model.model.layers[0])} == {want}


def test_no_deprecated_cache_keyword_on_specdraft_paths():
    """distill's generation (prefill, lean and transformers decode steps), continuations and the decoders'
    forward run without transformers' deprecation warning for the cache keyword."""
    model = tiny_llama(dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        generate_batched(model, [[5, 6, 7], [8, 9]], GenerationSettings(max_batch_size=2), [4, 4])
        greedy_continuations(model, [5, 6, 7, 8], 3)
        out = forward_with_hidden(model, torch.tensor([[5, 6]]), use_cache=True, logits=False)
        forward_with_hidden(model, torch.tensor([[7]]), past_key_values=out.past_key_values, use_cache=True)
    messages = [str(w.message) for w in seen if "past_key_values" in str(w.message)]
    assert not messages, messages[0]
