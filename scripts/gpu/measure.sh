#!/usr/bin/env bash
# On a lent GPU, after train_on_gpu.sh (or with exports carried into /tmp/x): the benchmarks docs/gpu.md asks
# for, most wanted first, each cut by its own time limit so a slow one costs only itself. Results in $OUT.
#   bash scripts/gpu/s3.sh && bash scripts/gpu/measure.sh
source scripts/gpu/env.sh
D=$(ls -d /tmp/o/{redrafter_smollm2_copy,eagle_smollm2_long,eagle3_smollm2_long}/export 2>/dev/null | paste -sd' ')
[ -n "$D" ] || D=$(ls -d /tmp/x/* | paste -sd' ')
R=$(echo $D | tr ' ' '\n' | grep -v eagle3 | paste -sd' ')  # the batch bench: ReDrafter and EAGLE-1
echo "drafters: $D"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
T0=$(date +%s); t() { echo "== $1 done at $(( $(date +%s) - T0 )) s (rc $2)"; }
timeout ${T1:-80} python3 scripts/bench_target_forward.py --device cuda --dtype bf16 --prompts 3 --rounds 4 \
  --json $OUT/target_forward.json > $OUT/target_forward.log 2>&1; t target_forward $?
timeout ${T2:-120} python3 scripts/bench_decode.py --device cuda --dtype bf16 --drafter $D --lookup 10 \
  --dynamic ar --prompts 3 --max-new-tokens 128 --json $OUT/bench_decode.json > $OUT/bench_decode.log 2>&1; t bench_decode $?
timeout ${T3:-100} python3 scripts/bench_batch.py --device cuda --dtype bf16 --drafter $R --lookup 10 \
  --batch 1 4 16 --requests 32 --max-new-tokens 64 --prefill-rows 0 --json $OUT/bench_batch.json \
  > $OUT/bench_batch.log 2>&1; t bench_batch $?
timeout ${T4:-45} python3 scripts/gpu/draft_timing.py $D > $OUT/draft_timing.log 2>&1; t draft_timing $?
timeout 30 python3 scripts/gpu/kernel_counts.py > $OUT/kernel_counts.log 2>&1; t kernel_counts $?
ls -la $OUT
