"""Batched decoding on a CPU with the eager verify's padding packed out of the per-token products
(`fast_target.Packing`, the default) against computing every padded position, in one run: passes
alternate (padded, packed) per method, and the outputs must match.

    python scripts/bench_batch_packing.py --batch 16 --requests 32 --max-new-tokens 64 --lookup 10
    python scripts/bench_batch_packing.py --drafter outputs/<run>/export --batch 4 16 --json out.json
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the paired passes, print a table (and write JSON)."""
    from specdraft.eval.bench_common import add_target_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[16], help="batch sizes")
    p.add_argument("--requests", type=int, default=32, help="MT-Bench first turns decoded per pass")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="alternated (padded, packed) rounds")
    a = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from specdraft.eval.batch_decode import BatchDecoder
    from specdraft.eval.bench_common import first_turns, load_bench, write_json
    from specdraft.eval.proposers import PromptLookupProposer, make_proposer

    bench = load_bench(a)
    model = bench.model
    prompts = first_turns(bench.tokenizer, a.bench, a.requests)
    methods: dict[str, Any] = {"ar": None}
    if a.lookup:
        methods[f"lookup:{a.lookup}"] = lambda: PromptLookupProposer(a.lookup)
    for label, drafter in bench.drafters:  # as bench_batch.py and evaluate.py draft on a CPU
        methods[label] = partial(make_proposer, drafter, int8_head=True, draft_block="auto")
    BatchDecoder(model, 2).generate(prompts[:2], 4, bench.stop_ids)  # warm-up
    rows: list[dict[str, Any]] = []
    for b in a.batch:
        for name, factory in methods.items():
            runs: dict[bool, list[float]] = {False: [], True: []}
            outs: dict[bool, list[list[int]]] = {}
            for _ in range(a.rounds):
                for pack in (False, True):
                    dec = BatchDecoder(model, b, pack_padding=pack)
                    t0 = time.perf_counter()
                    res = dec.generate(prompts, a.max_new_tokens, bench.stop_ids, proposer_factory=factory)
                    dt = time.perf_counter() - t0
                    runs[pack].append(sum(len(o) for o, _ in res) / dt)
                    outs[pack] = [o for o, _ in res]
            same = sum(x == y for x, y in zip(outs[False], outs[True], strict=True))
            rows.append(
                {
                    "batch": b, "method": name, "padded_tok_s": max(runs[False]), "packed_tok_s": max(runs[True]),
                    "ratio": max(runs[True]) / max(runs[False]), "same": f"{same}/{len(prompts)}",
                    "padded_runs": runs[False], "packed_runs": runs[True],
                }
            )  # fmt: skip
            print(f"batch {b} {name}: padded {runs[False]} packed {runs[True]} tok/s", flush=True)
    t = Table(title=f"packed vs padded eager verify ({model.device}, {model.dtype}; best of {a.rounds})")
    for c in ("batch", "method", "padded tok/s", "packed tok/s", "packed / padded", "same tokens"):
        t.add_column(c)
    for r in rows:
        t.add_row(
            str(r["batch"]), r["method"], f"{r['padded_tok_s']:.1f}", f"{r['packed_tok_s']:.1f}",
            f"{r['ratio']:.2f}x", r["same"],
        )  # fmt: skip
    Console().print(t)
    write_json(a.json, model, {"rows": rows})


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
