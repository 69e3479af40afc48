"""Speculative decoding == autoregressive decoding on tiny random models (fp64), and sampling exactness."""

from collections import Counter

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import specdraft.eval.decode as decode
from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.tree import DraftTree, ProposerSpec, pack_beams
from specdraft.eval.verify import sample_verify
from specdraft.testing import OracleBeamProposer, RandomTreeProposer, chi_square_pvalue, exact_first_two

VOCAB = 96
SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def _tiny(
    arch: str = "llama", vocab: int = VOCAB, logit_scale: float = 1.0, seed: int = 0
) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **SMALL))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **SMALL))
    else:
        model = MistralForCausalLM(MistralConfig(vocab_size=vocab, sliding_window=None, **SMALL))
    model = model.double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # sharper next-token distributions
    return model


@pytest.fixture(scope="module")
def llama64():
    return _tiny("llama")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("prompt_len", [1, 5, 23])
def test_greedy_random_trees_equal_ar(arch, prompt_len):
    model = _tiny(arch)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    ref, _ = ar_generate(model, None, prompt, 24, stop_ids=set())
    out, stats = speculative_generate(
        model, None, prompt, RandomTreeProposer(VOCAB, seed=prompt_len), 24, stop_ids=set()
    )
    assert out == ref
    assert stats.new_tokens == 24 and sum(stats.accepted) + stats.steps + 1 >= 24


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("prompt_len", [2, 17])
def test_greedy_oracle_beams_equal_ar_and_accept(llama64, seed, prompt_len):
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(100 + seed))
    ref, _ = ar_generate(llama64, None, prompt, 40, stop_ids=set())
    proposer = OracleBeamProposer(ref, prompt_len, seed=seed)
    out, stats = speculative_generate(llama64, None, prompt, proposer, 40, stop_ids=set())
    assert out == ref
    assert stats.tokens_per_step > 1.8  # the truth is in the tree, so long paths get accepted
    assert max(stats.accepted) == 4 and len(stats.compression) == stats.steps


def test_perfect_oracle_accepts_everything(llama64):
    prompt = torch.arange(9)
    ref, ar_stats = ar_generate(llama64, None, prompt, 30, stop_ids=set())

    class Perfect(OracleBeamProposer):
        def propose(self, hidden, tokens):
            self.seen += tokens.shape[0]
            done = self.seen - (self.prompt_len - 1)
            beam = torch.tensor([int(tokens[-1])] + (self.ref[done : done + 4] + [0] * 4)[:4])
            return pack_beams(beam[None])[0]

    out, stats = speculative_generate(llama64, None, prompt, Perfect(ref, 9), 30, stop_ids=set())
    assert out == ref
    assert stats.steps == 6 and stats.accepted[:5] == [4] * 5  # 1 + 5 * 5 = 26, then the last step
    assert ar_stats.steps == 29


def test_stop_tokens_and_budget_match_ar(llama64):
    prompt = torch.arange(5, 12)
    ref, _ = ar_generate(llama64, None, prompt, 30, stop_ids=set())
    stop = ref[7]  # a token AR emits mid-way
    ar_out, ar_stats = ar_generate(llama64, None, prompt, 30, stop_ids={stop})
    proposer = OracleBeamProposer(ref, len(prompt))
    sp_out, sp_stats = speculative_generate(llama64, None, prompt, proposer, 30, stop_ids={stop})
    assert sp_out == ar_out and ar_out[-1] == stop and stop not in ar_out[:-1]
    assert sp_stats.finish_reason == ar_stats.finish_reason == "stop"
    for budget in [0, 1, 2, 5]:
        ar_b, _ = ar_generate(llama64, None, prompt, budget, stop_ids=set())
        sp_b, st = speculative_generate(
            llama64, None, prompt, OracleBeamProposer(ref, 7), budget, stop_ids=set()
        )
        assert sp_b == ar_b == ref[:budget] and st.finish_reason == "length"


def test_root_only_trees_and_bf16_run(llama64):
    class RootOnly:
        spec = ProposerSpec()  # reads the last layer; declares no depth or budget
        last_compression = None

        def reset(self):
            pass

        def propose(self, hidden, tokens):
            return DraftTree(tokens[-1:], torch.tensor([-1]))

    prompt = torch.arange(4)
    ref, _ = ar_generate(llama64, None, prompt, 10, stop_ids=set())
    out, stats = speculative_generate(llama64, None, prompt, RootOnly(), 10, stop_ids=set())
    assert out == ref and stats.tokens_per_step == 1.0
    model = _tiny("llama").to(torch.bfloat16)  # runs in low precision (equality not guaranteed there)
    out, _ = speculative_generate(model, None, prompt, RandomTreeProposer(VOCAB), 8, stop_ids=set())
    assert len(out) == 8


def test_wrong_root_is_an_error(llama64):
    class WrongRoot(RandomTreeProposer):
        def propose(self, hidden, tokens):
            return DraftTree(tokens[-1:] + 1, torch.tensor([-1]))

    with pytest.raises(RuntimeError, match="rooted at"):
        speculative_generate(llama64, None, torch.arange(4), WrongRoot(VOCAB), 5, stop_ids=set())


# ---- sampling: the first k emitted tokens follow the target's distribution --------------------------
SV = 6  # small vocabulary: the full tree of depth 2 has 1 + 6 + 36 nodes; we use part of it


class FixedTreeProposer:
    """Root + children {3,1,2,3(dup)} + grandchildren {4,2} under '3' and {2} under '1' (deterministic)."""

    spec = ProposerSpec()  # reads the last layer; declares no depth or budget
    last_compression = None

    def reset(self):
        pass

    def propose(self, hidden, tokens):
        toks = torch.tensor([int(tokens[-1]), 3, 1, 2, 3, 4, 2, 2])
        return DraftTree(toks, torch.tensor([-1, 0, 0, 0, 0, 1, 1, 2]))


def _spec_first2_counts(model, prompt, n, temperature):
    g = torch.Generator().manual_seed(7)
    counts = Counter()
    for _ in range(n):
        out, _ = speculative_generate(
            model, None, prompt, FixedTreeProposer(), 2, temperature, set(), generator=g
        )
        counts[tuple(out)] += 1
    return counts


@pytest.fixture(scope="module")
def small_vocab_model():
    return _tiny("llama", vocab=SV, logit_scale=60.0, seed=3)


def test_speculative_sampling_matches_target_distribution(small_vocab_model):
    prompt = torch.tensor([1, 4, 2])
    expected = exact_first_two(small_vocab_model, prompt, 0.8)
    n = 1200
    counts = _spec_first2_counts(small_vocab_model, prompt, n, 0.8)
    assert chi_square_pvalue(counts, expected, n) > 1e-3


def _broken_rule(tree, logits, temperature, top_k=0, top_p=1.0, generator=None):
    """`sample_verify` with the bonus drawn from p instead of the residual: not lossless."""
    path, _ = sample_verify(tree, logits, temperature, top_k, top_p, generator)
    return path, int(torch.multinomial((logits[path[-1]] / temperature).softmax(-1), 1, generator=generator))


def _batched_first2_counts(model, prompt, calls, temperature, static=False):
    """First two tokens of 6 identical requests per `BatchDecoder` call (3 rows, so rows are refilled), on the
    eager or the fixed-shape path."""
    g = torch.Generator().manual_seed(11)
    dec = BatchDecoder(model, 3, static=static)
    counts = Counter()
    for _ in range(calls):
        out = dec.generate(
            [prompt.tolist()] * 6, 2, set(), FixedTreeProposer, temperature=temperature, generator=g
        )
        counts.update(tuple(t) for t, _ in out)
    return counts


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed"])
def test_batched_sampling_matches_target_distribution(small_vocab_model, static):
    """Every row of the batched decoder (refills included) samples the target's distribution."""
    prompt = torch.tensor([1, 4, 2])
    expected = exact_first_two(small_vocab_model, prompt, 0.8)
    counts = _batched_first2_counts(small_vocab_model, prompt, 200, 0.8, static)
    assert chi_square_pvalue(counts, expected, 1200) > 1e-3


def test_batched_chi_square_catches_broken_rule(small_vocab_model, monkeypatch):
    import specdraft.eval.batch_decode as batch_decode

    monkeypatch.setattr(batch_decode, "sample_verify", _broken_rule)  # bonus from p, not the residual
    prompt = torch.tensor([1, 4, 2])
    expected = exact_first_two(small_vocab_model, prompt, 0.8)
    counts = _batched_first2_counts(small_vocab_model, prompt, 200, 0.8)
    assert chi_square_pvalue(counts, expected, 1200) < 1e-4


def test_batch1_sampling_draws_as_the_dynamic_path():
    """One row, one generator seed: the batched decoder draws exactly what `speculative_generate` draws."""
    from specdraft.eval.proposers import PromptLookupProposer

    model = _tiny("llama")
    prompt = torch.tensor([3, 9, 3, 9, 5, 3, 9, 12, 40, 3])
    for seed, dec in zip(range(4), [BatchDecoder(model, 1), BatchDecoder(model, 1, static=True)] * 2):
        kw = dict(temperature=0.9, top_k=16, top_p=0.95)
        ref, _ = speculative_generate(
            model, None, prompt, PromptLookupProposer(3), 16, stop_ids=set(),
            generator=torch.Generator().manual_seed(seed), **kw,
        )  # fmt: skip
        out = dec.generate(
            [prompt.tolist()], 16, set(), lambda: PromptLookupProposer(3),
            generator=torch.Generator().manual_seed(seed), **kw,
        )  # fmt: skip
        assert out[0][0] == ref, seed


def test_model_level_chi_square_catches_broken_rule(small_vocab_model, monkeypatch):
    monkeypatch.setattr(decode, "sample_verify", _broken_rule)  # bonus from p instead of the residual
    prompt = torch.tensor([1, 4, 2])
    expected = exact_first_two(small_vocab_model, prompt, 0.8)
    n = 1200
    counts = _spec_first2_counts(small_vocab_model, prompt, n, 0.8)
    assert chi_square_pvalue(counts, expected, n) < 1e-4
