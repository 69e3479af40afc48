"""Optional cached target features for offline training: hidden states and teacher top-k log-probs.

Stored per row (one conversation) as raw little-endian bf16/fp16 bytes, so Arrow keeps them compact:

| column          | bytes of                          |
|-----------------|-----------------------------------|
| `hidden`        | (L, H) last layer, post final norm |
| `hidden_layers` | list of (L, H), one per `spec.layers` (index into HF `hidden_states`, 0 = embeddings) |
| `topk_ids`      | list[list[int]] (L, k), not bytes   |
| `topk_logprobs` | (L, k) log-softmax values           |

`decode_features(row, spec)` turns a row back into tensors. distill/ writes them (`distill.features.compute_features`,
`pack_features`); training reads them here without importing distill/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

FEATURE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class FeatureSpec:
    """Which features to cache; recorded in the manifest under `features`."""

    hidden: bool = False  # last-layer hidden states
    layers: tuple[int, ...] = ()  # extra hidden_states indices (EAGLE-3)
    topk: int = 0  # teacher top-k (0 = off)
    dtype: str = "bf16"  # bf16 | fp16
    hidden_size: int = 0  # H of the target
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes

    @property
    def enabled(self) -> bool:
        """True when any feature is cached."""
        return self.hidden or bool(self.layers) or self.topk > 0

    def bytes_per_token(self) -> int:
        """Disk bytes per token for the chosen features."""
        width = 2  # bf16/fp16
        n = (int(self.hidden) + len(self.layers)) * self.hidden_size * width
        return n + self.topk * (8 + width)  # ids are int64 in Arrow

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the manifest."""
        return {
            "hidden": self.hidden,
            "layers": list(self.layers),
            "topk": self.topk,
            "dtype": self.dtype,
            "hidden_size": self.hidden_size,
        }


def decode_features(
    row: dict[str, Any], spec: FeatureSpec | dict[str, Any], layer_cols: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """Tensors back from a stored row: hidden (L, H), hidden_layers (L, m, H), topk_ids/topk_logprobs (L, k).

    `layer_cols` picks (and orders) the cached layers to decode as `hidden_layers` (None: all; []: none).
    """
    if isinstance(spec, dict):
        spec = FeatureSpec(
            spec["hidden"], tuple(spec["layers"]), spec["topk"], spec["dtype"], spec["hidden_size"]
        )
    dtype, H = FEATURE_DTYPES[spec.dtype], spec.hidden_size

    def tensor(b: bytes, cols: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.int16).view(dtype).view(-1, cols)

    out: dict[str, torch.Tensor] = {}
    if spec.hidden:
        out["hidden"] = tensor(row["hidden"], H)
    cols = range(len(spec.layers)) if layer_cols is None else layer_cols
    if spec.layers and cols:
        out["hidden_layers"] = torch.stack([tensor(row["hidden_layers"][c], H) for c in cols], dim=1)
    if spec.topk > 0:
        out["topk_ids"] = torch.tensor(row["topk_ids"], dtype=torch.long)
        out["topk_logprobs"] = tensor(row["topk_logprobs"], spec.topk)
    return out
