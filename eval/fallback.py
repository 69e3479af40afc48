"""Self-adaptive fallback (LLMCad, seed 003): draft only while drafting pays, else plain target steps.

A speculative step costs the drafter's time plus one target forward over the whole tree, and how much more
that forward costs than a one-token step depends on the machine: on a 2-core AVX512 Xeon in fp32 a 16-node
forward costs 2.8x a one-token one, on a bf16 EPYC 1.3x, on an H100 (eager) 1.0x. A drafter whose drafts are
rarely accepted then runs *below* autoregressive decoding. The controller measures both rates on the fly and
picks the better one each step:

    drafted step: rate_d = EMA(tokens emitted) / EMA(step wall time)       # draft + verify + accept
    target step:  rate_t = 1 / EMA(step wall time of a root-only tree)      # what AR would do
    draft while rate_d >= rate_t; otherwise take target steps and probe drafting again after
    `probe` target steps, doubling `probe` (up to `max_probe`) while probes keep failing.

The target step is a one-node tree through the same verify path, so the output is the target's own token:
whatever the controller decides, greedy output equals AR output and sampling keeps the target's
distribution (the decision never looks at the tokens, only at counts and clocks). What changes from run to
run with the clock is only which steps drafted, so tokens/step is reported as measured. One controller serves
one method for a whole benchmark: its running means carry over from prompt to prompt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FallbackController:
    """Chooses per decode step between drafting and a plain target step (see module docstring)."""

    ema: float = 0.3  # weight of the newest observation in the running means
    min_probe: int = 2  # target steps before the first probe after a fallback
    max_probe: int = 64  # longest gap between probes while drafting keeps losing
    margin: float = 1.0  # draft while rate_d >= margin * rate_t

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next call starts with one target step (to time it), then drafts."""
        self.draft_tokens: float | None = None  # EMA of tokens emitted per drafted step
        self.draft_s: float | None = None  # EMA of a drafted step's wall time
        self.target_s: float | None = None  # EMA of a target step's wall time
        self.probe = self.min_probe
        self.countdown = 0  # target steps left before the next probe
        self.drafting = True
        self.fallbacks = 0  # how often drafting was switched off (reported)

    @staticmethod
    def _mix(old: float | None, new: float, w: float) -> float:
        return new if old is None else (1 - w) * old + w * new

    def should_draft(self) -> bool:
        """Whether the next step drafts (True) or is a plain target step (False)."""
        if self.target_s is None:
            return False  # time one target step first
        return self.drafting or self.countdown <= 0  # drafting, or a probe is due

    def observe(self, drafted: bool, emitted: int, seconds: float) -> None:
        """Record one finished step.

        Args:
            drafted: whether the step verified a drafted tree.
            emitted: tokens the step committed (accepted drafts + the target's own token).
            seconds: the step's wall time (draft + verify + accept).
        """
        if not drafted:
            self.target_s = self._mix(self.target_s, seconds, self.ema)
            self.countdown -= 1
            return
        self.draft_tokens = self._mix(self.draft_tokens, float(emitted), self.ema)
        self.draft_s = self._mix(self.draft_s, seconds, self.ema)
        pays = self.pays()
        if pays and not self.drafting:
            self.probe = self.min_probe  # a probe won: draft again
        elif not pays:
            if self.drafting:
                self.fallbacks += 1
            else:
                self.probe = min(2 * self.probe, self.max_probe)  # a probe lost: wait longer
            self.countdown = self.probe
        self.drafting = pays

    def pays(self) -> bool:
        """rate_d >= margin * rate_t on the running means (True while either is unknown)."""
        if self.draft_tokens is None or self.draft_s is None or self.target_s is None:
            return True
        return self.draft_tokens / self.draft_s >= self.margin / self.target_s
