"""What CUDA graphs capture must not read tensors on the host, and a greedy step of the fixed-shape path reads
once (the packed verify result), AR once per `AR_QUEUE` tokens. Checked on the CPU with `HostReads`, a stand-in
for torch's CUDA sync debug mode: the H100 run of 2026-11-25 found a `torch.equal` inside EAGLE-2's captured
expansion (the capture failed) and host-side copy-gate lookups that kept the ReDrafter's draft step eager."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.eval.static_decode import AR_QUEUE, StaticDecoder
from specdraft.testing import HostReads, random_prompts, tiny_proposer, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
CAPTURED = ["redrafter", "redrafter_copy", "medusa", "medusa_root", "eagle", "eagle_vocab", "eagle3"]


@pytest.mark.parametrize("family", CAPTURED)
def test_fixed_shape_draft_steps_read_nothing_on_the_host(family):
    """Every call of the static proposer's `propose` (commit + the step a CUDA graph captures) over a decode."""
    model = tiny_target("llama")
    proposer = tiny_proposer(family, model, static=True)
    if hasattr(proposer, "early_stop"):
        proposer.early_stop = False  # EAGLE: off under graphs (its per-level check reads the host)
    inner, calls = proposer.propose, []
    reads = HostReads()

    def watched(hidden, tokens):
        reads.active = True
        try:
            return inner(hidden, tokens)
        finally:
            reads.active, _ = False, calls.append(1)

    proposer.propose = watched
    prompt = torch.tensor(random_prompts([13], seed=4)[0])
    with reads:
        reads.active = False
        StaticDecoder(model, 96, static=True).speculative_generate(None, prompt, proposer, 30, stop_ids=set())
    assert len(calls) > 5 and reads.count == 0, dict(reads.sites)
    # `t[0] = 0.0` copies a Python number from the host: a capture refuses it (the ReDrafter's beam scores
    # did so on the H100, session 32); `fill_` does not
    assert reads.scalar_writes == 0, dict(reads.write_sites)


@pytest.mark.parametrize("family", ["ar", "redrafter", "redrafter_copy", "medusa", "eagle3"])
def test_a_greedy_step_reads_the_host_once(family):
    model = tiny_target("llama")
    dec = StaticDecoder(model, 128, static=True)
    prompt = torch.tensor(random_prompts([9], seed=5)[0])
    reads = HostReads()
    if family == "ar":
        with reads:
            out, stats = dec.ar_generate(None, prompt, 40, stop_ids=set())
        assert reads.count <= math.ceil(len(out) / AR_QUEUE) + 1, dict(reads.sites)
        return
    proposer = tiny_proposer(family, model, static=True)
    if hasattr(proposer, "early_stop"):
        proposer.early_stop = False
    with reads:
        _, stats = dec.speculative_generate(None, prompt, proposer, 40, stop_ids=set())
    assert stats.steps > 5 and reads.count <= stats.steps + 3, dict(reads.sites)  # + the call's setup
