"""The lean forward's elementwise stretches compiled into one kernel each (`models/fused_ops.py`): equal to the
eager ops to rounding on any row count, the lean step equal with them on or off, decoding through them lossless
against the decoder's own AR, eager again after a failed compile; off unless asked. Compiled here with inductor's
C++ kernels (`SPECDRAFT_FUSED_OPS=on`); a GPU compiles Triton kernels (the CUDA test)."""

from __future__ import annotations

import pytest
import torch

from specdraft.models import fast_target, fused_ops
from specdraft.testing import check_trees_lossless, tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _args(rows: int, dtype: torch.dtype, device: str = "cpu") -> dict[str, tuple]:
    """Random inputs of every stretch for `rows` rows (H = 32, 4 + 2 heads of 8, I = 24)."""
    g = torch.Generator().manual_seed(rows)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    heads = r(1, rows, 8, 8)
    cos, sin = r(1, rows, 1, 8), r(1, rows, 1, 8)
    return {
        "norm": (r(rows, 32), r(32), 1e-5),
        "add_norm": (r(rows, 32), r(rows, 32), r(32), 1e-6),
        "rotate_heads": (heads, 6, cos, sin),
        "silu_mul": (r(rows, 48), 24),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_stretches_equal_the_eager_ops(monkeypatch, dtype):
    """Every stretch compiled (one graph for 1, 3 and 17 rows) equals its eager ops: fp32 to ~1e-6, bf16 to a
    rounding step (inductor keeps intermediates in fp32)."""
    monkeypatch.setenv(fused_ops.ENV, "on")
    compiled = fused_ops.ops()
    assert all(isinstance(f, fused_ops._Compiled) for f in compiled.values())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for rows in (1, 3, 17):
        for name, args in _args(rows, dtype).items():
            got, want = compiled[name](*args), fused_ops.EAGER[name](*args)
            for a, b in zip(
                got if isinstance(got, tuple) else (got,),
                want if isinstance(want, tuple) else (want,),
                strict=True,
            ):
                assert a.dtype == b.dtype and a.shape == b.shape
                torch.testing.assert_close(a, b, **tol)
    assert all(c.failed is None for c in fused_ops.COMPILED.values())


def test_off_unless_asked(monkeypatch):
    """Off by default (unmeasured on a GPU, slower on a CPU): the eager functions are the stretches' own; `on`
    compiles them on any device."""
    monkeypatch.delenv(fused_ops.ENV, raising=False)
    assert not fused_ops.wanted()  # on every device
    assert fused_ops.ops()["norm"] is fused_ops.norm
    monkeypatch.setenv(fused_ops.ENV, "on")
    assert fused_ops.wanted() and isinstance(fused_ops.ops()["norm"], fused_ops._Compiled)


def test_a_failed_compile_runs_eagerly_from_then_on(monkeypatch, capsys):
    """A compile error (here: torch.compile raising, as without Triton) gives the eager result, says so once on
    stderr, and does not try again."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no backend\nmore")

    monkeypatch.setattr(torch, "compile", broken)
    stretch = fused_ops._Compiled(fused_ops.norm)
    x, w = torch.randn(2, 8), torch.randn(8)
    for _ in range(3):
        assert torch.equal(stretch(x, w, 1e-5), fused_ops.norm(x, w, 1e-5))
    assert len(calls) == 1 and stretch.failed == "RuntimeError: no backend"
    assert capsys.readouterr().err.count("norm runs eagerly") == 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_step_and_decoding_with_the_compiled_stretches(monkeypatch, arch):
    """The lean forward of a tree step with the stretches compiled equals it op by op (to the norm's fp32), and
    greedy tree decoding through them equals the decoder's own AR on the eager and fixed-shape paths."""
    from transformers import DynamicCache

    from specdraft.models.base_llm import forward_with_hidden

    model = tiny_target(arch)
    ids = torch.randint(5, 120, (1, 6), generator=torch.Generator().manual_seed(0))
    step = torch.tensor([[7, 9, 11]])
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), allowed], dim=1)[None, None]
    mask = torch.where(mask, torch.zeros((), dtype=model.dtype), torch.finfo(model.dtype).min)
    pos = torch.tensor([[6, 7, 7]])
    outs = {}
    for setting in ("off", "on"):
        monkeypatch.setenv(fused_ops.ENV, setting)
        cache = DynamicCache()
        forward_with_hidden(model, ids, past_key_values=cache, use_cache=True, logits=False)
        with torch.inference_mode():
            lean = fast_target.fast_forward(model, step, mask, pos, cache)
        assert lean is not None
        outs[setting] = lean[0]
    # to fp32 rounding: transformers' RMSNorm takes its statistics in fp32 even in an fp64 model
    torch.testing.assert_close(outs["on"], outs["off"], rtol=1e-5, atol=1e-6)
    check_trees_lossless(model)  # still "on": every verify and AR step through the compiled stretches
    assert all(c.failed is None for c in fused_ops.COMPILED.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_stretches_on_cuda_inside_a_graph(monkeypatch):
    """On CUDA: Triton kernels equal the eager ops to rounding, and greedy decoding on the graph path (verify
    forwards captured as CUDA graphs, the stretches compiled in the warm-ups) equals the decoder's AR."""
    from specdraft.eval.static_decode import StaticDecoder
    from specdraft.testing import OracleBeamProposer

    monkeypatch.setenv(fused_ops.ENV, "on")
    compiled = fused_ops.ops()
    for name, args in _args(5, torch.bfloat16, "cuda").items():
        got, want = compiled[name](*args), fused_ops.EAGER[name](*args)
        for a, b in zip(
            got if isinstance(got, tuple) else (got,),
            want if isinstance(want, tuple) else (want,),
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    model = tiny_target("llama", device="cuda")
    dec = StaticDecoder(model, 64, static=True, graphs=True)
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(9))
    ref, _ = dec.ar_generate(None, prompt, 30, stop_ids=set())
    out, stats = dec.speculative_generate(
        None, prompt, OracleBeamProposer(ref, 9, vocab=96), 30, stop_ids=set()
    )
    assert out == ref and stats.tokens_per_step > 1.8
    assert all(c.failed is None for c in fused_ops.COMPILED.values())
