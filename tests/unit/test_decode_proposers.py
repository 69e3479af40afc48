"""ReDrafter proposer: beam search -> dedup-packed tree, lossless decoding with real drafter beams, int8 head."""

import pytest
import torch

from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.hybrid import LookupBranch
from specdraft.eval.proposers import (
    Int8Linear,
    LookupIndex,
    PromptLookupProposer,
    ReDrafterProposer,
    drafter_label,
    int8_supported,
    make_proposer,
    prompt_lookup,
    prompt_lookup_scored,
)
from specdraft.eval.tree import pack_beams
from specdraft.models import redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.train.config import ReDrafterSchema


@pytest.fixture(scope="module")
def target_and_drafter():
    target = tiny_llama(dtype=torch.float64)
    schema = ReDrafterSchema(draft_len=4, beam_width=6, num_layers=1, init_from_lm_head=True)
    drafter = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer())).double().eval()
    with torch.no_grad():  # a non-trivial random drafter (the lm-head init alone drafts mostly one token)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return target, drafter


def test_drafter_labels_name_the_run_of_an_export(target_and_drafter):
    """Tables and records tell several runs' exports apart: `<run>/export` is labelled by its run folder, any
    other folder (a checkpoint, a Hub id) by its last part."""
    _, d = target_and_drafter
    assert (
        drafter_label(d, "outputs/redrafter_smollm2_copy_5k/export") == "redrafter:redrafter_smollm2_copy_5k"
    )
    assert drafter_label(d, "outputs/redrafter_smollm2_copy/export/") == "redrafter:redrafter_smollm2_copy"
    assert drafter_label(d, "runs/x/checkpoints/step-00000750") == "redrafter:step-00000750"
    assert drafter_label(d, "export") == "redrafter:export"
    assert drafter_label(d, "someone/redrafter-vicuna-7b") == "redrafter:redrafter-vicuna-7b"


def test_beam_search_cum_are_the_prefix_log_probs(target_and_drafter):
    """cum[:, k] (what `min_prob` prunes on) is the teacher-forced log-prob of each beam's first k drafts."""
    _, drafter = target_and_drafter
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        h = torch.randn(32, generator=g, dtype=torch.float64)
        beams, cum = drafter.beam_search(h, 7, beam_width=6, draft_len=4)
        again, cum2 = drafter.beam_search(h, 7, 6, 4, head=drafter.head)  # an explicit head: the same search
        assert torch.equal(again, beams) and torch.equal(cum2, cum)
        logits = drafter(h[None, None].expand(1, 6, -1), beams[None, :, 0], beams[None, :, 1:])[
            0
        ]  # (W, D, V)
        per = torch.log_softmax(logits, -1).gather(-1, beams[:, 1:, None]).squeeze(-1)  # (W, D)
        ref = torch.nn.functional.pad(per.cumsum(-1), (1, 0))  # (W, 1 + D), 0 for the root
        torch.testing.assert_close(cum.double(), ref, rtol=1e-6, atol=1e-6)
        assert (cum[:-1, -1] >= cum[1:, -1]).all() and (cum.diff(dim=1) <= 0).all()


@pytest.mark.parametrize(("int8", "min_prob"), [(False, 0.0), (True, 0.0), (False, 0.02)])
@pytest.mark.parametrize("prompt_len", [3, 20])
def test_redrafter_proposer_is_lossless(target_and_drafter, int8, min_prob, prompt_len):
    target, drafter = target_and_drafter
    if int8 and not int8_supported():
        pytest.skip("no fbgemm int8 ops in this torch build")
    proposer = ReDrafterProposer(drafter, beam_width=6, beam_length=5, int8_head=int8, min_prob=min_prob)
    assert (proposer.head is not None) == int8
    prompt = torch.randint(0, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    ref, _ = ar_generate(target, None, prompt, 30, stop_ids=set())
    out, stats = speculative_generate(target, None, prompt, proposer, 30, stop_ids=set())
    assert out == ref
    assert all(1.0 <= c <= 6.0 for c in stats.compression)  # beam tokens / N
    assert max(stats.tree_sizes) <= 6 * 4 + 1
    if min_prob:  # pruning shrinks the trees
        full = ReDrafterProposer(drafter, beam_width=6, beam_length=5)
        _, full_stats = speculative_generate(target, None, prompt, full, 30, stop_ids=set())
        assert sum(stats.tree_sizes) / stats.steps < sum(full_stats.tree_sizes) / full_stats.steps


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


def test_prompt_lookup_most_recent_longest_match():
    ctx = torch.tensor([5, 1, 2, 3, 9, 1, 2, 4, 6, 7, 1, 2])
    assert prompt_lookup(ctx, max_ngram=2, num_tokens=3).tolist() == [4, 6, 7]  # most recent "1 2"
    assert prompt_lookup(ctx, max_ngram=3, num_tokens=3).tolist() == [4, 6, 7]  # "7 1 2" unseen -> 2-gram
    assert prompt_lookup(ctx, max_ngram=2, num_tokens=6).tolist() == [
        3,
        9,
        1,
        2,
        4,
        6,
    ]  # only the first is full
    assert prompt_lookup(torch.tensor([3, 4, 5]), 3, 4).tolist() == []
    assert prompt_lookup(torch.tensor([3, 4, 3]), 3, 4).tolist() == [4, 3]  # continuation may run to the end
    assert prompt_lookup(torch.tensor([8]), 3, 4).tolist() == []


def _vectorised_lookup_scored(context: torch.Tensor, max_ngram: int, num_tokens: int):
    """The vectorised search `LookupIndex` replaced (a pass over the whole context per n): the reference."""
    t = context.shape[0]
    for n in range(min(max_ngram, t - 1), 0, -1):
        windows = context[: t - 1].unfold(0, n, 1)  # (T-n, n): every earlier n-gram with a successor
        hits = (windows == context[t - n :]).all(1).nonzero()  # (h, 1)
        if hits.numel():
            full = hits[hits + n + num_tokens <= t]  # matches followed by a full-length continuation
            start = int(full[-1] if full.numel() else hits[0]) + n  # most recent full one, else the longest
            cont = context[start : start + num_tokens]  # (k,)
            idx = hits + n + torch.arange(cont.shape[0])  # (h, k)
            same = (context[idx.clamp(max=t - 1)] == cont) & (idx < t)  # (h, k)
            agree = same.long().cumprod(1).sum(0)  # (k,) occurrences agreeing up to each depth
            return cont, agree.float() / (hits.shape[0] + 1)
    return context[:0], torch.zeros(0)


def test_the_host_lookup_index_equals_the_vectorised_search_bit_for_bit():
    """`LookupIndex` (what `PromptLookupProposer` and `prompt_lookup_scored` draft with) against the vectorised
    search at every length of random texts with many repeats, committed a few tokens at a time: the same
    continuation and the same float32 probabilities; and the proposer's chain tree equals `pack_beams` of root +
    continuation."""
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        vocab, n, k = 3 + trial % 5, 1 + trial % 4, 1 + trial % 7
        text = torch.randint(0, vocab, (60,), generator=g)
        index, proposer, t = LookupIndex(n), PromptLookupProposer(k, n), 0
        while t < text.shape[0]:
            step = 1 + int(torch.randint(0, 4, (1,), generator=g))
            new = text[t : t + step]
            t += new.shape[0]
            index.extend(new.tolist())
            cont, probs = index.scored(k)
            want, want_p = _vectorised_lookup_scored(text[:t], n, k)
            assert cont == want.tolist() and torch.equal(probs, want_p), (trial, t)
            got, got_p = prompt_lookup_scored(text[:t], n, k)
            assert torch.equal(got, want) and torch.equal(got_p, want_p), (trial, t)
            tree = proposer.propose(torch.zeros(new.shape[0], 4), new)
            ref = pack_beams(torch.cat([new[-1:], want])[None])[0]
            for field in ("tokens", "parents", "depth", "ancestors", "beam_nodes"):
                assert torch.equal(getattr(tree, field), getattr(ref, field)), (trial, t, field)
            assert torch.equal(tree.scores, torch.cat([torch.ones(1), want_p]))


@pytest.mark.parametrize("prompt_len", [4, 24])
def test_lookup_proposers_are_lossless_and_accept_repeats(target_and_drafter, prompt_len):
    target, drafter = target_and_drafter
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 128, (prompt_len,), generator=g)
    ref, _ = ar_generate(target, None, prompt, 40, stop_ids=set())
    # the AR continuation appears in the prompt: lookup must find and accept it
    echo = torch.cat([prompt, torch.tensor(ref[:30]), prompt[-3:]])
    ref_echo, _ = ar_generate(target, None, echo, 30, stop_ids=set())
    for proposer in [PromptLookupProposer(6), LookupBranch(ReDrafterProposer(drafter, 4, 4), 6)]:
        out, _ = speculative_generate(target, None, prompt, proposer, 40, stop_ids=set())
        assert out == ref
        out, stats = speculative_generate(target, None, echo, proposer, 30, stop_ids=set())
        assert out == ref_echo
        assert max(stats.accepted) >= 3  # the echoed continuation is found and accepted
    assert stats.compression and max(stats.tree_sizes) <= 4 * 3 + 6 + 1


def test_redrafter_with_target_layers_reads_h_and_the_layers_and_is_lossless():
    """With `target_layers` the decoder hands the drafter [h_t; l_i,t] of the newest committed position (checked
    against a plain forward over the same tokens), and greedy output still equals the target's own."""
    from specdraft.models.base_llm import forward_with_hidden

    target = tiny_llama(dtype=torch.float64)
    schema = ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1, target_layers=[1], exit_dim=32)
    drafter = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer())).double().eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    proposer = ReDrafterProposer(drafter, beam_width=4, beam_length=4)
    assert proposer.spec.feature_layers == (1,) and proposer.spec.keep_last_hidden
    seen: list[torch.Tensor] = []
    search = drafter.beam_search
    drafter.beam_search = lambda h, *a: seen.append(h) or search(h, *a)  # type: ignore[method-assign]
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(3))
    ref, _ = ar_generate(target, None, prompt, 24, stop_ids=set())
    out, stats = speculative_generate(target, None, prompt, proposer, 24, stop_ids=set())
    assert out == ref and stats.steps == len(seen)
    full = forward_with_hidden(
        target, torch.cat([prompt, torch.tensor(out)])[None], layers=(1,), logits=False
    )
    feats = torch.cat([full.hidden[0], full.layers[0].flatten(-2)], dim=-1)  # (L, 2H): [h; l_1]
    # step 1 drafts from the last prompt position; later steps from the last accepted position
    torch.testing.assert_close(seen[0], feats[len(prompt) - 1])
    committed = len(prompt) - 1 + 1 + stats.accepted[0]  # + root + accepted drafts of step 1
    torch.testing.assert_close(seen[1], feats[committed], rtol=1e-9, atol=1e-9)
