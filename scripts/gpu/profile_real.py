"""GPU diagnostics on the real target (docs/gpu.md): every host sync inside a step about to be captured as a
CUDA graph (`syncprobe`), then where a draft's time goes (median `propose` ms, a torch.profiler table, counts of
stream syncs, copies, graph replays and kernel launches), for each drafter on the static path with graphs.

    PYTHONPATH=/tmp/site:scripts/gpu python3 scripts/gpu/profile_real.py /tmp/x/<export> [...]
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import syncprobe  # noqa: F401  (patches CudaGraph: syncs inside captured steps are printed)
import torch
from torch.profiler import ProfilerActivity, profile

from specdraft.eval.bench_common import first_turns
from specdraft.eval.proposers import make_proposer
from specdraft.eval.static_decode import StaticDecoder
from specdraft.models.base_llm import load_target, target_fingerprint
from specdraft.models.hub import load_drafter

COUNTS = ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaGraphLaunch", "cudaLaunchKernel")


def main(paths: list[str]) -> None:
    """Profile each export in `paths` on SmolLM2 (bf16, CUDA), one MT-Bench prompt."""
    model, tok = load_target(SimpleNamespace(name_or_path="smollm2-135m", dtype="bf16", device="cuda"))
    fp = target_fingerprint(model, tok)
    prompt = torch.tensor(first_turns(tok, "mt_bench", 1)[0])
    for path in paths:
        d = load_drafter(path, model, fp).to(torch.bfloat16)
        dec = StaticDecoder(model, 1024, static=True, graphs=True)
        p = make_proposer(d, static=True, graphs=True)  # as evaluate.py on CUDA
        print(f"\n##### {path}: {type(p).__name__} static={p.static} graphs={p.graphs}", flush=True)
        dec.speculative_generate(None, prompt, p, 48, stop_ids=set())  # warm: captures
        times: list[float] = []
        inner = p.propose

        def timed(*args, _inner=inner, _times=times):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = _inner(*args)
            torch.cuda.synchronize()
            _times.append(time.perf_counter() - t)
            return out

        p.propose = timed
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dec.speculative_generate(None, prompt, p, 32, stop_ids=set())
        print(f"propose ms: median {sorted(times)[len(times) // 2] * 1e3:.2f} over {len(times)} calls")
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
        for name in COUNTS:
            print(name, sum(e.count for e in table if e.key == name))


if __name__ == "__main__":
    main(sys.argv[1:])
