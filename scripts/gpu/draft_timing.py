"""Per-call draft timings on the real target (docs/gpu.md): for each drafter, built as evaluate.py builds it on
CUDA (fixed-shape draft steps, CUDA graphs), the distribution of `propose` times over a few MT-Bench prompts
(median, mean, p90, max), EAGLE's eager commit (only the rows before the newest depth + 1: a prompt, an
undrafted step) and its graph-replayed step (commit of the newest rows + expansion) apart, and the CUDA graph
captures made while timing (each a one-off cost a mean includes).

    PYTHONPATH=/tmp/site python3 scripts/gpu/draft_timing.py /tmp/x/<export> [...]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from specdraft.eval import graphs as graph_mod
from specdraft.eval.bench_common import first_turns
from specdraft.eval.proposers import make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models.base_llm import load_target, target_fingerprint
from specdraft.models.hub import load_drafter


def timed(fn: Callable[..., Any], times: list[float]) -> Callable[..., Any]:
    """`fn` with each call's device-synchronised wall time appended to `times` (ms)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        return out

    return wrapper


def summary(name: str, ms: list[float]) -> str:
    """One line: count, median, mean, p90, max of `ms`."""
    if not ms:
        return f"{name}: no calls"
    s = sorted(ms)
    return (
        f"{name}: {len(s)} calls, median {statistics.median(s):.2f} ms, mean {statistics.fmean(s):.2f}, "
        f"p90 {s[int(0.9 * (len(s) - 1))]:.2f}, max {s[-1]:.2f}"
    )


def main(paths: list[str]) -> None:
    """Time each export in `paths` on SmolLM2 (bf16, CUDA) over 3 MT-Bench first turns x 128 new tokens."""
    model, tok = load_target(SimpleNamespace(name_or_path="smollm2-135m", dtype="bf16", device="cuda"))
    fp = target_fingerprint(model, tok)
    prompts = [torch.tensor(p) for p in first_turns(tok, "mt_bench", 4)]
    captures: list[float] = []
    init = graph_mod.CudaGraph.__init__
    graph_mod.CudaGraph.__init__ = timed(init, captures)  # type: ignore[method-assign]
    dec = StaticDecoder(model, 1024, static=True, graphs=True)
    _, st = dec.ar_generate(None, prompts[0], 64, stop_ids=set())
    for path in paths:
        d = load_drafter(path, model, fp).to(torch.bfloat16)
        p = make_proposer(d, int8_head=True, draft_block="auto", static=True, graphs=True)
        dec.speculative_generate(None, prompts[0], p, 128, stop_ids=set())  # warm-up: captures
        n0, props, commits, runs = len(captures), [], [], []
        p.propose = timed(p.propose, props)
        fixed = getattr(p, "fixed", None)
        if fixed is not None:
            fixed.commit, fixed.run = timed(fixed.commit, commits), timed(fixed.run, runs)
        steps = toks = 0
        t = time.perf_counter()
        for ids in prompts[1:]:
            out, st = dec.speculative_generate(None, ids, p, 128, stop_ids=set())
            steps, toks = steps + st.steps, toks + len(out)
        wall = time.perf_counter() - t
        print(f"##### {path}: {type(p).__name__} graphs={getattr(p, 'graphs', None)}")
        print(f"  {toks} tokens in {steps} steps ({toks / steps:.2f}/step), {toks / wall:.1f} tok/s")
        print("  " + summary("propose", props))
        print("  " + summary("  commit (eager, excess rows)", commits))
        print("  " + summary("  run: excess commit + graph step", runs))
        print(f"  captures while timing: {len(captures) - n0} ({sum(captures[n0:]):.0f} ms)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
