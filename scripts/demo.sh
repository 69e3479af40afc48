#!/usr/bin/env bash
# `make demo`: the whole pipeline on the embedded default (SmolLM2-135M-Instruct, 2 CPU cores, no network):
#   1. distill  - the frozen target answers ShareGPT prompts (self-distillation, hidden states cached)
#   2. train    - a ReDrafter learns those answers from the cached features (the target never reruns)
#   3. evaluate - AR vs speculative decoding on MT-Bench (both turns) in the same process, + prompt lookup
# Every stage is a plain command you can run alone; sizes come from the preset (conf/conf/$PRESET.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-redrafter_smollm2}
RUN_DIR=${RUN_DIR:-outputs/$PRESET}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
stage() { echo; echo "== [$(( $(date +%s) - start ))s] $*"; }

stage "1/3 distill: python distill.py conf=$PRESET"
python distill.py conf=$PRESET

stage "2/3 train: accelerate launch train.py conf=$PRESET"
# accelerate launch sets OMP_NUM_THREADS=1 unless it is set: one process may use every core.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} accelerate launch --num_processes 1 --num_machines 1 \
  --dynamo_backend no train.py conf=$PRESET

stage "3/3 evaluate: python evaluate.py conf=$PRESET"
python evaluate.py conf=$PRESET

stage "done in $(( $(date +%s) - start ))s"
echo "results: $RUN_DIR/eval/results.json (tables above; plots next to it), drafter: $RUN_DIR/export"
