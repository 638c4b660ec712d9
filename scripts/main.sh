#!/usr/bin/env bash
# README Quickstart command 1: set up, train a tiny LoopFormer and a Base-Loop of the same size on the embedded
# synthetic arithmetic-chain corpus (CPU, under 10 minutes for both, in parallel), evaluate both at every loop
# budget and schedule, print the table and a few generate(loop_budget=M) samples, write plots.
#   Outputs: runs/main/{loopformer,base_loop} (checkpoints AutoModelForCausalLM loads after `import loopformer_hf`),
#            runs/main/eval/{elastic_eval.json,quality_vs_budget.png,representations.png}
#   Knobs (environment): STEPS (default 4000), WARMUP (learning-rate warm-up steps, default 1000), LOOPS (L, the loop
#   steps of a full budget, default 3), DEPTH (longest chain, default 3), BATCH (sequences per step, default 64),
#   SEED (default 0: model and trajectory sampler), OUT (default runs/main).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
OUT=${OUT:-runs/main}
# The sweep's steps4k-warmup1000-depth1-3-loops3 cell (benchmarks/results/sweep_loopformer.md): a quarter of the
# steps warming up, chains of depth 1..3 looped L=3 times, the regime where all three claims held for each seed
# inside 10 minutes of training on 2 cores. On depth 1..4 with L=4 they need 8000 steps, about twice that:
# STEPS=8000 WARMUP=2000 LOOPS=4 DEPTH=4 is the sweep's steps8k-warmup2000 cell.
STEPS=${STEPS:-4000}
WARMUP=${WARMUP:-1000}
LOOPS=${LOOPS:-3}
DEPTH=${DEPTH:-3}
BATCH=${BATCH:-64}
SEED=${SEED:-0}
# no progress bars in the log (the Trainer's are off by flag; these are the hub's and transformers' loading bars)
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
# One thread per run: the two runs share the machine's cores instead of fighting over them.
export OMP_NUM_THREADS=1
# Tiny models (d=128, 1 shared block): the sizes in training/configs/loopformer/synthetic-tiny.yaml (flags after
# --config override its values).
COMMON=(--config training/configs/loopformer/synthetic-tiny.yaml --max_steps "$STEPS" --warmup_steps "$WARMUP"
        --num_loops "$LOOPS" --max_depth "$DEPTH"
        --per_device_train_batch_size "$BATCH" --seed "$SEED" --shortcut_seed "$SEED"
        --save_steps 1000 --save_total_limit 1 --overwrite_output_dir true)  # a second run trains afresh
mkdir -p "$OUT"
START=$(date +%s)
echo "== training Base-Loop in the background (log: $OUT/base_loop.log) and LoopFormer in the foreground"
$PY -m looped_training.loopformer.train --output_dir "$OUT/base_loop" --variant base_loop "${COMMON[@]}" \
    --disable_tqdm true > "$OUT/base_loop.log" 2>&1 &
BASE_PID=$!
$PY -m looped_training.loopformer.train --output_dir "$OUT/loopformer" --variant loopformer "${COMMON[@]}" \
    --disable_tqdm true
echo "== waiting for Base-Loop"
wait "$BASE_PID" || { tail -n 30 "$OUT/base_loop.log"; exit 1; }
grep -E "train_runtime|train_loss" "$OUT/base_loop.log" | tail -n 2
echo "== training took $(( $(date +%s) - START )) s"

echo "== elastic evaluation"
$PY -m looped_training.loopformer.evaluate "$OUT/loopformer" "$OUT/base_loop" --names LoopFormer Base-Loop \
    --output_dir "$OUT/eval" --generate_budgets 1 2 "$LOOPS" --halt_eps 0.1 0.3 0.5 0.8 --disable_tqdm true
$PY - "$OUT/loopformer" <<'PYEOF'
import sys
import loopformer_hf  # noqa: F401  (registers LoopFormer with the Auto classes)
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(f"AutoModelForCausalLM.from_pretrained({sys.argv[1]!r}) -> {type(model).__name__}, "
      f"{model.num_parameters()} parameters, num_loops={model.config.num_loops}")
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
enc = tok(["3*7+1*3=", "1+3="], return_tensors="pt", padding=True)
out = model.generate(**enc, max_new_tokens=2, do_sample=False, halt_eps=0.3, pad_token_id=tok.pad_token_id,
                     return_dict_in_generate=True)
# loop steps of each token the model read (prompt, then generated), the padding of the shorter prompt left out
real = [[n for n, keep in zip(row, mask + [1] * (len(row) - len(mask))) if keep]
        for row, mask in zip(out.loop_counts.tolist(), enc.attention_mask.tolist())]
print("generate(halt_eps=0.3):",
      [tok.decode(o[enc.input_ids.shape[1]:], skip_special_tokens=True).strip() for o in out.sequences],
      "loop steps per token:", real)
PYEOF
echo "== done in $(( $(date +%s) - START )) s"
