"""What the benchmark scripts (`scripts/bench_decode.py`, `bench_batch.py`, `bench_adaptive.py`) share: the
target / drafter / prompt arguments, loading them as evaluate.py does, and the results JSON.

    p = argparse.ArgumentParser(...)
    add_target_args(p)                      # --target --dtype --device --layout --drafter --lookup(-branch) --bench ...
    a = p.parse_args(argv)
    b = load_bench(a)                       # threads, target (+ Linear layout), stop ids, labelled drafters
    prompts = first_turns(b.tokenizer, a.bench, n)
    write_json(a.json, b.model, {"rows": rows})   # + the command line and the machine, atomically
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

LAYOUTS = ("auto", "transposed", "native", "packed", "panel")  # eval.linear_layout values


@dataclass
class Bench:
    """A loaded benchmark setup: the target, its tokenizer and stop ids, the drafters with their labels."""

    model: nn.Module
    tokenizer: Any
    stop_ids: set[int]
    drafters: list[tuple[str, nn.Module]]  # (label "family:run", drafter)


def add_target_args(
    p: argparse.ArgumentParser, layouts: tuple[str, ...] = LAYOUTS, layout_default: str = "auto"
) -> None:
    """The arguments every benchmark script takes: target, precision, device, Linear layout (and int8
    activations), drafters, prompt lookup, benchmark, threads and the JSON output."""
    p.add_argument("--target", default="smollm2-135m", help="target: a preset name, HF folder or Hub id")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto | fp32 | bf16 | fp16 (auto: bf16 where native, but fp32 where the panel kernels decode)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--layout",
        default=layout_default,
        choices=list(layouts),
        help="target Linear weights (eval.linear_layout; models/linear_layout.py)",
    )
    p.add_argument(
        "--q8-activations",
        action="store_true",
        help="the target's 4/8-bit products with int8 activations (base_model.q8_activations; models/qdot.py)",
    )
    p.add_argument("--drafter", nargs="*", default=[], help="exported drafter folders / Hub ids")
    p.add_argument(
        "--draft-dtype",
        default=None,
        help="drafters' dtype: auto | fp32 | bf16 | fp16 (eval.draft_dtype; default: the target's dtype)",
    )
    p.add_argument("--lookup", type=int, default=0, help="> 0: also prompt lookup with this many tokens")
    p.add_argument(
        "--lookup-branch",
        type=int,
        default=0,
        help="> 0: also each drafter with a prompt-lookup chain this long merged in (eval.lookup_tokens)",
    )
    p.add_argument("--bench", default="mt_bench", help="prompts: mt_bench | alpaca_eval | a .jsonl file")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write the rows (+ command, machine) to this JSON file")


def apply_bench_layout(model: nn.Module, layout: str, q8: bool = False) -> str:
    """`models.linear_layout.apply_layout`, plus "panel-fp32": fp32 panels even where a weight is exact
    (`models/exact_panels.py`), for A/B runs against the `panel` layout that stores those as integers,
    "panel-single": exact panels one after the other (`SPECDRAFT_PAIRED_PANELS=0`), against the paired ones, and
    "panel-q8": 4- and 8-bit weights with int8 activations (models/qdot.py: another target's arithmetic, a GGUF
    runtime's); `q8` (`--q8-activations`) makes "panel" mean "panel-q8". Returns the layout applied."""
    from specdraft.models.linear_layout import apply_layout
    from specdraft.models.panel_linear import panel_linears

    if layout == "panel-fp32":
        panel_linears(model, exact=False)
        return layout
    if layout == "panel-q8" or (q8 and layout == "panel"):
        panel_linears(model, q8=True)
        return "panel-q8"
    if layout == "panel-single":  # pairing has no argument: its switch, for this layout only
        before = os.environ.get("SPECDRAFT_PAIRED_PANELS")
        os.environ["SPECDRAFT_PAIRED_PANELS"] = "0"
        try:
            panel_linears(model)
        finally:
            if before is None:
                os.environ.pop("SPECDRAFT_PAIRED_PANELS")
            else:
                os.environ["SPECDRAFT_PAIRED_PANELS"] = before
        return layout
    chosen = apply_layout(model, layout, q8=q8)
    return "panel-q8" if q8 and chosen == "panel" else chosen


def load_bench(a: argparse.Namespace, layout: bool = True) -> Bench:
    """Threads, the target (`--layout` applied unless `layout=False`: the script lays it out itself), its
    tokenizer and stop ids, and every `--drafter` checked against the target's fingerprint, in `--draft-dtype`
    (default: the target's dtype, as evaluate.py)."""
    from specdraft.eval.decode import default_stop_ids
    from specdraft.eval.proposers import drafter_label
    from specdraft.hardware import draft_dtype_for
    from specdraft.models.base_llm import load_target, target_fingerprint
    from specdraft.models.hub import load_drafter
    from specdraft.models.linear_layout import apply_layout, match_target_layout

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_target(SimpleNamespace(name_or_path=a.target, dtype=a.dtype, device=a.device))
    if layout:
        apply_layout(model, a.layout, q8=bool(getattr(a, "q8_activations", False)))  # as evaluate.py does
    fingerprint = target_fingerprint(model, tok)
    drafters: list[tuple[str, nn.Module]] = []
    for path in a.drafter:
        d = load_drafter(path, model, fingerprint)
        torch.nn.Module.to(d, draft_dtype_for(a.draft_dtype, model, "--draft-dtype"))
        if layout:
            match_target_layout(d, model)  # as evaluate.py does
        drafters.append((drafter_label(d, path), d))
    print(f"device={model.device} dtype={model.dtype} threads={torch.get_num_threads()}", flush=True)
    return Bench(model, tok, default_stop_ids(tok, model), drafters)


def first_turns(tokenizer: Any, bench: str, n: int) -> list[list[int]]:
    """The chat-templated first user turn of the first `n` questions of `bench` (round-robin over its
    categories, as `eval.limit`), as token ids."""
    from specdraft.data.benchmarks import first_turn_ids, load_benchmark

    return first_turn_ids(tokenizer, load_benchmark(bench, n))


def write_json(path: str | None, model: nn.Module, payload: dict[str, Any]) -> None:
    """Write `payload` with the command line and the machine (`eval.cli.machine_info`) to `path`, atomically;
    nothing when `path` is None."""
    if path is None:
        return
    from specdraft.eval.cli import machine_info
    from specdraft.eval.graphs import capture_failures
    from specdraft.utils import atomic_write_json

    record = {"command": " ".join(sys.argv), "machine": machine_info(model), **payload}
    atomic_write_json(path, {**record, "graph_capture_failures": capture_failures()})
