#!/usr/bin/env bash
# The accelerator checks of one short device lease (GPU or TPU), in the order that matters if the lease runs
# out. Each step has its own time limit so one slow compile cannot lose the others' results:
#  info       the device, jax/jaxlib, glibc, and which of the project's dependencies the machine can import
#  store      the program store on this backend (exported_programs.py --restart, Gemma 3 270M shapes):
#             background warm-up into an empty store, a restart reading every program back, the decode step
#             compiled from its exported module bit-identical to direct lowering
#  e2b-export the same comparison for the Gemma 4 E2B text tower (decode step only)
#  engine     benchmarks/engine.py for each of MODELS: random weights in the device's compute dtype,
#             8 slots x 8192, decode at ctx 512 / 8191 (buckets 1024 / 8192, no verify program, so the
#             compile fits a lease), the fused decode + sampler program timed against two calls
# Env: OUT (result folder, default benchmarks/results), TAG (name part of the results, default gpu), PYTHON,
# STEPS (default "info store engine"), MODELS (default gemma4-e2b), LIMIT_S (per step and model),
# HBM_GBPS (the roofline's bandwidth: H200 4800, TPU v5e 819), SLOTSERVE_GIT_COMMIT (the commit, for the
# reports: the machine's copy of the tree has no .git).
set -u
out=${OUT:-benchmarks/results}
tag=${TAG:-gpu}
py=${PYTHON:-python3}
limit=${LIMIT_S:-240}
export PYTHONUNBUFFERED=1
mkdir -p "$out"

info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null
  "$py" -c 'import jax, jaxlib, platform; print("jax", jax.__version__, "jaxlib", jaxlib.__version__,
jax.devices(), "glibc", platform.libc_ver())'
  for module in numpy ml_dtypes safetensors tokenizers gguf yaml jinja2 pydantic fastapi uvicorn httpx \
      llguidance outlines_core prometheus_client zstandard redis; do
    "$py" -c "import $module" 2>/dev/null && echo "import $module: ok" || echo "import $module: missing"
  done
}

engine() {
  for model in ${MODELS:-gemma4-e2b}; do
    timeout "$limit" "$py" benchmarks/engine.py --config "configs/models/$model.json" --slots 8 \
      --max-len 8192 --contexts 512,8191 --attention-buckets 1024,8192 --verify-width 0 --fused-sampling \
      --hbm-gbps "${HBM_GBPS:-4800}" --out "$out/engine-$tag-$model.json"
    echo "$model: exit $?"
  done
}

for step in ${STEPS:-info store engine}; do
  case $step in
    info) info ;;
    store) timeout "$limit" "$py" benchmarks/exported_programs.py --config configs/models/gemma3-270m.json \
             --buckets 1024,8192 --restart --steps 50 --out "$out/exported-programs-$tag-gemma3-270m.json" ;;
    e2b-export) timeout "$limit" "$py" benchmarks/exported_programs.py --config configs/models/gemma4-e2b.json \
                  --buckets 1024,8192 --steps 50 --out "$out/exported-programs-$tag-gemma4-e2b.json" ;;
    engine) engine ;;
  esac >"$out/$step.log" 2>&1
  echo "$step: exit $? (log $out/$step.log)"
  tail -n 6 "$out/$step.log"
done
