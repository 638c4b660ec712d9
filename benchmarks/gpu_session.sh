#!/usr/bin/env bash
# Everything this project measures on one lent accelerator, in one call of about ten minutes:
#   1. the LoopFormer report at its gpu preset (issue 12): 18 training runs, evaluation, docs;
#   2. compiled vs eager cached decoding on CUDA (issue 14): manual torch.compile and generate's own compilation;
#   3. benchmarks.cuda_check (cache exactness, fp16/bf16 generate, speed by budget).
# usage: OUT=dir SHAKESPEARE=folder-of-plays [WHEELS=folder] [BUDGET_S=570] bash benchmarks/gpu_session.sh
# WHEELS: wheels of packages the machine lacks (its image had no `datasets`: datasets, dill, multiprocess).
# Prepared here, beside the checkout (ignored by git) and carried with the call:
#   cp -r ../shared/data/shakespeare .device/; pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#   device run: OUT=$OUT SHAKESPEARE=.device/shakespeare WHEELS=.whl bash benchmarks/gpu_session.sh  (carry .device .whl)
# Measured 2026-11-30 on an H200 (its first two calls): the gpu preset at twice today's size needed ~15 min; see
# benchmarks/configs/report-synthetic-gpu.yaml.
# Each step gets what is left of BUDGET_S (steps 2 and 3 keep at least their floor), so a slow step cannot take the
# later ones down with it; what finished is under $OUT (report.tgz holds the writeups/ and the runs' JSON and logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:?set OUT}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-570}
t0=$(date +%s)
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
left() { echo $((BUDGET_S - ($(date +%s) - t0) - $1)); }  # seconds left, keeping $1 for the steps after

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  $PY -c "import torch, transformers, accelerate, peft, tokenizers, huggingface_hub as h
print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__,
      'peft', peft.__version__, 'tokenizers', tokenizers.__version__, 'hub', h.__version__, torch.cuda.get_device_name(0))"
  $PY -c "import datasets; print('datasets', datasets.__version__)"
  nproc; } 2>&1 | tee "$OUT/env.txt"

runs=/tmp/runs-gpu
s=$(date +%s)
timeout "$(left 110)" $PY -m benchmarks.report --preset gpu --runs_dir $runs --out_dir $runs/writeups \
    --shakespeare "${SHAKESPEARE:?set SHAKESPEARE}" 2>&1 | tee "$OUT/report.log"
echo "report: exit ${PIPESTATUS[0]} after $(($(date +%s) - s)) s" | tee -a "$OUT/report.log"
(cd $runs && tar czf "$OUT/report.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude='*.pth' --exclude='tokenizer*' --exclude='checkpoint-*' . 2>/dev/null)

s=$(date +%s)
timeout "$(left 30)" $PY -m benchmarks.bench_compile --device cuda --budgets 4 1 --repeats 5 --new_tokens 64 \
    --output "$OUT/compile_cuda.json" 2>&1 | tail -8 | tee "$OUT/bench.log"
echo "bench_compile inductor: exit ${PIPESTATUS[0]} after $(($(date +%s) - s)) s" | tee -a "$OUT/bench.log"
timeout "$(left 0)" $PY -m benchmarks.cuda_check --output "$OUT/cuda_check.json" 2>&1 | tail -15 | tee -a "$OUT/bench.log"
echo "total $(($(date +%s) - t0)) s"
