"""Self-adaptive fallback (eval/fallback.py): the controller's decisions, and lossless decoding whatever it
decides (plain target steps between drafted ones feed the proposer all skipped positions at its next call)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.fallback import FallbackController
from specdraft.eval.proposers import PromptLookupProposer, ReDrafterProposer, make_proposer
from specdraft.models import eagle3, redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.testing import ScriptedFallback, tiny_llama, tiny_tokenizer
from specdraft.train.config import ReDrafterSchema


def test_drafting_that_pays_keeps_drafting():
    c = FallbackController()
    assert not c.should_draft()  # the first step times the target
    c.observe(False, 1, 0.10)
    for _ in range(20):
        assert c.should_draft()
        c.observe(True, 3, 0.15)  # 20 tok/s against 10 tok/s
    assert c.fallbacks == 0


def test_losing_drafts_fall_back_and_probe_with_backoff():
    c = FallbackController(min_probe=2, max_probe=8)
    c.observe(False, 1, 0.10)  # 10 tok/s
    decisions = []
    for _ in range(40):
        d = c.should_draft()
        decisions.append(d)
        c.observe(d, 1 if d else 1, 0.25 if d else 0.10)  # drafting: 4 tok/s, never pays
    assert c.fallbacks == 1
    gaps = [len(g) for g in "".join("D" if d else "." for d in decisions).split("D")[1:-1]]
    assert gaps[:3] == [2, 4, 8] and set(gaps[3:]) == {8}  # backoff doubles, capped at max_probe
    # the machine changes: drafting pays again; the next probe brings drafting back
    while not c.should_draft():
        c.observe(False, 1, 0.10)
    for _ in range(5):
        c.observe(True, 4, 0.12)
    assert c.drafting and c.probe == c.min_probe and c.should_draft()


def _redrafter(target, **kw):
    schema = ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1, **kw)
    d = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer())).double().eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ReDrafterProposer(d, beam_width=4, beam_length=4)


def _eagle3(target):
    schema = SimpleNamespace(
        draft_len=3, tree_total_tokens=8, tree_depth=3, tree_top_k=3, target_layers=None,
        draft_vocab_size=None, ttt_decay=0.8,
    )  # fmt: skip
    fp = {"name_or_path": "tiny", "hidden_size": 32, "vocab_size": 128, "tokenizer_hash": "t"}
    head = eagle3.build(schema, target, fp).double().eval()
    return make_proposer(head, tree_nodes=8)


@pytest.mark.parametrize("pattern", ["D..", ".D", "...D", "D"])
@pytest.mark.parametrize("kind", ["redrafter", "redrafter_context", "eagle3", "lookup"])
def test_lossless_whatever_the_controller_decides(kind, pattern):
    torch.manual_seed(0)
    target = tiny_llama(num_layers=4, dtype=torch.float64)
    proposer = {
        "redrafter": lambda: _redrafter(target),
        "redrafter_context": lambda: _redrafter(target, context_heads=2, context_dim=16, copy_ngram=3),
        "eagle3": lambda: _eagle3(target),
        "lookup": lambda: PromptLookupProposer(4),
    }[kind]()
    for prompt_len, stop in [(3, set()), (17, {7, 9})]:
        prompt = torch.randint(5, 128, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        ref, _ = ar_generate(target, None, prompt, 25, stop_ids=stop)
        ctrl = ScriptedFallback(pattern)
        out, stats = speculative_generate(target, None, prompt, proposer, 25, stop_ids=stop, fallback=ctrl)
        assert out == ref
        drafted = pattern.count("D") * stats.steps // len(pattern)
        assert abs(stats.steps - stats.target_steps - drafted) <= 1


def test_runner_labels_and_reports_target_steps():
    from specdraft.eval.runner import spec_method

    target = tiny_llama(num_layers=2, dtype=torch.float64)
    m = spec_method("lookup", target, None, PromptLookupProposer(4), set(), {"temperature": 0.0}, False, True)
    toks, st = m.run([5, 6, 7, 5, 6, 7], 12, None)
    ref, _ = ar_generate(target, None, [5, 6, 7, 5, 6, 7], 12, stop_ids=set())
    assert toks == ref and st["target_steps"] >= 1  # the first step always times the target
