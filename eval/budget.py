"""A node budget fitted to the machine (the hardware-aware idea of Sequoia), for every family alike.

The same drafter pays on one machine and loses on another because a target forward over b tree nodes
costs very different multiples of a one-token step (flat to 128 nodes on an H100 as CUDA graphs; 3x at 16
nodes on a 2-core CPU in fp32). Two measured curves decide the budget:

  * **cost(b)**: ms of one verify forward of b nodes after a 256-token prefix on this decode path, measured
    once per (model, device, dtype, threads, path) and cached as JSON (`CostCurve.load_or_measure`);
  * **gain(b)**: tokens/step the proposer's own trees would give if cut to their first b nodes. Proposers
    order nodes best first (beam rank, EAGLE-2 score, Medusa accuracy), and the first b nodes of a tree are a
    tree, so one verify of the full tree yields gain(b) for every b at once: the deepest fully accepted node
    among the first b (a running max over the nodes, computed on the device with the verify).

After `fit_steps` drafted steps at full size, `NodeBudget.cap` = argmax over b of
gain(b) / (cost(b) + draft time), where b = 1 means "do not draft" (gain 1, no draft time): a drafter that
cannot pay on this machine turns itself off. Output is unchanged whatever the budget.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedModel

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # budgets measured and considered


def _cache_dir() -> Path:
    """`$SPECDRAFT_COST_CURVES`, else `$SPECDRAFT_CACHE/cost_curves` (default ~/.cache/specdraft/cost_curves)."""
    if os.environ.get("SPECDRAFT_COST_CURVES"):
        return Path(os.environ["SPECDRAFT_COST_CURVES"])
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")) / "cost_curves"


def machine_key(model: torch.nn.Module, path: str) -> str:
    """What a cost curve depends on: the model's config, device (CPU model / GPU name), dtype, threads,
    torch version and the decode path ("eager" | "fixed" | "graph")."""
    emb = cast(torch.nn.Embedding, cast(PreTrainedModel, model).get_input_embeddings()).weight
    dev = emb.device
    if dev.type == "cuda":
        where = torch.cuda.get_device_name(dev)
    else:
        where = platform.processor() or platform.machine()
        with contextlib.suppress(OSError, StopIteration):
            where = next(
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            )
    cfg = cast(PreTrainedModel, model).config.to_json_string(use_diff=False)
    parts = [cfg, dev.type, where, str(emb.dtype), str(torch.get_num_threads()), torch.__version__, path]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


@dataclass
class CostCurve:
    """Median ms of one verify forward per node count (measured sizes; linear in between)."""

    ms: dict[int, float]

    def __call__(self, n: int) -> float:
        """Cost of an n-node verify, interpolated linearly (extrapolated past the largest size)."""
        xs = sorted(self.ms)
        if n in self.ms:
            return self.ms[n]
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
    ) -> CostCurve:
        """The cached curve for `key`, or `measure()` it (a few seconds) and cache it atomically."""
        path = _cache_dir() / f"{key}.json"
        if path.is_file() and not refresh:
            try:
                return CostCurve({int(k): float(v) for k, v in json.loads(path.read_text())["ms"].items()})
            except (ValueError, KeyError, TypeError):
                log(f"cost curve {path} is unreadable: measuring it again")
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


@dataclass
class NodeBudget:
    """Fits the node cap of one proposer on this machine (see module docstring); state carries over calls.

    Args:
        cost: the target's verify cost curve on this decode path.
        fit_steps: drafted steps observed at full size before the cap is chosen.
        sizes: candidate caps (1 = do not draft).
        label: the method's name, for the line printed when the cap is chosen ("" = silent).
    """

    cost: CostCurve
    fit_steps: int = 48
    sizes: tuple[int, ...] = SIZES
    label: str = ""
    cap: int | None = None  # None while fitting; then the chosen budget
    gains: list[list[int]] = field(
        default_factory=list
    )  # per step: accepted+1 with the first b nodes, b=1..n
    draft_ms: list[float] = field(default_factory=list)  # per step: proposer time

    def observe(self, prefix_accept: list[int], draft_s: float) -> None:
        """One drafted full-size step: `prefix_accept[b-1]` = tokens the first b nodes would have given."""
        if self.cap is not None:
            return
        self.gains.append(prefix_accept)
        self.draft_ms.append(draft_s * 1e3)
        if len(self.gains) >= self.fit_steps:
            self.cap = self.choose()
            if self.label:
                rates = self.rates()
                what = (
                    "no drafting (plain target steps)" if self.cap == 1 else f"trees cut to {self.cap} nodes"
                )
                print(
                    f"[node budget] {self.label}: {what}; expected tokens/s "
                    + ", ".join(f"{b}: {r * 1e3:.1f}" for b, r in rates.items()),
                    flush=True,
                )

    def rates(self) -> dict[int, float]:
        """Expected tokens per ms for each candidate cap (b = 1: plain target steps)."""
        draft = sum(self.draft_ms) / len(self.draft_ms)
        out = {1: 1.0 / self.cost(1)}
        for b in self.sizes[1:]:
            gain = sum(g[min(b, len(g)) - 1] for g in self.gains) / len(self.gains)
            ms = sum(self.cost(min(b, len(g))) for g in self.gains) / len(self.gains) + draft
            out[b] = gain / ms
        return out

    def choose(self) -> int:
        """The cap with the best expected rate (ties: the smaller)."""
        rates = self.rates()
        return max(sorted(rates), key=lambda b: (rates[b], -b))
