"""EAGLE-1 and EAGLE-3 through the real entry point (`python train.py drafter=eagle|eagle3`) on a tiny target:
train, evaluate every slot, export, reload, decode losslessly with the EAGLE-2 tree, convert to the engine layout."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdraft.data.chat import prompt_ids
from specdraft.eval.decode import ar_generate, speculative_generate
from specdraft.eval.proposers import make_proposer
from specdraft.models.eagle_export import export_from_folder
from specdraft.models.hub import load_drafter
from specdraft.testing import tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eagle_assets")
    tiny_llama(num_layers=4).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    rng = random.Random(0)
    with (root / "convs.jsonl").open("w") as f:
        for i in range(24):
            q, a = (" ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(n)) for n in (3, 6))
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"id": str(i), "messages": msgs}) + "\n")
    return root


@pytest.mark.parametrize("drafter,extra", [("eagle", []), ("eagle3", ["drafter.draft_vocab_size=48"])])
def test_train_export_decode(assets, drafter, extra, tmp_path):
    args = [
        sys.executable, "train.py", f"drafter={drafter}",
        f"base_model.name_or_path={assets / 'target'}", "base_model.dtype=fp32", "base_model.device=cpu",
        f"data.source={assets / 'convs.jsonl'}", "data.num_samples=null", "data.val_fraction=0.125",
        "data.max_length=96", f"output_root={tmp_path}", f"name={drafter}", "drafter.draft_len=3",
        "optim.warmup_steps=1", "train.max_steps=6", "train.batch_size=4", "train.eval_every=6",
        "train.eval_batches=1", "train.ckpt_every=6", "train.progress=false", "train.cache_target_features=true",
        "logger.tensorboard=false", *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / drafter
    final = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval/acc1_s2" in x]
    assert final and all(
        torch.isfinite(torch.tensor(v)) for k, v in final[-1].items() if k.startswith("eval/")
    )

    target, tok = tiny_llama(num_layers=4), tiny_tokenizer()
    head = load_drafter(str(run / "export"), target=target)
    assert head.config.architecture == drafter
    prompt = prompt_ids(tok, [{"role": "user", "content": "alpha beta"}])
    ref, _ = ar_generate(target, tok, prompt, 24, stop_ids=set())
    out, _ = speculative_generate(target, tok, prompt, make_proposer(head), 24, stop_ids=set())
    assert out == ref
    engine = export_from_folder(run / "export", tmp_path / "engine")
    assert (engine / "config.json").is_file() and (engine / "model.safetensors").is_file()
