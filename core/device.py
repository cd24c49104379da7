"""Device setup: XLA environment (before JAX is imported), compute dtype policy, cache directory.

`configure_environment()` must run before the first `import jax` anywhere in the process: XLA reads
its flags once. The CLI calls it first thing; library users may call it themselves.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

DTYPE_ENV = "SLOTSERVE_DTYPE"
PRECISION_ENV = "SLOTSERVE_PRECISION"
PRECISION_ALIASES = {"float": "float", "f32": "float", "w8a8": "w8a8"}
KV_DTYPE_ENV = "SLOTSERVE_KV_DTYPE"
CACHE_ENV = "SLOTSERVE_CACHE_DIR"
VALID_DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = ("compute", "int8", *VALID_DTYPES)


def default_cache_dir() -> Path:
    """Every slotserve cache lives under this: ``$SLOTSERVE_CACHE_DIR``, else ``~/.cache/slotserve``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "slotserve").expanduser()


def configure_environment(platform: str | None = None) -> None:
    """Set XLA environment variables; a no-op for settings the user already chose."""
    if "jax" in sys.modules:
        log.debug("jax already imported; XLA environment settings may not take effect")
    if platform:
        os.environ.setdefault("JAX_PLATFORMS", platform)
    # GPU: allocate on demand rather than grabbing 75% of memory. GEMM autotuning stays on (XLA's default):
    # on an H200 it halves the Gemma 4 E2B decode step (benchmarks/results/decode-profile-gpu-*.json) for a
    # few seconds more compile per program; SLOTSERVE_XLA_AUTOTUNE_LEVEL=0 turns it off.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    autotune = os.environ.get("SLOTSERVE_XLA_AUTOTUNE_LEVEL")
    flags = os.environ.get("XLA_FLAGS", "")
    if autotune is not None and "xla_gpu_autotune_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level={autotune}".strip()


def choose_dtype(override: str | None = None) -> tuple[str, str]:
    """The compute dtype and why it was chosen: explicit override, environment, then device rules."""
    import jax

    choice = override or os.environ.get(DTYPE_ENV)
    if choice:
        if choice not in VALID_DTYPES:
            raise ValueError(f"dtype {choice!r} is not one of {VALID_DTYPES}")
        return choice, "override" if override else f"${DTYPE_ENV}"
    device = jax.devices()[0]
    if device.platform == "gpu":
        capability = float(getattr(device, "compute_capability", "0") or 0)
        if capability and capability < 8.0:
            return "float16", f"GPU compute capability {capability} < 8.0 emulates bfloat16"
        return "bfloat16", f"GPU compute capability {capability or 'unknown'} has native bfloat16"
    if device.platform == "tpu":
        return "bfloat16", "TPU"
    return _remembered_cpu_dtype()


def choose_precision(override: str | None = None) -> tuple[str, str]:
    """How the weight matrices run ("float" or "w8a8") and why: explicit override, environment, device.

    On CPU, W8A8 (int8 x int8 -> int32 with rotated inputs, core.rotation) halves the decode step and more
    than doubles prefill against float32, within the quality gates (benchmarks/quality.py: greedy agreement
    >= 90%, perplexity within 2%). Accelerators run bfloat16 natively, so they keep the float path."""
    import jax

    choice = override or os.environ.get(PRECISION_ENV)
    if choice:
        if choice not in PRECISION_ALIASES:
            raise ValueError(f"precision {choice!r} is not one of {sorted(PRECISION_ALIASES)}")
        return PRECISION_ALIASES[choice], "override" if override else f"${PRECISION_ENV}"
    platform = jax.devices()[0].platform
    if platform == "cpu":
        return "w8a8", "CPU: int8 matmuls are ~2x float32 here, within the quality gates"
    return "float", f"{platform}: native low-precision float"


def choose_kv_dtype(override: str | None, precision: str) -> tuple[str | None, str]:
    """The KV cache's storage dtype (None: the compute dtype) and why: explicit override, environment, device.

    On CPU with W8A8 weights the decode step reads every slot's K/V; int8 storage (per-position scales)
    cuts those bytes 4x and the step time to ~0.87x, within the same quality gates as W8A8 itself
    (benchmarks/quality.py, variant w8a8_int8kv). Elsewhere the cache keeps the compute dtype."""
    import jax

    choice = override or os.environ.get(KV_DTYPE_ENV)
    if choice:
        if choice not in KV_DTYPES:
            raise ValueError(f"kv_dtype {choice!r} is not one of {KV_DTYPES}")
        return (None if choice == "compute" else choice), "override" if override else f"${KV_DTYPE_ENV}"
    platform = jax.devices()[0].platform
    if platform == "cpu" and precision == "w8a8":
        return "int8", "CPU with W8A8: int8 KV is ~0.87x the decode step, within the quality gates"
    return None, "the compute dtype"


CPU_DTYPE_MEMO = "cpu-dtype.json"  # the last measurement's result, with the host it was taken on


def _remembered_cpu_dtype() -> tuple[str, str]:
    """`_measure_cpu_dtype`'s answer for this host, measured once and kept in the cache directory (the
    measurement compiles and runs two programs: most of a second of every start otherwise)."""
    from core.json_file import read_json_dict, write_json_atomic

    path, host = default_cache_dir() / CPU_DTYPE_MEMO, _host_fingerprint()
    saved = read_json_dict(path)
    if saved.get("host") == host and saved.get("dtype") in VALID_DTYPES:
        return saved["dtype"], f"{saved.get('reason', 'CPU measurement')}, remembered"
    dtype, reason = _measure_cpu_dtype()
    write_json_atomic(path, {"host": host, "dtype": dtype, "reason": reason})
    return dtype, reason


def _host_fingerprint() -> str:
    """What the measurement depends on: the CPU (model and instruction sets), core count, jax and jaxlib."""
    import hashlib
    import platform

    import jax
    import jaxlib

    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpu = "".join(line for line in f.read().split("\n\n")[0].splitlines(keepends=True)
                          if line.startswith(("model name", "flags", "vendor_id")))
    except OSError:
        cpu = platform.processor()
    text = f"{cpu}|{os.cpu_count()}|{platform.machine()}|{jax.__version__}|{jaxlib.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _measure_cpu_dtype() -> tuple[str, str]:
    """Time a decode-shaped matmul in float32 and bfloat16; bfloat16 only wins on CPUs with native support."""
    import jax
    import jax.numpy as jnp

    timings = {}
    for dtype in ("float32", "bfloat16"):
        x = jnp.ones((8, 1024), dtype)
        w = jnp.ones((4096, 1024), dtype)
        fn = jax.jit(lambda a, b: jnp.einsum("bi,oi->bo", a, b))
        fn(x, w).block_until_ready()
        begin = time.perf_counter()
        for _ in range(5):
            fn(x, w).block_until_ready()
        timings[dtype] = (time.perf_counter() - begin) / 5
    best = min(timings, key=timings.get)
    detail = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timings.items())
    return best, f"CPU measurement ({detail})"
