"""T-token greedy continuations (distill/continuations.py) equal a naive per-position loop."""

from __future__ import annotations

import pytest
import torch

from specdraft.distill.continuations import greedy_continuations, positions_to_compute, shift_continuations
from specdraft.testing import tiny_llama


def naive(model, ids: list[int], t: int, T: int) -> list[int]:
    """Greedy T tokens after ids[:t+1], one full forward per token."""
    seq, out = list(ids[: t + 1]), []
    for _ in range(T):
        nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        out.append(nxt)
        seq.append(nxt)
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("chunk", [256, 3])
def test_continuations_equal_naive_loop(attn, chunk):
    model = tiny_llama(dtype=torch.float64)
    model.config._attn_implementation = attn
    ids = torch.randint(0, 128, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    positions = [0, 2, 3, 4, 9, 17, 18]
    cont = greedy_continuations(model, ids, T=4, positions=positions, chunk_size=chunk)
    assert len(cont) == 19 and all(len(r) == 4 for r in cont)
    for t in range(19):
        assert cont[t] == (naive(model, ids, t, 4) if t in positions else [-100] * 4)


def test_all_positions_fp32_and_forward_count():
    model = tiny_llama(dtype=torch.float32)
    calls = []
    orig = model.forward

    def spy(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return orig(*args, **kwargs)

    model.forward = spy
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    cont = greedy_continuations(model, ids, T=3)
    assert len(calls) == 3  # one base forward + T-1 rounds, never one forward per position
    model.forward = orig
    assert cont == [naive(model, ids, t, 3) for t in range(12)]


def test_shift_continuations_and_positions():
    assert shift_continuations([10, 11, 12], 2) == [[11, 12], [12, -100], [-100, -100]]
    assert positions_to_compute([0, 0, 1, 1, 0, 1]) == [1, 2, 4]
    model = tiny_llama()
    assert greedy_continuations(model, [1, 2, 3], 2, positions=[]) == [[-100, -100]] * 3
    with pytest.raises(ValueError, match="positions"):
        greedy_continuations(model, [1, 2, 3], 2, positions=[3])
