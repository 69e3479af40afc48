"""Tiny offline models and tokenizers for tests and examples (no network, builds in milliseconds)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import string
import subprocess
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdraft.eval.fallback import FallbackController
from specdraft.eval.tree import DraftTree, ProposerSpec, pack_beams

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


def load_script(path: Path) -> ModuleType:
    """Import a file of `scripts/` (not part of the package) as a module, e.g. to call its `main(argv)`."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def chi_square_pvalue(counts: Counter, expected: dict, n: int) -> float:
    """Pearson chi-square p-value of `n` draws' `counts` against `expected` probabilities (same keys); cells
    expected fewer than 5 times are pooled, together with draws of keys `expected` does not hold."""
    obs: list[float] = []
    exp: list[float] = []
    pool_o, pool_e = 0.0, 0.0
    for key, p in expected.items():
        if p * n < 5:
            pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + p * n
        else:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
    unknown = sum(c for k, c in counts.items() if k not in expected)
    obs.append(pool_o + unknown)
    exp.append(max(pool_e, 1e-9))
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    df = torch.tensor((len(obs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def broken_bonus_rule(
    tree: Any,
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, int]:
    """`verify.sample_verify` with its bonus token drawn from the target's p instead of the residual: a wrong rule
    the chi-square sampling tests must reject (their harness's sensitivity)."""
    from specdraft.eval.verify import sample_verify

    path, _ = sample_verify(tree, logits, temperature, top_k, top_p, generator)
    probs = (logits[path[-1]] / temperature).softmax(-1)
    return path, int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def exact_first_two(
    model: torch.nn.Module, prompt: torch.Tensor, temperature: float
) -> dict[tuple[int, int], float]:
    """The target's exact probability of every first two sampled tokens (a, b) after `prompt` (L,) at
    `temperature`, from two forwards over its whole (small) vocabulary: the expected cells of the chi-square
    sampling tests."""
    p1 = (model(prompt[None]).logits[0, -1] / temperature).softmax(-1)  # (V,)
    v = p1.shape[0]
    seqs = torch.cat([prompt.expand(v, -1), torch.arange(v)[:, None]], 1)  # (V, L+1)
    p2 = (model(seqs).logits[:, -1] / temperature).softmax(-1)  # (V, V)
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(v) for b in range(v)}


def peaked_tiny_target() -> torch.nn.Module:
    """An 8-token tiny Llama whose LM-head rows are scaled x3: peaked enough that a drafter's tokens are sometimes
    kept and often rejected (the chi-square sampling tests' target)."""
    target = tiny_llama(vocab_size=8, hidden_size=32, seed=5)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    return target


def check_sampling_keeps_distribution(
    target: torch.nn.Module,
    make: Callable[[], Any],
    monkeypatch: Any,
    n: int = 1000,
    temperature: float = 0.8,
) -> None:
    """Sample the first two tokens after a fixed prompt `n` times through `StaticDecoder` with `make()`'s proposer
    drafting, and assert: drafted tokens were both kept and rejected (5-90% of n); the pairs follow the target's
    own distribution (chi-square against `exact_first_two`, p > 1e-3); and the same harness rejects
    `broken_bonus_rule` (p < 1e-4), so it can tell. `monkeypatch`: pytest's, to swap the rule in.

    Args:
        target: a small-vocabulary target (`peaked_tiny_target`); make: a fresh proposer over it, capped by hand
            (sampling fits no node budget).
    """
    import specdraft.eval.static_decode as static_decode
    from specdraft.eval.static_decode import StaticDecoder

    prompt = torch.tensor([1, 4, 2, 4, 2])
    expected = exact_first_two(target, prompt, temperature)

    def counts() -> tuple[Counter, int]:
        proposer, dec, g = make(), StaticDecoder(target, 64), torch.Generator().manual_seed(3)
        seen: Counter = Counter()
        kept = 0
        for _ in range(n):
            out, stats = dec.speculative_generate(None, prompt, proposer, 2, temperature, set(), generator=g)
            seen[tuple(out)] += 1
            kept += sum(stats.accepted)
        return seen, kept

    seen, kept = counts()
    assert 0.05 * n < kept < 0.9 * n, kept
    assert chi_square_pvalue(seen, expected, n) > 1e-3
    monkeypatch.setattr(static_decode, "sample_verify", broken_bonus_rule)
    seen, _ = counts()
    assert chi_square_pvalue(seen, expected, n) < 1e-4


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer (printable ASCII + ChatML specials, vocab < 110) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # type: ignore[assignment]
    tk.decoder = decoders.Fuse()  # type: ignore[assignment]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_llama(
    vocab_size: int = 128,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> LlamaForCausalLM:
    """A randomly initialised GQA Llama in eval mode with grads off (deterministic for a given seed)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).to(dtype)  # type: ignore[arg-type]  # transformers' `@wraps(nn.Module.to)` stub
    # Random init gives near-uniform logits; sharpen them so greedy paths are not all near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.eval()
    model.requires_grad_(False)
    return model


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths (token ids 5..127: clear of the tiny vocabulary's special ids)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 128, (n,), generator=g).tolist() for n in lengths]


def tiny_target(arch: str = "llama", device: torch.device | str = "cpu") -> torch.nn.Module:
    """A tiny frozen fp64 target for exact decoding checks: `tiny_llama` (3 layers), or a Qwen2 / Mistral of
    the same sizes (vocab 128, hidden 32, GQA 4/2 heads) with the same sharpened LM head, on `device`."""
    if arch == "llama":
        return tiny_llama(num_layers=3, dtype=torch.float64).to(device)  # type: ignore[arg-type]  # `@wraps` stub
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kw: dict[str, Any] = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=3, pad_token_id=0,
    )  # fmt: skip
    if arch == "qwen2":
        model: torch.nn.Module = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **kw))
    else:
        raise ValueError(f"tiny_target: arch={arch!r}, expected llama | qwen2 | mistral")
    with torch.no_grad():
        cast(torch.nn.Linear, model.lm_head).weight.mul_(8.0)
    return model.double().eval().requires_grad_(False).to(device)


def check_static_equals_ar(
    decoder: Any, model: torch.nn.Module, proposer: Any, reference: Any = None, vocab: int = 128
) -> list[Any]:
    """Assert a `StaticDecoder`'s speculative output equals AR and the dynamic path's, step for step.

    Prompts of 3 and 17 tokens, 24 new tokens, without and with a stop token hit mid-way; the dynamic path
    (`eval.decode.speculative_generate`) runs `reference` (default: the same proposer).

    Returns:
        the decoder's `DecodeStats` of every call.
    """
    from specdraft.eval.decode import ar_generate, speculative_generate

    out_stats = []
    for prompt_len in (3, 17):
        prompt = torch.randint(5, vocab, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        full, _ = ar_generate(model, None, prompt, 24, stop_ids=set())
        for stop in (set(), {full[9]}):
            ref, _ = ar_generate(model, None, prompt, 24, stop_ids=stop)
            out, stats = decoder.speculative_generate(None, prompt, proposer, 24, stop_ids=stop)
            old, old_stats = speculative_generate(
                model, None, prompt, reference or proposer, 24, stop_ids=stop
            )
            assert out == ref == old
            assert stats.accepted == old_stats.accepted  # same trees, same acceptance on both paths
            assert stats.finish_reason == ("stop" if stop else "length")
            out_stats.append(stats)
    return out_stats


def check_trees_lossless(model: torch.nn.Module, new_tokens: int = 30, vocab: int = 96) -> None:
    """Assert greedy speculative decoding equals the decoder's own AR on the eager and the fixed-shape static
    paths: random trees (mostly rejected) and oracle beams (long accepted paths), prompts of 1 and 9 tokens."""
    from specdraft.eval.static_decode import StaticDecoder

    for shape in ("eager", "fixed"):
        dec = StaticDecoder(model, 64, static=shape == "fixed")
        for prompt_len in (1, 9):
            prompt = torch.randint(
                0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)
            )
            ref, _ = dec.ar_generate(None, prompt, new_tokens, stop_ids=set())
            random_tree = RandomTreeProposer(vocab, seed=prompt_len)
            assert dec.speculative_generate(None, prompt, random_tree, new_tokens, stop_ids=set())[0] == ref
            oracle = OracleBeamProposer(ref, prompt_len, vocab=vocab)
            out, stats = dec.speculative_generate(None, prompt, oracle, new_tokens, stop_ids=set())
            assert out == ref and stats.tokens_per_step > 1.8, shape


def write_train_assets(
    root: Path, num_layers: int = 2, num_convs: int = 48, words: Sequence[str] = ("alpha", "beta", "gamma")
) -> Path:
    """A tiny target folder (`root/target`: `tiny_llama` + `tiny_tokenizer`) and `root/convs.jsonl`, synthetic
    one-exchange conversations (a 3-word question, a 6-word answer drawn from `words`, seed 0). Returns root."""
    tiny_llama(num_layers=num_layers).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    rng = random.Random(0)
    with (root / "convs.jsonl").open("w") as f:
        for i in range(num_convs):
            q, a = (" ".join(rng.choice(list(words)) for _ in range(n)) for n in (3, 6))
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"id": str(i), "messages": msgs}) + "\n")
    return root


def run_tiny_train(
    repo: Path, assets: Path, output_root: Path, name: str, *extra: str, timeout: int = 300
) -> subprocess.CompletedProcess:
    """`python train.py` (from the source checkout `repo`) on `write_train_assets` output, offline, 1 thread.

    The fixed overrides point at the tiny target and conversations and keep the run small and quiet; `extra`
    adds the drafter, schedule and evaluation settings (a key given twice is a Hydra error).
    """
    args = [
        sys.executable, "train.py",
        f"base_model.name_or_path={assets / 'target'}", "base_model.dtype=fp32", "base_model.device=cpu",
        f"data.source={assets / 'convs.jsonl'}", "data.num_samples=null", "data.val_fraction=0.125",
        "data.max_length=96", f"output_root={output_root}", f"name={name}", "drafter.draft_len=3",
        "train.batch_size=4", "train.progress=false", "train.cache_target_features=true",
        "logger.tensorboard=false", *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


# ---- proposers for decoder tests (lossless checks need no trained drafter) ------------------------
FAMILIES = (
    "redrafter", "redrafter_context", "redrafter_copy", "medusa", "medusa_root", "medusa_copy", "eagle",
    "eagle_vocab", "eagle3", "eagle_int8", "eagle3_int8", "eagle_copy", "eagle3_copy", "redrafter_int8", "lookup",
)  # fmt: skip


def saved_without(model: Any, folder: Path, key: str) -> Path:
    """`model.save_pretrained(folder)` with `key` dropped from its config.json: an export from before that field
    was added (older exports must still load). Returns `folder`."""
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop(key)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def jitter(module: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    """Random non-identity weights (identity-initialised heads would all draft the same token)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module


def on_int8_grid(module: torch.nn.Module) -> None:
    """Round every Linear's weight in `module` to its int8 grid (one scale per row, max|w_row| / 127, as the native
    drafts' copies store it), so their products equal torch's up to float rounding where the activations stay
    fp32 (a CPU without VNNI, or inner sizes it does not take): the copies' own quantiser, dequantised."""
    from specdraft.eval.native_chain import rows_int8

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                q, s = rows_int8(m.weight)  # (N, K) int8, (N,) row scales
                m.weight.copy_(q.to(m.weight.dtype) * s.to(m.weight.dtype)[:, None])


def tiny_proposer(family: str, target: torch.nn.Module, static: bool = False, graphs: bool = False) -> Any:
    """A randomly initialised drafter of `family` (one of `FAMILIES`; "redrafter_copy": the copy gate without
    prefix attention; "medusa_root": Medusa heads that read the root token; "medusa_copy": those with a copy gate
    (`models/medusa_copy.py`); "eagle_vocab": EAGLE-1 drafting over
    64 of the 128 tokens; "eagle_int8" / "eagle3_int8" / "eagle3_fused": the head's layer run
    as int8 / fused products (`eval.draft_block`); "eagle_copy" / "eagle3_copy": the head with a copy gate;
    "redrafter_int8": the copy-gate ReDrafter searching through int8 products (`eval/int8_clone.py`);
    "lookup": prompt lookup of 4 tokens) on a
    `tiny_target`, in the target's dtype, behind its real decoding proposer (seed 1: the same drafter every
    call). Small trees (10-12 nodes, depth 4) so lossless checks run in milliseconds. `static` / `graphs`: the
    fixed-shape draft step and its CUDA graph (`make_proposer`; graphs only with the target on CUDA)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from transformers import PreTrainedModel

    from specdraft.eval.proposers import PromptLookupProposer, ReDrafterProposer, make_proposer
    from specdraft.models import eagle, eagle3, medusa, redrafter
    from specdraft.models.base_llm import target_fingerprint
    from specdraft.train.config import ReDrafterSchema

    if family == "lookup":
        return PromptLookupProposer(4)
    torch.manual_seed(1)
    model = cast(PreTrainedModel, target)
    fp = target_fingerprint(model, tiny_tokenizer())
    dtype = next(target.parameters()).dtype

    def ready(drafter: torch.nn.Module, scale: float) -> torch.nn.Module:
        dev = next(target.parameters()).device  # the target's device and dtype, as `load_drafter` places it
        return jitter(drafter.to(device=dev, dtype=dtype).eval(), scale)  # random non-identity weights

    if family.startswith("redrafter"):  # copy: the copy gate alone
        extra: dict[str, Any] = {
            "redrafter": {},
            "redrafter_context": dict(context_heads=2, context_dim=16, copy_ngram=3),
            "redrafter_copy": dict(copy_ngram=3),
            "redrafter_int8": dict(copy_ngram=3),
        }[family]
        d = redrafter.build(ReDrafterSchema(draft_len=3, beam_width=4, num_layers=1, **extra), model, fp)
        int8 = family == "redrafter_int8"
        return ReDrafterProposer(
            ready(d, 0.05), beam_width=4, beam_length=4, static=static, graphs=graphs, int8_layers=int8
        )
    if family in ("medusa", "medusa_root", "medusa_copy"):
        schema = OmegaConf.create(
            {"draft_len": 3, "num_layers": 1, "loss_decay": 0.8, "init_from_lm_head": True, "topk": 4,
             "tree_choices": None, "root_token": family != "medusa", "copy_hidden": 8, "copy_scale": 8.0,
             "copy_ngram": 3 if family == "medusa_copy" else 0}
        )  # fmt: skip
        return make_proposer(
            ready(medusa.build(schema, model, fp), 0.05), tree_nodes=12, static=static, graphs=graphs
        )
    if family in (
        "eagle",
        "eagle_vocab",
        "eagle3",
        "eagle_int8",
        "eagle3_int8",
        "eagle3_fused",
        "eagle_copy",
        "eagle3_copy",
    ):
        vocab = 64 if family == "eagle_vocab" else None  # the most frequent half of random counts
        eagle_schema = SimpleNamespace(
            draft_len=3, tree_total_tokens=10, tree_depth=4, tree_top_k=3, fc_bias=True, feature_weight=1.0,
            token_weight=0.1, noise=0.0, target_layers=None, draft_vocab_size=vocab, ttt_decay=0.8,
            copy_ngram=3 if family.endswith("_copy") else 0, copy_hidden=8, copy_scale=8.0,
        )  # fmt: skip
        module = eagle3 if family.startswith("eagle3") else eagle
        counts = torch.rand(int(fp["vocab_size"]), generator=torch.Generator().manual_seed(2))  # (V,)
        built = module.build(eagle_schema, model, fp, token_counts=counts)
        block = family.rpartition("_")[2] if family.endswith(("_int8", "_fused")) else "hf"
        return make_proposer(
            ready(built, 0.2), tree_nodes=10, draft_block=block, static=static, graphs=graphs
        )
    raise ValueError(f"tiny_proposer: family={family!r}, expected one of {', '.join(FAMILIES)}")


def tiny_proposer_factory(
    family: str, target: torch.nn.Module, static: bool = False, graphs: bool = False
) -> Callable[[], Any]:
    """Fresh proposers around ONE tiny drafter of `family` (as `tiny_proposer`), one per call, as evaluate.py
    makes one per batch row (`partial(make_proposer, drafter, ...)`), so rows can be drafted together
    (`eval.decode.RowBatchedProposer`); "+lookup" suffix: each behind a 4-token `LookupBranch`. `static` /
    `graphs`: the fixed-shape draft steps (and CUDA graphs), as the batched decoder's graph path builds them."""
    from specdraft.eval.hybrid import LookupBranch
    from specdraft.eval.proposers import PromptLookupProposer, ReDrafterProposer, make_proposer

    name, lookup = family.removesuffix("+lookup"), family.endswith("+lookup")
    inner: Callable[[], Any]
    if name == "lookup":
        inner = lambda: PromptLookupProposer(4)  # noqa: E731
    else:
        drafter = tiny_proposer(name, target).drafter
        if name.startswith("redrafter"):
            int8 = name == "redrafter_int8"
            inner = lambda: ReDrafterProposer(  # noqa: E731
                drafter, beam_width=4, beam_length=4, int8_layers=int8, static=static, graphs=graphs
            )
        else:
            nodes = 12 if name.startswith("medusa") else 10
            block = name.rpartition("_")[2] if name.endswith(("_int8", "_fused")) else "hf"
            inner = lambda: make_proposer(  # noqa: E731
                drafter, tree_nodes=nodes, draft_block=block, static=static, graphs=graphs
            )
    return (lambda: LookupBranch(inner(), 4)) if lookup else inner


def graph_rows_match_eager(
    family: str,
    model: torch.nn.Module,
    steps: list[list[tuple[torch.Tensor, torch.Tensor]]],
    same: Callable[[Any, Any], None],
    eager_early_stop: bool = True,
) -> list[Any]:
    """Three batch rows of `family`'s static proposers drafting with CUDA graphs and three eager ones, fed the
    same `steps` (per step, per row: (hidden, tokens); each row sits out every fourth step): `same(graph_tree,
    eager_tree)` for every tree of `propose_rows`. `eager_early_stop=False`: the eager rows' EAGLE expansion
    without early stop (off under graphs too). Returns the graph rows (their shared state holds the graphs)."""
    graph_factory = tiny_proposer_factory(family, model, static=True, graphs=True)  # one drafter for the rows
    graph_rows = [graph_factory() for _ in range(3)]  # (seed 1: the eager rows' drafter has its weights)
    eager_factory = tiny_proposer_factory(family, model, static=True)
    eager_rows = [eager_factory() for _ in range(3)]
    for p in eager_rows if not eager_early_stop else []:
        p.early_stop = False
    assert all(p.graphs for p in graph_rows) and not any(p.graphs for p in eager_rows)
    for s, step in enumerate(steps):
        rows = [r for r in range(3) if (s + r) % 4 != 3]
        h, t = [step[r][0] for r in rows], [step[r][1] for r in rows]
        got = graph_rows[rows[0]].propose_rows([graph_rows[r] for r in rows], h, t)
        want = eager_rows[rows[0]].propose_rows([eager_rows[r] for r in rows], h, t)
        assert got is not None and want is not None
        for a, b in zip(got, want, strict=True):
            same(a, b)
    return graph_rows


class RandomTreeProposer:
    """Random trees of random size over the whole vocabulary (mostly rejected drafts)."""

    spec = ProposerSpec()  # reads the last layer; declares no depth or budget
    last_compression: float | None = None

    def __init__(self, vocab: int, max_nodes: int = 12, seed: int = 0) -> None:
        self.vocab, self.max_nodes, self.g = vocab, max_nodes, torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        pass

    def fit_budget(self, nodes: int) -> None:
        """Trees are cut by the decoder; nothing to change here."""

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        """A random tree of 1..max_nodes nodes rooted at the last token; `hidden` (n, H), `tokens` (n,)."""
        n = int(torch.randint(1, self.max_nodes + 1, (1,), generator=self.g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=self.g)) for i in range(1, n)]
        toks = torch.randint(0, self.vocab, (n,), generator=self.g)
        toks[0] = tokens[-1]
        return DraftTree(toks, torch.tensor(parents))


class OracleBeamProposer:
    """Beams that contain the true AR continuation (cut at a random depth) among random beams, packed by
    dedup - exercises long accepted paths, branch choice and scattered KV compaction. With `wrong` set, every
    beam's first draft differs from the true next token, so nothing is ever accepted."""

    wrong = False  # set it (on the class or an instance) for drafts that never pay

    spec = ProposerSpec()  # reads the last layer; declares no depth or budget
    last_compression: float | None = None

    def __init__(
        self,
        reference: list[int],
        prompt_len: int,
        width: int = 4,
        length: int = 5,
        seed: int = 0,
        vocab: int = 96,
    ) -> None:
        self.ref, self.prompt_len, self.width, self.length = reference, prompt_len, width, length
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        self.seen = 0

    def fit_budget(self, nodes: int) -> None:
        """Trees are cut by the decoder; nothing to change here."""

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        """Beams around the reference continuation, packed as a tree; `hidden` (n, H), `tokens` (n,) committed."""
        assert hidden.shape[0] == tokens.shape[0]
        self.seen += tokens.shape[0]
        done = self.seen - (self.prompt_len - 1)  # generated tokens committed so far (root included)
        beams = torch.randint(0, self.vocab, (self.width, self.length), generator=self.g)
        truth = torch.tensor((self.ref[done : done + self.length - 1] + [0] * self.length)[: self.length - 1])
        cut = int(torch.randint(0, self.length, (1,), generator=self.g))
        w = int(torch.randint(0, self.width, (1,), generator=self.g))
        beams[w, 1 : 1 + cut] = truth[:cut]
        beams[(w + 1) % self.width, 1:3] = beams[w, 1:3]  # a shared prefix with another beam
        if self.wrong and self.length > 1:
            beams[:, 1] = (truth[0] + 1) % self.vocab
        beams[:, 0] = tokens[-1]
        tree, self.last_compression = pack_beams(beams)
        return tree


class HostReads(TorchFunctionMode):
    """Counts torch calls that read a tensor's values on the host (`item`, `tolist`, `bool`, `int`, `nonzero`,
    `torch.equal`, boolean-mask indexing, ...): each is a device sync on a GPU, and inside a step a CUDA graph
    captures, a failed capture. A CPU stand-in for `torch.cuda.set_sync_debug_mode`; `sites` counts them by
    the specdraft line that made them. Set `active` False to pause counting."""

    READS = frozenset(
        {
            torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
            torch.Tensor.__float__, torch.Tensor.__index__, torch.equal, torch.Tensor.nonzero, torch.nonzero,
            torch.Tensor.cpu, torch.Tensor.numpy, torch.masked_select, torch.Tensor.masked_select,
        }
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.count, self.active, self.sites = 0, True, Counter[str]()
        # Python numbers assigned into indexed tensors (`t[0] = 0.0`): a host-to-device copy on a GPU, which a
        # CUDA graph capture refuses (`t[:1].fill_(0.0)` is none); counted apart, with their sites
        self.scalar_writes, self.write_sites = 0, Counter[str]()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (
            self.active
            and func is torch.Tensor.__setitem__
            and len(args) > 2
            and isinstance(args[2], (int, float, bool))
        ):
            self.scalar_writes += 1
            here = [
                f
                for f in traceback.extract_stack()[:-1]
                if "specdraft" in f.filename or "/eval/" in f.filename
            ]
            self.write_sites[f"{here[-1].filename}:{here[-1].lineno}" if here else "?"] += 1
        if self.active and (func in self.READS or self._bool_index(func, args)):
            self.count += 1
            here = [
                f
                for f in traceback.extract_stack()[:-1]
                if "specdraft" in f.filename or "/eval/" in f.filename
            ]
            self.sites[
                f"{func.__name__} @ {here[-1].filename}:{here[-1].lineno}" if here else func.__name__
            ] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _bool_index(func: Any, args: tuple) -> bool:
        """Indexing with a boolean mask (a data-dependent shape)."""
        if func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) or len(args) < 2:
            return False
        idx = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)


class KernelCount(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (views, metadata ops and no-op casts excluded), by op: a CPU
    stand-in for the kernel launches of a step on a GPU, where a small model's step (and a graph's replay) costs
    a few microseconds per launch whatever the work (`scripts/gpu/kernel_counts.py`)."""

    FREE = frozenset(
        {
            "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "select", "slice", "unsqueeze",
            "squeeze", "alias", "permute", "t", "transpose", "detach", "as_strided", "flatten", "unbind",
            "split", "lift_fresh", "empty", "empty_like", "unfold", "view_as",
        }
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.active = Counter[str](), True  # `active` False: not counting (e.g. inside a forward)

    @property
    def count(self) -> int:
        """Kernel launches counted so far."""
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        no_op_cast = name in ("to", "_to_copy", "contiguous") and args and out is args[0]
        if self.active and name not in self.FREE and not no_op_cast:
            self.ops[name] += 1
        return out


class ScriptedFallback(FallbackController):
    """A fallback controller that drafts on a fixed pattern of "D" (draft) and "." (a plain target step),
    repeated: every transition exercised deterministically."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self.i = 0

    def should_draft(self) -> bool:
        """Whether this step drafts: the pattern's next character is "D"."""
        d = self.pattern[self.i % len(self.pattern)] == "D"
        self.i += 1
        return d
