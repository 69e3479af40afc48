#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct, CPU): distill -> train -> eval.
# Stages that are not built yet are skipped with a note; each stage is a plain command you can run alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-redrafter_smollm2}
echo "== target: load the embedded default and chat"
python scripts/chat.py "What is speculative decoding, in one sentence?"
echo "== config: python train.py conf=$PRESET --cfg job"
python train.py conf=$PRESET --cfg job | head -20
