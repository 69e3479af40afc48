"""Features captured during generation (distill/generate.py `capture`) equal a second full forward's.

The generation pass feeds prompt (prefill), g_1..g_{n-1} (decode steps) and the template tail (one forward of
the finished row on its own cache); the reference is `forward_with_hidden` / `compute_features` over the
finished sequence. Rows whose final ids differ from what generation fed must fall back to `compute_features`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdraft.conf.schema import register_configs
from specdraft.data.conversations import Conversation
from specdraft.data.features import FEATURE_DTYPES, FeatureSpec, decode_features
from specdraft.distill import generate as generate_mod
from specdraft.distill import turns
from specdraft.distill.features import capture_wanted, compute_features, feature_tensors
from specdraft.distill.generate import Captured, Generation, GenerationSettings, generate_batched
from specdraft.distill.run import distill
from specdraft.distill.shards import load_distilled
from specdraft.distill.turns import build_rows
from specdraft.models.base_llm import forward_with_hidden
from specdraft.testing import random_prompts, tiny_llama, tiny_target, tiny_tokenizer

STOP = (20, 104, 120)  # ids the seeded tiny target emits (at the first token, mid-sequence) for some prompts
CONVS = [
    Conversation("a", [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "x"},
                       {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "y"}]),
    Conversation("b", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a longer question"},
                       {"role": "assistant", "content": "z"}]),
    Conversation("c", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "w"}]),
    Conversation("d", [{"role": "user", "content": "why " * 6}, {"role": "assistant", "content": "v"}]),
]  # fmt: skip


def full_forward(model, ids: list[int], spec: FeatureSpec) -> dict[str, torch.Tensor]:
    """Reference features of one finished sequence: a single cache-free forward."""
    res = forward_with_hidden(model, torch.tensor([ids]), layers=spec.layers, logits=False)
    layers = res.layers[0] if res.layers is not None else None
    return feature_tensors(model, res.hidden[0], layers, spec)


def same_tails(tokens: list[int], reason: str) -> list[int]:
    return [7, 8] if reason == "eos" else tokens[-1:] + [9]


def ragged_tails(tokens: list[int], reason: str) -> list[int]:
    """Tails of 0 to 4 ids: rows finishing at one step are fed together, right-padded to the longest."""
    if reason == "eos":
        return [7] if tokens[0] % 2 else []
    return tokens[-1:] + [9, 10, 11][: tokens[0] % 4]


@pytest.mark.parametrize(
    "batch_tokens,max_batch_size,refill,tail",
    [
        (10**6, 32, True, same_tails),
        (60, 3, True, same_tails),
        (60, 3, False, same_tails),
        (10**6, 32, True, ragged_tails),
        (60, 3, True, ragged_tails),
    ],
    ids=["one-batch", "refill", "static", "one-batch-ragged-tails", "refill-ragged-tails"],
)
def test_generation_capture_equals_full_forward_fp64(monkeypatch, batch_tokens, max_batch_size, refill, tail):
    """fp64 features of prompt + generated + tail ids agree with one full forward to 1e-9; tokens unchanged."""
    monkeypatch.setitem(FEATURE_DTYPES, "fp64", torch.float64)  # keep fp64 (stored features are 16-bit)
    model = tiny_target()
    spec = FeatureSpec(hidden=True, layers=(0, 2), topk=4, dtype="fp64", hidden_size=32)
    prompts = random_prompts([1, 3, 9, 14, 5, 7, 11, 2], seed=2)
    budgets = [1, 12, 5, 12, 1, 9, 12, 3] if tail is same_tails else [4, 12, 12, 12, 12, 12, 12, 12]
    s = GenerationSettings(
        stop_ids=STOP, batch_tokens=batch_tokens, max_batch_size=max_batch_size, refill=refill
    )

    calls: list[list[int]] = []  # tail lengths per batched tail forward
    real = generate_mod._tail_features

    def spy(model, cache, mask, pos, rows, tails, capture):
        calls.append([len(t) for t in tails])
        return real(model, cache, mask, pos, rows, tails, capture)

    monkeypatch.setattr(generate_mod, "_tail_features", spy)
    if tail is ragged_tails:
        monkeypatch.setattr(generate_mod, "CHUNK", 5)  # a forward's rows' features taken over several chunks
    got = generate_batched(model, prompts, s, budgets, capture=spec, tail=tail)
    ref = generate_batched(model, prompts, s, budgets)
    assert [(g.tokens, g.finish_reason) for g in got] == [(g.tokens, g.finish_reason) for g in ref]
    assert {g.finish_reason for g in got} == {"eos", "length"}
    if batch_tokens > 1000:  # one batch: rows finishing at the same step share one tail forward
        assert any(len(c) > 1 for c in calls), calls
        if tail is ragged_tails:
            assert any(len(set(c)) > 1 for c in calls), calls  # of different lengths (right padding)
    for p, g in zip(prompts, got):
        assert g.captured is not None
        assert g.captured.ids == p + g.tokens[:-1] + tail(g.tokens, g.finish_reason)
        want = full_forward(model, g.captured.ids, spec)
        assert set(g.captured.tensors) == set(want)
        for k in ("hidden", "hidden_layers", "topk_logprobs"):
            assert g.captured.tensors[k].dtype == torch.float64
            torch.testing.assert_close(g.captured.tensors[k], want[k], atol=1e-9, rtol=0)
        assert torch.equal(g.captured.tensors["topk_ids"], want["topk_ids"])


def tiny_setup() -> tuple:
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), num_layers=3, dtype=torch.float64)
    spec = FeatureSpec(hidden=True, layers=(1, 3), topk=5, dtype="bf16", hidden_size=32)
    s = GenerationSettings(
        max_new_tokens=10, stop_ids=(tok.eos_token_id, 54, 84), pad_id=tok.pad_token_id, max_batch_size=3
    )  # 54, 84: chars the seeded model emits mid-answer for some rows (eos finishes on non-template stops)
    return tok, model, spec, s


def assert_same_features(got: dict, want: dict, spec: FeatureSpec) -> None:
    """Decoded 16-bit features agree (one bf16 step at most) and the top-k ids are equal."""
    a, b = decode_features(got, spec), decode_features(want, spec)
    assert a.keys() == b.keys() and a["hidden"].dtype == torch.bfloat16  # stored dtype unchanged
    for k in ("hidden", "hidden_layers", "topk_logprobs"):
        torch.testing.assert_close(a[k], b[k])
    assert torch.equal(a["topk_ids"], b["topk_ids"])


@pytest.mark.parametrize("max_turns,max_length", [(1, 512), (2, 512), (2, 56)])
def test_build_rows_capture_equals_compute_features(max_turns, max_length):
    """Every row (eos and budget finishes, two turns, rows cut at max_length) takes the captured features."""
    tok, model, spec, s = tiny_setup()
    rows, _, stats = build_rows(model, tok, CONVS, s, True, max_turns, max_length, T=3, capture=spec)
    plain, _, plain_stats = build_rows(model, tok, CONVS, s, True, max_turns, max_length, T=3)
    assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in plain]
    assert stats["features_captured"] == len(rows) == len(CONVS) and "features_captured" not in plain_stats
    assert max(len(r["input_ids"]) for r in rows) == max_length or max_length == 512  # 56: a row is cut
    reasons = Counter(f for r in rows for f in r["finish_reasons"])
    assert reasons["eos"] > 0 and reasons["length"] > 0
    want = compute_features(model, [r["input_ids"] for r in plain], spec, batch_tokens=64)
    for row, ref in zip(rows, want):
        assert_same_features(row, ref, spec)


def test_retokenize_mismatch_falls_back(monkeypatch):
    """An answer whose text re-tokenises differently (the chars of `<pad>` -> one special token) gets none."""
    tok, model, spec, s = tiny_setup()
    chars = [tok.convert_tokens_to_ids(c) for c in "ok <pad>"]

    def stub(model, prompts, settings, max_new_tokens=None, generator=None, on_tokens=None, **kw):
        gens = generate_batched(model, prompts, settings, max_new_tokens, generator, on_tokens, **kw)
        tokens = chars + [tok.eos_token_id]  # as if generated one char at a time
        ids = list(prompts[0]) + tokens[:-1] + kw["tail"](tokens, "eos")
        gens[0] = Generation(tokens, "eos", Captured(ids, full_forward(model, ids, spec)))
        return gens

    monkeypatch.setattr(turns, "regenerate", functools.partial(turns.regenerate, generate_fn=stub))
    s = dataclasses.replace(s, stop_ids=(tok.eos_token_id,))  # the other rows: budget finishes, no mismatch
    rows, _, stats = build_rows(model, tok, CONVS, s, True, 1, 512, T=3, capture=spec)
    assert stats["retokenize_mismatch"] == 1 and stats["features_captured"] == len(CONVS) - 1
    assert rows[0]["id"] == "a" and "hidden" not in rows[0] and all("hidden" in r for r in rows[1:])


def test_distill_run_capture_on_and_off_give_the_same_shards(tmp_path):
    """`distill(cfg)` end to end: same rows and features with `distill.capture_features` on and off."""
    tok = tiny_tokenizer()
    tiny_llama(vocab_size=len(tok), num_layers=3).save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    turn = [{"from": "human", "value": "question"}, {"from": "gpt", "value": "a"}]
    lines = [
        json.dumps({"id": f"c{i}", "conversations": [{**turn[0], "value": f"q {i}"}, turn[1]]})
        for i in range(5)
    ]
    (tmp_path / "convs.jsonl").write_text("\n".join(lines) + "\n")
    conf_dir = str(Path(__file__).resolve().parents[2] / "conf")
    register_configs()
    out = {}
    for on in (True, False):
        with initialize_config_dir(conf_dir, version_base="1.3"):
            cfg = compose("config", overrides=[
                f"base_model.name_or_path={tmp_path / 'target'}", "base_model.dtype=fp32", "base_model.device=cpu",
                f"data.source={tmp_path / 'convs.jsonl'}", "data.num_samples=null", "data.max_length=128",
                f"distill.out_dir={tmp_path / str(on)}", "distill.num_samples=null", "distill.max_new_tokens=8",
                "distill.shard_size=3", "distill.save_hidden=true", "distill.hidden_layers=[2]", "distill.topk=3",
                f"distill.capture_features={str(on).lower()}",
            ])  # fmt: skip
        out[on] = load_distilled(distill(cfg))
    (ds_on, man_on), (ds_off, man_off) = out[True], out[False]
    assert man_on["counts"]["features_captured"] == 5 and man_on["counts"]["features_recomputed"] == 0
    assert man_off["counts"]["features_recomputed"] == 5 and "features_captured" not in man_off["counts"]
    assert man_on["features"] == man_off["features"] and ds_on.column_names == ds_off.column_names
    spec = FeatureSpec(**{**man_on["features"], "layers": tuple(man_on["features"]["layers"])})
    for a, b in zip(ds_on.to_list(), ds_off.to_list()):
        assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
        assert_same_features(a, b, spec)


def test_capture_auto_captures_on_a_cpu_only() -> None:
    """`distill.capture_features`: auto captures on a CPU and takes a second forward on a GPU; true/false force."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no CUDA
    assert capture_wanted("auto", cpu) and not capture_wanted("auto", gpu)
    for v in (True, "true", "True"):  # Hydra hands `true` to the str field as "True"
        assert capture_wanted(v, cpu) and capture_wanted(v, gpu)
    for v in (False, "false", "False"):
        assert not capture_wanted(v, cpu) and not capture_wanted(v, gpu)
    with pytest.raises(ValueError, match="distill.capture_features='maybe' is not one of auto"):
        capture_wanted("maybe", cpu)
