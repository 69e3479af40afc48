"""Kernel launches per fixed-shape draft step, counted on the CPU (`specdraft.testing.KernelCount`: aten ops
that launch a kernel, views excluded). On a GPU a small model's draft step is launch-bound even as a CUDA graph
(H100, session 32: the copy-gate ReDrafter's draft graph took 2.0 ms), so fewer launches is a faster step. A
diagnostic to run before a lent GPU (docs/gpu.md), on tiny random models with the long presets' search sizes
(ReDrafter W = 8 beams, D = 4 slots, 2 blocks, copy gate up to 4-grams); kernel counts do not depend on widths.

    python scripts/gpu/kernel_counts.py                 # per family, then batched rows (ReDrafter, EAGLE)
"""

from __future__ import annotations

import argparse

import torch

from specdraft.eval.proposers import ReDrafterProposer
from specdraft.testing import (
    KernelCount,
    jitter,
    tiny_proposer,
    tiny_proposer_factory,
    tiny_target,
    tiny_tokenizer,
)


def _redrafter(model: torch.nn.Module, copy_ngram: int) -> torch.nn.Module:
    """A random ReDrafter of the long preset's search shape on `model` (fp64, as the tiny target)."""
    from specdraft.models import redrafter
    from specdraft.models.base_llm import target_fingerprint
    from specdraft.train.config import ReDrafterSchema

    fp = target_fingerprint(model, tiny_tokenizer())  # type: ignore[arg-type]
    schema = ReDrafterSchema(draft_len=4, beam_width=8, num_layers=2, copy_ngram=copy_ngram)
    return jitter(redrafter.build(schema, model, fp).to(torch.float64).eval(), 0.05)  # type: ignore[arg-type]


def _inputs(n: int, seed: int, width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, width) fp64 features and (n,) tokens from 6 ids (so the copy gate's n-grams recur)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g, dtype=torch.float64), torch.randint(5, 11, (n,), generator=g)


def draft_kernels(proposer, steps: int = 3) -> KernelCount:
    """Kernels of the last of `steps` `propose` calls (3 new positions each, after a 30-token prompt); features
    as wide as the proposer reads (EAGLE-3: its target layers concatenated)."""
    width = 32 * max(len(getattr(proposer, "target_layers", ()) or ()), 1)
    h, t = _inputs(30 + 3 * steps, 0, width)
    proposer.propose(h[:30], t[:30])
    count = KernelCount()
    for s in range(steps):
        lo = 30 + 3 * s
        if s == steps - 1:
            with count:
                proposer.propose(h[lo : lo + 3], t[lo : lo + 3])
        else:
            proposer.propose(h[lo : lo + 3], t[lo : lo + 3])
    return count


def rows_kernels(make, rows: int, together: bool, width: int = 32) -> int:
    """Kernels of one batched draft of `rows` rows (3 new positions each, after a 30-token prompt): in one
    fixed-shape step for all rows (`propose_rows`), or row by row."""
    ps = [make() for _ in range(rows)]
    ins = [_inputs(33, seed=r, width=width) for r in range(rows)]
    for p, (h, t) in zip(ps, ins, strict=True):  # each row's prompt
        p.propose(h[:30], t[:30]) if not together else None
    if together:
        ps[0].propose_rows(ps, [h[:30] for h, _ in ins], [t[:30] for _, t in ins])
    count = KernelCount()
    with count:
        if together:
            ps[0].propose_rows(ps, [h[30:] for h, _ in ins], [t[30:] for _, t in ins])
        else:
            for p, (h, t) in zip(ps, ins, strict=True):
                p.propose(h[30:], t[30:])
    return count.count


def _no_early_stop(factory):
    """EAGLE proposers from `factory` with early stop off (as under CUDA graphs: its check reads the host)."""

    def make():
        p = factory()
        p.early_stop = False
        return p

    return make


def batch_step_kernels(family: str, batch: int, tokens: int = 24) -> tuple[float, int]:
    """Kernels per batched step of the fixed-shape path outside the target's forwards (the verify is one CUDA
    graph on a GPU; prefills are eager either way): drafting, packing the trees, the acceptance rule, the
    cache commit and the next proposer inputs. `family` "ar" or a `tiny_proposer_factory` family.

    Returns:
        (kernels per step, steps).
    """
    from specdraft.eval.batch_decode import BatchDecoder
    from specdraft.testing import random_prompts

    model = tiny_target("llama")
    factory = None if family == "ar" else tiny_proposer_factory(family, model, static=True)
    dec = BatchDecoder(model, batch, static=True)
    count = KernelCount()
    forward = dec._forward

    def paused(*args, **kwargs):
        count.active = False
        try:
            return forward(*args, **kwargs)
        finally:
            count.active = True

    dec._forward = paused  # type: ignore[method-assign]
    prompts = random_prompts([5 + (7 * i) % 23 for i in range(batch)], seed=2)
    with count:
        res = dec.generate(prompts, tokens, set(), factory)
    steps = res[0][1].batch.steps
    return count.count / max(steps, 1), steps


def target_forward_kernels(nodes: int) -> dict[str, int]:
    """Kernels of one fixed-shape verify forward of `nodes` nodes on the tiny target (3 layers): transformers'
    forward against the lean one (`models/fast_target.py`). On this CPU `F.rms_norm` counts as one op, as the
    fused kernel it is on CUDA."""
    import os

    from specdraft.eval.static_decode import StaticDecoder
    from specdraft.models.fast_target import ENV

    model, out = tiny_target("llama"), {}
    for kind in ("hf", "fast"):
        os.environ[ENV] = kind
        with torch.inference_mode():
            run = StaticDecoder(model, 128, static=True).cost_probe((nodes,))
            run(nodes)
            with KernelCount() as k:
                run(nodes)
        out[kind] = k.count
    os.environ.pop(ENV, None)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=6, help="ops shown per method")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="batched ReDrafter row counts")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = tiny_target("llama")
    print("== kernel launches of one fixed-shape draft step (the GPU's path)")
    methods = {
        "redrafter (W=8, D=4)": ReDrafterProposer(_redrafter(model, 0), 8, 5, static=True),
        "redrafter + copy gate (4-grams)": ReDrafterProposer(_redrafter(model, 4), 8, 5, static=True),
    }
    for fam in ("medusa", "eagle", "eagle3"):
        p = tiny_proposer(fam, model, static=True)
        if hasattr(p, "early_stop"):
            p.early_stop = False  # off under graphs
        methods[f"{fam} (tiny_proposer)"] = p
    for name, p in methods.items():
        c = draft_kernels(p)
        top = ", ".join(f"{op} {n}" for op, n in c.ops.most_common(a.top))
        print(f"{name:34s} {c.count:5d}   {top}")
    print("== drafting R batch rows: one fixed-shape step for all rows vs row by row")
    drafter = _redrafter(model, 4)
    makers = {
        "redrafter + copy gate": lambda: ReDrafterProposer(drafter, 8, 5, static=True),
        "eagle (tiny_proposer)": _no_early_stop(tiny_proposer_factory("eagle", model, static=True)),
    }
    for name, make in makers.items():
        for r in a.rows:
            both = rows_kernels(make, r, True), rows_kernels(make, r, False)
            print(f"{name:22s} R = {r:3d}: together {both[0]:6d}   row by row {both[1]:6d}")
    print(
        "== kernels per verify forward of the tiny target (3 layers): transformers' forward vs the lean one"
    )
    for nodes in (1, 8):
        k = target_forward_kernels(nodes)
        print(f"{nodes} node(s): transformers {k['hf']:5d}   lean {k['fast']:5d}")
    print("== kernels per batched step outside the target's forwards (fixed-shape path, tiny target)")
    for fam in ("ar", "redrafter_copy", "eagle", "eagle3", "medusa"):
        per = [batch_step_kernels(fam, r)[0] for r in a.rows]
        print(f"{fam:16s} " + "   ".join(f"B = {r}: {k:7.0f}" for r, k in zip(a.rows, per, strict=True)))


if __name__ == "__main__":
    main()
