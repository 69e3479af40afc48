#!/usr/bin/env bash
# On a lent GPU (after the setup calls of docs/gpu.md; carry .gpu/d with sharegpt8k.jsonl.xz): self-distill the
# long preset's set (3,000 prompts) alone, then train the ReDrafter, EAGLE-1, EAGLE-3 and Medusa recipes (all four with the copy
# gate; Medusa's heads also read the root token) side by side on it while the CUDA tests (and then the rest of the suite, until the trainings end) run on the host's CPUs.
# Exports land in /tmp/o/<preset>/export; bf16 copies, logs and summaries go to $OUT (Medusa's, 75 MB in bf16,
# stays in /tmp/bf for measure.sh to send: at most 8 files, ~64 MB in all, come back per call). Usage (from the checkout):
#   bash scripts/gpu/s3.sh && bash scripts/gpu/train_on_gpu.sh [distill_prompts] [train_timeout_s]
source scripts/gpu/env.sh
N=${1:-3000}
TT=${2:-200}
DEV=${DEV:-cuda}  # DEV=cpu NOTESTS=1 S1=2 S2=2 S3=2: a dry run of this script on a CPU
S1=${S1:-2000} S2=${S2:-1500} S3=${S3:-1000} S4=${S4:-1500}  # upper bounds: train.max_minutes ends them
mkdir -p $OUT/logs
[ -f /tmp/sharegpt8k.jsonl ] || python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.gpu/d/sharegpt8k.jsonl.xz'), open('/tmp/sharegpt8k.jsonl', 'wb'))"
T0=$(date +%s)
# features by a second batched forward (capture_features=false, what auto picks on a GPU), as in session 30's
# 27 conversations/s; captured during generation, session 36 ran at ~7/s (its per-row tail forwards are batched
# since, not measured on a GPU). A shard is generated as one continuous batch: 300 conversations keep up to 256
# rows busy (the preset's 100 caps a batch at 100 rows).
timeout 220 python3 distill.py conf=redrafter_smollm2_long output_root=/tmp/o base_model.device=$DEV \
  data.source=/tmp/sharegpt8k.jsonl data.num_samples=$N distill.num_samples=$N distill.max_batch_size=256 \
  distill.batch_tokens=131072 distill.shard_size=300 distill.capture_features=false > $OUT/logs/distill.log 2>&1
echo "distill rc $? at $(( $(date +%s) - T0 )) s"
M=$(python3 -c "print(round(max($TT - 60, 30) / 60, 2))")  # each training stops itself (eval, export) in time
C="output_root=/tmp/o base_model.device=$DEV data.num_samples=$N train.allow_incomplete_data=true train.max_minutes=$M train.eval_replay_rows=8"
# while the trainings run (each one process, launch-bound): the tests skipped on a CPU-only host (CUDA graphs,
# CUDA placement), then the rest of the suite. Never beside the distill: 8 test workers next to its 16 torch
# threads made it 5x slower (H200, 2026-11-26: 900 of 3,000 prompts in 220 s).
[ -n "$NOTESTS" ] || ( OMP_NUM_THREADS=1 PYTHONPATH=/tmp/site:scripts/gpu timeout 200 python3 -m pytest -n 6 -q --timeout 100 \
    -p faillog -p no:cacheprovider -p no:benchmark -k "graph or cuda or gpu" tests/unit tests/integration \
    > $OUT/logs/pytest_cuda.log 2>&1
  OMP_NUM_THREADS=1 PYTHONPATH=/tmp/site:scripts/gpu timeout 600 python3 -m pytest -n 8 -q --timeout 100 \
    -p faillog -p no:cacheprovider -p no:benchmark -k "not (graph or cuda or gpu)" tests \
    > $OUT/logs/pytest_rest.log 2>&1 ) &
TESTS=$!
OMP_NUM_THREADS=2 timeout $TT python3 train.py conf=redrafter_smollm2_copy $C train.max_steps=$S1 train.batch_size=32 \
  train.eval_every=$S1 train.ckpt_every=$S1 > $OUT/logs/train_redrafter.log 2>&1 & P1=$!
OMP_NUM_THREADS=2 timeout $TT python3 train.py conf=eagle_smollm2_long drafter.copy_ngram=4 $C train.max_steps=$S2 train.batch_size=32 \
  train.eval_every=$S2 train.ckpt_every=$S2 > $OUT/logs/train_eagle.log 2>&1 & P2=$!
# EAGLE-1 and EAGLE-3 with the copy gate (as the ReDrafter recipe has its own): session 55's like-for-like comparison
OMP_NUM_THREADS=2 timeout $TT python3 train.py conf=eagle3_smollm2_long drafter.copy_ngram=4 $C train.max_steps=$S3 train.batch_size=16 \
  train.eval_every=$S3 train.ckpt_every=$S3 > $OUT/logs/train_eagle3.log 2>&1 & P3=$!
# Medusa with the root token and the copy gate from the start (session 59: on the CPU, warm-started, 2.0-2.1 tokens
# a step against 1.5 without the gate; a 4-step run from scratch checked on the CPU)
OMP_NUM_THREADS=2 timeout $TT python3 train.py conf=medusa_smollm2_long drafter.root_token=true drafter.copy_ngram=4 $C \
  train.max_steps=$S4 train.batch_size=32 \
  train.eval_every=$S4 train.ckpt_every=$S4 > $OUT/logs/train_medusa.log 2>&1 & P4=$!
wait $P1 $P2 $P3 $P4
echo "trainings done at $(( $(date +%s) - T0 )) s"
for n in redrafter_smollm2_copy eagle_smollm2_long eagle3_smollm2_long medusa_smollm2_long; do
  [ -f /tmp/o/$n/summary.json ] && cp /tmp/o/$n/summary.json $OUT/logs/summary_$n.json
  if [ -f /tmp/o/$n/export/model.safetensors ]; then
    python3 -c "import sys; sys.path.insert(0, 'scripts/gpu'); from pack import bf16_copy; from pathlib import Path; bf16_copy(Path('/tmp/o/$n/export'), Path('/tmp/bf/$n/export'))"
    tar -C /tmp/bf -cf /tmp/bf/$n.tar $n
    [ $n = medusa_smollm2_long ] || split -b 15m -d /tmp/bf/$n.tar $OUT/$n.tar.
  fi
done
pkill -f "python3 -m pytest" 2>/dev/null; kill $TESTS 2>/dev/null; sleep 2; pkill -f "exec(eval(sys.stdin" 2>/dev/null
tail -c 3000 $OUT/logs/pytest_cuda.log > $OUT/logs/pytest_cuda.tail; tail -c 3000 $OUT/logs/pytest_rest.log > $OUT/logs/pytest_rest.tail
[ -f $OUT/failures.log ] && mv $OUT/failures.log $OUT/logs/  # at most 8 files come back: parts + logs.tgz
tar -C $OUT -czf $OUT/logs.tgz logs && rm -rf $OUT/logs
ls -la $OUT; echo "all done at $(( $(date +%s) - T0 )) s"
