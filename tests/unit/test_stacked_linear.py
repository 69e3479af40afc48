"""Stacked q/k/v and gate/up products over plain Linears (`models/stacked_linear.py`, taken by
`models/fast_target.py` on the native layout: GPUs, bf16 CPUs): one product each, the weights held once (the
members read views of the stack), rebuilt after a move, off where the weights train or the switch says so."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specdraft.models import fast_target
from specdraft.models.base_llm import forward_with_hidden
from specdraft.models.stacked_linear import StackedLinear
from specdraft.testing import tiny_target

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


class _Ops(TorchDispatchMode):
    """Counts the aten ops a block of code dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _storages(model: nn.Module) -> dict[int, int]:
    """address -> bytes of every distinct storage the model's parameters live in."""
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


def _step(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-node tree step after a 6-token prefix through the lean forward -> (hidden (1, 3, H), HF's)."""
    from transformers import DynamicCache

    ids = torch.randint(5, 120, (1, 6), generator=torch.Generator().manual_seed(1))
    lean_cache, hf_cache = DynamicCache(), DynamicCache()
    for c in (lean_cache, hf_cache):
        forward_with_hidden(model, ids, past_key_values=c, use_cache=True, logits=False)
    step = torch.tensor([[7, 9, 11]])
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), allowed], dim=1)[None, None]  # (1, 1, 3, 9)
    zero = torch.zeros((), dtype=model.dtype)
    mask = torch.where(mask, zero, torch.finfo(model.dtype).min)
    pos = torch.tensor([[6, 7, 7]])
    with torch.inference_mode():
        lean = fast_target.fast_forward(model, step, mask, pos, lean_cache)
        hf = forward_with_hidden(model, step, mask, pos, hf_cache, use_cache=True, logits=False)
    assert lean is not None
    return lean[0], hf.hidden


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_one_product_each_with_the_weights_held_once(arch):
    """After a lean step every layer's q/k/v and gate/up are one stack each, whose rows ARE the Linears'
    weights (and Qwen2's biases): no parameter memory added; the step equals transformers' (fp64)."""
    model = tiny_target(arch)
    before = sum(_storages(model).values())
    lean, hf = _step(model)
    torch.testing.assert_close(lean, hf, rtol=0, atol=1e-12)
    for layer in model.model.layers:
        stacks = fast_target._linear_stacks(layer)
        assert stacks is not None
        attn, mlp = layer.self_attn, layer.mlp
        for stack, mods in zip(
            stacks, ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
        ):
            assert stack.members == list(mods)
            for m in mods:
                assert m.weight.untyped_storage().data_ptr() == stack.weight.untyped_storage().data_ptr()
                assert not m.weight.is_inference()  # usable outside inference mode (training's features)
                if m.bias is not None:
                    assert stack.bias is not None
                    assert m.bias.untyped_storage().data_ptr() == stack.bias.untyped_storage().data_ptr()
    assert sum(_storages(model).values()) == before  # moved, not copied
    x = torch.randn(4, model.config.hidden_size, dtype=model.dtype)
    attn = model.model.layers[0].self_attn
    want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    got = fast_target._linear_stacks(model.model.layers[0])[0].whole(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # one GEMM's blocking, not three: rounding


def test_a_layer_makes_three_products_fewer_and_rotates_once(monkeypatch):
    """Counted aten ops of one lean step: stacked, a layer runs 4 products (q|k|v, o, gate|up, down) instead of
    7 and one roll (q and k together) instead of two; the outputs are the same."""
    model = tiny_target("llama")
    n_layers = model.config.num_hidden_layers
    counts, outs = {}, {}
    for stacked in ("0", "1"):
        monkeypatch.setenv("SPECDRAFT_STACKED_LINEARS", stacked)
        _step(model)  # stacks built (or not) outside the count
        with _Ops() as ops:
            outs[stacked] = _step(model)[0]
        counts[stacked] = ops.count
    torch.testing.assert_close(outs["1"], outs["0"], rtol=0, atol=1e-12)
    products = {s: c["linear"] + c["mm"] + c["addmm"] + c["matmul"] for s, c in counts.items()}
    # both counts include the causal prefixes through transformers' forward (7 products a layer, 2 prefixes)
    assert products["0"] - products["1"] == 3 * n_layers
    assert counts["0"]["roll"] - counts["1"]["roll"] == n_layers


def test_a_moved_model_is_stacked_again():
    """A `.to()` after stacking gives the Linears new weights: the stale stack is dropped and built again."""
    model = tiny_target("qwen2")
    _step(model)
    old = fast_target._linear_stacks(model.model.layers[0])
    model.to(torch.float32)
    assert old is not None and not old[0].current()
    lean, hf = _step(model)
    torch.testing.assert_close(lean, hf, rtol=1e-5, atol=1e-5)
    new = fast_target._linear_stacks(model.model.layers[0])
    assert new is not None and new[0] is not old[0] and new[0].weight.dtype == torch.float32
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == new[0].weight.untyped_storage().data_ptr()


def test_what_does_not_stack(monkeypatch):
    """Trained (requires_grad) weights, a Linear subclass, mixed biases or input widths do not stack; without the
    lean forward (`SPECDRAFT_TARGET_FORWARD=hf`) nothing is stacked and the layers keep their own weights."""
    a, b = nn.Linear(8, 4), nn.Linear(8, 2)
    assert not StackedLinear.stackable([a, b])  # trainable weights
    a.requires_grad_(False), b.requires_grad_(False)
    assert StackedLinear.stackable([a, b])
    assert not StackedLinear.stackable([a, nn.Linear(8, 2, bias=False).requires_grad_(False)])
    assert not StackedLinear.stackable([a, nn.Linear(6, 2).requires_grad_(False)])

    class Sub(nn.Linear):
        pass

    assert not StackedLinear.stackable([a, Sub(8, 2).requires_grad_(False)])
    with pytest.raises(ValueError, match="do not stack"):
        StackedLinear([a, nn.Linear(8, 2)])
    model = tiny_target("qwen2")
    monkeypatch.setenv("SPECDRAFT_TARGET_FORWARD", "hf")  # no lean forward: nothing to stack for
    ptr = model.model.layers[0].self_attn.k_proj.weight.data_ptr()
    assert fast_target.stack_linears(model) == 0
    assert model.model.layers[0].self_attn.k_proj.weight.data_ptr() == ptr


@pytest.mark.parametrize("kind", ["static", "batch"])
def test_a_decoder_stacks_the_weights_when_it_is_built(kind):
    """The decoders stack the target's weights in their constructor, before any forward: a CUDA graph keeps the
    addresses it captured, so no graph may read a weight that stacking later moves."""
    from specdraft.eval.batch_decode import BatchDecoder
    from specdraft.eval.static_decode import StaticDecoder

    model = tiny_target("qwen2")
    v = model.model.layers[2].self_attn.v_proj.weight
    before = v.data_ptr()
    StaticDecoder(model, 64) if kind == "static" else BatchDecoder(model, 2, 64)
    stacks = fast_target._linear_stacks(model.model.layers[2])
    assert stacks is not None and stacks[0].current()
    assert v.data_ptr() != before
    assert v.untyped_storage().data_ptr() == stacks[0].weight.untyped_storage().data_ptr()
