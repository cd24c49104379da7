"""Device setup: XLA environment (before JAX is imported), compute dtype policy, cache directory.

`configure_environment()` must run before the first `import jax` anywhere in the process: XLA reads
its flags once. The CLI calls it first thing; library users may call it themselves.
"""

from __future__ import annotations

import logging
import os
import sys
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


# XLA:CPU flags that make a row's result independent of how many rows share its call and where it sits among
# them, on every x86 host; without them a prompt token's logits change with the chunk layout, so a prefix-cache
# hit would not be bit-identical to a cold prefill (docs/design-notes.md, "Exact on every host").
EXACT_CPU_FLAGS = {
    # XLA's own kernels without FMA: its LLVM backend always allows multiply-add contraction, and contracts in
    # some code paths (a scalar tail) and not others (the vector body), so the same element rounds differently
    # by shape. AVX is every x86-64 CPU of the last decade's baseline; the large matmuls run in YNNPACK,
    # which picks its own kernels by CPU and keeps AVX-512 / VNNI.
    "xla_cpu_max_isa": "AVX",
    # Reductions in XLA's emitter: YNNPACK takes a reduction with at least 4096 elements, so a norm over
    # 640 channels moved to another summation order at 7 rows.
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    # YNNPACK's float kernels that are consistent with each other only (its faster tile-k variants round
    # differently); integer dots are exact either way.
    "xla_cpu_enable_platform_dependent_math": "false",
}


def pin_exact_cpu_flags() -> None:
    """Add EXACT_CPU_FLAGS to XLA_FLAGS (before XLA reads them: the first computation). A flag the user set
    is kept, with a warning: that host's exactness is then the user's to check (tests/test_exactness.py)."""
    flags = os.environ.get("XLA_FLAGS", "")
    words = flags.split()
    for name, value in EXACT_CPU_FLAGS.items():
        given = [w for w in words if w.split("=", 1)[0] == f"--{name}"]
        if not given:
            words.append(f"--{name}={value}")
        elif given[-1] != f"--{name}={value}":
            log.warning("XLA_FLAGS sets %s; exactness across chunk layouts assumes --%s=%s", given[-1], name, value)
    os.environ["XLA_FLAGS"] = " ".join(words)


def configure_environment(platform: str | None = None) -> None:
    """Set XLA environment variables; a no-op for settings the user already chose."""
    if "jax" in sys.modules:
        log.debug("jax already imported; XLA environment settings may not take effect")
    pin_exact_cpu_flags()
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
    return "float32", "CPU: pinned, so that results do not depend on the host's bfloat16 support"


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


def choose_overlap(override: bool | None = None) -> tuple[bool, str]:
    """Whether decode steps sample inside the decode program with the next step queued before the previous
    one's tokens are read (EngineConfig.fused_sampling + SchedulerConfig.overlap_steps), and why.

    On an accelerator the host's work between steps (update, delivery, dispatch) otherwise leaves the device
    idle: 8 streams ran at 0.59x the engine's step rate on a TPU v5e (benchmarks/serving_loop.py). On CPU the
    device is the host's own cores, and the fused programs add two per attention bucket to every start."""
    import jax

    if override is not None:
        return override, "override"
    platform = jax.devices()[0].platform
    if platform == "cpu":
        return False, "CPU: the host's cores are the device, so there is little idle time to overlap"
    return True, f"{platform}: host work between steps overlaps the device"


def choose_transfer_sizes() -> tuple[int, ...]:
    """Sizes below the attention buckets in which slot ranges move to and from the host
    (EngineConfig.transfer_sizes). On an accelerator a save copies its whole covering size off the device, so
    a short chat's KV should not travel as 1,024 positions; on CPU the copy is a memcpy (none: two programs
    fewer to compile at each start)."""
    import jax

    return () if jax.devices()[0].platform == "cpu" else (128, 512)
