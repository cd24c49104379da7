"""The server's YAML configuration (`configs/default.yaml` documents every field)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from agents.runtime import RuntimeOptions
from agents.service import DEFAULT_MAX_TOKENS
from agents.store.lease import LEASE_S
from agents.store.redis_store import DEFAULT_PREFIX, DEFAULT_TIMEOUT_S
from server import defaults

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


# The runtime's defaults (each stated once, by the part that owns it); the sections below take theirs from here.
RUNTIME = RuntimeOptions()
DEFAULT_ADAPTER_SLOTS = 8  # adapter slots when adapters are in use and the config does not say how many


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _increasing_sizes(value: list[int], info: ValidationInfo) -> list[int]:
    """A list of sizes (chunk or carry widths) must be strictly increasing positive integers."""
    if sorted(set(value)) != value or value[0] < 1:
        raise ValueError(f"{info.field_name} must be strictly increasing positive integers")
    return value


class ModelSection(_Section):
    name: str = RUNTIME.model  # "default", an HF checkpoint directory or a .gguf file
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # None: chosen per device
    # None: chosen per device (int8 on CPU with W8A8, else the compute dtype); "compute" forces the latter
    kv_dtype: Literal["compute", "int8", "float32", "bfloat16", "float16"] | None = None
    precision: Literal["float", "f32", "w8a8"] | None = None  # None: chosen per device
    # Gemma 4's per-layer-embedding table (E2B: 2.35e9 values): as the compute dtype, or packed int4 with per-row
    # scales (a quarter of bfloat16's bytes); a model without one ignores it.
    per_layer_embeddings: Literal["compute", "int4"] = "compute"
    # For a checkpoint without a chat template of its own: a plain transcript (what a base model continues)
    # or Gemma's turn tokens (an instruction-tuned checkpoint that ships no template).
    chat_template: Literal["transcript", "gemma-turns"] = RUNTIME.chat_template
    slots: int = Field(RUNTIME.num_slots, ge=1)
    max_len: int = Field(RUNTIME.max_len, ge=16)
    chunk_sizes: list[int] = Field(default_factory=lambda: list(RUNTIME.chunk_sizes), min_length=1)
    compile_cache: str | None = None  # directory; None: ~/.cache/slotserve/xla; "off": disabled
    background_compile: bool = RUNTIME.background_compile  # ready once a short request's programs are compiled

    @field_validator("chunk_sizes")
    @classmethod
    def _increasing(cls, value: list[int], info: ValidationInfo) -> list[int]:
        return _increasing_sizes(value, info)


class SchedulerSection(_Section):
    prefill_budget: int | None = Field(RUNTIME.prefill_budget, ge=1)
    max_waiting: int = Field(RUNTIME.max_waiting, ge=1)
    prefix_caching: bool = RUNTIME.prefix_caching
    speculative: bool = RUNTIME.speculative  # prompt-lookup speculation (same tokens as plain decoding)
    batched_speculation: bool = RUNTIME.batched_speculation  # several streams verify drafts in one pass
    chunk_in_decode: bool = RUNTIME.chunk_in_decode  # a decode step carries one short prompt chunk
    carry_sizes: list[int] = Field(default_factory=lambda: list(RUNTIME.carry_sizes), min_length=1)
    overlap_steps: bool | None = RUNTIME.overlap_steps  # next decode step queued before tokens are read
    host_tier_bytes: int = Field(RUNTIME.host_tier_bytes, ge=0)
    disk_tier_dir: str | None = RUNTIME.disk_tier_dir  # None: ~/.cache/slotserve/kv; "off": no disk tier
    disk_tier_bytes: int = Field(RUNTIME.disk_tier_bytes, ge=0)
    disk_tier_flush_s: float = Field(RUNTIME.disk_tier_flush_s, ge=0)

    @field_validator("carry_sizes")
    @classmethod
    def _increasing(cls, value: list[int], info: ValidationInfo) -> list[int]:
        return _increasing_sizes(value, info)

    @field_validator("disk_tier_dir", mode="before")
    @classmethod
    def _off(cls, value: object) -> object:
        return "off" if value is False else value  # YAML reads a bare `off` as false


class GrammarSection(_Section):
    backend: Literal["llguidance", "outlines-core"] = RUNTIME.grammar_backend  # type: ignore[assignment]
    compile_timeout_s: float = Field(RUNTIME.grammar_compile_timeout_s, gt=0)
    max_schema_bytes: int = Field(RUNTIME.max_schema_bytes, ge=1)


class AdaptersSection(_Section):
    """LoRA adapters on the resident model (docs/lora.md)."""

    # Engine slots, compiled into every step. None: DEFAULT_ADAPTER_SLOTS when adapters can be named (dirs are
    # given, or an agent file names one), else 0: no adapter path in any step.
    slots: int | None = Field(None, ge=0, le=64)
    max_rank: int = Field(RUNTIME.adapter_rank, ge=1, le=256)
    # What the slots store and multiply in: the compute dtype, or bfloat16 (half the bytes a decode step under
    # many adapters reads; the adapter products' inputs rounded to bfloat16, accumulated in float32).
    dtype: Literal["compute", "bfloat16"] = "compute"
    dirs: list[str] = Field(default_factory=list)  # adapters named over HTTP must lie inside one; none: off
    base_agent: str = "assistant"  # whose settings an adapter loaded through vLLM's route gets

    def slot_count(self, named_in_files: bool) -> int:
        if self.slots is not None:
            return self.slots
        return DEFAULT_ADAPTER_SLOTS if self.dirs or named_in_files else 0


class AuthSection(_Section):
    enabled: bool = False
    admin_keys: list[str] = Field(default_factory=list)  # Bearer keys for /admin (and any agent)


class LimitsSection(_Section):
    max_body_bytes: int = Field(1_048_576, ge=1024)  # larger request bodies: 413
    max_prompt_tokens: int | None = Field(None, ge=1)  # besides each agent's context_limit and the slot length
    default_max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1)  # when neither the request nor the agent sets max_tokens
    max_tokens: int | None = Field(None, ge=1)  # cap on generated tokens per request (None: the slot length)


class StoreSection(_Section):
    url: str = "memory://"  # memory:// or redis://host:port/db
    prefix: str = DEFAULT_PREFIX  # Redis key prefix
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0)  # every Redis call; beyond it requests get 503 store_unavailable
    session_ttl_s: float = Field(86_400, ge=0)  # 0: sessions never expire
    max_sessions_per_agent: int = Field(0, ge=0)  # 0: no limit
    # A crashed server's hold on a running turn (its session, its Idempotency-Key) lapses this long after it
    # last renewed it: the session's next turn and the retry may run then.
    lease_s: float = Field(LEASE_S, gt=0)


class ServerSection(_Section):
    host: str = defaults.HOST
    port: int = Field(defaults.PORT, ge=0, le=65535)
    graceful_shutdown_s: float = Field(30.0, ge=0)  # in-flight streams get this long, then are ended
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_json: bool = True
    # X-Slotserve-Replica on every response (which replica behind a router answered); None: hostname:port
    replica_name: str | None = Field(None, pattern=r"^[\x21-\x7e]{1,128}$")


class ServerConfig(_Section):
    model: ModelSection = Field(default_factory=ModelSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    grammar: GrammarSection = Field(default_factory=GrammarSection)
    adapters: AdaptersSection = Field(default_factory=AdaptersSection)
    auth: AuthSection = Field(default_factory=AuthSection)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    store: StoreSection = Field(default_factory=StoreSection)
    server: ServerSection = Field(default_factory=ServerSection)
    agents_dir: str | None = "configs/agents"  # relative paths: from the repository root; null: none

    @field_validator("auth")
    @classmethod
    def _keys_when_enabled(cls, value: AuthSection) -> AuthSection:
        if value.enabled and not value.admin_keys:
            raise ValueError("auth.enabled needs at least one admin key")
        return value

    def agents_path(self) -> Path | None:
        if self.agents_dir is None:
            return None
        path = Path(self.agents_dir)
        return path if path.is_absolute() else REPO_ROOT / path

    def adapter_dirs(self) -> list[Path]:
        """`adapters.dirs`, relative ones from the repository root."""
        return [p if p.is_absolute() else REPO_ROOT / p for p in map(Path, self.adapters.dirs)]

    def runtime_options(self, adapters_in_files: bool = False) -> RuntimeOptions:
        """What `build_runtime` takes; ``adapters_in_files``: some agent file names an adapter."""
        m, s, g = self.model, self.scheduler, self.grammar
        return RuntimeOptions(
            model=m.name, dtype=m.dtype, kv_dtype=m.kv_dtype, precision=m.precision, chat_template=m.chat_template,
            int4_ple=m.per_layer_embeddings == "int4",
            num_slots=m.slots,
            max_len=m.max_len,
            chunk_sizes=tuple(m.chunk_sizes), compile_cache=m.compile_cache,
            background_compile=m.background_compile, prefill_budget=s.prefill_budget,
            max_waiting=s.max_waiting, prefix_caching=s.prefix_caching, speculative=s.speculative,
            batched_speculation=s.batched_speculation, chunk_in_decode=s.chunk_in_decode,
            carry_sizes=tuple(s.carry_sizes),
            overlap_steps=s.overlap_steps,
            host_tier_bytes=s.host_tier_bytes, disk_tier_dir=s.disk_tier_dir, disk_tier_bytes=s.disk_tier_bytes,
            disk_tier_flush_s=s.disk_tier_flush_s,
            adapter_slots=self.adapters.slot_count(adapters_in_files), adapter_rank=self.adapters.max_rank,
            adapter_dtype=None if self.adapters.dtype == "compute" else self.adapters.dtype,
            grammar_backend=g.backend, grammar_compile_timeout_s=g.compile_timeout_s,
            max_schema_bytes=g.max_schema_bytes,
        )


class ConfigError(ValueError):
    pass


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServerConfig:
    """The config from ``path`` (default: configs/default.yaml), with dotted ``overrides`` applied
    (e.g. {"server.port": 9000, "store.url": "redis://..."})."""
    source = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{source}: cannot read YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: invalid config: {e}") from e
