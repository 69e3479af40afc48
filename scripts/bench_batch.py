"""Throughput against batch size: batched AR and batched tree decoding on the same requests, in one run.

    # AR and prompt lookup at batch 1, 4 and 16 over 16 MT-Bench first turns, 64 new tokens each
    python scripts/bench_batch.py --requests 16 --batch 1 4 16 --lookup 10
    # a trained drafter too (one proposer per row)
    python scripts/bench_batch.py --drafter outputs/redrafter_smollm2/export --batch 1 4 16

Prints tokens/s (all requests' new tokens over the wall time of the batched call), tokens per step and the
speedup over batched AR at the same batch size and over batch-1 AR; every output is checked against the
batch-1 AR output of its request. Continuous batching: finished rows are refilled from the queue (FIFO).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from types import SimpleNamespace

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--drafter", nargs="*", default=[], help="exported drafter folders")
    p.add_argument("--lookup", type=int, default=0, help="> 0: prompt lookup with this many tokens")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args()

    from rich.console import Console

    from specdraft.data.benchmarks import load_benchmark
    from specdraft.data.chat import prompt_ids
    from specdraft.eval.decode import default_stop_ids
    from specdraft.eval.proposers import PromptLookupProposer, drafter_family, make_proposer
    from specdraft.eval.throughput import Factory, print_throughput, throughput_rows
    from specdraft.models.base_llm import load_target, target_fingerprint
    from specdraft.models.hub import load_drafter

    model, tok = load_target(SimpleNamespace(name_or_path=a.target, dtype=a.dtype, device=a.device))
    stop = default_stop_ids(tok, model)
    requests = [
        prompt_ids(tok, [{"role": "user", "content": i.turns[0]}])
        for i in load_benchmark("mt_bench", a.requests)
    ]
    methods: list[tuple[str, Factory]] = [("ar", None)]
    for path in a.drafter:
        d = load_drafter(path, model, target_fingerprint(model, tok))
        methods.append((f"{drafter_family(d)}:{path}", partial(make_proposer, d)))
    if a.lookup:
        methods.append((f"lookup:{a.lookup}", partial(PromptLookupProposer, a.lookup)))
    print(f"device={model.device} dtype={model.dtype} threads={torch.get_num_threads()}")
    rows = throughput_rows(model, "mt_bench", requests, methods, a.batch, a.max_new_tokens, stop)
    print_throughput(rows, Console(width=160))
    if a.json:
        from specdraft.eval.cli import machine_info
        from specdraft.utils import atomic_write_json

        atomic_write_json(
            a.json, {"command": " ".join(sys.argv), "machine": machine_info(model), "rows": rows}
        )


if __name__ == "__main__":
    main()
