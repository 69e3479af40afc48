"""ReDrafter proposer: beam search -> dedup-packed tree, lossless decoding with real drafter beams, int8 head."""

import pytest
import torch

from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.proposers import Int8Linear, ReDrafterProposer, int8_supported, make_proposer, redrafter_beam_search
from specdraft.models import redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.train.config import ReDrafterSchema


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target_and_drafter():
    target = tiny_llama(dtype=torch.float64)
    schema = ReDrafterSchema(draft_len=4, beam_width=6, num_layers=1, init_from_lm_head=True)
    drafter = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer())).double().eval()
    with torch.no_grad():  # a non-trivial random drafter (the lm-head init alone drafts mostly one token)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return target, drafter


def test_local_beam_search_equals_drafter_beam_search(target_and_drafter):
    _, drafter = target_and_drafter
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        h = torch.randn(32, generator=g, dtype=torch.float64)
        ref_beams, ref_scores = drafter.beam_search(h, 7, beam_width=6, draft_len=4)
        beams, scores = redrafter_beam_search(drafter, drafter.head, h, 7, 6, 4)
        assert torch.equal(beams, ref_beams)
        torch.testing.assert_close(scores, ref_scores)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("prompt_len", [3, 20])
def test_redrafter_proposer_is_lossless(target_and_drafter, int8, prompt_len):
    target, drafter = target_and_drafter
    if int8 and not int8_supported():
        pytest.skip("no fbgemm int8 ops in this torch build")
    proposer = ReDrafterProposer(drafter, beam_width=6, beam_length=5, int8_head=int8)
    assert (proposer.head is not None) == int8
    prompt = torch.randint(0, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    ref, _ = ar_generate(target, None, prompt, 30, stop_ids=set())
    out, stats = speculative_generate(target, None, prompt, proposer, 30, stop_ids=set())
    assert out == ref
    assert all(1.0 <= c <= 6.0 for c in stats.compression)  # W*(1+D) / N with N >= 1 + D
    assert max(stats.tree_sizes) <= 6 * 4 + 1


def test_int8_head_tracks_float_head():
    if not int8_supported():
        pytest.skip("no fbgemm int8 ops in this torch build")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 500, bias=False)
    x = torch.randn(8, 64)
    ref, got = lin(x), Int8Linear(lin)(x)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_make_proposer_defaults_and_unknown_family(target_and_drafter):
    _, drafter = target_and_drafter
    p = make_proposer(drafter)
    assert (p.beam_width, p.draft_len) == (6, 4)
    p = make_proposer(drafter, beam_width=3, beam_length=3)
    assert (p.beam_width, p.draft_len) == (3, 2)

    class Odd(torch.nn.Module):
        config = type("C", (), {"architecture": "mystery"})()

    with pytest.raises(NotImplementedError, match="mystery"):
        make_proposer(Odd())
