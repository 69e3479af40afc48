"""Decoding never relies on the default device, so it runs as written on a GPU host.

A CPU-only stand-in for running these paths beside a CUDA model: under `torch.device("meta")` every tensor made
without an explicit device lands on the meta device, and any op that mixes it with the CPU model's tensors, or
reads it on the host, raises - exactly where a stray CPU tensor would break a decode on CUDA (as
`torch.randint(..., generator=<cuda generator>)` once broke the eval CLI there). Models, proposers, budgets and
generators are built before the context, as the eval CLI builds them before decoding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from specdraft.eval.adaptive import AdaptiveProposer
from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.budget import CostCurve, NodeBudget
from specdraft.eval.decode import speculative_generate
from specdraft.eval.hybrid import LookupBranch
from specdraft.eval.static_decode import StaticDecoder
from specdraft.testing import FAMILIES, random_prompts, tiny_proposer, tiny_proposer_factory, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
FLAT = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}  # a cost curve on which drafting pays: trees stay


def _strict(fn: Callable[[], Any]) -> Any:
    """Run `fn` with the meta device as the default device."""
    with torch.device("meta"):
        return fn()


def _budget() -> NodeBudget:
    return NodeBudget(CostCurve(FLAT), fit_steps=4, check_steps=2, sizes=(1, 2, 4, 8))


def _wrapped(kind: str, family: str, model: torch.nn.Module):
    """The family's proposer, alone or inside one of the composing wrappers."""
    inner = tiny_proposer(family, model)
    if kind == "lookup":
        return LookupBranch(inner, 4)
    if kind == "adaptive":
        return AdaptiveProposer(inner)
    return inner


@pytest.mark.parametrize("kind", ["plain", "lookup", "adaptive"])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_prompt_paths_make_no_tensor_on_the_default_device(family, kind):
    model = tiny_target("llama")
    prompt = torch.arange(5, 16)
    for static in (False, True):  # the eager and the fixed-shape (CUDA graph) static path
        dec = StaticDecoder(model, 64, static=static)
        proposer, budget = _wrapped(kind, family, model), _budget()
        _strict(lambda: dec.speculative_generate(None, prompt, proposer, 20, stop_ids=set(), budget=budget))  # noqa: B023
        g = torch.Generator().manual_seed(0)
        _strict(
            lambda: dec.speculative_generate(None, prompt, proposer, 12, 0.8, set(), top_k=20, generator=g)  # noqa: B023
        )
        _strict(lambda: dec.ar_generate(None, prompt, 8, stop_ids=set()))  # noqa: B023
    proposer = _wrapped(kind, family, model)
    _strict(lambda: speculative_generate(model, None, prompt, proposer, 16, stop_ids=set()))


@pytest.mark.parametrize("kind", ["plain", "lookup", "adaptive"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_paths_make_no_tensor_on_the_default_device(family, kind):
    model = tiny_target("llama")
    prompts = random_prompts([3, 9, 5, 12], seed=1)
    for static in (False, True):
        dec = BatchDecoder(model, 3, max_len=32, static=static)  # small: the cache grows inside the call
        for sampling in (False, True):
            pool = [_wrapped(kind, family, model) for _ in range(3)]
            budget = None if sampling else _budget()
            kw = dict(temperature=0.8, generator=torch.Generator().manual_seed(0)) if sampling else {}
            _strict(lambda: dec.generate(prompts, [10, 14, 6, 12], set(), pool.pop, budget=budget, **kw))  # noqa: B023
        _strict(lambda: dec.generate(prompts, 6, set()))  # noqa: B023


@pytest.mark.parametrize(
    "family", ["redrafter", "redrafter_copy", "medusa", "eagle3", "redrafter_copy+lookup"]
)
def test_rows_drafted_together_make_no_tensor_on_the_default_device(family):
    """The batched decoder with proposers sharing one drafter, so each step drafts every row in one call
    (`RowBatchedProposer`), greedy with a budget and sampling."""
    model = tiny_target("llama")
    prompts = random_prompts([3, 9, 5, 12], seed=1)
    make = tiny_proposer_factory(family, model)
    for static in (False, True):
        dec = BatchDecoder(model, 3, max_len=32, static=static)
        pool = [make() for _ in range(6)]  # made outside: a proposer sets its static layout up on the CPU
        _strict(lambda: dec.generate(prompts, [10, 14, 6, 12], set(), pool.pop, budget=_budget()))  # noqa: B023
        g = torch.Generator().manual_seed(0)
        _strict(lambda: dec.generate(prompts, 8, set(), pool.pop, temperature=0.8, generator=g))  # noqa: B023


def test_cost_probes_make_no_tensor_on_the_default_device():
    """The node budget's start-up measurement (eval.node_budget=auto) on both decoders and paths."""
    model = tiny_target("llama")
    for static in (False, True):
        _strict(lambda: StaticDecoder(model, 64, static=static).measure_costs((1, 4), prefix=8, reps=1))  # noqa: B023
        _strict(lambda: BatchDecoder(model, 2, static=static).measure_costs((1, 4), prefix=8, reps=1))  # noqa: B023
