#!/usr/bin/env bash
# README Quickstart command 1: set up, train a tiny LoopFormer and a Base-Loop of the same size on the embedded
# synthetic arithmetic-chain corpus (CPU, a few minutes each, in parallel), evaluate both at every loop budget and
# schedule, print the table and a few generate(loop_budget=M) samples, write plots.
#   Outputs: runs/main/{loopformer,base_loop} (checkpoints AutoModelForCausalLM loads after `import loopformer_hf`),
#            runs/main/eval/{elastic_eval.json,quality_vs_budget.png,representations.png}
#   Knobs (environment): STEPS (default 1200), OUT (default runs/main).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
OUT=${OUT:-runs/main}
STEPS=${STEPS:-1200}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# One thread per run: the two runs share the machine's cores instead of fighting over them.
export OMP_NUM_THREADS=1
COMMON=(--task synthetic --num_loops 6 --num_blocks 1 --hidden_size 64 --num_attention_heads 4
        --max_depth 5 --num_train_problems 60000 --num_eval_problems 500
        --max_steps "$STEPS" --per_device_train_batch_size 64 --learning_rate 3e-3 --lr_scheduler_type cosine
        --warmup_steps 50 --weight_decay 0.1 --adam_beta2 0.95 --max_grad_norm 1.0
        --logging_steps 100 --save_steps 400 --save_total_limit 1 --use_cpu --report_to none --seed 0)
mkdir -p "$OUT"
START=$(date +%s)
echo "== training Base-Loop in the background (log: $OUT/base_loop.log) and LoopFormer in the foreground"
$PY -m training.train_loopformer --output_dir "$OUT/base_loop" --variant base_loop "${COMMON[@]}" \
    --disable_tqdm true > "$OUT/base_loop.log" 2>&1 &
BASE_PID=$!
$PY -m training.train_loopformer --output_dir "$OUT/loopformer" --variant loopformer "${COMMON[@]}"
echo "== waiting for Base-Loop"
wait "$BASE_PID" || { tail -n 30 "$OUT/base_loop.log"; exit 1; }
grep -E "train_runtime|train_loss" "$OUT/base_loop.log" | tail -n 2
echo "== training took $(( $(date +%s) - START )) s"

echo "== elastic evaluation"
$PY -m training.evaluate_elastic "$OUT/loopformer" "$OUT/base_loop" --names LoopFormer Base-Loop \
    --output_dir "$OUT/eval" --generate_budgets 1 2 4 6
$PY - "$OUT/loopformer" <<'PYEOF'
import sys
import loopformer_hf  # noqa: F401  (registers LoopFormer with the Auto classes)
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(f"AutoModelForCausalLM.from_pretrained({sys.argv[1]!r}) -> {type(model).__name__}, "
      f"{model.num_parameters()} parameters, num_loops={model.config.num_loops}")
PYEOF
echo "== done in $(( $(date +%s) - START )) s"
