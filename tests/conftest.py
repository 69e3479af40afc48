"""Shared fixtures: tiny offline models; the Hub is never contacted."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process: tiny models gain nothing from more, and launched subprocesses (DDP, DeepSpeed,
# kill-and-resume) inherit it, so 2 cores are never oversubscribed.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Cost curves measured by eval.node_budget=auto go to a throwaway folder, not the user's cache.
os.environ.setdefault("SPECDRAFT_COST_CURVES", tempfile.mkdtemp(prefix="specdraft_cost_curves_"))

import pytest  # noqa: E402
import torch  # noqa: E402

import specdraft.eval.graphs as _graphs  # noqa: E402

# a CUDA graph capture that fails once is a test failure (pyproject turns its warning into an error), never
# quietly taken on the retry a user's run makes
_graphs.RETRIES = 0

from specdraft.testing import tiny_llama as _tiny_llama  # noqa: E402
from specdraft.testing import tiny_tokenizer as _tiny_tokenizer  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def one_cpu_thread():
    """Pinned to the CPU, one thread (other test runs share the machine), restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Character-level tokenizer with a ChatML chat template (vocab < 128)."""
    return _tiny_tokenizer()


@pytest.fixture
def tiny_llama():
    """A tiny random GQA Llama (vocab 128, hidden 32, 2 layers), fp32, frozen."""
    return _tiny_llama()


@pytest.fixture
def tiny_llama64():
    """The same tiny Llama in fp64, for exact-equality decoding checks."""
    return _tiny_llama(dtype=torch.float64)


@pytest.fixture(scope="session")
def eval_assets(tmp_path_factory):
    """A folder with a tiny target (`target/`: model + tokenizer), a randomly initialised ReDrafter export
    (`drafter/`) and mini benchmarks (`mini_mt.jsonl`, 3 questions of 2 turns; `mini_alpaca.jsonl`)."""
    import json

    from specdraft.models import redrafter
    from specdraft.models.base_llm import target_fingerprint
    from specdraft.models.hub import export_drafter
    from specdraft.train.config import ReDrafterSchema

    root = tmp_path_factory.mktemp("eval_assets")
    target, tok = _tiny_llama(), _tiny_tokenizer()
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    schema = ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1, init_from_lm_head=True)
    drafter = redrafter.build(schema, target, target_fingerprint(target, tok))
    export_drafter(drafter, root / "drafter", {"steps": 0})
    rows = [  # short MT-Bench-style questions (the char-level tokenizer makes real prompts long)
        {"question_id": i, "category": c, "turns": [f"Say {w}.", "Again, shorter."]}
        for i, (c, w) in enumerate([("writing", "hello"), ("math", "one two"), ("writing", "yes")])
    ]
    (root / "mini_mt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "mini_alpaca.jsonl").write_text(
        json.dumps({"instruction": "List two colors.", "dataset": "x"}) + "\n"
    )
    return root
