"""Response-length prediction in buckets (S3, Jin et al. 2023) for the length-aware batch scheduler.

A linear probe (softmax regression over standardised features) maps a cheap signal of a prompt to a bucket of
the target's greedy response length. Buckets are half-open ranges cut at `edges`, e.g. edges (32, 64, 128):
[0, 32), [32, 64), [64, 128), [128, inf); with distill's max_new_tokens = 128 the last bucket is "ran to
the cap". Signals (`prompt_features`), cheapest first:

    length  [log(1 + P)]                                   no target compute
    embed   [mean input embedding of the prompt (H); log(1 + P)]   an embedding lookup
    hidden  [target last-layer state at the last prompt position (H); log(1 + P)]   one prompt forward

The scheduler ranks requests by the expected length `probs @ bucket_lengths` (each bucket's median training
length). Saved as one safetensors file (weights + standardisation) whose metadata holds the JSON config,
written atomically; `load_length_predictor(path)` reads it back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn
from transformers import PreTrainedModel

from specdraft.models.base_llm import forward_with_hidden
from specdraft.utils import atomic_write_bytes

FORMAT_VERSION = 1
DEFAULT_EDGES = (32, 64, 128)  # response-length bucket edges in tokens
SIGNALS = ("length", "embed", "hidden")
_TENSORS = ("mean", "std", "weight", "bias", "bucket_lengths")


def bucketize(lengths: Sequence[int] | Tensor, edges: Sequence[int]) -> Tensor:
    """Bucket index of each length: the number of edges <= length.

    Args:
        lengths: (N,) response lengths in tokens.
        edges: ascending bucket edges (K - 1 of them).

    Returns:
        (N,) long bucket ids in [0, K).
    """
    x = torch.as_tensor(lengths, dtype=torch.long)
    return torch.bucketize(x, torch.tensor(list(edges), dtype=torch.long), right=True)


@torch.inference_mode()
def prompt_features(model: nn.Module, prompts: list[list[int]], signal: str) -> Tensor:
    """The predictor's input for each prompt (module docstring), fp32 on the CPU.

    Args:
        model: the target (HF causal LM).
        prompts: N prompts' token ids (chat template applied, generation header included).
        signal: `length` | `embed` | `hidden`.

    Returns:
        (N, F) features: F = 1 for `length`, H + 1 otherwise.
    """
    if signal not in SIGNALS:
        raise ValueError(f"signal={signal!r}: expected one of {', '.join(SIGNALS)}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_features: empty prompt")
    lens = torch.tensor([[math.log1p(len(p))] for p in prompts], dtype=torch.float32)  # (N, 1)
    if signal == "length":
        return lens
    lm = cast(PreTrainedModel, model)
    emb = cast(nn.Embedding, lm.get_input_embeddings())
    dev = emb.weight.device
    rows = []
    for p in prompts:
        ids = torch.tensor([p], dtype=torch.long, device=dev)  # (1, P)
        if signal == "embed":
            rows.append(emb(ids)[0].float().mean(0).cpu())  # (H,)
        else:
            rows.append(forward_with_hidden(lm, ids, logits=False).hidden[0, -1].float().cpu())  # (H,)
    return torch.cat([torch.stack(rows), lens], dim=1)  # (N, H + 1)


class LengthPredictor(nn.Module):
    """Softmax regression over standardised prompt features -> response-length bucket.

    Args:
        signal: which `prompt_features` signal it reads.
        edges: bucket edges (K - 1 ascending ints).
        mean, std: (F,) feature standardisation.
        weight: (K, F); bias: (K,).
        bucket_lengths: (K,) representative length of each bucket (median of its training lengths).
        info: free-form JSON-able metadata (training data, accuracy report).
    """

    mean: Tensor  # (F,) buffers, registered in __init__
    std: Tensor  # (F,)
    weight: Tensor  # (K, F)
    bias: Tensor  # (K,)
    bucket_lengths: Tensor  # (K,)

    def __init__(
        self,
        signal: str,
        edges: Sequence[int],
        mean: Tensor,
        std: Tensor,
        weight: Tensor,
        bias: Tensor,
        bucket_lengths: Tensor,
        info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        k, f = weight.shape
        if len(edges) != k - 1 or mean.shape != (f,) or std.shape != (f,) or bias.shape != (k,):
            raise ValueError(
                f"length predictor: inconsistent shapes (weight {tuple(weight.shape)}, {len(edges)} edges, "
                f"mean {tuple(mean.shape)}, std {tuple(std.shape)}, bias {tuple(bias.shape)})"
            )
        self.signal, self.edges, self.info = signal, tuple(int(e) for e in edges), dict(info or {})
        for name, t in zip(_TENSORS, (mean, std, weight, bias, bucket_lengths), strict=True):
            self.register_buffer(name, t.detach().float().clone())

    @property
    def num_buckets(self) -> int:
        """K, the number of buckets."""
        return len(self.edges) + 1

    def forward(self, features: Tensor) -> Tensor:
        """Bucket logits.

        Args:
            features: (N, F) from `prompt_features(..., self.signal)`.

        Returns:
            (N, K) logits.
        """
        x = (features.float() - self.mean) / self.std  # (N, F)
        return x @ self.weight.T + self.bias  # (N, K)

    def predict_bucket(self, features: Tensor) -> Tensor:
        """(N, F) features -> (N,) most likely bucket ids."""
        return self(features).argmax(-1)

    def expected_length(self, features: Tensor) -> Tensor:
        """(N, F) features -> (N,) expected response length `softmax(logits) @ bucket_lengths` (tokens)."""
        return self(features).softmax(-1) @ self.bucket_lengths

    def reserve_length(self, features: Tensor, max_new_tokens: int, quantile: float = 0.9) -> Tensor:
        """KV tokens to reserve for each response: the upper edge of the first bucket whose cumulative
        probability reaches `quantile` (the last bucket's edge is `max_new_tokens`), as S3 allocates a
        predicted bucket's upper bound. A response that outgrows it is re-admitted (`eval.grouped`).

        Args:
            features: (N, F) from `prompt_features(..., self.signal)`.
            max_new_tokens: the generation budget (>= 1); every reserve is clamped to it.
            quantile: in (0, 1]; higher reserves more and overflows less.

        Returns:
            (N,) long reserves in [1, max_new_tokens].
        """
        if not 0.0 < quantile <= 1.0 or max_new_tokens < 1:
            raise ValueError(
                f"quantile={quantile} must be in (0, 1] and max_new_tokens={max_new_tokens} >= 1"
            )
        cdf = self(features).softmax(-1).cumsum(-1)  # (N, K)
        k = (cdf < quantile - 1e-6).sum(-1).clamp(max=self.num_buckets - 1)  # (N,) first bucket reaching q
        uppers = torch.tensor([*self.edges, max_new_tokens], dtype=torch.long)  # (K,) upper edge per bucket
        return uppers[k].clamp(1, max_new_tokens)

    def save(self, path: str | Path) -> None:
        """Write one safetensors file (tensors + JSON config in its metadata), atomically."""
        meta = {"format_version": FORMAT_VERSION, "signal": self.signal, "edges": list(self.edges)}
        tensors = {
            n: cast(Tensor, getattr(self, n)).contiguous() for n in _TENSORS
        }  # (F,) (F,) (K,F) (K,) (K,)
        blob = st_save(
            tensors, metadata={"specdraft_length_predictor": json.dumps({**meta, "info": self.info})}
        )
        atomic_write_bytes(path, blob)


def load_length_predictor(path: str | Path) -> LengthPredictor:
    """Read a `LengthPredictor.save` file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a length-predictor safetensors file (one line naming the path and what is wrong).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: length predictor not found; train one with scripts/train_length_predictor.py"
        )
    blob = path.read_bytes()
    try:
        tensors = st_load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + header_len])
        raw = header.get("__metadata__", {}).get("specdraft_length_predictor")
    except (SafetensorError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file ({e}); retrain it") from e
    if raw is None or any(n not in tensors for n in _TENSORS):
        raise ValueError(f"{path}: not a specdraft length predictor (no config metadata or missing tensors)")
    meta = json.loads(raw)
    if meta.get("format_version") != FORMAT_VERSION or meta.get("signal") not in SIGNALS:
        raise ValueError(
            f"{path}: length predictor format_version={meta.get('format_version')!r} signal="
            f"{meta.get('signal')!r}, expected {FORMAT_VERSION} and one of {', '.join(SIGNALS)}; retrain it"
        )
    t = [tensors[n] for n in _TENSORS]
    return LengthPredictor(meta["signal"], meta["edges"], t[0], t[1], t[2], t[3], t[4], info=meta.get("info"))


def fit_length_predictor(
    features: Tensor,
    lengths: Sequence[int],
    signal: str,
    edges: Sequence[int] = DEFAULT_EDGES,
    weight_decay: float = 1e-2,
    steps: int = 200,
) -> LengthPredictor:
    """Fit the probe by full-batch L-BFGS on cross-entropy + L2 (weights only).

    Args:
        features: (N, F) training features.
        lengths: (N,) response lengths (tokens).
        signal: the features' signal name (stored).
        edges: bucket edges.
        weight_decay: L2 strength on the standardised-feature weights.
        steps: L-BFGS iterations.
    """
    y = bucketize(lengths, edges)  # (N,)
    k = len(edges) + 1
    x = features.float()
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)  # (F,)
    z = (x - mean) / std
    counts = torch.bincount(y, minlength=k).float()
    weight = torch.zeros(k, x.shape[1], requires_grad=True)
    bias = torch.log((counts + 1) / (counts.sum() + k)).requires_grad_(True)  # start at the class prior
    opt = torch.optim.LBFGS([weight, bias], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(z @ weight.T + bias, y) + weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)  # type: ignore[no-untyped-call]
    lens = torch.as_tensor(list(lengths), dtype=torch.float32)
    lo = [0, *edges]
    reps = torch.tensor(
        [float(lens[y == b].median()) if bool((y == b).any()) else float(lo[b]) for b in range(k)]
    )  # (K,)
    return LengthPredictor(signal, edges, mean, std, weight.detach(), bias.detach(), reps)


def accuracy_report(pred: Tensor, true: Tensor, constant: int, num_buckets: int) -> dict[str, Any]:
    """Per-bucket and overall accuracy of `pred` against `true`, and of always predicting `constant`.

    Args:
        pred, true: (N,) bucket ids.
        constant: the baseline's bucket (the training majority).
        num_buckets: K.

    Returns:
        {"overall", "constant_baseline", "n", "buckets": [{"bucket", "n", "accuracy"}, ...]} (accuracy None
        for an empty bucket).
    """
    out: dict[str, Any] = {
        "n": int(true.numel()),
        "overall": float((pred == true).float().mean()) if true.numel() else None,
        "constant_baseline": float((true == constant).float().mean()) if true.numel() else None,
        "constant_bucket": int(constant),
        "buckets": [],
    }
    for b in range(num_buckets):
        sel = true == b
        n = int(sel.sum())
        out["buckets"].append(
            {"bucket": b, "n": n, "accuracy": float((pred[sel] == b).float().mean()) if n else None}
        )
    return out


def bucket_names(edges: Sequence[int]) -> list[str]:
    """Human-readable bucket ranges, e.g. ['[0,32)', '[32,64)', '[64,128)', '[128,inf)']."""
    lo, hi = [0, *edges], [*edges, "inf"]
    return [f"[{a},{b})" for a, b in zip(lo, hi, strict=True)]
