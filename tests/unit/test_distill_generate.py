"""Batched generation (distill/generate.py) equals unbatched greedy generation token for token."""

from __future__ import annotations

import pytest
import torch

from specdraft.distill import generate
from specdraft.distill.generate import GenerationSettings, generate_batched, pick_tokens
from specdraft.testing import tiny_llama, tiny_target

STOP = (97, 106, 114)  # tokens the seeded tiny model emits mid-sequence for some prompts


def greedy_reference(model, prompt: list[int], budget: int, stop=STOP) -> tuple[list[int], str]:
    """Unbatched, cache-free greedy decoding: one full forward per new token."""
    ids, out = list(prompt), []
    for _ in range(budget):
        t = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
        if t in stop:
            return out, "eos"
    return out, "length"


def make_prompts(n: int = 11, seed: int = 1) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=g).tolist()
    prompts = [torch.randint(6, 128, (n_,), generator=g).tolist() for n_ in lengths]
    budgets = torch.randint(1, 16, (n,), generator=g).tolist()
    return prompts, budgets


@pytest.fixture(scope="module")
def references() -> dict:
    """Unbatched greedy outputs per dtype, computed once for the module."""
    prompts, budgets = make_prompts()
    out = {}
    for dtype in (torch.float64, torch.float32):
        model = tiny_llama(dtype=dtype)
        out[dtype] = [greedy_reference(model, p, b) for p, b in zip(prompts, budgets)]
    return out


@pytest.mark.parametrize(
    "dtype,batch_tokens,max_batch_size,refill",
    [
        (torch.float64, 10**6, 32, True),
        (torch.float64, 60, 3, True),
        (torch.float64, 60, 3, False),
        (torch.float64, 10**6, 1, True),
        (torch.float32, 10**6, 32, True),
        (torch.float32, 60, 3, True),
    ],
    ids=["fp64-one-batch", "fp64-refill", "fp64-static", "fp64-bs1", "fp32-one-batch", "fp32-refill"],
)
def test_batched_equals_unbatched_greedy(references, dtype, batch_tokens, max_batch_size, refill):
    """Mixed prompt lengths (1..19, left padding) and budgets; stop tokens and budgets both end rows."""
    model = tiny_llama(dtype=dtype)
    prompts, budgets = make_prompts()
    s = GenerationSettings(
        stop_ids=STOP, batch_tokens=batch_tokens, max_batch_size=max_batch_size, refill=refill
    )
    got = generate_batched(model, prompts, s, max_new_tokens=budgets)
    for g, ref, b in zip(got, references[dtype], budgets):
        assert (g.tokens, g.finish_reason) == ref
        assert g.length == len(g.tokens) <= b
    reasons = {g.finish_reason for g in got}
    assert reasons == {"eos", "length"}  # both stopping rules exercised


@pytest.mark.parametrize("arch,window", [("qwen2", None), ("mistral", None), ("mistral", 6)])
def test_batched_equals_unbatched_greedy_other_targets(arch, window):
    """Qwen2 and Mistral targets, and a sliding window shorter than most rows (transformers' forward takes the
    decode steps past it: the lean forward's padding mask would not hide the keys beyond the window)."""
    model = tiny_target(arch)
    model.config.sliding_window = window
    prompts, budgets = make_prompts(n=9, seed=5)
    s = GenerationSettings(stop_ids=(3,), batch_tokens=60, max_batch_size=3, refill=True)
    got = generate_batched(model, prompts, s, max_new_tokens=budgets)
    for g, p, b in zip(got, prompts, budgets):
        assert (g.tokens, g.finish_reason) == greedy_reference(model, p, b, stop=(3,))
    if window is not None:
        assert max(len(p) + g.length for p, g in zip(prompts, got)) > window + 4


def test_refill_splices_rows_into_a_running_batch(monkeypatch):
    """With refill, new prompts join while others still decode (fewer forwards than static batches)."""
    model = tiny_llama(dtype=torch.float64)
    prompts, budgets = make_prompts(n=12, seed=3)
    calls = {"n": 0, "mixed": 0}
    orig = generate._forward

    def counting(model, ids, mask, pos, cache, capture):
        calls["n"] += 1
        if ids.shape[1] == 1 and mask[:, 0].min() == 0:
            calls["mixed"] += 1  # a decode step over left-padded (spliced) rows
        return orig(model, ids, mask, pos, cache, capture)

    monkeypatch.setattr(generate, "_forward", counting)
    s = GenerationSettings(stop_ids=STOP, max_batch_size=4, refill=True)
    refilled = generate_batched(model, prompts, s, max_new_tokens=budgets)
    n_refill, mixed = calls["n"], calls["mixed"]
    calls["n"] = 0
    static = generate_batched(
        model,
        prompts,
        GenerationSettings(stop_ids=STOP, max_batch_size=4, refill=False),
        max_new_tokens=budgets,
    )
    assert [g.tokens for g in refilled] == [g.tokens for g in static]
    assert mixed > 0 and n_refill < calls["n"]


def test_token_budget_packs_rows_and_long_prompts_run_alone(monkeypatch):
    model = tiny_llama(dtype=torch.float64)
    sizes: list[int] = []
    orig = generate._forward

    def spy(model, ids, *args):
        sizes.append(ids.shape[0])
        return orig(model, ids, *args)

    monkeypatch.setattr(generate, "_forward", spy)
    prompts = [[7] * 40, [8] * 10, [9] * 10, [10] * 10]
    s = GenerationSettings(
        stop_ids=(), batch_tokens=45, max_batch_size=8, refill=False
    )  # footprint = len + 4
    out = generate_batched(model, prompts, s, max_new_tokens=[4] * 4)
    assert max(sizes) == 3 and sizes[0] == 1  # the 40-token prompt alone first, then 3 x 14 <= 45
    assert all(g.finish_reason == "length" and g.length == 4 for g in out)


def test_zero_budget_and_bad_inputs():
    model = tiny_llama()
    out = generate_batched(model, [[1, 2], [3]], GenerationSettings(), max_new_tokens=[0, 2])
    assert out[0].tokens == [] and out[0].finish_reason == "length" and out[1].length == 2
    with pytest.raises(ValueError, match="at least one token"):
        generate_batched(model, [[]], GenerationSettings())
    with pytest.raises(ValueError, match="2 prompts"):
        generate_batched(model, [[1], [2]], GenerationSettings(), max_new_tokens=[1])


def test_sampling_top_p_and_seed():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    s = GenerationSettings(do_sample=True, temperature=1.0, top_p=1e-6)
    assert pick_tokens(logits, s, None).item() == 1  # top-p keeps only the best token
    s = GenerationSettings(do_sample=True, temperature=1.0, top_p=0.9)
    draws = {pick_tokens(logits, s, torch.Generator().manual_seed(i)).item() for i in range(50)}
    assert draws == {1, 2}  # tokens 0 and 3 lie outside the nucleus
    model = tiny_llama()
    prompts, budgets = make_prompts(n=4)
    s = GenerationSettings(do_sample=True, temperature=0.8, top_p=0.95)
    a = generate_batched(model, prompts, s, budgets, generator=torch.Generator().manual_seed(0))
    b = generate_batched(model, prompts, s, budgets, generator=torch.Generator().manual_seed(0))
    assert [g.tokens for g in a] == [g.tokens for g in b]
