#!/usr/bin/env bash
# Engine benchmark on a GPU machine, as one short run: the default model's shapes (Gemma 3 270M) and the
# Gemma 4 E2B text tower, random weights, 8 slots x 8192, decode at contexts 512 and 8191.
# Two decode programs (buckets 1024 and 8192) and no verify program keep the compile inside a lease;
# each model has its own time limit so that one slow compile cannot lose the other's results.
# Env: OUT (result folder, default benchmarks/results), PYTHON, MODELS, LIMIT_S (per model), EXTRA (more args).
set -u
out=${OUT:-benchmarks/results}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$out/gpu-info.txt" 2>&1 || true
for model in ${MODELS:-gemma3-270m gemma4-e2b}; do
  # shellcheck disable=SC2086  # EXTRA is a list of arguments
  timeout "${LIMIT_S:-300}" "$py" benchmarks/engine.py --config "configs/models/$model.json" --slots 8 \
    --max-len 8192 --contexts 512,8191 --attention-buckets 1024 --verify-width 0 \
    --out "$out/engine-gpu-$model.json" ${EXTRA:-} 2>&1 | tee "$out/engine-gpu-$model.log"
  echo "$model: exit ${PIPESTATUS[0]}"
done
