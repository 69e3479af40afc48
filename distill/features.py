"""Target features computed for the cache (hidden states, teacher top-k), packed into a row's columns.

The stored format, `FeatureSpec` and `decode_features` live in `data/features.py` (training reads them without
importing distill/). The same columns come either from `compute_features` (a forward over finished rows) or from
the generation pass (`distill/generate.py` records `feature_tensors` while it decodes); both pack with
`pack_features`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from specdraft.data.features import FEATURE_DTYPES, FeatureSpec
from specdraft.models.base_llm import forward_with_hidden, lm_logits, teacher_topk

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def make_spec(cfg_distill: Any, model: PreTrainedModel) -> FeatureSpec:
    """Build and validate a `FeatureSpec` from the `distill` config and the target."""
    if cfg_distill.feature_dtype not in FEATURE_DTYPES:
        raise ValueError(
            f"distill.feature_dtype={cfg_distill.feature_dtype!r} is not one of {sorted(FEATURE_DTYPES)}"
        )
    n_layers = int(model.config.num_hidden_layers)
    layers = tuple(int(i) for i in (cfg_distill.hidden_layers or ()))
    bad = [i for i in layers if not 0 <= i <= n_layers]
    if bad:
        raise ValueError(
            f"distill.hidden_layers={list(layers)}: {bad} outside [0, {n_layers}] (0 = embeddings)"
        )
    if cfg_distill.topk < 0:
        raise ValueError(f"distill.topk={cfg_distill.topk} must be >= 0")
    return FeatureSpec(
        hidden=bool(cfg_distill.save_hidden),
        layers=layers,
        topk=int(cfg_distill.topk),
        dtype=str(cfg_distill.feature_dtype),
        hidden_size=int(model.config.hidden_size),
    )


def check_disk_budget(
    spec: FeatureSpec, num_rows: int, max_tokens_per_row: int, max_disk_gb: float, show: bool = True
) -> float:
    """Print the projected feature size (an upper bound; `show`) and refuse when it exceeds `max_disk_gb`.

    Returns:
        The projected size in GB (0.0 when no feature is cached).

    Raises:
        ValueError: projected size > `max_disk_gb`, naming the knobs that shrink it.
    """
    if not spec.enabled:
        return 0.0
    gb = num_rows * max_tokens_per_row * spec.bytes_per_token() / 1e9
    if show:
        print(
            f"[distill] projected feature size: <= {gb:.3f} GB ({num_rows} rows x <= {max_tokens_per_row} tokens x "
            f"{spec.bytes_per_token()} B/token; limit distill.max_disk_gb={max_disk_gb})",
            flush=True,
        )
    if gb > max_disk_gb:
        raise ValueError(
            f"cached features would take up to {gb:.2f} GB > distill.max_disk_gb={max_disk_gb}. Lower "
            "distill.num_samples or data.max_length, drop distill.hidden_layers/distill.topk, set "
            "distill.save_hidden=false, or raise distill.max_disk_gb."
        )
    return gb


def _to_bytes(x: torch.Tensor, dtype: torch.dtype) -> bytes:
    return x.detach().to("cpu", dtype).contiguous().view(torch.int16).numpy().tobytes()


def capture_wanted(setting: object, device: torch.device) -> bool:
    """`distill.capture_features` on `device`: features recorded by the generation pass itself, or taken by a
    second batched forward over the finished rows (the same values; tests/unit/test_distill_capture.py).

    `auto` captures on a CPU, where the second forward is real compute (1.08x faster distill with capture,
    2-core EPYC), and not on a GPU, where generation is launch-bound and the capture's extra per-step work
    costs more than one batched forward (measured across runs, not A/B: ~7 conversations/s with capture on an
    H200, session 36, against 27/s without on an H100, session 30). `true` / `false` force it.
    """
    v = str(setting).lower()
    if v == "auto":
        return device.type == "cpu"
    if v in ("true", "false"):
        return v == "true"
    raise ValueError(f"distill.capture_features={setting!r} is not one of auto | true | false")


def feature_columns(spec: FeatureSpec) -> list[str]:
    """The row columns `spec` enables (a subset of the module docstring's table)."""
    cols = ["hidden"] if spec.hidden else []
    cols += ["hidden_layers"] if spec.layers else []
    return cols + (["topk_ids", "topk_logprobs"] if spec.topk > 0 else [])


def has_features(row: dict[str, Any], spec: FeatureSpec) -> bool:
    """True when `row` already holds every column `spec` enables."""
    return all(c in row for c in feature_columns(spec))


def feature_tensors(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    layers: torch.Tensor | None,
    spec: FeatureSpec,
    logits: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One row's features at n positions, on the CPU in the spec's dtype (top-k ids int64).

    Args:
        model: the target (its LM head gives the top-k when `logits` is None).
        hidden: (n, H) last-layer states after the final norm.
        layers: (n, m, H) the `spec.layers` states, or None when `spec.layers` is empty.
        spec: which features.
        logits: (n, V) logits of these positions when already computed.

    Returns:
        hidden (n, H), hidden_layers (n, m, H), topk_ids / topk_logprobs (n, k): the keys `spec` enables.
    """
    dtype = FEATURE_DTYPES[spec.dtype]
    out: dict[str, torch.Tensor] = {}
    if spec.hidden:
        out["hidden"] = hidden.to("cpu", dtype)  # (n, H)
    if spec.layers:
        assert layers is not None  # requested through `spec.layers`
        out["hidden_layers"] = layers.to("cpu", dtype)  # (n, m, H)
    if spec.topk > 0:
        vals, idx = teacher_topk(lm_logits(model, hidden) if logits is None else logits, spec.topk)  # (n, k)
        out["topk_ids"], out["topk_logprobs"] = idx.cpu(), vals.to("cpu", dtype)
    return out


def pack_features(tensors: dict[str, torch.Tensor], spec: FeatureSpec) -> dict[str, Any]:
    """Row columns (module docstring) from `feature_tensors`' output (n positions)."""
    dtype = FEATURE_DTYPES[spec.dtype]
    row: dict[str, Any] = {}
    if spec.hidden:
        row["hidden"] = _to_bytes(tensors["hidden"], dtype)  # (n, H)
    if spec.layers:
        layers = tensors["hidden_layers"]  # (n, m, H)
        row["hidden_layers"] = [_to_bytes(layers[:, m], dtype) for m in range(layers.shape[1])]
    if spec.topk > 0:
        row["topk_ids"] = tensors["topk_ids"].tolist()  # (n, k)
        row["topk_logprobs"] = _to_bytes(tensors["topk_logprobs"], dtype)  # (n, k)
    return row


@torch.no_grad()
def compute_features(
    model: PreTrainedModel, sequences: Sequence[Sequence[int]], spec: FeatureSpec, batch_tokens: int = 4096
) -> list[dict[str, Any]]:
    """Run the target over whole sequences (right-padded, length-sorted batches) and pack the features.

    Args:
        model: the frozen target.
        sequences: token ids per row.
        spec: which features.
        batch_tokens: rows * max length per forward at most.

    Returns:
        One dict per sequence (input order) with the columns of the module docstring that `spec` enables.
    """
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    out: list[dict[str, Any]] = [{} for _ in sequences]
    start = 0
    while start < len(order):
        width = len(sequences[order[start]])
        stop = start + max(1, batch_tokens // max(width, 1))
        group = order[start:stop]
        start = stop
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, : len(sequences[i])] = torch.tensor(list(sequences[i]))
            mask[r, : len(sequences[i])] = 1
        res = forward_with_hidden(
            model, ids.to(device), attention_mask=mask.to(device), layers=spec.layers, logits=False
        )
        for r, i in enumerate(group):
            n = len(sequences[i])  # one row's (n, V) logits at a time for the top-k, not the batch's
            layers = res.layers[r, :n] if res.layers is not None else None  # (n, m, H)
            out[i] = pack_features(feature_tensors(model, res.hidden[r, :n], layers, spec), spec)
    return out
