#!/usr/bin/env bash
# The GPU checks of one short device lease, in the order that matters if the lease runs out:
#  1. the program store on this backend (benchmarks/exported_programs.py --restart, Gemma 3 270M shapes):
#     background warm-up into an empty store, a restart reading every program back, the decode step compiled
#     from its exported module bit-identical to direct lowering;
#  2. the same comparison for the Gemma 4 E2B text tower (decode step only);
#  3. the engine benchmark of the E2B tower at ctx 512 / 8191 (benchmarks/gpu_engine.sh), with the fused
#     decode + sampler program timed against two calls.
# Random weights, bfloat16, 8 slots x 8192. Each step has its own time limit so one slow compile cannot lose
# the others' results. Env: OUT (result folder, default benchmarks/results), PYTHON, STEPS (which of
# "store e2b-export engine" to run), LIMIT_S (per step), SLOTSERVE_GIT_COMMIT (the commit, for the reports).
set -u
out=${OUT:-benchmarks/results}
py=${PYTHON:-python3}
limit=${LIMIT_S:-240}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
"$py" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
for step in ${STEPS:-store e2b-export engine}; do
  case $step in
    store) timeout "$limit" "$py" benchmarks/exported_programs.py --config configs/models/gemma3-270m.json \
             --buckets 1024,8192 --restart --steps 50 --out "$out/exported-programs-gpu-gemma3-270m.json" ;;
    e2b-export) timeout "$limit" "$py" benchmarks/exported_programs.py --config configs/models/gemma4-e2b.json \
                  --buckets 1024,8192 --steps 50 --out "$out/exported-programs-gpu-gemma4-e2b.json" ;;
    engine) OUT=$out MODELS=gemma4-e2b LIMIT_S=$limit PYTHON=$py EXTRA=--fused-sampling bash benchmarks/gpu_engine.sh ;;
  esac >"$out/$step.log" 2>&1
  echo "$step: exit $? (log $out/$step.log)"
  tail -n 4 "$out/$step.log"
done
