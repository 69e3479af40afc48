"""A node budget learnt from the decode loop's own steps (`eval.node_budget=bandit`): each candidate cap is an arm
of a discounted Thompson-sampling bandit whose reward is the tokens a step emitted per second of that step.

`NodeBudget` (`eval.node_budget=auto`) models every cap from probe steps of large trees: the first b nodes of a
probe tree and the verify cost curve. On a machine where extra nodes are dear that model is biased (a capped
proposer drafts other trees than a probe's first nodes; a probe that meets a copied passage rates large caps
high), and the probes themselves cost: on a 2-core Zen 4 the fitted budget served 1.06x where a fixed 2-node cap
served 1.12x (docs/experiments.md, session 66). Here nothing is modelled: a step at cap b is timed from one
`tick` to the next (draft, verify, acceptance rule, commit: all of it), its tokens are what it emitted (1 for a
plain step), and the next step's cap is the arm whose sampled rate is highest. Older steps weigh `discount` less
per step (the text moves on: a passage the drafter copies favours larger caps while it lasts). A step at a cap
b > 1 on which the proposer did not draft (`eval.fallback` skipped it) is not scored. The output never changes,
only how much is drafted and verified. The batched decoder drives it the same way, one bandit per batch size:
a step's tokens are every row's, a plain step's one per decoded request, and the time its refills spend
prefilling is left out.

Two things keep the sampling from wasting steps on arms it cannot tell apart (session 68: replayed on the logged
steps of a 2-core Zen 4 run, the bandit served 0.91x of its best arm's rate with tree prompt lookup; with both,
alternated runs gave tree prompt lookup +2.9% in fp32 and +8.5% in q8 over the bandit before, the ReDrafter
-0.2% / +1.3%: docs/experiments.md):
  * arms past the proposer's own tree (`ProposerSpec.node_budget`) are one arm: a 10-token lookup chain (11
    nodes) drafts the same tree at caps 16 and 32, which the bandit used to explore as two;
  * an arm's rate is drawn around its ratio estimate (discounted tokens over discounted seconds) with the
    delta-method variance of that ratio, which counts the covariance of a step's tokens and its time (a step
    that verifies a long chain costs more and emits more); drawing tokens and seconds independently overstated
    the spread of arms whose tree size varies from step to step.

Each step is scored in its context, the outcome of the step before (`CONTEXTS`): `none` (a plain or undrafted
step, or the first step of a call: nothing learnt of the drafter's recent acceptance), `miss` (a drafted step
that emitted one token a row: its first draft rejected) or `hit` (at least 1.5 tokens a row). Acceptance runs in
streaks (a passage the drafter copies is accepted step after step), so the best cap depends on it. Logged steps
of tree prompt lookup on MT-Bench (a 2-core Zen 4, q8 target): after a miss no cap beat a plain step (219
tokens/s), after a hit 8 nodes served 388; the ReDrafter's 4 nodes served 199 after a miss and 262 after a hit
(2 nodes: 232 / 258). With `contexts` on (the default) every context is its own bandit over the same arms, its
records discounted per step scored in it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdraft.eval.budget import SIZES, CostCurve, payable_size

TIME_FLOOR = 0.05  # relative standard deviation assumed at least for a step's time (a few samples say little)
TOKEN_FLOOR = 0.25  # the same for its tokens (variance floor, tokens^2)
MOMENTS = 6  # discounted [weight, tokens, tokens^2, seconds, seconds^2, tokens x seconds] per arm
# the step before: plain or undrafted, one token a row, >= HIT_TOKENS tokens a row
CONTEXTS = ("none", "miss", "hit")
HIT_TOKENS = 1.5  # tokens a row (mean over a batched step's rows) from which a drafted step is a hit


@dataclass
class BanditBudget:
    """Chooses each greedy step's node cap among `sizes` (1 = a plain target step) by discounted Thompson
    sampling on tokens per second; the same calls as `NodeBudget` (`start`, `tick`, `observe`, `refit_cap`,
    `drafting_cap`) so the decoder drives either.

    Args:
        cost: the target's verify cost curve: bounds the arms by the largest size that could pay at all
            (`budget.payable_size`); its values never price an arm.
        label: the method's name, for the line printed at the first call ("" = silent).
        sizes: candidate caps.
        discount: weight of a step's record per later scored step, in (0, 1] (0.997: about the newest 330).
        explore: scored steps every arm gets, smallest arm first, before sampling takes over.
        seed: the sampler's seed (the output does not depend on it, only the caps).
        clock: seconds now (tests drive a simulated one).
        contexts: one bandit per context (`CONTEXTS`: the outcome of the step before); False: one for all steps.
    """

    cost: CostCurve
    label: str = ""
    sizes: tuple[int, ...] = SIZES
    discount: float = 0.997
    explore: int = 2
    seed: int = 0
    clock: Callable[[], float] = time.perf_counter
    contexts: bool = True
    cap: int = 1  # the arm of the step under way
    settled: bool = True  # never in a fitting phase: the decoder computes no gain curves for it
    off_for_good: bool = False  # any arm may be played again
    refits: int = 0  # times the proposer was told a new cap
    gains: list[list[int]] = field(default_factory=list)  # (none: there are no probe steps)
    arms: list[int] = field(default_factory=list)  # the candidate caps of this proposer (`start`)
    context: str = "none"  # the context of the step under way (`CONTEXTS`)
    # context -> arm -> discounted moments (`MOMENTS`), and scored steps per arm in that context
    _stats: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    _plays: dict[str, dict[int, int]] = field(default_factory=dict)
    _pending: tuple[int, float, int] | None = None  # (arm, tick time, rows) of the step under way
    _tokens: int | None = None  # tokens the step under way emitted (`observe`); None: not drafted
    _told: int | None = None  # the cap the proposer drafts at
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"BanditBudget: discount={self.discount} must be in (0, 1]")
        self._rng.seed(self.seed)

    def start(self, max_depth: int, node_budget: int = 0) -> int:
        """Call at the start of every decode call: sets the arms (sizes up to the largest that could pay for a
        proposer of depth `max_depth`, and none past the first size that holds its whole tree of `node_budget`
        nodes: larger caps draft the same tree; 0 = not declared), drops the step under way (the time since
        spans a prefill) and returns the cap the proposer drafts at now."""
        bound = payable_size(self.cost, self.sizes, max_depth)
        whole = max(self.sizes)  # the first size that holds the whole tree
        if node_budget > 0:
            whole = min((b for b in self.sizes if b >= node_budget), default=whole)
        arms = [b for b in self.sizes if b == 1 or b <= min(bound, whole)]
        if arms != self.arms:
            self.arms = arms
            for ctx in CONTEXTS if self.contexts else ("none",):
                for b in arms:
                    self._stats.setdefault(ctx, {}).setdefault(b, [0.0] * MOMENTS)
                    self._plays.setdefault(ctx, {}).setdefault(b, 0)
            if self.label:
                where = f", one per context {list(CONTEXTS)}" if self.contexts else ""
                print(
                    f"[node budget] {self.label}: bandit over caps {arms} (1: plain steps){where}", flush=True
                )
        self._pending, self._tokens, self.context = None, None, "none"
        if self._told is None or self._told not in arms:
            self._told = max(arms)
            self.cap = self._told
        return self._told

    def tick(self, rows: int = 1, exclude_s: float = 0.0) -> bool:
        """Call before every greedy decode step: scores the step before (its tokens over the time since the
        last tick, less `exclude_s`) and picks this step's cap. True when the proposer must be told a new cap
        (`fit_budget(refit_cap())`).

        Args:
            rows: requests the coming step decodes (the batched decoder: a plain step emits one token each).
            exclude_s: seconds since the last tick spent outside decode steps (the batched decoder's refills:
                prefilling admitted requests is paid alike at every cap).
        """
        now = self.clock()
        after = "none"  # the context of the coming step
        if self._pending is not None:
            arm, t0, plain = self._pending
            if arm == 1 or self._tokens is not None:
                tokens = plain if arm == 1 else int(self._tokens or 1)
                self._score(arm, tokens, max(now - t0 - exclude_s, 1e-9))
                if arm > 1 and self.contexts:
                    after = "hit" if tokens >= HIT_TOKENS * plain else "miss"
        self.context = after
        self.cap = self._choose()
        self._pending, self._tokens = (self.cap, now, rows), None
        if self.cap > 1 and self.cap != self._told:
            self._told = self.cap
            self.refits += 1
            return True
        return False

    def refit_cap(self) -> int:
        """The cap the proposer is told after `tick` returned True."""
        return self.cap

    @property
    def drafting_cap(self) -> int:
        """The size this step's tree is cut to."""
        return self.cap

    def observe(
        self,
        draft_s: float,
        accepted: int,
        prefix_accept: list[int] | None = None,
        verify_s: float | None = None,
    ) -> None:
        """A drafted greedy step's row: `accepted` = the tokens it emitted (accepted nodes, root included),
        added up over the rows of a batched step (one call per row); the time comes from `tick`, so `draft_s`,
        `prefix_accept` and `verify_s` are not needed."""
        self._tokens = (self._tokens or 0) + int(accepted)

    @property
    def plays(self) -> dict[int, int]:
        """Scored steps per arm, all contexts together."""
        out: dict[int, int] = {}
        for per_arm in self._plays.values():
            for b, n in per_arm.items():
                out[b] = out.get(b, 0) + n
        return out

    def rate(self, arm: int) -> float:
        """The arm's discounted mean tokens per second over all contexts (0 before any scored step)."""
        w = tok = s = 0.0
        for per_arm in self._stats.values():
            cw, ctok, _, cs, _, _ = per_arm.get(arm, [0.0] * MOMENTS)
            w, tok, s = w + cw, tok + ctok, s + cs
        return tok / s if w > 0 and s > 0 else 0.0

    def _score(self, arm: int, tokens: int, seconds: float) -> None:
        """Record one step of `arm` in the context it was played in; every record of that context so far weighs
        `discount` less."""
        stats = self._stats[self.context]
        for st in stats.values():
            for i in range(MOMENTS):
                st[i] *= self.discount
        st = stats[arm]
        for i, v in enumerate((1.0, tokens, tokens * tokens, seconds, seconds * seconds, tokens * seconds)):
            st[i] += v
        self._plays[self.context][arm] += 1

    def _choose(self) -> int:
        """In the coming step's context: the smallest arm with fewer than `explore` scored steps there, else the
        arm with the highest sampled rate:
        r ~ N(t / s, var(t - r s) / (w s^2)) with t, s the arm's discounted mean tokens and seconds a step and w
        its discounted weight (the delta-method variance of a ratio of means, covariance included; the
        variances floored at `TOKEN_FLOOR` and `TIME_FLOOR`)."""
        stats, plays = self._stats[self.context], self._plays[self.context]
        fresh = [b for b in self.arms if plays[b] < self.explore]
        if fresh:
            return fresh[0]
        best, pick = float("-inf"), self.arms[0]
        for b in self.arms:
            w, tok, tok2, s, s2, ts = stats[b]
            if w < 1e-6:  # not played for thousands of steps (its weight would underflow): play it again
                return b
            mt, ms = tok / w, s / w
            r = mt / ms
            vt = max(tok2 / w - mt * mt, TOKEN_FLOOR)
            vs = max(s2 / w - ms * ms, (TIME_FLOOR * ms) ** 2)
            cov = ts / w - mt * ms
            # (floored: no arm's rate is known better than TIME_FLOOR relative from one step)
            vr = max(vt - 2.0 * r * cov + r * r * vs, (TIME_FLOOR * mt) ** 2) / (w * ms * ms)
            draw = self._rng.gauss(r, vr**0.5)
            if draw > best:
                best, pick = draw, b
        return pick
