"""Pack what a lent GPU machine needs into call-sized parts (no network there; 64 MiB per call, the working tree
included): the wheels of `../shared/gpu/prepare.sh` (.gpu/whl), the embedded SmolLM2 wheel re-split to fit
beside the current working tree, and drafter exports as bf16 copies (bit-identical to the fp32 weights cast to
bf16, the dtype they run in on the GPU). Prints the calls to make, back to back (a machine is given back ~30 s
after a call). See docs/gpu.md.

    bash ../shared/gpu/prepare.sh          # once: .gpu/whl, .gpu/a, .gpu/b
    python scripts/gpu/pack.py outputs/redrafter_smollm2_long/export outputs/eagle3_smollm2_long_stage4/export
    python scripts/gpu/pack.py --data          # no exports yet: carry the prompts, train there (train_on_gpu.sh)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

LIMIT = 64 << 20  # bytes one call may carry, working tree included
MARGIN = 800_000  # stage scripts, rounding


def tree_bytes() -> int:
    """Bytes of what every call sends: tracked files and untracked files git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(Path(p.decode()).stat().st_size for p in out if p and Path(p.decode()).is_file())


def bf16_copy(src: Path, dst: Path) -> int:
    """`src` export folder -> `dst` with model.safetensors in bf16 (other files copied); returns its bytes."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    sd = load_file(str(src / "model.safetensors"))
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    save_file(half, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return sum(f.stat().st_size for f in dst.iterdir())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="*", help="drafter export folders to carry (as bf16 copies)")
    ap.add_argument(
        "--data",
        action="store_true",
        help="carry the ShareGPT subset too (.gpu/d, for scripts/gpu/train_on_gpu.sh)",
    )
    a = ap.parse_args(argv)
    root = Path(".gpu")
    if not (root / "whl" / ".done").is_file() or not (root / "b" / "smollm2.partB").is_file():
        raise SystemExit(".gpu/ has no payload: run `bash ../shared/gpu/prepare.sh` first")
    room = LIMIT - tree_bytes() - MARGIN  # what one call can carry beside the tree
    whl = sum(f.stat().st_size for f in (root / "whl").iterdir())
    model = (root / "a" / "smollm2.partA").read_bytes() + (root / "b" / "smollm2.partB").read_bytes()
    for d in root.glob("p[0-9]"):
        shutil.rmtree(d)
    for d in root.glob("x[0-9]"):
        shutil.rmtree(d)
    parts, first = [], room - whl  # call 1 carries the wheels too
    cut = [0, first] + [first + room * i for i in range(1, len(model) // room + 2)]
    for i in range(len(cut) - 1):
        chunk = model[cut[i] : min(cut[i + 1], len(model))]
        if chunk:
            (root / f"p{i + 1}").mkdir()
            (root / f"p{i + 1}" / "p").write_bytes(chunk)
            parts.append(len(chunk))
    shutil.copy(root / "b" / "wheel_name", root / "wheel_name")
    shutil.copy(
        root / "b" / "wheel_name", root / "p1" / "wheel_name"
    )  # travels with call 1 (s1.sh stashes it)
    # exports: the last model part's call first, then new calls, first fit
    calls: list[tuple[int, list[str]]] = [(room - parts[-1], [f".gpu/p{len(parts)}"])]
    shutil.rmtree(root / "d", ignore_errors=True)
    if a.data:  # the training prompts travel with the last model part (8.5 MB)
        (root / "d").mkdir()
        shutil.copy(root / "b" / "sharegpt8k.jsonl.xz", root / "d" / "sharegpt8k.jsonl.xz")
        size = (root / "d" / "sharegpt8k.jsonl.xz").stat().st_size
        calls[0] = (calls[0][0] - size, [*calls[0][1], ".gpu/d"])
    for src in a.exports:
        tmp = root / "x_tmp" / Path(src).parent.name
        size = bf16_copy(Path(src), tmp)
        if size > room:
            raise SystemExit(f"{src}: {size / 1e6:.1f} MB as bf16 exceeds one call's {room / 1e6:.1f} MB")
        slot = next((j for j, (free, _) in enumerate(calls) if free >= size), None)
        if slot is None:
            calls.append((room, []))
            slot = len(calls) - 1
        folder = root / f"x{slot + 1}"
        folder.mkdir(exist_ok=True)
        shutil.move(str(tmp), folder / tmp.name)
        if f".gpu/x{slot + 1}" not in calls[slot][1]:
            calls[slot][1].append(f".gpu/x{slot + 1}")
        calls[slot] = (calls[slot][0] - size, calls[slot][1])
        print(f"{src}: {size / 1e6:.1f} MB (bf16) in .gpu/x{slot + 1}")
    shutil.rmtree(root / "x_tmp", ignore_errors=True)
    print(f"working tree {tree_bytes() / 1e6:.1f} MB; each call carries <= {room / 1e6:.1f} MB beside it")
    print("calls, back to back (device `run`, carry / command):")
    print('  1. [".gpu/whl", ".gpu/p1"]  bash scripts/gpu/s1.sh')
    for i in range(2, len(parts)):
        print(f'  {i}. [".gpu/p{i}"]  bash scripts/gpu/s2.sh p{i}')
    for j, (_, carry) in enumerate(calls):
        print(
            f"  {len(parts) + j}. {json.dumps(carry)}  bash scripts/gpu/s3.sh && <your commands>  (drafters in /tmp/x)"
        )


if __name__ == "__main__":
    main()
