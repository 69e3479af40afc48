"""Draft time per step of each drafter with its Linear layers as loaded against packed like the target's.

    # the target packed (models/linear_layout.py), each drafter twice: as loaded, and match_target_layout'ed
    python scripts/bench_draft_layout.py --drafter outputs/eagle3_smollm2_long/export \
        outputs/redrafter_smollm2_long/export --prompts 2 --max-new-tokens 48 --reps 2

Whole trees (no node budget), greedy, on the static path, over the first turns of `--bench`; the two copies of
each drafter alternate within every repetition. Prints the proposer's ms per drafted step for each copy (per
repetition), tokens/step and whether every output equals the target's own AR output; `--json` writes them with
the command and the machine, atomically.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, pack the target, time each drafter both ways, print the table."""
    from specdraft.eval.bench_common import add_target_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p, layouts=("packed",), layout_default="packed")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=2, help="repetitions (each times both copies)")
    a = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from specdraft.eval.bench_common import first_turns, load_bench, write_json
    from specdraft.eval.proposers import drafter_label, make_proposer
    from specdraft.eval.static_decode import StaticDecoder
    from specdraft.models.base_llm import target_fingerprint
    from specdraft.models.hub import load_drafter
    from specdraft.models.linear_layout import match_target_layout

    drafter_paths, a.drafter = a.drafter, []  # loaded here, twice each
    bench = load_bench(a)  # the target, packed
    model, tok, stop = bench.model, bench.tokenizer, bench.stop_ids
    fingerprint = target_fingerprint(model, tok)
    prompts = first_turns(tok, a.bench, a.prompts)
    dec = StaticDecoder(model, 1024)
    refs = [dec.ar_generate(tok, ids, a.max_new_tokens, stop_ids=stop)[0] for ids in prompts]
    table = Table(title=f"draft ms per step, whole trees, target packed ({a.prompts} {a.bench} prompts)")
    for col in ("drafter", "layers packed", "as loaded", "packed", "speedup", "tokens/step", "same as AR"):
        table.add_column(col)
    rows = []
    for path in drafter_paths:
        plain = load_drafter(path, model, fingerprint)
        packed = load_drafter(path, model, fingerprint)
        n = match_target_layout(packed, model)
        ms: dict[str, list[float]] = {"as_loaded": [], "packed": []}
        same, tok_step = 0, 0.0
        for _ in range(a.reps):
            for name, d in (("as_loaded", plain), ("packed", packed)):
                draft_s, steps, tokens = 0.0, 0, 0
                for ids, ref in zip(prompts, refs, strict=True):
                    out, st = dec.speculative_generate(
                        tok, ids, make_proposer(d), a.max_new_tokens, stop_ids=stop, profile=True
                    )
                    draft_s, steps, tokens = draft_s + st.draft_s, steps + st.steps, tokens + len(out)
                    same += out == ref
                ms[name].append(draft_s / max(steps, 1) * 1e3)
                tok_step = tokens / max(steps, 1)
        label = drafter_label(plain, path)
        speedup = sum(ms["as_loaded"]) / max(sum(ms["packed"]), 1e-9)
        total = 2 * a.reps * len(prompts)
        rows.append(dict(drafter=label, packed_layers=n, draft_ms=ms, speedup=speedup, tok_step=tok_step,
                         same=f"{same}/{total}"))  # fmt: skip
        fmt = lambda v: " / ".join(f"{x:.1f}" for x in v)  # noqa: E731
        table.add_row(
            label,
            str(n),
            fmt(ms["as_loaded"]),
            fmt(ms["packed"]),
            f"{speedup:.2f}x",
            f"{tok_step:.2f}",
            f"{same}/{total}",
        )
    Console(width=200).print(table)
    write_json(a.json, model, {"rows": rows})


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
