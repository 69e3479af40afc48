"""One batched step's KV commit on a SmolLM2-shaped cache (30 layers, 3 key/value heads of 64, fp32): the
cache's `commit` (every layer in one index_select + index_copy_ over one buffer, only the first max accepted
slots) against the per-layer copy of every padded slot it replaced (session 44), in one run.

    python scripts/bench_commit.py                   # B = 16 rows, trees padded to 64 nodes, 300 cached positions
    python scripts/bench_commit.py --rows 4 --nodes 8
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from specdraft.eval.batch_kv import BatchKVCache


class _Geometry(torch.nn.Module):
    """Just what `BatchKVCache` reads of a model: its text config and an fp32 embedding (device, dtype)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(2, 4)
        cfg = SimpleNamespace(
            num_attention_heads=3 * kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            hidden_size=3 * kv_heads * head_dim, num_hidden_layers=layers,
        )  # fmt: skip
        self.config = SimpleNamespace(get_text_config=lambda decoder=True: cfg)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.emb


def per_layer_commit(cache: BatchKVCache, path: torch.Tensor, accepted: list[int]) -> None:
    """The commit before session 44: every padded slot of every row, 4 kernels per layer (lengths untouched)."""
    k = path.shape[1]
    acc = torch.tensor(accepted)
    slot = torch.arange(k)[None]  # (1, k)
    src = torch.where(slot < acc[:, None], path, slot) + cache.lengths_t[:, None]  # (B, k)
    rows = slice(0, cache.num_rows)
    src_i, dst_i = cache.flat_index(rows, src), cache.flat_index(rows, cache.lengths_t[:, None] + slot)
    for layer in cache.kv_layers:
        for buf in (layer.keys, layer.values):
            flat = buf.view(-1, buf.shape[-1])
            flat.index_copy_(0, dst_i, flat.index_select(0, src_i))


def main(argv: list[str] | None = None) -> None:
    """Time both commits round-robin and print ms per commit and their ratio."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--nodes", type=int, default=64, help="padded tree nodes per row")
    p.add_argument("--prefix", type=int, default=300, help="committed positions per row")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cache = BatchKVCache(_Geometry(30, 3, 64), a.rows, a.prefix + a.nodes)
    g = torch.Generator().manual_seed(0)
    accepted = [1 + int(x) for x in torch.randint(0, 4, (a.rows,), generator=g)]  # 1-4 tokens per row
    path = torch.stack(
        [torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(a.nodes - 1, generator=g).sort()[0] + 1])
         for _ in range(a.rows)]
    )  # (B, nodes): ascending node indices, as a verified path  # fmt: skip

    def rewind() -> None:
        """Every row back to `prefix` committed positions (outside the timing)."""
        cache.lengths_t.fill_(a.prefix)
        cache.lengths = [a.prefix] * a.rows

    rewind()
    ms: dict[str, list[float]] = {"per-layer, every slot": [], "one buffer, accepted slots": []}
    for _ in range(a.reps):
        runs = (lambda: per_layer_commit(cache, path, accepted), lambda: cache.commit(path, accepted, False))
        for name, fn in zip(ms, runs, strict=True):
            t = time.perf_counter()
            fn()
            ms[name].append(1000 * (time.perf_counter() - t))
            rewind()
    med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
    for k, v in med.items():
        print(f"{k:28s} {v:7.2f} ms per commit")
    print(f"rows {a.rows}, padded nodes {a.nodes}, mean accepted {sum(accepted) / a.rows:.2f}: "
          f"{med['per-layer, every slot'] / med['one buffer, accepted slots']:.1f}x")  # fmt: skip


if __name__ == "__main__":
    from specdraft.entry import reported_errors

    with reported_errors():  # bad input: one line `error: ...`, exit 2 (SPECDRAFT_DEBUG=1: the traceback)
        main()
