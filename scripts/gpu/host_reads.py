"""Host reads per decode step, by family and path, counted on the CPU (`specdraft.testing.HostReads`): on a GPU
each read is a device sync, and inside a step a CUDA graph captures, a failed capture. A diagnostic to run
before a lent GPU (docs/gpu.md), on tiny random models; prints the top call sites of each method.

    python scripts/gpu/host_reads.py            # single-prompt fixed-shape path and the batched path (B = 4)
"""

from __future__ import annotations

import argparse

import torch

from specdraft.eval.batch_decode import BatchDecoder
from specdraft.eval.static_decode import StaticDecoder
from specdraft.testing import HostReads, random_prompts, tiny_proposer, tiny_proposer_factory, tiny_target

FAMILIES = ("ar", "redrafter", "redrafter_copy", "medusa", "eagle", "eagle3", "lookup")


def _report(label: str, reads: HostReads, steps: int, top: int) -> None:
    """One line per method, then its `top` call sites (reads per step)."""
    print(f"{label}: {steps} steps, {reads.count / max(steps, 1):.1f} host reads per step")
    for site, n in reads.sites.most_common(top):
        print(f"    {n / max(steps, 1):5.1f}  {site}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=40, help="new tokens per prompt")
    ap.add_argument("--top", type=int, default=4, help="call sites shown per method")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = tiny_target("llama")
    prompt = torch.tensor(random_prompts([12], seed=3)[0])
    print(
        "== single prompt, fixed-shape path (the GPU's; static proposers, EAGLE's early stop off as under graphs)"
    )
    for fam in FAMILIES:
        dec, reads = StaticDecoder(model, 256, static=True), HostReads()
        if fam == "ar":
            with reads:
                out, stats = dec.ar_generate(None, prompt, a.tokens, stop_ids=set())
            _report(fam, reads, len(out), a.top)  # per token
            continue
        proposer = tiny_proposer(fam, model, static=True)
        if hasattr(proposer, "early_stop"):
            proposer.early_stop = False
        with reads:
            _, stats = dec.speculative_generate(None, prompt, proposer, a.tokens, stop_ids=set())
        _report(fam, reads, stats.steps, a.top)
    print("== batched path (B = 4, 8 requests, fixed-shape verify; proposers as evaluate.py builds them)")
    prompts = random_prompts([5, 9, 13, 7, 11, 6, 8, 10], seed=2)
    for fam in FAMILIES:
        dec, reads, steps = BatchDecoder(model, 4, 256, static=True), HostReads(), []
        factory = None if fam == "ar" else tiny_proposer_factory(fam, model)
        with reads:
            dec.generate(prompts, a.tokens, set(), factory, on_step=lambda d: steps.append(1))  # noqa: B023
        _report(fam, reads, len(steps), a.top)


if __name__ == "__main__":
    main()
