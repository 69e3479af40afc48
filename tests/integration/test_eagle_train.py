"""EAGLE-1 and EAGLE-3 through the real entry point (`python train.py drafter=eagle|eagle3`) on a tiny target:
train, evaluate every slot, export, reload, decode losslessly with the EAGLE-2 tree, convert to the engine layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdraft.data.chat import prompt_ids
from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.proposers import make_proposer
from specdraft.models.eagle_export import export_from_folder
from specdraft.models.hub import load_drafter
from specdraft.testing import run_tiny_train, tiny_llama, tiny_tokenizer, write_train_assets

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return write_train_assets(tmp_path_factory.mktemp("eagle_assets"), num_layers=4, num_convs=24)


@pytest.mark.parametrize(
    "drafter,extra",
    [
        ("eagle", []),
        ("eagle", ["drafter.draft_vocab_size=48"]),  # drafts over the 48 most frequent training labels
        ("eagle3", ["drafter.draft_vocab_size=48"]),
        (
            "eagle3",
            ["drafter.draft_vocab_size=48", "drafter.norm_fused=true", "drafter.draft_len=7"],
        ),  # EAGLE-3.1
    ],
)
def test_train_export_decode(assets, drafter, extra, tmp_path):
    proc = run_tiny_train(
        REPO, assets, tmp_path, drafter, f"drafter={drafter}", "optim.warmup_steps=1", "train.max_steps=6",
        "train.eval_every=6", "train.eval_batches=1", "train.ckpt_every=6", *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / drafter
    final = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval/acc1_s2" in x]
    assert final and all(
        torch.isfinite(torch.tensor(v)) for k, v in final[-1].items() if k.startswith("eval/")
    )

    target, tok = tiny_llama(num_layers=4), tiny_tokenizer()
    head = load_drafter(str(run / "export"), target=target)
    assert head.config.architecture == drafter
    assert getattr(head.config, "norm_fused", False) == ("drafter.norm_fused=true" in extra)
    assert head.draft_ids().numel() == (48 if "drafter.draft_vocab_size=48" in extra else 128)
    prompt = prompt_ids(tok, [{"role": "user", "content": "alpha beta"}])
    ref, _ = ar_generate(target, tok, prompt, 24, stop_ids=set())
    out, _ = speculative_generate(target, tok, prompt, make_proposer(head), 24, stop_ids=set())
    assert out == ref
    engine = export_from_folder(run / "export", tmp_path / "engine")
    assert (engine / "config.json").is_file() and (engine / "model.safetensors").is_file()
