"""Run every decoding method on the same benchmark prompts, in the same process, and record each call.

Methods (one `Method` each, all batch size 1, same target, dtype, prompts, stop tokens and budget):
  * `ar`            our autoregressive loop (`decode.ar_generate`): the reference of every drafter;
  * `<family>:<n>`  tree speculative decoding with a drafter's proposer (`decode.speculative_generate`);
  * `hf_ar`         `model.generate` without speculation: the reference of the transformers baselines;
  * `hf_static`     `model.generate(cache_implementation="static")`: transformers' static cache (and its
                    automatic compilation where generate applies it);
  * `prompt_lookup` `model.generate(prompt_lookup_num_tokens=...)`;
  * `assisted`      `model.generate(assistant_model=...)`.
Per prompt the methods run back to back (interleaved), so slow drift of a shared machine hits all alike.
MT-Bench turn 2 is asked after the AR answer to turn 1 (the same conversation for every method).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from specdraft.data.benchmarks import BenchmarkItem
from specdraft.data.chat import prompt_ids as chat_prompt_ids
from specdraft.eval.budget import FULL, CapPolicy, NodeBudget
from specdraft.eval.decode import ar_generate, model_device, speculative_generate, sync_device, target_forward
from specdraft.eval.fallback import FallbackController
from specdraft.eval.kv import new_cache
from specdraft.eval.static_decode import StaticDecoder

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

    from specdraft.eval.decode import Proposer

RunFn = Callable[[list[int], int, "torch.Generator | None"], tuple[list[int], dict[str, Any]]]


@dataclass
class Method:
    """A named decoding method timed against `reference` (`ar` or `hf_ar`)."""

    name: str
    kind: str  # "ar" | "spec" | "hf"
    run: RunFn  # (prompt ids, max_new_tokens, generator) -> (new tokens, stats dict)
    reference: str
    draft_len: int | None = None  # max draft depth (acceptance rate denominator)
    factory: Callable[[], Any] | None = None  # spec methods: a fresh proposer (the batched throughput table)
    # ReDrafter: min_prob -> a factory of its proposers pruned below that probability (eval.batch_min_prob)
    pruned: Callable[[float], Callable[[], Any]] | None = None
    # fixed-shape spec methods with a budget: run every node cap once (CUDA graphs captured), state restored
    prepare: Callable[[list[int], int], None] | None = None


def spec_method(
    name: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    proposer: Proposer,
    stop_ids: set[int],
    sampling: dict,
    profile: bool,
    fallback: bool = False,
    decoder: StaticDecoder | None = None,
    budget: CapPolicy | None = None,
) -> Method:
    """Our tree speculative decoder with `proposer` (and a `FallbackController` when `fallback`), on the
    static path of `decoder` or, without one, the dynamic path of `decode.py`; `budget` (static path only)
    fits the node cap to this machine."""
    controller = FallbackController() if fallback else None
    if decoder is not None:
        generate = partial(decoder.speculative_generate, budget=budget)
    elif budget is not None:
        raise ValueError("eval.node_budget=auto needs eval.decode_path=static")
    else:
        generate = partial(speculative_generate, model)

    def run(ids, max_new, gen):
        toks, st = generate(
            tokenizer,
            ids,
            proposer,
            max_new,
            stop_ids=stop_ids,
            generator=gen,
            profile=profile,
            fallback=controller,
            **sampling,
        )
        prof = {
            "prefill_s": st.prefill_s,
            "draft_s": st.draft_s,
            "verify_s": st.verify_s,
            "accept_s": st.accept_s,
        }
        comp = sum(st.compression) / len(st.compression) if st.compression else None
        return toks, {
            "time_s": st.time_s,
            "steps": st.steps,
            "accepted": st.accepted,
            "mean_tree_size": sum(st.tree_sizes) / max(len(st.tree_sizes), 1),
            "mean_compression": comp,
            "finish_reason": st.finish_reason,
            "target_steps": st.target_steps,
            "node_cap": budget.cap if budget is not None else None,  # None while fitting or off
            "budget_fit_steps": len(budget.gains) if budget is not None else None,
            "budget_refits": budget.refits if budget is not None else None,  # refits so far
            "profile": prof,
        }

    method = Method(name, "spec", run, "ar", _draft_len(proposer))
    if decoder is not None and decoder.static and budget is not None:
        method.prepare = partial(precapture, decoder, tokenizer, proposer, budget, stop_ids)
    return method


def precapture(
    decoder: StaticDecoder,
    tokenizer: Any,
    proposer: Any,
    budget: CapPolicy,
    stop_ids: set[int],
    ids: list[int],
    max_new: int,
) -> None:
    """Decode `ids` once at every node cap the budget may settle on (below the proposer's full tree), each
    under its own fixed budget, so that the fixed-shape path captures each cap's draft step and verify as CUDA
    graphs before timing (the first use of a shape captures it: two warm-up runs and the capture, which a short
    timed run would otherwise pay). The method's own budget is not touched; the proposer is restored to its
    full trees and reset."""
    full = int(proposer.spec.node_budget) or max(budget.sizes)  # 0: the proposer declares none
    for cap in [c for c in budget.sizes if 1 < c < full]:
        decoder.speculative_generate(
            tokenizer, ids, proposer, max_new, stop_ids=stop_ids, budget=NodeBudget.fixed(cap)
        )
    proposer.fit_budget(FULL)
    proposer.reset()


def _draft_len(proposer) -> int | None:
    """Maximum draft depth a proposer declares (`spec.max_depth`; None when it declares none)."""
    return proposer.spec.max_depth or None


def ar_method(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: set[int],
    sampling: dict,
    decoder: StaticDecoder | None = None,
) -> Method:
    """Our autoregressive baseline (same forward/cache/prefill/path as the speculative loop)."""
    generate = decoder.ar_generate if decoder is not None else partial(ar_generate, model)

    def run(ids, max_new, gen):
        toks, st = generate(tokenizer, ids, max_new, stop_ids=stop_ids, generator=gen, **sampling)
        return toks, {"time_s": st.time_s, "steps": st.steps, "finish_reason": st.finish_reason}

    return Method("ar", "ar", run, "ar")


def hf_method(
    name: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: set[int],
    sampling: dict,
    **extra: Any,
) -> Method:
    """`model.generate` with `extra` (e.g. `prompt_lookup_num_tokens`, `assistant_model`); counts target forwards."""
    from transformers import GenerationConfig

    temperature = sampling["temperature"]
    gen_args = {k: extra.pop(k) for k in list(extra) if k != "assistant_model"}  # config fields
    gcfg = GenerationConfig(
        **gen_args,
        max_new_tokens=1,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=(sampling["top_k"] or None) if temperature > 0 else None,
        top_p=sampling["top_p"] if temperature > 0 else None,
        eos_token_id=sorted(stop_ids),
        pad_token_id=tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else min(stop_ids, default=0),
    )
    counter = {"n": 0}

    def hook(*_):
        counter["n"] += 1

    def run(ids, max_new, gen):
        device = model_device(model)
        x = torch.tensor([ids], device=device)
        if gen is not None:  # generate() has no generator argument: seed the global RNG instead
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen, device=gen.device)))
        handle = model.register_forward_hook(hook)
        counter["n"] = 0
        try:
            sync_device(device)
            t0 = time.perf_counter()
            gcfg.max_new_tokens = max_new
            out = cast("GenerationMixin", model).generate(
                x, attention_mask=torch.ones_like(x), generation_config=gcfg, **extra
            )
            sync_device(device)
            dt = time.perf_counter() - t0
        finally:
            handle.remove()
        toks = out[0, x.shape[1] :].tolist()
        finish = "stop" if toks and toks[-1] in stop_ids else "length"
        return toks, {"time_s": dt, "steps": max(counter["n"] - 1, 0), "finish_reason": finish}

    return Method(name, "hf", run, "hf_ar")


def top2_gap(model: PreTrainedModel, prompt: list[int], tokens: list[int], position: int) -> float:
    """The target's top-2 logit gap at new-token index `position` (one full forward, fresh cache)."""
    device = model_device(model)
    ids = torch.tensor([prompt + tokens[:position]], device=device)
    with torch.inference_mode():
        logits, _ = target_forward(model, ids, new_cache(model), logits_rows=slice(-1, None))
    top = logits[-1].float().topk(2).values
    return float(top[0] - top[1])


def _divergence(model, prompt: list[int], ref: list[int], out: list[int], near_tie_gap: float) -> dict | None:
    """First position where `out` differs from the AR reference `ref`, with the AR top-2 gap there."""
    n = min(len(ref), len(out))
    pos = next((i for i in range(n) if ref[i] != out[i]), None)
    if pos is None:
        if len(ref) == len(out):
            return None
        pos = n
    gap = top2_gap(model, prompt, ref, pos) if pos < len(ref) else float("nan")
    return {
        "position": pos,
        "ar_token": ref[pos] if pos < len(ref) else None,
        "method_token": out[pos] if pos < len(out) else None,
        "top2_gap": gap,
        "near_tie": bool(gap <= near_tie_gap),
    }


def run_benchmark(
    bench: str,
    items: list[BenchmarkItem],
    methods: list[Method],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    seed: int,
    check_lossless: bool,
    near_tie_gap: float,
    log: Callable[[str], None] = lambda msg: print(msg, flush=True),
) -> list[dict[str, Any]]:
    """Every method on every turn of every item; returns one record per (item, turn, method)."""
    records: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        messages: list[dict[str, str]] = []
        for turn, user in enumerate(item.turns):
            messages.append({"role": "user", "content": user})
            ids = chat_prompt_ids(tokenizer, messages)
            outputs: dict[str, list[int]] = {}
            for m in methods:
                gen = torch.Generator(device=model_device(model)).manual_seed(seed + 1000 * k + turn)
                toks, st = m.run(ids, max_new_tokens, gen)
                outputs[m.name] = toks
                rec = {
                    "bench": bench,
                    "id": item.id,
                    "category": item.category,
                    "turn": turn + 1,
                    "method": m.name,
                    "kind": m.kind,
                    "reference": m.reference,
                    "draft_len": m.draft_len,
                    "prompt_tokens": len(ids),
                    "new_tokens": len(toks),
                    **st,
                    "tokens_per_s": len(toks) / st["time_s"] if st["time_s"] > 0 else 0.0,
                }
                if check_lossless and m.name != "ar":
                    div = _divergence(model, ids, outputs["ar"], toks, near_tie_gap)
                    rec["identical"], rec["divergence"] = div is None, div
                records.append(rec)
            ar_tps = next(r["tokens_per_s"] for r in records[-len(methods) :] if r["method"] == "ar")
            line = " ".join(
                f"{r['method']}={r['tokens_per_s'] / max(ar_tps, 1e-9):.2f}x"
                for r in records[-len(methods) :]
            )
            log(f"[{bench} {k + 1}/{len(items)} {item.category} turn {turn + 1}] {line}")
            answer = str(tokenizer.decode(outputs["ar"], skip_special_tokens=True))
            messages.append({"role": "assistant", "content": answer})
    return records


def warm_up(methods: list[Method], prompts: list[list[int]], tokens: int) -> None:
    """Run every method on a few prompts (results dropped): allocator, kernels and caches warm up."""
    for ids in prompts:
        for m in methods:
            m.run(ids, tokens, None)
    for m in methods:  # every node cap's shapes, once (captured as CUDA graphs on a GPU)
        if m.prepare is not None and prompts:
            m.prepare(prompts[0], tokens)
