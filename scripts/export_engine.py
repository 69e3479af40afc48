"""Convert a trained drafter (our export folder) into the checkpoint layout a serving engine loads.

    # an EAGLE-1 / EAGLE-3 head -> the layout of the EAGLE reference code, vLLM and SGLang
    python scripts/export_engine.py outputs/eagle3_smollm2_long/export outputs/eagle3_smollm2_long/engine
    # Medusa heads -> vLLM's Medusa layout (MedusaModel)
    python scripts/export_engine.py outputs/medusa_smollm2_long/export outputs/medusa_smollm2_long/engine
    # a head trained with the copy gate: engines do not run the gate; export the head alone
    python scripts/export_engine.py outputs/eagle3_smollm2_long_copy/export /tmp/engine --drop-copy-gate

Writes `config.json` and `model.safetensors` (in `--dtype`, float16 by default) atomically into the output folder,
which must not exist yet or be empty (`--force` replaces it), then prints the files and how an engine loads them.
The layouts: `models/eagle_export.py` and `models/medusa_export.py`. A ReDrafter has no engine layout here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import cast


def _vllm(method: str, folder: Path, tokens: int) -> str:
    """The vLLM option that drafts with the exported folder (method: eagle | eagle3 | medusa)."""
    spec = json.dumps({"method": method, "model": str(folder), "num_speculative_tokens": tokens})
    return f"vLLM: vllm serve <the target> --speculative-config '{spec}'"


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, convert, print what was written; one line and exit status 2 on bad input."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="our export folder (<run>/export) or a Hub id of a specdraft drafter")
    p.add_argument("dst", help="the engine-layout folder to write")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument(
        "--drop-copy-gate",
        action="store_true",
        help="export an EAGLE head trained with the copy gate (drafter.copy_ngram) without it",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    a = p.parse_args(argv)
    dst = Path(a.dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not a.force:
        print(
            f"export_engine: {dst} exists and is not empty: choose another folder or --force", file=sys.stderr
        )
        return 2
    from specdraft.models import eagle_export, medusa_export
    from specdraft.models.hub import load_drafter
    from specdraft.models.medusa import Medusa

    try:
        model = load_drafter(a.src, field="src")
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"export_engine: {e}", file=sys.stderr)
        return 2
    family = str(model.config.architecture)
    try:
        if family in ("eagle", "eagle3"):
            eagle_export.export_engine_layout(model, dst, a.dtype, drop_copy_gate=a.drop_copy_gate)
            how = _vllm(family, dst, 5)
        elif family == "medusa":
            medusa_export.export_engine_layout(cast(Medusa, model), dst, a.dtype)
            how = _vllm("medusa", dst, int(model.config.draft_len))
        else:
            print(
                f"export_engine: {a.src} is a {family} drafter; only EAGLE-1, EAGLE-3 and Medusa heads have a "
                "serving-engine layout here",
                file=sys.stderr,
            )
            return 2
    except ValueError as e:
        print(f"export_engine: {a.src}: {e}", file=sys.stderr)
        return 2
    for f in sorted(dst.iterdir()):
        print(f"{f}  {f.stat().st_size / 2**20:.1f} MiB")
    print(f"target: {model.config.base_model_name_or_path}; load with the target it was trained on")
    print(how)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
