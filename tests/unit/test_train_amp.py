"""The training loop under accelerate's native bf16 AMP: `_autocast_only` drops the fp32 copy of the outputs and
changes no value, no loss and no gradient."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from specdraft.models import redrafter
from specdraft.models.base_llm import target_fingerprint
from specdraft.models.losses import distill_loss
from specdraft.testing import tiny_llama, tiny_tokenizer
from specdraft.train.config import ReDrafterSchema
from specdraft.train.loop import _autocast_only


@pytest.fixture
def bf16_accelerator():
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    yield acc
    AcceleratorState._reset_state(True)  # other tests build their own state
    GradientState._reset_state()


def test_autocast_only_keeps_bf16_outputs_with_the_same_loss_and_gradient(bf16_accelerator):
    acc = bf16_accelerator
    target = tiny_llama()
    schema = ReDrafterSchema(draft_len=3, num_layers=1)
    drafter = redrafter.build(schema, target, target_fingerprint(target, tiny_tokenizer()))
    with torch.no_grad():  # non-trivial weights (the ResBlocks start at zero)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = acc.prepare(drafter)
    g = torch.Generator().manual_seed(0)
    hidden, root = torch.randn(1, 6, 32, generator=g), torch.randint(0, 128, (1, 6), generator=g)
    targets = torch.randint(0, 128, (1, 6, 3), generator=g)

    def loss_and_grad() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model.zero_grad()
        logits = model(hidden, root, targets)  # (1, 6, 3, V)
        loss = distill_loss(logits, targets)
        loss.backward()
        return logits.detach(), loss.detach(), drafter.head.weight.grad.clone()

    ref_logits, ref_loss, ref_grad = loss_and_grad()
    assert ref_logits.dtype == torch.float32  # accelerate's wrapper: fp32(autocast(forward))
    _autocast_only(acc, model)
    logits, loss, grad = loss_and_grad()
    assert logits.dtype == torch.bfloat16  # still autocast, no fp32 copy
    assert torch.equal(logits.float(), ref_logits) and torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad)
