#!/usr/bin/env bash
# On a lent GPU, after train_on_gpu.sh (or with exports carried into /tmp/x): the benchmarks docs/gpu.md asks
# for, most wanted first, each cut by its own time limit so a slow one costs only itself. Results in $OUT.
#   bash scripts/gpu/s3.sh && bash scripts/gpu/measure.sh
source scripts/gpu/env.sh
D=$(ls -d /tmp/o/{redrafter_smollm2_copy,eagle_smollm2_long,eagle3_smollm2_long,medusa_smollm2_long}/export 2>/dev/null | paste -sd' ')
[ -n "$D" ] || D=$(ls -d /tmp/x/* | paste -sd' ')
R=$(echo $D | tr ' ' '\n' | grep -v eagle3 | paste -sd' ')  # the batch bench: all but EAGLE-3
echo "drafters: $D"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
T0=$(date +%s); t() { echo "== $1 done at $(( $(date +%s) - T0 )) s (rc $2)"; }
timeout ${T1:-80} python3 scripts/bench_target_forward.py --device cuda --dtype bf16 --prompts 3 --rounds 4 \
  --json $OUT/target_forward.json > $OUT/target_forward.log 2>&1; t target_forward $?
# session 57: stacked q/k/v and gate/up products (on by default) and compiled elementwise stretches (opt-in), A/B'd
timeout ${T1B:-60} python3 scripts/bench_target_forward.py --device cuda --dtype bf16 --compare stacked --prompts 3 \
  --rounds 3 --json $OUT/target_forward_stacked.json > $OUT/target_forward_stacked.log 2>&1; t stacked $?
timeout ${T1C:-150} python3 scripts/bench_target_forward.py --device cuda --dtype bf16 --compare fused --prompts 3 \
  --rounds 3 --json $OUT/target_forward_fused.json > $OUT/target_forward_fused.log 2>&1; t fused $?
timeout ${T2:-150} python3 scripts/bench_decode.py --device cuda --dtype bf16 --drafter $D --lookup 10 \
  --dynamic ar --prompts ${P:-5} --max-new-tokens 128 --json $OUT/bench_decode.json > $OUT/bench_decode.log 2>&1; t bench_decode $?
timeout ${T3:-100} python3 scripts/bench_batch.py --device cuda --dtype bf16 --drafter $R --lookup 10 \
  --batch 1 4 16 --requests 32 --max-new-tokens 64 --prefill-rows 0 --json $OUT/bench_batch.json \
  > $OUT/bench_batch.log 2>&1; t bench_batch $?
timeout ${T4:-40} python3 scripts/gpu/draft_timing.py $D > $OUT/draft_timing.log 2>&1; t draft_timing $?
# the eval CLI's tables with the trained drafters (our rows only: transformers' eager rows run at ~14 tok/s here)
timeout ${T5:-80} python3 evaluate.py conf=redrafter_smollm2_long output_root=/tmp/o base_model.device=cuda \
  eval.limit=2 eval.max_new_tokens=96 eval.out_dir=$OUT/eval "eval.drafters=[$(echo $D | tr ' ' ',')]" \
  'eval.baselines=[]' > $OUT/evaluate.log 2>&1; t evaluate $?
# session 67: the per-step bandit budget (auto's choice on a CPU) against the fitted one above (auto on a GPU)
timeout ${T6:-60} python3 evaluate.py conf=redrafter_smollm2_long output_root=/tmp/o base_model.device=cuda \
  eval.limit=2 eval.max_new_tokens=96 eval.out_dir=$OUT/eval_bandit "eval.drafters=[$(echo $D | tr ' ' ',')]" \
  'eval.baselines=[]' eval.node_budget=bandit > $OUT/evaluate_bandit.log 2>&1; t evaluate_bandit $?
# ~64 MB come back per call: the logs in one archive and the first 4 15-MB parts of Medusa's bf16 export
# (train_on_gpu.sh); the rest waits in /tmp/bf/parts for the next call: `cp /tmp/bf/parts/* $OUT/`
tar -C $OUT -czf /tmp/measure.tgz . && find $OUT -mindepth 1 -delete && mv /tmp/measure.tgz $OUT/
if [ -f /tmp/bf/medusa_smollm2_long.tar ]; then
  mkdir -p /tmp/bf/parts && split -b 15m -d /tmp/bf/medusa_smollm2_long.tar /tmp/bf/parts/medusa_smollm2_long.tar.
  for f in $(ls /tmp/bf/parts/* | head -4); do mv $f $OUT/; done
  echo "still on the machine (next call: cp /tmp/bf/parts/* \$OUT/): $(ls /tmp/bf/parts | paste -sd' ')"
fi
ls -la $OUT
