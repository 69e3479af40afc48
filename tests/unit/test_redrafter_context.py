"""ReDrafter's prefix attention (`context_heads` > 0): what position t may see in training, the same logits from the
decoder's incrementally grown memory, a lossless decoder, and a warm start that leaves an export's logits as they
were."""

from __future__ import annotations

import pytest
import torch

from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.hybrid import LookupBranch
from specdraft.eval.proposers import ReDrafterProposer
from specdraft.models import redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.models.redrafter import ReDrafter
from specdraft.models.teacher_forced import _forward_with_context
from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.train.config import ReDrafterSchema

D = 3


@pytest.fixture(scope="module")
def target_and_drafter() -> tuple[torch.nn.Module, ReDrafter]:
    target = tiny_llama(dtype=torch.float64)
    schema = ReDrafterSchema(
        draft_len=D,
        beam_width=4,
        num_layers=1,
        target_layers=[1],
        exit_dim=32,
        context_heads=2,
        context_dim=16,
    )
    drafter = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer())).double().eval()
    with torch.no_grad():  # non-trivial weights everywhere, the zero-initialised output projection included
        torch.manual_seed(0)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return target, drafter


def _sequence(seed: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g), torch.randn(n, 64, generator=g, dtype=torch.float64)


def _tf_logits(drafter: ReDrafter, ids: torch.Tensor, feats: torch.Tensor, ts: list[int]) -> torch.Tensor:
    """Teacher-forced logits (len(ts), D, V) of positions `ts` through the training path."""
    t = torch.tensor(ts)
    targets = torch.stack([ids[i + 2 : i + 2 + D] for i in ts])  # (N, D)
    return _forward_with_context(
        drafter, {"input_ids": ids[None]}, feats[None, :, :32], feats[t], ids[t + 1], targets, t * 0, t
    )


def test_position_t_sees_exactly_the_committed_positions_2_to_t(target_and_drafter):
    _, drafter = target_and_drafter
    ids, feats = _sequence(0)
    t = 8
    ref = _tf_logits(drafter, ids, feats, [t])
    # the future (x_{t+2}.. are the labels, fed separately)
    later_ids, later_feats = ids.clone(), feats.clone()
    later_ids[t + 2 :], later_feats[t + 1 :] = 5, 9.0
    # positions 0 and 1 are never visible (x_0 is unknown)
    early_ids, early_feats = ids.clone(), feats.clone()
    early_ids[0], early_feats[:2] = 7, -3.0
    for i2, f2 in [(later_ids, later_feats), (early_ids, early_feats)]:
        t_ = torch.tensor([t])
        batch, last = {"input_ids": i2[None]}, f2[None, :, :32]
        labels = ids[None, t + 2 : t + 2 + D]
        out = _forward_with_context(drafter, batch, last, feats[t_], ids[t_ + 1], labels, t_ * 0, t_)
        torch.testing.assert_close(out, ref)
    seen = feats.clone()
    seen[4] += 1.0  # a visible position changes the drafts
    assert not torch.allclose(_tf_logits(drafter, ids, seen, [t]), ref)


def test_decoder_memory_gives_the_training_logits(target_and_drafter):
    """The proposer's memory, grown over two calls as the decoder commits positions, gives the teacher-forced
    logits of the newest position (rows regrouped and padded in training, flat at decode time)."""
    _, drafter = target_and_drafter
    ids, feats = _sequence(1)
    ts = [3, 6, 10]
    ref = _tf_logits(drafter, ids, feats, ts)  # (3, D, V)
    for i, t in enumerate(ts):
        proposer = ReDrafterProposer(drafter, beam_width=4, beam_length=D + 1)
        cut = min(2, t)
        proposer._update_memory(feats[:cut], ids[1 : cut + 1])  # prefill: positions 0.., tokens x_1..
        keys, values = proposer._update_memory(feats[cut : t + 1], ids[cut + 1 : t + 2])
        assert keys.shape[0] == t  # the sink, then positions 2..t
        assert not keys[0].any() and not values[0].any()
        h = drafter.features(feats[t][None])  # (1, F)
        state = drafter.init_state(ids[t + 1][None])
        for k in range(D):
            if k > 0:
                state = drafter.next_state(state, ids[t + 1 + k][None])
            out = drafter.state_logits(state, h, context=(keys, values, None))[0]
            torch.testing.assert_close(out, ref[i, k])


def test_decoder_memory_grows_past_its_buffer_and_resets(target_and_drafter):
    """The proposer's memory buffer doubles when full (64 rows first): after 200 positions committed in uneven
    calls it holds exactly the memory computed in one go; `reset` starts a new prompt from the sink alone."""
    _, drafter = target_and_drafter
    n = 200
    ids, feats = _sequence(3, n + 1)
    proposer = ReDrafterProposer(drafter, beam_width=4, beam_length=D + 1)
    start = 0
    for size in [1, 2, 5, 40, 3, 90, 1, 58]:  # sums to 200
        keys, values = proposer._update_memory(feats[start : start + size], ids[start + 1 : start + size + 1])
        start += size
    assert start == n and keys.shape[0] == 1 + (n - 2)  # the sink, then positions 2 .. n - 1
    j = torch.arange(2, n)
    ref_k, ref_v = drafter.context_memory(
        feats[j, :32], ids[j - 1], ids[j], ids[j + 1]
    )  # (1 + n - 2, A) each
    torch.testing.assert_close(keys, ref_k)
    torch.testing.assert_close(values, ref_v)
    proposer.reset()
    keys, _ = proposer._update_memory(feats[:3], ids[1:4])
    torch.testing.assert_close(keys, ref_k[:2])  # the sink and position 2 only


@pytest.mark.parametrize("prompt_len", [1, 3, 20])
@pytest.mark.parametrize("min_prob", [0.0, 0.01])  # 0.01: trees pruned on the cumulative log-probs
def test_prefix_attention_decoding_is_lossless(target_and_drafter, prompt_len, min_prob):
    target, drafter = target_and_drafter
    inner = ReDrafterProposer(drafter, 4, D + 1, min_prob=min_prob)
    proposer = LookupBranch(inner, 4, lookup_alone=False)  # a lookup chain merged in on every step
    assert inner.uses_context
    prompt = torch.randint(0, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    ref, _ = ar_generate(target, None, prompt, 30, stop_ids=set())
    for _ in range(2):  # the proposer is reused: `reset` must forget the previous prompt's memory
        out, stats = speculative_generate(target, None, prompt, proposer, 30, stop_ids=set())
        assert out == ref
        # the history holds every position committed before the last step (whose tokens end the loop)
        grown = prompt_len + sum(stats.accepted[:-1]) + stats.steps - 1
        assert inner._history is not None and inner._history.shape[0] == grown


def test_warm_start_adds_prefix_attention_exactly(target_and_drafter, tmp_path):
    from specdraft.models.hub import warm_start

    target, drafter = target_and_drafter
    fp = target_fingerprint(target, tiny_tokenizer())
    plain_schema = ReDrafterSchema(draft_len=D, num_layers=1, target_layers=[1], exit_dim=32)
    src = redrafter.build(plain_schema, target, fp).double()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    src.save_pretrained(tmp_path / "src")
    schema = ReDrafterSchema(
        draft_len=D, num_layers=1, target_layers=[1], exit_dim=32, context_heads=2, context_dim=16
    )
    dst = redrafter.build(schema, target, fp).double()
    assert dst.ctx is not None
    with torch.no_grad():  # a used attention (non-zero output) would change the export's logits: refused
        dst.ctx.out.weight.fill_(0.1)
    with pytest.raises(ValueError, match="has no tensor 'ctx"):
        warm_start(dst, str(tmp_path / "src"), fp)
    dst = redrafter.build(schema, target, fp).double()
    assert warm_start(dst, str(tmp_path / "src"), fp) == len(src.state_dict())
    ids, feats = _sequence(2)
    t = torch.tensor([5, 9])
    targets = torch.stack([ids[i + 2 : i + 2 + D] for i in t.tolist()])
    torch.testing.assert_close(
        _tf_logits(dst, ids, feats, t.tolist()), src(feats[t][None], ids[t + 1][None], targets[None])[0]
    )
    dst.save_pretrained(tmp_path / "dst")  # and the export round trip keeps the attention
    back = ReDrafter.from_pretrained(tmp_path / "dst").double()
    redrafter.attach(back, target)
    assert back.config.context_heads == 2
    torch.testing.assert_close(_tf_logits(back, ids, feats, [7]), _tf_logits(dst, ids, feats, [7]))
