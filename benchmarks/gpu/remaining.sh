#!/usr/bin/env bash
# The GPU measurements issue 26 still needs, as prepared calls for a lent GPU machine (see README.md here).
#   bash benchmarks/gpu/remaining.sh grpo     GRPO step vs TRL GRPOTrainer, both memory trades   (about 5 min)
#   bash benchmarks/gpu/remaining.sh gsm8k    GSM8K: baseline -> finetune -> GRPO, each scored     (about 9 min)
# Each is one device call with `.gpu` carried (gsm8k also needs the Gemma parts added first). Results are
# written under $OUT (what the device returns). Runs at the repository root of the copy sent to the machine.
set -uo pipefail
what="${1:?usage: remaining.sh grpo|gsm8k}"
OUT="${OUT:?OUT must name the folder whose files come back}"
RUN=".gpu/run-on-gpu.sh"
[[ -f "$RUN" ]] || { echo "no $RUN: build it with ../shared/gpu/build-bundle.sh .gpu --with-trl --with-transformers 5.24.0 and carry .gpu"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

case "$what" in
  grpo)
    # Goal: >= 2.0x TRL's step time in both memory trades at <= 1.0x its peak GPU memory.
    bash "$RUN" --timeout 540 --log grpo.log -- python3 -m flowopt.benchmarks.perf.grpo_throughput \
      --model gemma-shaped --device cuda --threads 8 --batch 8 --group 8 --completion 64 --steps 3 --warmup 1 \
      --repeats 2 --impls flowopt,flowopt-ckpt,trl,trl-nockpt --out "$OUT/grpo_throughput_gpu"
    ;;
  gsm8k)
    # Item 5: every stage scored on 500 test questions; GPU utilisation sampled once a second.
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/gpu_util.csv" 2>/dev/null &
    smi=$!
    bash "$RUN" --timeout 560 --log gsm8k.log -- flowopt bench gsm8k-dspy --lm gemma-3-270m --program cot \
      --stages finetune,grpo --labels only --train 200 --dev 50 --test 500 --epochs 2 --grpo-steps 8 \
      --grpo-batch 16 --group-size 8 --max-tokens 200 --threads 128 --lm-batch 128 --lm-compile off \
      --max-wall-s 80 --out /tmp/gsm
    kill "$smi" 2>/dev/null
    # flowopt bench writes more files, and deeper, than $OUT returns: keep the few that matter, packed.
    (cd /tmp/gsm && find . -type f \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.jsonl' \) \
      -size -4M | tar czf "$OUT/gsm8k.tgz" -T -)
    ;;
  *) echo "unknown check '$what': use grpo or gsm8k"; exit 2 ;;
esac
