"""The tree decoder on the real SmolLM2-135M (fp32): greedy speculative == AR on MT-Bench prompts (slow)."""

from __future__ import annotations

import pytest
import torch

from specdraft.conf.schema import BaseModelConfig
from specdraft.data.benchmarks import load_benchmark
from specdraft.data.chat import prompt_ids
from specdraft.eval.decode import ar_generate, default_stop_ids, speculative_generate
from specdraft.eval.hybrid import LookupBranch
from specdraft.eval.proposers import PromptLookupProposer, ReDrafterProposer
from specdraft.eval.runner import top2_gap
from specdraft.models import redrafter
from specdraft.models.base_llm import load_target, target_fingerprint
from specdraft.train.config import ReDrafterSchema

pytestmark = pytest.mark.slow


def test_smollm2_fp32_speculative_equals_ar() -> None:
    torch.manual_seed(0)
    model, tok = load_target(BaseModelConfig(name_or_path="smollm2-135m", dtype="fp32", device="cpu"))
    fingerprint = target_fingerprint(model, tok)
    drafter = redrafter.build(ReDrafterSchema(exit_dim=576), model, fingerprint)  # untrained: random beams
    stop = default_stop_ids(tok, model)
    proposers = [LookupBranch(ReDrafterProposer(drafter, 4, 4, int8_head=True), 6), PromptLookupProposer(6)]
    for item in load_benchmark("mt_bench", limit=1):
        ids = prompt_ids(tok, [{"role": "user", "content": item.turns[0]}])
        ref, _ = ar_generate(model, tok, ids, 20, stop_ids=stop)
        for proposer in proposers:
            out, stats = speculative_generate(model, tok, ids, proposer, 20, stop_ids=stop)
            if out != ref:  # allowed only at a numeric near-tie of the AR logits
                pos = next(i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b)
                assert top2_gap(model, ids, ref, pos) < 1e-2, (item.id, pos)
            assert stats.steps >= 1 and stats.new_tokens == len(out)
