"""CUDA graph capture: warm-ups and capture pick the same SDPA backends (`attention.fixed_shapes`), a failed
capture is tried again in a user's run and recorded when it gives up (`graphs.capture_failures`).

On an H200 (torch 2.11, bf16 SmolLM2) every verify capture of a process's first decoder failed: the
warm-ups ran inside `varying_shape_sdpa` (no cuDNN), the capture with torch's choice (cuDNN, which then
built its per-shape graph inside the capture). The CPU tests drive `CudaGraph` through stand-ins for the
CUDA stream and graph calls; the last test captures a bf16 target for real and needs CUDA.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch

import specdraft.eval.graphs as graphs
from specdraft.models.attention import fixed_shapes, varying_shape_sdpa

CUDA = torch.device("cuda")


def _keeps_torch_choice() -> bool:
    """Whether an eager CUDA forward here would keep torch's SDPA choice (cuDNN included)."""
    return isinstance(varying_shape_sdpa(CUDA), contextlib.nullcontext)


def test_varying_shape_sdpa_keeps_torch_choice_inside_fixed_shapes():
    """Outside: a varying-shape CUDA forward leaves cuDNN out; inside `fixed_shapes` (nested too) it keeps
    torch's choice, and leaving restores the outer state. CPU forwards always keep it."""
    assert not _keeps_torch_choice()
    assert isinstance(varying_shape_sdpa(torch.device("cpu")), contextlib.nullcontext)
    with fixed_shapes():
        assert _keeps_torch_choice()
        with fixed_shapes():
            assert _keeps_torch_choice()
        assert _keeps_torch_choice()
    assert not _keeps_torch_choice()
    with pytest.raises(RuntimeError), fixed_shapes():
        raise RuntimeError("a failing warm-up")
    assert not _keeps_torch_choice()


def test_fixed_shapes_is_per_thread():
    """A capture is per thread: another thread's eager forward keeps leaving cuDNN out meanwhile."""
    seen: list[bool] = []
    with fixed_shapes():
        t = threading.Thread(target=lambda: seen.append(_keeps_torch_choice()))
        t.start()
        t.join()
    assert seen == [False]


class _FakeCuda:
    """Stand-ins for the CUDA stream and graph calls `CudaGraph` makes, recording the capture's span."""

    def __init__(self) -> None:
        self.capturing = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        fake = self

        class Graph:
            def replay(self):
                pass

        @contextlib.contextmanager
        def graph(g):
            fake.capturing = True
            try:
                yield
            finally:
                fake.capturing = False

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)


def test_warm_ups_and_capture_see_the_same_backends(monkeypatch):
    """Both warm-up runs and the captured run of a step keep torch's SDPA choice: a backend that prepares per
    shape prepares in a warm-up, never inside the capture. Afterwards eager forwards leave cuDNN out again."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    calls: list[tuple[bool, bool]] = []

    def step() -> torch.Tensor:
        calls.append((fake.capturing, _keeps_torch_choice()))
        return torch.zeros(1)

    g = graphs.CudaGraph(step, CUDA)
    assert calls == [(False, True), (False, True), (True, True)]
    assert g() is g.out
    assert not _keeps_torch_choice()


def test_a_failed_capture_is_tried_again_then_recorded(monkeypatch):
    """RETRIES = 1 (a user's run): a capture failing once is taken on its second try, without a warning; one
    failing every try warns, returns None (the caller runs eagerly) and is listed by `capture_failures`,
    which `report_captures` prints. The suite itself runs with RETRIES = 0."""
    assert graphs.RETRIES == 0  # tests/conftest.py
    tries: list[str] = []

    class Flaky:
        def __init__(self, fn, device):
            tries.append(fn())
            if fn() == "broken" or tries.count(fn()) == 1:
                raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(graphs, "CudaGraph", Flaky)
    monkeypatch.setattr(graphs, "_FAILED", [])
    monkeypatch.setattr(graphs, "RETRIES", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(graphs.capture_or_none(lambda: "flaky", CUDA, "a 4-node verify"), Flaky)
    assert tries == ["flaky", "flaky"] and graphs.capture_failures() == []
    with pytest.warns(UserWarning, match="capture failed for a 1-node verify"):
        assert graphs.capture_or_none(lambda: "broken", CUDA, "a 1-node verify") is None
    assert graphs.capture_failures() == ["a 1-node verify"]
    monkeypatch.setattr(graphs, "RETRIES", 0)
    with pytest.warns(UserWarning, match="capture failed for a 2-node verify"):
        assert graphs.capture_or_none(lambda: "fails once", CUDA, "a 2-node verify") is None


def test_report_captures_names_the_eager_steps(monkeypatch, capsys):
    """Nothing printed without failures; one line naming them (the first four) otherwise."""
    monkeypatch.setattr(graphs, "_FAILED", [])
    graphs.report_captures()
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(graphs, "_FAILED", [f"a {n}-node verify" for n in (1, 2, 4, 8, 16)])
    graphs.report_captures()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "5 CUDA graph capture(s) failed" in out
    assert "a 8-node verify" in out and "a 16-node verify" not in out and "ran eagerly" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_verify_graphs_capture_on_the_first_try():
    """A bf16 target with head size 64 (where torch picks cuDNN's attention on recent GPUs): every verify of
    the static decoder is captured on its first try (the suite has no retry, and a failed capture's warning
    is an error), for AR and for speculative steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.eval.static_decode import StaticDecoder
    from specdraft.testing import RandomTreeProposer

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(device=CUDA, dtype=torch.bfloat16).eval()
    before = graphs.capture_failures()
    dec = StaticDecoder(model, 128, static=True, graphs=True)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(1))
    out, _ = dec.ar_generate(None, prompt, 24, stop_ids=set())
    spec, _ = dec.speculative_generate(None, prompt, RandomTreeProposer(256, seed=3), 24, stop_ids=set())
    assert len(out) == 24 and len(spec) == 24
    assert graphs.capture_failures() == before
