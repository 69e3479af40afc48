"""Cached features (data/features.py, distill/features.py): packing round trip, batching/padding, disk budget refusal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.data.features import FeatureSpec, decode_features
from specdraft.distill.features import check_disk_budget, compute_features, make_spec
from specdraft.models.base_llm import forward_with_hidden
from specdraft.testing import tiny_llama


def cfg(**kw):
    base = dict(save_hidden=True, hidden_layers=(1,), topk=3, feature_dtype="bf16")
    return SimpleNamespace(**{**base, **kw})


def test_features_match_single_forward_and_round_trip():
    model = tiny_llama()
    spec = make_spec(cfg(), model)
    seqs = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    rows = compute_features(model, seqs, spec, batch_tokens=10)  # 2 batches, right padding
    for seq, row in zip(seqs, rows):
        ref = forward_with_hidden(model, torch.tensor([seq]), layers=(1,))
        got = decode_features(row, spec.to_dict())
        assert got["hidden"].dtype == torch.bfloat16 and got["hidden"].shape == (len(seq), 32)
        torch.testing.assert_close(got["hidden"].float(), ref.hidden[0].bfloat16().float())
        torch.testing.assert_close(got["hidden_layers"][:, 0].float(), ref.layers[0, :, 0].bfloat16().float())
        logp = torch.log_softmax(ref.logits[0].float(), -1)
        assert torch.equal(got["topk_ids"], logp.topk(3, -1).indices)
        torch.testing.assert_close(got["topk_logprobs"].float(), logp.topk(3, -1).values.bfloat16().float())


def test_spec_validation_and_disk_budget(capsys):
    model = tiny_llama()
    with pytest.raises(ValueError, match="feature_dtype"):
        make_spec(cfg(feature_dtype="fp8"), model)
    with pytest.raises(ValueError, match=r"hidden_layers=\[7\]"):
        make_spec(cfg(hidden_layers=(7,)), model)
    off = FeatureSpec()
    assert check_disk_budget(off, 10**9, 10**6, 0.0) == 0.0
    spec = FeatureSpec(hidden=True, hidden_size=4096)
    gb = check_disk_budget(spec, 1000, 2048, 20.0)  # 1000 x 2048 x 8192 B
    assert gb == pytest.approx(16.777, abs=1e-3)
    assert "projected feature size" in capsys.readouterr().out
    with pytest.raises(ValueError, match="max_disk_gb=1.0"):
        check_disk_budget(spec, 1000, 2048, 1.0)
