"""The KV-cache keyword across transformers versions: `cache` (5.2x, where `past_key_values` is deprecated and
goes in 5.40) or `past_key_values` (older releases, down to the 4.56 `pyproject.toml` allows).

transformers 5.24 logs "`past_key_values`/`cache_params` are deprecated. Use `cache` instead." once per process
for the old keyword, on a module call or on reading an output's `.past_key_values`; from 5.40 the old keyword
is gone. Every forward specdraft calls with a cache passes it through `cache_kwargs`, and reads a returned
cache with `returned_cache`, so one code path runs on both.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

NEW, OLD = "cache", "past_key_values"


@cache
def _keyword(forward: Any) -> str:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or C callable: the older keyword
        return OLD
    return NEW if NEW in params else OLD


def cache_keyword(module: Any) -> str:
    """`cache` when `module.forward` takes it (transformers >= 5.2x), else `past_key_values`."""
    return _keyword(type(module).forward)


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """{keyword: cache} for calling `module` (an HF model, decoder, layer or attention module) with a KV cache."""
    return {cache_keyword(module): cache}


def returned_cache(out: Any) -> Any:
    """The KV cache a transformers model output carries (`cache`, or `past_key_values` on older releases)."""
    fields = getattr(out, "__dataclass_fields__", {})
    return getattr(out, NEW if NEW in fields else OLD, None)
