#!/usr/bin/env bash
# The accelerator checks of one short device lease (GPU or TPU), in the order that matters if the lease runs
# out. Each step has its own time limit so one slow compile cannot lose the others' results:
#  info       the device, jax/jaxlib, glibc, and which of the project's dependencies the machine can import
#  store      the program store on this backend (exported_programs.py --restart, Gemma 3 270M shapes):
#             background warm-up into an empty store, a restart reading every program back, the decode step
#             compiled from its exported module bit-identical to direct lowering
#  e2b-export the same comparison for the Gemma 4 E2B text tower (decode step only)
#  http       8 and 16 HTTP streams x 128 tokens through the server (http_load.py) on a unix socket, beside the
#             engine's own batched rate in the same process: random weights of the Gemma 3 270M shapes in a
#             checkpoint directory written there (random_checkpoint.py) with the real tokenizer from TOKENIZER
#  loop       the scheduler's host work per iteration without HTTP (serving_loop.py, cProfile), same weights
#  engine     benchmarks/engine.py for each of MODELS: random weights in the device's compute dtype,
#             8 slots x 8192, decode at ctx 512 / 8191 (buckets 1024 / 8192, no verify program, so the
#             compile fits a lease), the fused decode + sampler program timed against two calls
# Env: OUT (result folder, default benchmarks/results), TAG (name part of the results, default gpu), PYTHON,
# STEPS (default "info store engine"), MODELS (default gemma4-e2b), LIMIT_S (per step and model),
# HBM_GBPS (the roofline's bandwidth: H200 4800, TPU v5e 819), SLOTSERVE_GIT_COMMIT (the commit, for the
# reports: the machine's copy of the tree has no .git), WHEELS (a folder of wheels the machine lacks: installed
# under /tmp/site first), TOKENIZER (a tokenizer directory, for http), HTTP_ARGS, LOOP_ARGS, ENGINE_ARGS (more
# http_load.py, serving_loop.py, engine.py args).
set -u
out=${OUT:-benchmarks/results}
tag=${TAG:-gpu}
py=${PYTHON:-python3}
limit=${LIMIT_S:-240}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
  PIP_CONFIG_FILE=/dev/null "$py" -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

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
      --hbm-gbps "${HBM_GBPS:-4800}" --out "$out/engine-$tag-$model.json" ${ENGINE_ARGS:-}
    echo "$model: exit $?"
  done
}

random_checkpoint() {
  [ -f /tmp/gemma3-270m-random/model.safetensors ] || "$py" benchmarks/random_checkpoint.py \
    --config configs/models/gemma3-270m.json --tokenizer "$TOKENIZER" --out /tmp/gemma3-270m-random
}

http() {
  random_checkpoint || return
  # shellcheck disable=SC2086  # HTTP_ARGS is a list of arguments
  timeout "$limit" "$py" benchmarks/http_load.py --uds --model /tmp/gemma3-270m-random --concurrency 8,16 \
    --max-tokens 128 --out "$out/http-load-$tag-gemma3-270m-random.json" ${HTTP_ARGS:-}
}

for step in ${STEPS:-info store engine}; do
  case $step in
    info) info ;;
    store) timeout "$limit" "$py" benchmarks/exported_programs.py --config configs/models/gemma3-270m.json \
             --buckets 1024,8192 --restart --steps 50 --out "$out/exported-programs-$tag-gemma3-270m.json" ;;
    e2b-export) timeout "$limit" "$py" benchmarks/exported_programs.py --config configs/models/gemma4-e2b.json \
                  --buckets 1024,8192 --steps 50 --out "$out/exported-programs-$tag-gemma4-e2b.json" ;;
    http) http ;;
    loop) random_checkpoint && timeout "$limit" "$py" benchmarks/serving_loop.py --model /tmp/gemma3-270m-random \
            --out "$out/serving-loop-$tag-gemma3-270m-random.json" ${LOOP_ARGS:-} ;;
    engine) engine ;;
  esac >"$out/$step.log" 2>&1
  echo "$step: exit $? (log $out/$step.log)"
  tail -n 6 "$out/$step.log"
done
