"""`evaluate(cfg)`: the speedup benchmark behind `python evaluate.py conf=<preset> eval.drafters=[...]`.

Loads the target once, every drafter (dispatching on its family), the benchmarks, runs the AR baseline,
every drafter and the transformers baselines on the same prompts in the same process (warm-up first),
prints the tables and writes `<out_dir>/results.json` (settings, machine, summary, per-prompt records)
plus PNG plots. Returns the results path.
"""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from specdraft.conf.validate import validate_config
from specdraft.eval.config import CURVE_BUDGETS, budget_kind, fixed_node_cap
from specdraft.eval.graphs import capture_failures, report_captures
from specdraft.hardware import host_info, log_environment, resolve_placement
from specdraft.utils import atomic_write_json, seed_everything

NEAR_TIE_GAP = {"float64": 1e-6, "float32": 1e-2, "bfloat16": 0.5, "float16": 0.25}  # default by dtype


def _bench_label(name: str) -> str:
    """Short benchmark name for tables and file names (a file's stem, a Hub id's last part)."""
    return Path(name).stem if name.endswith((".json", ".jsonl")) else name.rstrip("/").split("/")[-1]


def _drafter_paths(cfg: DictConfig) -> list[str]:
    """`eval.drafters`, or the run's export folder when that list is empty (nothing if it does not exist)."""
    if cfg.eval.drafters:
        return [str(p) for p in cfg.eval.drafters]
    export = cfg.train.get("export_dir") or os.path.join(str(cfg.run_dir), "export")
    if Path(export, "config.json").is_file():
        return [str(export)]
    print(f"WARNING: eval.drafters is empty and {export} holds no drafter: running the baselines only")
    return []


def _spec(
    cfg: DictConfig,
    runner,
    name: str,
    model,
    tokenizer,
    proposer,
    stop_ids: set[int],
    sampling: dict,
    decoder,
    cost=None,
):
    """A speculative method; `eval.acceptance=typical` swaps in Medusa's LOSSY rule (labelled in the name),
    `eval.fallback` adds the self-adaptive fallback (labelled `+fallback`; output unchanged), a cost curve
    `cost` a node budget (records carry `node_cap`): `eval.node_budget=fit` the fitted one (`NodeBudget`),
    `bandit` a cap chosen per step from the loop's measured tokens per second (`BanditBudget`), `auto` (the
    default) the bandit on a CPU and the fitted one elsewhere (`budget_kind`); a count a fixed cap
    (`NodeBudget.fixed`: every tree cut to that many nodes, no fitting)."""
    from specdraft.eval.bandit_budget import BanditBudget
    from specdraft.eval.budget import CapPolicy, NodeBudget
    from specdraft.eval.decode import model_device

    e = cfg.eval
    if e.acceptance == "typical":  # Medusa typical acceptance: LOSSY, labelled in every table
        from specdraft.eval.medusa_tree import typical_rule

        rule = typical_rule(
            float(e.temperature), float(e.typical_epsilon), float(e.typical_delta), int(e.seed)
        )
        sampling, name = {**sampling, "verify_fn": rule}, f"{name}+typical(LOSSY)"
    if e.fallback:
        name += "+fallback"
    setting = str(e.get("node_budget", "auto"))
    fixed = fixed_node_cap(setting)
    kind = budget_kind(setting, model_device(model).type if setting == "auto" else "")
    budget: CapPolicy | None
    if fixed is not None and decoder is not None:
        budget = NodeBudget.fixed(fixed, label=name)
    elif cost is not None and kind == "bandit":
        budget = BanditBudget(cost, label=name, seed=int(e.seed))
    elif cost is not None:
        budget = NodeBudget(
            cost,
            label=name,
            refit_gap=int(e.node_budget_refit),
            refit_scale=int(e.node_budget_refit_scale),
            confidence=float(e.node_budget_confidence),
            memory=int(e.get("node_budget_memory", 192)),
            refit_on_call=bool(e.node_budget_refit_on_call),
            trim_slowest=decoder is not None and decoder.graphs,  # captures happen only under graphs
        )
    else:
        budget = None
    return runner.spec_method(
        name,
        model,
        tokenizer,
        proposer,
        stop_ids,
        sampling,
        bool(e.profile),
        bool(e.fallback),
        decoder,
        budget,
    )


def _methods(cfg: DictConfig, model, tokenizer, stop_ids: set[int]) -> tuple[list, dict[str, str]]:
    """The AR reference, one method per drafter, then the transformers baselines (and why any was skipped)."""
    from specdraft.eval import runner
    from specdraft.eval.budget import RECHECK_SIZES, CostCurve, machine_key
    from specdraft.eval.decode import model_device
    from specdraft.eval.graphs import graphs_wanted
    from specdraft.eval.proposers import PromptLookupProposer, drafter_label, make_proposer, pruned_factories
    from specdraft.eval.static_decode import make_decoder
    from specdraft.hardware import draft_dtype_for
    from specdraft.models.base_llm import target_fingerprint
    from specdraft.models.hub import load_drafter
    from specdraft.models.linear_layout import match_target_layout

    e = cfg.eval
    sampling = {"temperature": float(e.temperature), "top_k": int(e.top_k), "top_p": float(e.top_p)}
    decoder = make_decoder(
        model, str(e.decode_path), str(e.cuda_graphs)
    )  # shared: one cache, one set of graphs
    batch_graphs = graphs_wanted(
        model_device(model), str(e.cuda_graphs)
    )  # the batched decoders' (throughput)
    methods = [runner.ar_method(model, tokenizer, stop_ids, sampling, decoder)]
    cost = None
    if e.node_budget in CURVE_BUDGETS and decoder is not None:  # verify cost per node count (cached)
        cost = CostCurve.load_or_measure(
            machine_key(model, decoder.path_name()),
            decoder.measure_costs,
            # this machine? its speed and shape now
            recheck=lambda: decoder.measure_costs(RECHECK_SIZES, reps=5),
        )
    elif e.node_budget != "off" and decoder is None:
        print(
            f"eval.node_budget={e.node_budget}: not applied on eval.decode_path=dynamic (the reference path has "
            "no budget)"
        )
    fingerprint = target_fingerprint(model, tokenizer)
    for path in _drafter_paths(cfg):
        drafter = load_drafter(path, model, fingerprint, field="eval.drafters")
        # the target's dtype unless set: an fp32 export drafting next to a bf16 target costs 2-7x the draft time
        torch.nn.Module.to(drafter, draft_dtype_for(e.draft_dtype, model))  # (PreTrainedModel.to: a wrapper)
        match_target_layout(drafter, model)  # packed Linear weights like the target's, where it has them
        base_name = drafter_label(drafter, path)  # `<run>/export` -> family:<run>
        variants = [(base_name, 0)]
        if e.lookup_tokens:  # also with prompt lookup's chain merged into its trees (eval/hybrid.py)
            variants.append((base_name + "+lookup", int(e.lookup_tokens)))
        for name, lookup_tokens in variants:
            proposer = make_proposer(
                drafter,
                e.beam_width,
                e.beam_length,
                e.tree_nodes,
                bool(e.int8_draft_head),
                lookup_tokens,
                float(e.draft_min_prob),
                static=decoder is not None
                and decoder.static,  # fixed-shape draft steps where verify is fixed
                graphs=decoder is not None and decoder.graphs,
                draft_block=str(e.draft_block),
                verify_cost=cost,  # a lookup branch prices its drafter on the fitted budget's curve
            )
            while any(m.name == name for m in methods):
                name += "'"
            methods.append(
                _spec(cfg, runner, name, model, tokenizer, proposer, stop_ids, sampling, decoder, cost)
            )
            eager = partial(  # the same drafter and settings for the batched decoder
                make_proposer, drafter, e.beam_width, e.beam_length, e.tree_nodes, bool(e.int8_draft_head),
                lookup_tokens, float(e.draft_min_prob), draft_block=str(e.draft_block),
            )  # fmt: skip
            # with graphs (a GPU) each row's draft step takes its fixed shape and CUDA graph there too
            methods[-1].factory = partial(eager, static=batch_graphs, graphs=batch_graphs)
            methods[-1].pruned = pruned_factories(  # eval.batch_min_prob's rows (ReDrafter only, else None)
                drafter, beam_width=e.beam_width, beam_length=e.beam_length, tree_nodes=e.tree_nodes,
                int8_head=bool(e.int8_draft_head), lookup_tokens=lookup_tokens, draft_block=str(e.draft_block),
            )  # fmt: skip
            if e.adaptive == "on":  # next to it: the same drafter, pruned per step by confidence (LLMCad)
                from specdraft.eval.adaptive import AdaptiveProposer

                pruned = AdaptiveProposer(eager(), float(e.adaptive_threshold))
                methods.append(
                    _spec(cfg, runner, name + "+adaptive", model, tokenizer, pruned, stop_ids, sampling, decoder, cost)
                )  # fmt: skip
    skipped: dict[str, str] = {}
    baselines = list(e.baselines)  # names checked by conf/validate.py
    if "tree_lookup" in baselines:  # prompt lookup through our decoder, as the drafters run there
        # the same fitted node budget and fallback as every drafter row: on a CPU where 8+ verified nodes cost
        # ~2x one, ten looked-up tokens per step lose to AR on prompts that repeat little (the demo's table,
        # 2-core EPYC fp32: 0.88x at 1.35 tokens/step without them); transformers' prompt_lookup row stays
        # the reference implementation with its fixed candidate length
        lookup = PromptLookupProposer(int(e.prompt_lookup_num_tokens))
        methods.append(
            _spec(cfg, runner, "tree_lookup", model, tokenizer, lookup, stop_ids, sampling, decoder, cost)
        )
        methods[-1].factory = partial(PromptLookupProposer, int(e.prompt_lookup_num_tokens))
        if e.adaptive == "on":  # prompt lookup pruned by its n-gram counts (eval/adaptive.py)
            from specdraft.eval.adaptive import AdaptiveProposer

            pruned = AdaptiveProposer(methods[-1].factory(), float(e.adaptive_threshold))
            methods.append(
                _spec(cfg, runner, "tree_lookup+adaptive", model, tokenizer, pruned, stop_ids, sampling, decoder, cost)
            )  # fmt: skip
        baselines.remove("tree_lookup")
    if baselines:
        methods.append(runner.hf_method("hf_ar", model, tokenizer, stop_ids, sampling))
    if "hf_static" in baselines:  # transformers' static KV cache (compiled by generate where it does so)
        methods.append(
            runner.hf_method("hf_static", model, tokenizer, stop_ids, sampling, cache_implementation="static")
        )
    if "prompt_lookup" in baselines:
        n = int(e.prompt_lookup_num_tokens)
        methods.append(
            runner.hf_method(
                "prompt_lookup", model, tokenizer, stop_ids, sampling, prompt_lookup_num_tokens=n
            )
        )
    if "assisted" in baselines:
        assistant, name = None, "assisted"
        if not e.assistant_model:
            skipped["assisted"] = (
                "no eval.assistant_model set (a same-tokenizer model, or layers:N for the target's first N layers)"
            )
        elif str(e.assistant_model).startswith("layers:"):  # the target's first N layers + its own head
            from specdraft.models.base_llm import first_layers

            n_layers = int(str(e.assistant_model).split(":", 1)[1])
            assistant, name = first_layers(model, n_layers), f"assisted[{n_layers}L]"
        else:
            from specdraft.models.base_llm import load_target

            base = cast(dict[str, Any], OmegaConf.to_container(cfg.base_model, resolve=True))  # a DictConfig
            base.update(name_or_path=str(e.assistant_model), gguf_file=None, revision=None)
            assistant, _ = load_target(SimpleNamespace(**base))
            assistant.to(model.device, model.dtype)
        if assistant is not None:
            methods.append(
                runner.hf_method(name, model, tokenizer, stop_ids, sampling, assistant_model=assistant)
            )
    return methods, skipped


def machine_info(model: torch.nn.Module) -> dict[str, Any]:
    """Where the numbers were measured: `hardware.host_info` of the model's device (its GPU, if any), the
    device, dtype and the target's Linear layout (`models.linear_layout`: the LM head's class)."""
    from transformers import PreTrainedModel

    layout = type(model.get_output_embeddings()).__name__ if isinstance(model, PreTrainedModel) else None
    dtype = str(model.dtype).replace("torch.", "")
    device = cast(torch.device, model.device)  # a PreTrainedModel's property (a bare Module has none)
    return {**host_info(device), "device": str(device), "dtype": dtype, "linear_layout": layout}


def load_benches(cfg: DictConfig) -> dict[str, list]:
    """`eval.benches` loaded (`eval.limit` prompts each), by label.

    Raises:
        ValueError: a benchmark with no prompts (an empty file), naming it.
    """
    from specdraft.data.benchmarks import load_benchmark

    benches = {}
    for b in cfg.eval.benches:
        items = load_benchmark(str(b), cfg.eval.limit)
        if not items:
            raise ValueError(f"eval.benches: {b} holds no prompts: fill it or drop it from eval.benches")
        benches[_bench_label(str(b))] = items
    return benches


def publish(out_dir: Path, results: dict[str, Any], plots: bool) -> tuple[Path, list[Path]]:
    """Write results.json (+ the PNG plots) into `out_dir` once everything is rendered.

    Everything is written into a temporary folder inside `out_dir` first, then moved into place, plots first
    and results.json last, each with an atomic rename: a failure leaves the previous results untouched.

    Returns:
        (the results.json path, the plot paths).
    """
    from specdraft.eval.speedup import write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-eval-", dir=out_dir) as tmp:
        staged = write_plots(results["records"], results["categories"], Path(tmp)) if plots else []
        if plots and results.get("throughput"):
            from specdraft.eval.throughput import plot_throughput

            staged += plot_throughput(results["throughput"], Path(tmp))
        atomic_write_json(Path(tmp) / "results.json", results)
        for p in staged:
            os.replace(p, out_dir / p.name)
        os.replace(Path(tmp) / "results.json", out_dir / "results.json")
    return out_dir / "results.json", [out_dir / p.name for p in staged]


def _throughput(cfg: DictConfig, benches: dict, methods: list, model, tokenizer, stop_ids: set[int]) -> list:
    """`eval.batch_sizes`: the batched throughput table over each benchmark's first turns (greedy, or sampled
    at `eval.temperature` > 0)."""
    from specdraft.data.benchmarks import first_turn_ids
    from specdraft.eval.decode import model_device
    from specdraft.eval.throughput import (
        Factory,
        print_throughput,
        pruned_method,
        throughput_rows,
        width_method,
    )

    e = cfg.eval
    if not e.batch_sizes:
        return []
    pairs: list[tuple[str, Factory]] = [("ar", None)]
    pairs += [(m.name.replace("+fallback", ""), m.factory) for m in methods if m.kind == "spec" and m.factory]
    drafters = [(n, f) for n, f in pairs[1:] if callable(f)]  # (name, proposer factory)
    pruning = str(e.get("batch_min_prob", "off"))
    if pruning != "off":  # each ReDrafter again, its trees pruned to confident nodes (per batch size: auto)
        prob = None if pruning == "auto" else float(pruning)
        pairs += [
            pruned_method(m.name.replace("+fallback", ""), m.pruned, prob)
            for m in methods
            if m.kind == "spec" and m.pruned is not None
        ]
    if str(e.get("batch_width", "off")) == "auto":  # each drafter again, one verify width per step
        pairs += [width_method(n, f) for n, f in drafters]
    scheduler = str(e.get("scheduler", "fifo"))
    schedulers = {
        "fifo": ["fifo"],
        "length": ["length"],
        "both": ["fifo", "length"],
        "groups": ["fifo", "groups", "oracle_groups"],
        "all": ["fifo", "length", "groups", "oracle_groups"],
    }[scheduler]
    predictor = None
    if {"length", "groups"} & set(schedulers):
        if not e.get("length_predictor"):
            print(
                f"eval.scheduler={scheduler}: no eval.length_predictor given; predicted-length rows skipped"
            )
            schedulers = [s for s in schedulers if s not in ("length", "groups")] or ["fifo"]
        else:
            from specdraft.eval.length_predictor import load_length_predictor

            predictor = load_length_predictor(str(e.length_predictor))
    rows: list = []
    for bench, items in benches.items():
        prompts = first_turn_ids(tokenizer, items)
        predicted, reserve, predict_s = None, None, 0.0
        if predictor is not None:
            from specdraft.eval.length_predictor import prompt_features

            t0 = time.perf_counter()
            feats = prompt_features(model, prompts, predictor.signal)  # (N, F)
            predicted = predictor.expected_length(feats).clamp(max=int(e.max_new_tokens)).tolist()
            q = float(e.get("reserve_quantile", 0.9))
            reserve = predictor.reserve_length(feats, int(e.max_new_tokens), q).tolist()
            predict_s = time.perf_counter() - t0
        rows += throughput_rows(
            model,
            str(bench),
            prompts,
            pairs,
            [int(b) for b in e.batch_sizes],
            int(e.max_new_tokens),
            stop_ids,
            schedulers=schedulers,
            predicted=predicted,
            predict_s=predict_s,
            reserve=reserve,
            node_budget=str(e.get("node_budget", "off")) in CURVE_BUDGETS,
            # the same kind as the single-prompt rows: `auto` is a bandit per batch size on a CPU
            bandit=budget_kind(e.get("node_budget", "off"), model_device(model).type) == "bandit",
            node_cap=fixed_node_cap(e.get("node_budget", "auto")),  # eval.node_budget=N: every batched tree cut to N nodes too
            budget_refit=int(e.get("node_budget_refit", 128)),
            budget_refit_scale=int(e.get("node_budget_refit_scale", 4)),
            budget_confidence=float(e.get("node_budget_confidence", 1.0)),
            budget_refit_on_call=bool(e.get("node_budget_refit_on_call", True)),
            budget_memory=int(e.get("node_budget_memory", 192)),
            cuda_graphs=str(e.cuda_graphs),
            prefill_rows=int(e.get("prefill_rows", 0) or 0),
            refill_rows=int(e.get("refill_rows", 0) or 0),
            sample={"temperature": float(e.temperature), "top_k": int(e.get("top_k", 0) or 0),
                    "top_p": float(e.get("top_p", 1.0)), "seed": int(e.seed)} if e.temperature > 0 else None,
        )  # fmt: skip
    print_throughput(rows)
    return rows


def evaluate(cfg: DictConfig) -> Path:
    """Run the benchmark described by `cfg.eval` and write the results; returns `<out_dir>/results.json`.

    Bad settings and empty benchmarks are refused before the target loads; results.json and the plots are
    written only at the end of a successful run (`publish`), so a failed run never replaces earlier results.
    """
    from specdraft.eval.decode import default_stop_ids
    from specdraft.eval.runner import run_benchmark, warm_up
    from specdraft.eval.speedup import print_tables, summarize
    from specdraft.models.base_llm import load_target
    from specdraft.models.hub import read_config
    from specdraft.models.linear_layout import apply_layout, layout_label

    validate_config(cfg)
    e = cfg.eval
    benches = load_benches(cfg)
    for path in e.drafters or ():  # a missing or unreachable export is refused before the target loads
        read_config(str(path), "eval.drafters")
    if e.num_threads:
        torch.set_num_threads(int(e.num_threads))
    seed_everything(int(e.seed))
    base = cast(dict[str, Any], OmegaConf.to_container(cfg.base_model, resolve=True))  # a DictConfig
    base.update({k: v for k, v in (("dtype", e.dtype), ("device", e.device)) if v})
    model, tokenizer = load_target(SimpleNamespace(**base))
    # small-M products (verify trees) cheaper on a CPU; int8 activations where base_model.q8_activations is set
    layout = apply_layout(model, str(e.linear_layout), q8=bool(base.get("q8_activations")))
    if layout != "native":
        print(f"eval.linear_layout: target Linear weights {layout_label(model, layout)} (CPU decode layout)")
    log_environment("evaluate", resolve_placement(base["device"], base["dtype"]))
    stop_ids = default_stop_ids(tokenizer, model)
    methods, skipped = _methods(cfg, model, tokenizer, stop_ids)
    dtype = str(model.dtype).replace("torch.", "")
    gap = float(e.near_tie_gap) if e.near_tie_gap is not None else NEAR_TIE_GAP.get(dtype, 0.5)
    warm = [i for items in benches.values() for i in items][: int(e.warmup)]
    if warm:
        from specdraft.data.benchmarks import first_turn_ids

        warm_up(methods, first_turn_ids(tokenizer, warm), int(e.warmup_tokens))
    check = bool(e.check_lossless)
    if check and e.temperature > 0:  # sampled outputs differ run to run; exactness is tested in distribution
        print("eval.check_lossless: skipped for temperature > 0 (token-for-token equality is a greedy check)")
        check = False
    t0 = time.time()
    records = []
    for bench, items in benches.items():
        records += run_benchmark(
            str(bench),
            items,
            methods,
            model,
            tokenizer,
            int(e.max_new_tokens),
            int(e.seed),
            check,
            gap,
        )
    summary, categories = summarize(records), summarize(records, by_category=True)
    turns = summarize(records, by_turn=True)
    print_tables(summary, categories, turns=turns)
    throughput = _throughput(cfg, benches, methods, model, tokenizer, stop_ids)
    out_dir = Path(e.out_dir or os.path.join(str(cfg.run_dir), "eval"))
    results = {
        "settings": {
            "eval": OmegaConf.to_container(e, resolve=True),
            "base_model": base,
            "methods": [
                {"name": m.name, "kind": m.kind, "reference": m.reference, "draft_len": m.draft_len}
                for m in methods
            ],
            "skipped": skipped,
            "stop_ids": sorted(stop_ids),
            "near_tie_gap": gap,
            "definitions": "tokens_per_step = tokens emitted per target forward in the decode phase (accepted "
            "drafts + 1); acceptance_rate = accepted drafts / (steps x draft_len); speedup = tokens/s over the "
            "reference's tokens/s on the same prompts (ar for drafters, hf_ar for transformers baselines)",
        },
        "machine": machine_info(model),
        "graph_capture_failures": capture_failures(),  # steps that ran eagerly on the graph path
        "wall_time_s": time.time() - t0,
        "summary": summary,
        "categories": categories,
        "turns": turns,
        "throughput": throughput,
        "records": records,
    }
    path, plots = publish(out_dir, results, bool(e.plots))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    report_captures()  # steps whose CUDA graph capture failed ran eagerly
    print(f"results: {path}" + (f" (plots: {', '.join(p.name for p in plots)})" if plots else ""))
    return path
