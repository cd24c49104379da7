"""Dtype policy and XLA environment set-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from core.device import choose_dtype


def test_explicit_override_wins_and_is_validated(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_DTYPE", "bfloat16")
    assert choose_dtype("float16") == ("float16", "override")
    assert choose_dtype() == ("bfloat16", "$SLOTSERVE_DTYPE")
    with pytest.raises(ValueError, match="int3"):
        choose_dtype("int3")


def test_cpu_compute_dtype_is_float32_on_every_host(monkeypatch):
    """A bfloat16 step can be the faster one on a CPU with AMX or AVX-512 BF16; choosing by host would make
    the numbers (and every cached KV) depend on the host, so CPU is pinned to float32."""
    monkeypatch.delenv("SLOTSERVE_DTYPE", raising=False)
    dtype, reason = choose_dtype()
    assert dtype == "float32" and "pinned" in reason


def xla_environment(**extra: str) -> dict[str, str | None]:
    """The XLA variables configure_environment() leaves in a fresh process (jax never imported)."""
    code = (
        "import json, os, sys\n"
        "from core.device import configure_environment\n"
        "configure_environment()\n"
        "assert 'jax' not in sys.modules\n"
        "print(json.dumps({k: os.environ.get(k) for k in ('XLA_PYTHON_CLIENT_PREALLOCATE', 'XLA_FLAGS')}))\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "SLOTSERVE_XLA_AUTOTUNE_LEVEL")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, **extra},
                         check=True)
    return json.loads(out.stdout)


def test_xla_environment_is_set_before_jax_is_imported():
    values = xla_environment()
    assert values["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    # GEMM autotuning is left to XLA's default (on): it halves the GPU decode step.
    assert "xla_gpu_autotune_level" not in (values["XLA_FLAGS"] or "")


def test_autotune_level_can_be_set_but_never_overrides_the_users_xla_flags():
    assert "--xla_gpu_autotune_level=0" in xla_environment(SLOTSERVE_XLA_AUTOTUNE_LEVEL="0")["XLA_FLAGS"]
    flags = xla_environment(SLOTSERVE_XLA_AUTOTUNE_LEVEL="0", XLA_FLAGS="--xla_gpu_autotune_level=2")["XLA_FLAGS"]
    assert [f for f in flags.split() if "autotune" in f] == ["--xla_gpu_autotune_level=2"]


RESTARTED_PROCESS = (
        "import sys\n"
        "from core.device import configure_environment\n"
        "from core.compile_cache import enable_compile_cache\n"
        "configure_environment()\n"
        "import jax, jax.numpy as jnp\n"
        "hits = []\n"
        "jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))\n"
        "enable_compile_cache(sys.argv[1])\n"
        "print(jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((16, 16))).sum().item())\n"
        "print(sum(h == '/jax/compilation_cache/cache_hits' for h in hits))\n"
)


def start_process(cache) -> tuple[str, int]:
    """A new process computing one jitted program: its output, and how many programs came from the cache."""
    run = subprocess.run([sys.executable, "-c", RESTARTED_PROCESS, str(cache)], capture_output=True, text=True,
                         check=True)
    output, hits = run.stdout.split()
    return output, int(hits)


def test_a_damaged_compile_cache_entry_is_deleted_and_compiled_again(tmp_path):
    from core.compile_cache import ENTRY_SUFFIX, MANIFEST

    cold, hits = start_process(tmp_path)
    assert hits == 0
    entries = sorted(tmp_path.glob(f"*{ENTRY_SUFFIX}"))
    assert entries
    # A crash mid-write: truncated before any start recorded it. Not used; compiled and stored again.
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    assert start_process(tmp_path) == (cold, 0)
    assert start_process(tmp_path) == (cold, len(entries))  # the rebuilt entries serve the next start
    assert json.loads((tmp_path / MANIFEST).read_text()).keys() == {e.name for e in entries}
    # One byte flipped in an entry the manifest knows: its checksum differs, so it is replaced too.
    damaged = bytearray(entries[0].read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    entries[0].write_bytes(bytes(damaged))
    assert start_process(tmp_path) == (cold, len(entries) - 1)
    assert start_process(tmp_path) == (cold, len(entries))


def test_persistent_compile_cache_serves_a_restarted_process(tmp_path):
    first, second = start_process(tmp_path), start_process(tmp_path)
    assert first[1] == 0 and second[1] >= 1
    assert first[0] == second[0]


def test_precision_defaults_to_w8a8_on_cpu_and_can_be_overridden(monkeypatch):
    from core.device import choose_precision

    monkeypatch.delenv("SLOTSERVE_PRECISION", raising=False)
    precision, reason = choose_precision()
    assert precision == "w8a8" and reason.startswith("CPU")
    assert choose_precision("f32") == ("float", "override")
    assert choose_precision("float") == ("float", "override")
    monkeypatch.setenv("SLOTSERVE_PRECISION", "float")
    assert choose_precision() == ("float", "$SLOTSERVE_PRECISION")
    with pytest.raises(ValueError, match="w4a4"):
        choose_precision("w4a4")


def test_server_config_takes_the_precision():
    from server.config import ConfigError, load_config

    assert load_config().runtime_options().precision is None  # chosen per device
    assert load_config(overrides={"model.precision": "w8a8"}).runtime_options().precision == "w8a8"
    assert load_config(overrides={"model.precision": "f32"}).runtime_options().precision == "f32"
    with pytest.raises(ConfigError, match="precision"):
        load_config(overrides={"model.precision": "int4"})


def test_kv_dtype_is_int8_with_w8a8_on_cpu_and_can_be_overridden(monkeypatch):
    from core.device import choose_kv_dtype

    monkeypatch.delenv("SLOTSERVE_KV_DTYPE", raising=False)
    kv, reason = choose_kv_dtype(None, "w8a8")
    assert kv == "int8" and "W8A8" in reason
    assert choose_kv_dtype(None, "float") == (None, "the compute dtype")  # the f32 reference stays exact
    assert choose_kv_dtype("compute", "w8a8") == (None, "override")
    assert choose_kv_dtype("int8", "float") == ("int8", "override")
    monkeypatch.setenv("SLOTSERVE_KV_DTYPE", "float32")
    assert choose_kv_dtype(None, "w8a8") == ("float32", "$SLOTSERVE_KV_DTYPE")
    with pytest.raises(ValueError, match="int4"):
        choose_kv_dtype("int4", "w8a8")


def test_server_config_and_cli_take_the_kv_dtype():
    import argparse

    from server.config import ConfigError, load_config
    from server.run import config_overrides

    assert load_config().runtime_options().kv_dtype is None  # chosen per device and precision
    assert load_config(overrides={"model.kv_dtype": "compute"}).runtime_options().kv_dtype == "compute"
    with pytest.raises(ConfigError, match="kv_dtype"):
        load_config(overrides={"model.kv_dtype": "int4"})
    args = argparse.Namespace(host=None, port=None, redis_url=None, model=None, precision=None, kv_dtype="int8")
    assert config_overrides(args) == {"model.kv_dtype": "int8"}


def test_every_default_is_stated_once_and_the_documented_yaml_matches_it():
    from agents.runtime import RuntimeOptions
    from core.engine import EngineConfig
    from scheduler.grammar import GrammarCompiler
    from scheduler.kv_manager import CacheConfig
    from scheduler.scheduler import SchedulerConfig
    from server.config import DEFAULT_CONFIG, ServerConfig, load_config

    # configs/default.yaml documents the defaults: it must say exactly what the code does without it.
    assert load_config(DEFAULT_CONFIG) == ServerConfig()
    options, engine, scheduler, cache = RuntimeOptions(), EngineConfig(), SchedulerConfig(), CacheConfig()
    assert ServerConfig().runtime_options() == options
    assert (options.num_slots, options.max_len, options.chunk_sizes, options.carry_sizes) == (
        engine.num_slots, engine.max_len, engine.chunk_sizes, engine.carry_sizes)
    assert (options.max_waiting, options.prefix_caching, options.host_tier_bytes, options.speculative) == (
        scheduler.max_waiting, cache.prefix_caching, cache.host_tier_bytes, scheduler.speculative)
    compiler = GrammarCompiler.__init__.__defaults__
    assert (options.grammar_backend, options.grammar_compile_timeout_s, options.max_schema_bytes) == compiler[:3]


def test_generate_cli_takes_the_runtime_defaults_unless_given():
    from server.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert (args.model, args.slots, args.max_len) == (None, None, None)  # RuntimeOptions fills them
    args = build_parser().parse_args(["generate", "--prompt", "x", "--slots", "2", "--max-len", "64"])
    assert (args.slots, args.max_len) == (2, 64)


def test_queued_decode_steps_and_small_transfers_are_for_accelerators_and_configurable():
    """On CPU the device is the host's cores: no fused sampler, no queued steps, no extra transfer programs
    unless asked; the server config's `scheduler.overlap_steps` reaches the runtime options."""
    from agents.runtime import engine_config
    from core.device import choose_overlap, choose_transfer_sizes
    from core.engine import EngineConfig
    from server.config import load_config

    assert choose_overlap()[0] is False and choose_overlap(True) == (True, "override")
    assert choose_transfer_sizes() == ()
    assert load_config().runtime_options().overlap_steps is None
    options = load_config(overrides={"scheduler.overlap_steps": True}).runtime_options()
    assert options.overlap_steps is True
    # The choice reaches the engine: queued steps feed tokens back through the fused sampler.
    overlap, _ = choose_overlap(options.overlap_steps)
    assert engine_config(options, None, overlap).fused_sampling is True
    assert engine_config(options, "int8", False) == EngineConfig(kv_dtype="int8", rows_verify_width=3,
                                                                 chunk_in_decode=True)


def test_carry_sizes_reach_the_engine_and_bad_ones_are_refused():
    """`scheduler.carry_sizes` sets the widths carried chunks are padded to; a list that is not strictly
    increasing and positive is a configuration error naming the field."""
    from agents.runtime import engine_config
    from server.config import ConfigError, load_config

    options = load_config(overrides={"scheduler.carry_sizes": [16, 32]}).runtime_options()
    assert engine_config(options, "int8", False).carry_sizes == (16, 32)
    for bad in ([64, 32], [0, 32], [32, 32]):
        with pytest.raises(ConfigError, match="carry_sizes must be strictly increasing"):
            load_config(overrides={"scheduler.carry_sizes": bad})
