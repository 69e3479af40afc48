"""CUDA graph capture of a fixed-shape step (the target's verify forward, a proposer's draft step).

A captured step reads its inputs from tensors whose addresses never change (the caller copies new values
in) and writes its outputs to tensors the graph owns; `replay()` relaunches every kernel with one call,
which is what removes the ~40 ms of per-forward launch overhead measured on an H100 for a 135M target.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from specdraft.models.attention import fixed_shapes

T = TypeVar("T")
log = logging.getLogger(__name__)
_FAILED: list[str] = []  # what `capture_or_none` gave up on in this process, in order (`capture_failures`)
# captures tried again after a failure (the test suite sets 0: a first failure is a failure there)
RETRIES = 1


class CudaGraph(Generic[T]):
    """`fn` captured once as a CUDA graph after two warm-up runs on a side stream; calling replays it. Warm-ups
    and capture run inside `attention.fixed_shapes()`, so both pick the same SDPA backends.

    Args:
        fn: a step with fixed shapes and no host sync, reading and writing only persistent tensors.
        device: the CUDA device.
    """

    def __init__(self, fn: Callable[[], T], device: torch.device) -> None:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with fixed_shapes():
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out: T = fn()

    def __call__(self) -> T:
        """Replay; returns the graph's output tensors (overwritten by the next replay)."""
        self.graph.replay()
        return self.out


def capture_or_none(fn: Callable[[], T], device: torch.device, what: str) -> CudaGraph[T] | None:
    """`CudaGraph(fn)`, tried `RETRIES` + 1 times (a capture spoilt by a library's first-use preparation
    usually takes the second time), or None with a warning when every try failed (the caller then runs `fn`
    eagerly, with the same output): capture is an optimisation, never a reason to stop a run. Each give-up is
    recorded: `capture_failures`."""
    for attempt in range(RETRIES + 1):
        try:
            return CudaGraph(fn, device)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
            if attempt < RETRIES:
                log.info("CUDA graph capture of %s failed once (%s); trying again", what, e)
                continue
            _FAILED.append(what)
            warnings.warn(f"CUDA graph capture failed for {what} ({e}); running it eagerly", stacklevel=2)
    return None


def capture_failures() -> list[str]:
    """The steps whose capture failed (every try) in this process, in order: they ran eagerly, so a benchmark
    that reports a graph path should say so (`eval.bench_common.write_json` records them)."""
    return list(_FAILED)


def report_captures() -> None:
    """Print one line when CUDA graph captures failed in this run: those steps ran eagerly, so rows labelled
    as graph paths hold eager timings (an H200 run once reported 61 tok/s "static" AR that way)."""
    failed = capture_failures()
    if failed:
        print(
            f"warning: {len(failed)} CUDA graph capture(s) failed ({', '.join(failed[:4])}"
            f"{', ...' if len(failed) > 4 else ''}): those steps ran eagerly, "
            "so the graph rows above are not graph timings"
        )


def replay_or_run(
    graphs: dict[Any, CudaGraph[T] | None], key: Any, fn: Callable[[], T], device: torch.device, what: str
) -> T:
    """Replay the graph of `key` in `graphs`, capturing `fn` on its first use (`capture_or_none`); where
    capture failed, run `fn` eagerly (the same output)."""
    if key not in graphs:
        graphs[key] = capture_or_none(fn, device, what)
    graph = graphs[key]
    return graph() if graph is not None else fn()


def graphs_wanted(device: torch.device, cuda_graphs: str) -> bool:
    """Whether `eval.cuda_graphs` (auto | on | off) turns the fixed-shape, graph-captured verify on for a
    target on `device`: auto means exactly when it is on CUDA; on without CUDA is a config error."""
    if cuda_graphs not in ("auto", "on", "off"):
        raise ValueError(f"eval.cuda_graphs={cuda_graphs!r}: expected auto | on | off")
    on_cuda = device.type == "cuda"
    if cuda_graphs == "on" and not on_cuda:
        raise ValueError(
            "eval.cuda_graphs=on needs the target on a CUDA device (base_model.device=cuda); use auto or off"
        )
    return cuda_graphs == "on" or (cuda_graphs == "auto" and on_cuda)
