"""A node budget fitted to the machine (the hardware-aware idea of Sequoia), for every family alike.

The same drafter pays on one machine and loses on another because a target forward over b tree nodes
costs very different multiples of a one-token step (flat to 128 nodes on an H100 as CUDA graphs; 3x at 16
nodes on a 2-core CPU in fp32). Two measured curves decide the budget:

  * **cost(b)**: ms of one verify forward of b nodes after a 256-token prefix on this decode path, measured
    once per (model, device, dtype, threads, path) and cached as JSON (`CostCurve.load_or_measure`), a cached
    curve re-timed at 1, 4 and 8 nodes before each use and measured again when its speed or shape moved;
  * **gain(b)**: tokens/step the proposer's own trees would give if cut to their first b nodes. Proposers
    order nodes best first (beam rank, EAGLE-2 score, Medusa accuracy), and the first b nodes of a tree are a
    tree, so one verify of the full tree yields gain(b) for every b at once: the deepest fully accepted node
    among the first b (a running max over the nodes, computed on the device with the verify).

`NodeBudget.cap` = argmax over b of gain(b) / (cost(b) + draft time), where b = 1 means "do not draft" (gain
1, no draft time): a drafter that cannot pay on this machine turns itself off. The draft time is re-measured
at the chosen size before that last decision (a ReDrafter told to fill 2 nodes searches one beam of one token,
several times cheaper than its full search). Every size is rated with the tokens phase 1's steps gave with their
first b nodes, never with the tokens of the steps that re-timed it: those come from other text, one size after
another, so a check that met a passage the drafter copies (MT-Bench "rewrite your previous answer") would win
for its size whatever it is (an H100 eval run, session 43, rated 8 nodes at 718 tok/s against 365-395 at 16-32
nodes that way). Rated so, a size larger than the provisional cap never needs a check: with the same draft time
d for both, gain(b') / (cost(b') + d) - gain(b) / (cost(b) + d) grows with d when gain(b') > gain(b), so a
larger size that lost with phase 1's full-size draft time loses by more with the shorter real one. Output is
unchanged whatever the budget.

The gain depends on the text as much as on the drafter: prompt lookup gains little while a model writes
prose and a lot while it extracts or edits (MT-Bench's first questions are writing ones). So the fit is not
final. A refit drafts `refit_steps` steps at a probe size again, the gain curve becomes the newest `fit_steps`
drafted steps (with `memory`, the newest `memory` probe steps of every fit so far, each rating the sizes up to
its own probe: one refit's passage then no longer outweighs the prompts before it), and the cap is settled anew.
The probe is `refit_scale` times the cap settled before (at least `probe_floor`, 4 nodes): a full-size refit
of a 64-node Medusa tree costs 2.3 target steps a step on a 2-core CPU, and at a cap of 4 nodes sizes past 16
are never chosen anyway. The first fit probes the largest size whose verify costs at most two one-token steps
(at least 4; full-size trees on a flat GPU curve). A fit that settles on its probe size is refitted at once,
`refit_scale` times further, so large trees are probed only while they keep winning. (A floor of 8 made every
first fit on a 2-core CPU in fp32 draft 48 steps of 8-node trees at 2.3-2.4 one-token steps each, and every
refit after "no drafting" 16 more: 1-9% of a 10-prompt run, Session 47.)

No fit, first or refit, drafts past the largest size that could pay at all (`could_pay`): a step verifying b
nodes gives at most 1 + min(D, b - 1) tokens (D the proposer's declared `max_depth`: every node of its deepest
path accepted, drafting free), so where its verify costs that many one-token steps or more, that step gives
fewer tokens per ms than plain steps whatever the drafter. On a 2-core CPU in fp32 (1 / 16 / 32 / 64 nodes =
1 / 3.2 / 5.4 / 9.1 steps) no fit of a depth-4 ReDrafter or Medusa tree drafts more than 16 nodes (33 or 64
before). Where even two nodes cost two steps (a steep batched curve), no drafting is settled for good at once.
A refit starts
  * while drafting (cap > 1), when the tokens per step at the cap drift: the mean over `drift_window` drafted
    steps is more than `drift` (relative) away from what the fit expected there, in either direction (a
    refit costs probe-size steps, so a drafter whose gains hold is not refitted for nothing); while such
    refits keep the same cap the window doubles, up to `drift_window_max` (a change of prompt moves the
    tokens per step without moving the best cap; each refit cost 3-7% of an eval run's speed, Session 29);
    a changed cap resets it;
  * after "no drafting" (cap 1: nothing to watch) or a cap of 2 (one draft node: a step gives at most 2
    tokens, so the drift test hardly ever sees that a larger cap would now pay), `refit_gap` decode steps
    after settling; while such refits keep the same cap the gap doubles, up to `refit_max`, so a drafter that
    never pays costs a few percent at most; a changed cap resets the gap.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, cast

import torch
from transformers import PreTrainedModel

from specdraft.eval.decode import sync_device
from specdraft.hardware import cpu_model
from specdraft.models.base_llm import fast_supported
from specdraft.models.fast_target import wanted
from specdraft.models.panel_linear import kernel_identity, storage_summary
from specdraft.utils import cache_root

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # budgets measured and considered
# bumped when the decode code changes what a verify costs, so curves cached before are measured again
# (2: one-token steps and batch-1 trees attend per key/value head, models/attention.py)
COST_VERSION = 2
RECHECK_SIZES = (1, 4, 8)  # the verify sizes a cached cost curve is checked at before it is reused (cheap)
FULL = 1 << 30  # `Proposer.fit_budget(FULL)`: no cap, draft full-size trees again (a refit)


def _cache_dir() -> Path:
    """`$SPECDRAFT_COST_CURVES`, else `$SPECDRAFT_CACHE/cost_curves` (default ~/.cache/specdraft/cost_curves)."""
    if os.environ.get("SPECDRAFT_COST_CURVES"):
        return Path(os.environ["SPECDRAFT_COST_CURVES"])
    return cache_root() / "cost_curves"


def machine_key(model: torch.nn.Module, path: str) -> str:
    """What a cost curve depends on: the model's config, device (CPU model / GPU name), dtype, threads,
    torch version, the decode path ("eager" | "fixed" | "graph"), the Linear weight layout
    (`models.linear_layout`: the LM head's class tells; panels: fp32 or exact blocks), the attention implementation, the target forward
    (`models/fast_target.py` or transformers'), on a CPU the kernel library's build and switches
    (`models.panel_linear.kernel_identity`: a curve measured before a kernel change is not reused after it) and
    `COST_VERSION`."""
    emb = cast(torch.nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight
    dev = emb.device
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
    cfg = cast(PreTrainedModel, model).config.to_json_string(use_diff=False)
    layout = type(cast(PreTrainedModel, model).get_output_embeddings()).__name__
    parts = [
        cfg,
        dev.type,
        where,
        str(emb.dtype),
        str(torch.get_num_threads()),
        torch.__version__,
        path,
        layout,
        storage_summary(model),  # fp32 or exact block panels (models/exact_panels.py)
        str(getattr(cast(PreTrainedModel, model).config, "_attn_implementation", "")),
        "lean-forward" if wanted() and fast_supported(model) else "hf-forward",
        kernel_identity() if dev.type == "cpu" else "",  # the CPU kernels' build and switches
        f"cost-v{COST_VERSION}",
    ]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def time_round_robin(
    run: Callable[[int], object], sizes: tuple[int, ...], reps: int, device: torch.device
) -> dict[int, float]:
    """Median ms of `run(b)` for each size b, timed round-robin: every rep visits every size (rep 0 warms up,
    e.g. captures CUDA graphs), so a machine's drift or a noisy neighbour shifts all sizes alike instead of
    skewing their ratios. The device is synchronised around each call."""
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for rep in range(reps + 1):
        for b in sizes:
            sync_device(device)
            t = time.perf_counter()
            run(b)
            sync_device(device)
            if rep:
                times[b].append(time.perf_counter() - t)
    return {b: sorted(ts)[len(ts) // 2] * 1e3 for b, ts in times.items()}


def typical_ms(ms: list[float], trim: bool = True) -> float:
    """Mean of `ms`, with `trim` without its slowest eighth (at least one sample once there are two): under
    CUDA graphs a step that captured a graph at a new size (tens to hundreds of ms, once) must not price that
    size's every step. Without captures (`trim` False: a CPU) the plain mean: a proposer whose steps take two
    kinds of time (prompt lookup's chain alone on most steps, the drafter's search on the others,
    `eval/hybrid.py`) would lose its slow, real steps to the trim and be priced as if it rarely drafted."""
    keep = sorted(ms)[: len(ms) - max(1, len(ms) // 8)] if trim and len(ms) > 1 else list(ms)
    return sum(keep) / len(keep)


def _moved(cached: CostCurve, now: dict[int, float], tolerance: float, shape_tolerance: float) -> str | None:
    """Why a cached curve no longer prices this machine (cost(1) or a size's cost(n) / cost(1) drifted past its
    tolerance, relative), as words for the log line; None when it still does. `now`: {nodes: ms}, 1 in it."""
    if abs(now[1] - cached(1)) > tolerance * cached(1):
        return f"a 1-node verify takes {now[1]:.1f} ms now against {cached(1):.1f} ms"
    for n in sorted(now):
        was, ratio = cached(n) / cached(1), now[n] / now[1]
        if n != 1 and abs(ratio - was) > shape_tolerance * was:
            return f"a {n}-node verify costs {ratio:.2f} one-node verifies now against {was:.2f}"
    return None


@dataclass
class CostCurve:
    """Median ms of one verify forward per node count (measured sizes; linear in between)."""

    ms: dict[int, float]

    def __call__(self, n: float) -> float:
        """Cost of an n-node verify, interpolated linearly (extrapolated past the largest size); n may be a
        mean over rows (`batch_width`: rows x cost(nodes / rows))."""
        xs = sorted(self.ms)
        if n == int(n) and int(n) in self.ms:
            return self.ms[int(n)]
        hi = next((x for x in xs if x > n), None)
        lo = max((x for x in xs if x < n), default=xs[0])
        if hi is None:  # extrapolate from the last two sizes
            lo, hi = xs[-2], xs[-1]
        w = (n - lo) / (hi - lo)
        return self.ms[lo] + w * (self.ms[hi] - self.ms[lo])

    @staticmethod
    def load_or_measure(
        key: str,
        measure: Callable[[], dict[int, float]],
        refresh: bool = False,
        log: Callable[[str], None] = print,
        recheck: Callable[[], dict[int, float]] | None = None,
        tolerance: float = 0.25,
        shape_tolerance: float = 0.15,
    ) -> CostCurve:
        """The cached curve for `key`, or `measure()` it (a few seconds) and cache it atomically.

        Args:
            key: `machine_key` of the model and decode path.
            measure: () -> {nodes: ms}, the whole curve.
            refresh: measure even when a curve is cached.
            log: where the one-line reports go.
            recheck: () -> {nodes: ms} of a few verify sizes now, 1 among them (a second or less); a cached
                curve whose cost(1) is more than `tolerance` (relative) away from it is measured again: the
                machine's speed moved since it was cached (a VM's timings drift 10-30% from day to day: a
                curve cached at 44 ms per one-token step fitted budgets while AR ran at 33 ms, pricing the
                draft time a third too low). So is one whose shape moved: a size's cost over cost(1) more
                than `shape_tolerance` (relative) away from the cached ratio (on a 2-core Zen 4 a q8
                curve cached at 2.49x for 8 nodes measured 1.69x a session later, cost(1) within 5%: every
                budget was fitted against trees 1.5x dearer than they were). Within both the cached curve is
                scaled by now / cost(1), so the verify costs it gives are at the speed the draft times are
                measured at. None: the cached curve as it is.
            tolerance: relative drift of cost(1) a cached curve survives.
            shape_tolerance: relative drift of each rechecked size's cost(n) / cost(1) a cached curve survives.
        """
        path = _cache_dir() / f"{key}.json"
        if path.is_file() and not refresh:
            try:
                cached = CostCurve({int(k): float(v) for k, v in json.loads(path.read_text())["ms"].items()})
            except (ValueError, KeyError, TypeError):
                log(f"cost curve {path} is unreadable: measuring it again")
            else:
                if recheck is None:
                    return cached
                now = recheck()
                why = _moved(cached, now, tolerance, shape_tolerance)
                if why is None:  # the same machine, at today's speed
                    return CostCurve({n: v * now[1] / cached(1) for n, v in cached.ms.items()})
                log(f"cost curve {path}: {why} when it was cached: measuring it again")
        t0 = time.perf_counter()
        ms = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"ms": ms, "measured_s": time.perf_counter() - t0}))
        tmp.replace(path)
        log(
            f"cost curve measured in {time.perf_counter() - t0:.1f} s (cached in {path}): "
            + ", ".join(f"{n}: {ms[n] / ms[1]:.2f}x" for n in sorted(ms))
            + f" of {ms[1]:.1f} ms"
        )
        return CostCurve(ms)


class CapPolicy(Protocol):
    """What a decoder asks of a node budget (`NodeBudget`, fitted; `bandit_budget.BanditBudget`, learnt per step):
    `start` at each decode call, `tick` before each greedy step (True: tell the proposer `refit_cap()`),
    `observe` after each drafted greedy step, and the cap (`cap`: 1 = a plain step) and size (`drafting_cap`)
    the step's tree is cut to."""

    @property
    def cap(self) -> int | None: ...  # None while a fit's phase 1 runs
    @property
    def settled(self) -> bool: ...  # False while the decoder must report gain curves (phase 1 and checks)
    @property
    def off_for_good(self) -> bool: ...  # drafting is off and stays off: skipped positions need not be kept
    @property
    def drafting_cap(self) -> int | None: ...  # the size trees are cut to (None: whole trees)
    @property
    def sizes(self) -> tuple[int, ...]: ...  # candidate caps
    @property
    def refits(self) -> int: ...  # records: refits (fitted) or cap changes (bandit) so far
    @property
    def gains(self) -> list[list[int]]: ...  # records: the probe steps that rate the caps (bandit: none)

    def start(self, max_depth: int, node_budget: int = 0) -> int: ...  # the proposer's spec
    def tick(self, rows: int = 1, exclude_s: float = 0.0) -> bool: ...  # rows and refills of a batched step
    def refit_cap(self) -> int: ...
    def observe(
        self,
        draft_s: float,
        accepted: int,
        prefix_accept: list[int] | None = None,
        verify_s: float | None = None,
    ) -> None: ...


def payable_size(cost: CostCurve, sizes: tuple[int, ...], max_depth: int) -> int:
    """The largest of `sizes` that could beat plain steps on `cost`: b nodes give at most 1 + min(max_depth,
    b - 1) tokens a step (every node of the deepest path accepted, drafting free), so b could pay only if its
    verify costs less than that many one-token verifies. `FULL` when `max_depth` is 0 (undeclared), the curve
    has one point (no bound) or the largest size could; 1 when no size > 1 could (never draft here).

    Args:
        cost: the verify cost curve; sizes: the candidate caps; max_depth: the proposer's deepest draft node
            (`ProposerSpec.max_depth`).
    """
    if max_depth <= 0 or len(cost.ms) < 2:  # (a `fixed` budget's curve has one point)
        return FULL
    one = cost(1)
    ok = [b for b in sizes if b > 1 and (1 + min(max_depth, b - 1)) * one > cost(b)]
    if not ok:
        return 1
    return FULL if max(ok) == max(sizes) else max(ok)


def marginal_min_prob(curve: CostCurve) -> float:
    """The drafter probability a tree node needs to pay for its place in the verify on this cost curve.

    A node accepted with probability p adds p tokens to a step's expected output (a tree's expected accepted
    length is the sum of its nodes' acceptance probabilities), and one more verified node costs
    cost(2) - cost(1) against cost(1) for a plain step's one token; so a node pays when
    p >= (cost(2) - cost(1)) / cost(1). On a per-row batch curve (`BatchDecoder.row_cost_curve`) this grows with
    the batch: ~0.1 at batch 1 on a 2-core CPU, ~0.35 at batch 16, where the batch's products stop being
    bound by streaming the weights. With ReDrafter's `min_prob` (a node's probability: the product of the
    drafter's probabilities along its beam) each row then drafts only where its drafter is confident enough.

    Args:
        curve: verify ms per node count (1 and 2 measured or interpolated).

    Returns:
        The threshold, clamped to [0, 0.99].
    """
    one = curve(1)
    return min(max((curve(2) - one) / one, 0.0), 0.99) if one > 0 else 0.0


@dataclass
class NodeBudget:
    """Fits the node cap of one proposer on this machine (see module docstring); state carries over calls.

    Two phases, so that "do not draft" is only decided with the draft time of the trees actually kept:
    1. `fit_steps` drafted steps at the probe size (`refit_cap`) record the gain curve and the draft time; the
       best cap b >= 2
       becomes provisional (`cap`), and the proposer is told (`Proposer.fit_budget`), so it may draft less;
    2. `check_steps` drafted steps at that cap measure the draft time it really has, and, where the decoder
       reports it, the verify time it really has in the decode loop, which rate it with the gain curves of
       phase 1 and of the checks (the same steps for every size up to the checked cap: comparing the checks'
       own tokens with phase 1's would compare two stretches of text). The loop's verify can
       cost a different multiple of a plain step than the cost curve's: on a 2-core Zen 4 VM the slope of a
       q8 target's curve doubled within half an hour (a busy neighbour on the shared cores), and a budget
       priced on the curve measured at start-up settled on 4-node trees at 0.86-0.93x of AR where 2 nodes
       gave 1.10x (session 64). The checks' gain curves (the first b nodes of the trees drafted at the checked
       cap) join phase 1's for every size up to that cap: phase 1's probe trees are not the trees a smaller
       cap drafts (a ReDrafter's first 4 nodes of a 2-beam search against its one-beam chain), and a refit
       that a drift up started probes a passage the drafter copies, so phase 1 alone rated 4-node trees at
       2.15 tokens a step where they served 1.8-1.9 (session 64);
       then the next smaller size is checked the same way, as long as its phase-1 gain over its verify cost
       alone (no draft time: the best it could do) beats every rate so far, because a proposer told a smaller
       cap drafts less (fewer beams, fewer head passes) and phase 1 charged it the full-size draft time. The
       final cap is the best of the checked caps and 1 (no drafting) (`settled`).

    Args:
        cost: the target's verify cost curve on this decode path.
        fit_steps: drafted full-size steps of phase 1.
        check_steps: drafted steps of phase 2 (0: settle after phase 1, with the full-size draft time).
        sizes: candidate caps (1 = do not draft).
        label: the method's name, for the line printed when the cap is settled ("" = silent).
        refit_gap: decode steps after settling on no drafting before a refit (0: the first fit is final,
            drift included).
        refit_max: longest such gap: it doubles after each refit that keeps drafting off.
        refit_steps: drafted steps (at the probe size, `refit_cap`) of a refit's phase 1.
        drift_window: drafted steps at the cap whose mean tokens per step are compared with the fit's.
        drift: relative difference of that mean from the fit's expectation that starts a refit.
        drift_window_max: longest drift window: it doubles after each refit that keeps the cap.
        refit_scale: a refit drafts trees of at most this many times the previously settled cap, and at least
            `probe_floor` nodes (`refit_cap`); 0: full-size trees.
        probe_floor: the smallest probe of a fit on a steep curve (`refit_cap`): a fit that settles on it is
            refitted at once, `refit_scale` times further.
        trim_slowest: draft times are averaged without their slowest eighth (`typical_ms`): on for a decoder
            that captures CUDA graphs (a capture is one slow step), off elsewhere.
        confidence: the best size (by mean gain) drafts only if its rate with the gain lowered by this many
            standard errors of the mean over the fit's steps still beats plain steps (`_settle`), so a gain within
            the noise of a few dozen steps of one text (a refit: 16) does not turn drafting on; 0: the mean
            decides. The choice among drafted sizes is the means'.
        loop_verify: price each checked cap with the verify time phase 2 measured in the decode loop (where the
            decoder reports it) instead of the cost curve's; False: the curve alone (a synthetic curve in a
            test, whose seconds-long verifies no loop reproduces).
        memory: phase-1 steps whose gain curves rate the caps, over every fit so far (the newest
            `max(fit_steps, memory)`, the prompts before included), each rating only the sizes up to the cap it
            was drafted at; 0: the newest `fit_steps` (a refit's 16 steps and the 32 before them). A refit that
            meets a passage the drafter copies then moves the cap only if the passage outweighs the text seen
            before (see `docs/experiments.md`, session 66).
        refit_on_call: a decode call (a new prompt: new text) starts a refit at its first step when the budget
            is settled on no drafting and at least `refit_steps` steps have passed since, instead of waiting
            out the gap: whether drafting pays depends on the text (prompt lookup pays on a turn that quotes
            the previous one), and a 128-token answer is shorter than the gap. Not on 2 nodes (session 59 did
            that too): there a refit at every prompt drafted 16 probe steps of 8-node trees and 16 checks per
            128-token answer, and cost the copy-gate ReDrafter 12-14% on a 2-core Zen 4 against refitting on
            the timer and on drift alone (session 64); a step at 2 nodes still sees a drift up (its mean tokens
            can rise 20% above the fit's expectation while that is under 1.67).
    """

    cost: CostCurve
    fit_steps: int = 48
    check_steps: int = 16
    sizes: tuple[int, ...] = SIZES
    label: str = ""
    refit_gap: int = 128
    refit_max: int = 2048
    refit_steps: int = 16
    drift_window: int = 32
    drift: float = 0.2
    drift_window_max: int = 256
    refit_scale: int = 4
    probe_floor: int = 4
    trim_slowest: bool = True
    confidence: float = 1.0
    refit_on_call: bool = True
    loop_verify: bool = True
    memory: int = 0
    cap: int | None = None  # None in phase 1; then the (provisional, later settled) cap
    settled: bool = False
    gains: list[list[int]] = field(
        default_factory=list
    )  # phase 1, per step: accepted+1 with the first b nodes
    draft_ms: list[float] = field(default_factory=list)  # phase 1, per step: proposer time
    probes: list[int] = field(default_factory=list)  # phase 1, per step: the cap its tree was cut to
    # phase 2, per step: (draft ms, tokens, verify ms or None)
    checks: list[tuple[float, int, float | None]] = field(default_factory=list)
    # phase 2, per step where the decoder reports it: (the checked cap, tokens the first b nodes gave)
    check_gains: list[tuple[int, list[int]]] = field(default_factory=list)
    # phase 2: typical verify ms in the decode loop at each checked cap (where the decoder reports it)
    verified: dict[int, float] = field(default_factory=dict)
    # phase 2: tokens per ms at each checked cap (phase 1's gain there over its verify cost + the measured draft)
    measured: dict[int, float] = field(default_factory=dict)
    refits: int = 0  # refits started so far
    history: list[int] = field(default_factory=list)  # every settled cap, in order
    _left: int = -1  # phase-1 steps left (-1: `fit_steps`, the first fit)
    _since: int = 0  # decode steps since the cap settled
    _gap: int = 0  # steps between settling on no drafting and the next refit (0: `refit_gap`)
    _expect: float = 0.0  # tokens per drafted step the fit expects at the settled cap
    _recent: list[int] = field(default_factory=list)  # tokens of the latest drafted steps at the cap
    _check_tokens: dict[int, float] = field(default_factory=dict)  # phase 2: mean tokens at each checked cap
    _due: bool = False  # the drift test asks for a refit
    _window: int = 0  # drafted steps the drift test averages (0: `drift_window`); doubles while refits agree
    _payable: int = FULL  # the largest size that could pay (`could_pay`), set by `start`

    @classmethod
    def fixed(cls, cap: int, label: str = "") -> NodeBudget:
        """A budget settled at `cap` nodes from the start that never refits: every tree cut to `cap` nodes
        (the proposer told so), no fitting steps (benchmarks at a fixed tree size, `bench_batch.py --cap`)."""
        if cap < 1:
            raise ValueError(f"NodeBudget.fixed: cap={cap} must be >= 1")
        b = cls(CostCurve({1: 1.0}), label=label, refit_gap=0)
        b.cap, b.settled, b.history = int(cap), True, [int(cap)]
        return b

    @property
    def off_for_good(self) -> bool:
        """Drafting is off and no refit will turn it on again (`refit_gap` 0): the decoder need not keep the
        skipped positions for the proposer."""
        return self.settled and self.cap == 1 and self.refit_gap <= 0

    def warm_start(self, other: NodeBudget) -> None:
        """Skip phase 1 with `other`'s gain curve: the same proposer on the same kind of text (e.g. fitted at
        another batch size: the tokens the first b nodes of a row's tree give do not depend on how many rows
        are verified together, only the cost does). The provisional cap comes from this budget's cost curve
        with `other`'s gains and draft time, and phase 2 checks it with the draft time it really has here, so
        a batch of 16 rows does not pay full-size trees for 16 rows to relearn what batch 4 measured. Refits
        still draft full-size trees. No-op when `other` never finished a phase 1 (a refit under way still has
        its previous curve), or this one has started."""
        fitted = other.cap is not None or bool(other.history)
        if not fitted or len(other.gains) < self.fit_steps or self.gains or self.cap is not None:
            return
        keep = max(self.fit_steps, self.memory)
        self.gains = [list(g) for g in other.gains[-keep:]]
        self.probes = other._probes()[-keep:]
        self.draft_ms = list(other.draft_ms[-self.fit_steps :])
        self._provisional(self.rates(self.draft_ms))
        self._left = 0
        if self.check_steps <= 0:
            self._settle({})

    def could_pay(self, max_depth: int) -> int:
        """`payable_size` on this budget's curve and sizes, for a proposer of depth `max_depth`."""
        return payable_size(self.cost, self.sizes, max_depth)

    def start(self, max_depth: int, node_budget: int = 0) -> int:
        """Call at the start of every decode call with the proposer's `spec.max_depth` (`node_budget` is not
        needed here: sizes past a proposer's whole tree rate as its whole tree): bounds every fit's
        probe by `could_pay` and returns the node cap the proposer drafts at now (`Proposer.fit_budget`): the
        cap once settled, else phase 1's probe size (`refit_cap`). When no size could pay, an unsettled budget
        settles on no drafting for good (no refits: `off_for_good`). A budget settled on no drafting refits at
        this call's first step (`refit_on_call`)."""
        self._payable = self.could_pay(max_depth)
        if self._payable == 1 and not self.settled:  # (a settled budget, e.g. `fixed`, keeps its cap)
            self.cap, self.settled, self.refit_gap = 1, True, 0
            self.history.append(1)
            if self.label:
                print(
                    f"[node budget] {self.label}: no drafting (plain target steps): on this cost curve no tree "
                    f"of depth <= {max_depth} could pay for its verify",
                    flush=True,
                )
        if self.refit_on_call and self._timed and self.cap == 1 and self._since >= self.refit_steps:
            self._due = True  # new text: a refit at this call's first step
        return self.cap if self.cap is not None else self.refit_cap()

    @property
    def _timed(self) -> bool:
        """Settled on no drafting or one draft node, with refits on: refitted on a timer (`tick`), and with no
        drafting on a new call (`start`, `refit_on_call`), not only on drift."""
        return self.settled and self.cap is not None and self.cap <= 2 and self.refit_gap > 0

    def tick(self, rows: int = 1, exclude_s: float = 0.0) -> bool:
        """Call before every decode step (`rows` and `exclude_s` are for a budget that times steps; a fit ignores
        them). True when a refit starts (the drift test asked for one, or the gap
        after settling on no drafting or on 2 nodes has passed): phase 1 again, so the caller raises the
        proposer's cap to the probe size (`fit_budget(refit_cap())`) and drafts those trees, observing them
        with their gain curves, until the cap settles again."""
        if not self.settled or self.refit_gap <= 0:
            return False
        self._since += 1
        if not self._due and (not self._timed or self._since <= (self._gap or self.refit_gap)):
            return False
        self.cap, self.settled, self.measured, self.checks, self.verified = None, False, {}, [], {}
        self.check_gains = []
        self._left, self.refits, self._due, self._check_tokens = self.refit_steps, self.refits + 1, False, {}
        return True

    def refit_cap(self) -> int:
        """The node cap a fit's phase 1 drafts at (`Proposer.fit_budget(budget.refit_cap())` when `tick` starts
        one; `start` for the first); trees are cut to it (`drafting_cap`). A refit: `refit_scale` times the cap
        settled before, at least `probe_floor`. The first fit: the largest size whose verify costs at most two
        one-token verifies, at least `probe_floor` (`FULL` on a flat curve); a fit that settles on its probe is
        refitted at once, `refit_scale` times further (`_settle`), so a steep curve is not paid for at every
        size to learn that small trees win. Full-size trees (`FULL`) with `refit_scale` 0 or `refit_gap` 0 (no refit could
        probe further). Never past the largest size that could pay (`could_pay`, from `start`)."""
        if self.refit_scale <= 0:
            scaled = FULL
        elif self.history:
            scaled = max(self.probe_floor, self.refit_scale * self.history[-1])
        elif self.refit_gap <= 0:
            scaled = FULL
        else:
            cheap = (
                [b for b in self.sizes if self.cost(b) <= 2 * self.cost(1)] if len(self.cost.ms) > 1 else []
            )
            scaled = FULL if not cheap or max(cheap) == max(self.sizes) else max(self.probe_floor, max(cheap))
        return min(scaled, self._payable)

    @property
    def drafting_cap(self) -> int | None:
        """The size trees are cut to now: the cap once there is one, else phase 1's probe (`refit_cap`);
        None when nothing cuts them (full-size trees)."""
        cap = self.cap if self.cap is not None else self.refit_cap()
        return None if cap >= FULL else cap

    def observe(
        self,
        draft_s: float,
        accepted: int,
        prefix_accept: list[int] | None = None,
        verify_s: float | None = None,
    ) -> None:
        """One drafted greedy step (call it for every one, settled or not): the proposer's time and the tokens
        the step emitted (accepted + 1); in phase 1 also `prefix_accept[b-1]` = tokens the first b nodes alone
        would have given; `verify_s`: the step's verify (forward and acceptance rule), read in phase 2, where a
        checked cap is priced with it instead of the cost curve when every check step reported one. Once
        settled, only the drift test reads the tokens. (The nodes verified are not needed: phase 2 prices
        every size on the gain curves of phase 1's trees and of its own.)"""
        if self.settled:
            if self.cap == 1 or self.drift_window <= 0 or self.refit_gap <= 0:
                return
            self._recent.append(accepted)
            if len(self._recent) >= (self._window or self.drift_window):
                mean = sum(self._recent) / len(self._recent)
                self._due = abs(mean - self._expect) > self.drift * self._expect
                self._recent = []
            return
        if self.cap is None:
            assert prefix_accept is not None, "phase 1 needs the gain curve of the step"
            self.probes.append(self.refit_cap())  # (`_probes` aligns it with `gains` from the newest end)
            self.gains.append(prefix_accept)
            self.draft_ms.append(draft_s * 1e3)
            self._left = (self.fit_steps if self._left < 0 else self._left) - 1
            if self._left <= 0:  # the curve: the newest `fit_steps` (or `memory`) probe steps
                keep = max(self.fit_steps, self.memory)
                del self.gains[:-keep], self.probes[:-keep], self.draft_ms[: -self.fit_steps]
                self._provisional(self.rates(self.draft_ms))
                if self.check_steps <= 0:
                    self._settle({})
            return
        self.checks.append((draft_s * 1e3, accepted, None if verify_s is None else verify_s * 1e3))
        if prefix_accept is not None:  # the checked cap's own trees: their gains rate every size up to it
            self.check_gains.append((self.cap, prefix_accept))
        if len(self.checks) >= self.check_steps:
            k = len(self.checks)
            draft = typical_ms([c[0] for c in self.checks], self.trim_slowest)
            loop = [c[2] for c in self.checks if c[2] is not None]
            if self.loop_verify and len(loop) == k:  # this cap's verify as the loop pays it
                self.verified[self.cap] = typical_ms(loop, self.trim_slowest)
            self._check_tokens[self.cap] = sum(c[1] for c in self.checks) / k  # the drift test's expectation
            self.measured[self.cap] = self.rates([draft])[self.cap]  # phase 1's gain, this draft time
            self.checks = []
            best = max([1.0 / self.cost(1), *self.measured.values()])
            bound = self.rates([0.0])  # no draft time: what each size could reach at best
            smaller = [
                b for b in self.sizes if 1 < b < self.cap and bound[b] > best and b not in self.measured
            ]
            if smaller:
                self.cap = max(smaller)  # check it next (the decoder tells the proposer)
            else:
                self._settle(self.measured, [draft])

    def _provisional(self, rates: dict[int, float]) -> None:
        """End of phase 1: the provisional cap, the best modelled rate among b > 1."""
        self.cap = max((b for b in sorted(rates) if b > 1), key=lambda b: (rates[b], -b))

    def _settle(self, measured: dict[int, float], draft_ms: list[float] | None = None) -> None:
        """Final cap among 1 and b <= the provisional cap: measured rates where there are some (the checked
        caps, in phase 2), else the phase-1 model with the draft time `draft_ms` (default: phase 1's)."""
        assert self.cap is not None
        top = max(measured, default=self.cap)
        rates = {b: r for b, r in self.rates(draft_ms or self.draft_ms).items() if b <= top}
        rates.update(measured)
        cap = max(sorted(rates), key=lambda b: (rates[b], -b))
        noise = cap > 1 and self.rates(draft_ms or self.draft_ms, self.confidence)[cap] <= rates[1]
        if noise:  # the gain over plain steps is within the fit's noise: plain steps
            cap = 1
        probe = self.refit_cap()  # the size this fit's phase 1 drafted at
        same = bool(self.history) and self.history[-1] == cap
        self._gap = min(2 * (self._gap or self.refit_gap), self.refit_max) if same else self.refit_gap
        grown = max(self.drift_window, min(2 * (self._window or self.drift_window), self.drift_window_max))
        self._window = grown if same else self.drift_window
        self.cap, self.settled, self._since, self._recent = cap, True, 0, []
        # settled on the probe while larger sizes could pay: refit at once, `refit_scale` times further
        self._due = cap >= probe and probe < min(self._payable, max(self.sizes)) and self.refit_gap > 0
        self._expect = self._check_tokens.get(cap) or sum(g[min(cap, len(g)) - 1] for g in self.gains) / len(
            self.gains
        )
        self.history.append(cap)
        if self.label and not same:
            what = "no drafting (plain target steps)" if self.cap == 1 else f"trees cut to {self.cap} nodes"
            what += " (the best size's gain is within the fit's noise)" if noise else ""
            when = f" (refit {self.refits})" if self.refits else ""
            print(
                f"[node budget] {self.label}{when}: {what}; expected tokens/s "
                + ", ".join(f"{b}: {r * 1e3:.1f}" for b, r in rates.items()),
                flush=True,
            )

    def _probes(self) -> list[int]:
        """The cap each step of `gains` was drafted at, one per step (`FULL` for steps set without one)."""
        if not self.gains:
            return []
        return [FULL] * (len(self.gains) - len(self.probes)) + self.probes[-len(self.gains) :]

    def rates(self, draft_ms: list[float], confidence: float = 0.0) -> dict[int, float]:
        """Expected tokens per ms for each candidate cap (b = 1: plain target steps, no draft time), from the
        gain curves of phase 1's steps and of phase 2's steps at caps >= b (`check_gains`), and the typical draft
        time of `draft_ms` (`typical_ms`); a drafted size's gain is the steps' mean less `confidence` standard
        errors of it (0: the mean). A size's verify time is the cost curve's over those steps' tree sizes, or
        the decode loop's where phase 2 measured it (`verified`)."""
        draft = typical_ms(draft_ms, self.trim_slowest)
        out = {1: 1.0 / self.cost(1)}
        probes = self._probes()
        for b in self.sizes[1:]:
            pooled = [g for g, p in zip(self.gains, probes) if p >= b] if self.memory > 0 else self.gains
            steps = pooled + [g for cap, g in self.check_gains if cap >= b]  # trees of >= b nodes
            n = len(steps)
            if n == 0:  # (`memory`: no step drafted this many nodes)
                continue
            tokens = [g[min(b, len(g)) - 1] for g in steps]  # (n,) tokens the first b nodes gave
            gain = sum(tokens) / n
            if confidence > 0 and n > 1:  # the mean's standard error over these steps
                gain -= confidence * (sum((t - gain) ** 2 for t in tokens) / (n - 1) / n) ** 0.5
            verify = self.verified.get(b)
            if verify is None:
                verify = sum(self.cost(min(b, len(g))) for g in steps) / n
            ms = verify + draft
            out[b] = gain / ms
        return out
