"""Model configuration for the Gemma 3 / Gemma 4 text models, parsed from an HF-style config dict.

The parsed form is a frozen (hashable) dataclass so that it can be a static argument of jitted steps.
Per-layer facts (attention kind, head size, which layer's KV cache it reads, MLP width) are resolved
once here, so the model code never re-derives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SLIDING = "sliding_attention"
GLOBAL = "full_attention"
SUPPORTED_MODEL_TYPES = ("gemma3_text", "gemma3", "gemma4_text", "gemma4")


class ConfigError(ValueError):
    """The checkpoint's config describes something this implementation does not support."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type. `inv_freq` has head_dim // 2 entries (zeros: not rotated)."""

    theta: float
    rope_type: str
    factor: float
    partial_rotary_factor: float

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """float32 [head_dim // 2], computed in float32 exactly as transformers does."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        if self.rope_type in ("default", "linear"):
            freqs = np.float32(1.0) / (np.float32(self.theta) ** exponents)
        elif self.rope_type == "proportional":
            rotated = int(self.partial_rotary_factor * head_dim // 2)
            freqs = np.float32(1.0) / (np.float32(self.theta) ** exponents[:rotated])
            freqs = np.concatenate([freqs, np.zeros(head_dim // 2 - rotated, np.float32)])
        else:
            raise ConfigError(f"unsupported rope_type {self.rope_type!r}")
        if self.rope_type != "default":
            freqs = freqs / np.float32(self.factor)
        return freqs.astype(np.float32)


@dataclass(frozen=True)
class LayerSpec:
    """Static facts about one decoder layer."""

    index: int
    kind: str  # SLIDING or GLOBAL
    head_dim: int
    num_kv_heads: int
    kv_source: int  # the layer whose K/V this layer attends to (itself when it owns a cache)
    mlp_dim: int
    k_eq_v: bool  # the value projection is the key projection (Gemma 4 `attention_k_eq_v`, global layers)

    @property
    def owns_cache(self) -> bool:
        return self.kv_source == self.index

    @property
    def is_sliding(self) -> bool:
        return self.kind == SLIDING


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "gemma3" or "gemma4"
    vocab_size: int
    hidden_size: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    sliding_window: int
    rms_norm_eps: float
    query_scale: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    rope: tuple[tuple[str, RopeSpec], ...]  # (layer kind, spec), hashable stand-in for a dict
    tie_word_embeddings: bool
    ple_dim: int  # per-layer-embedding width; 0 when the model has none
    ple_vocab_size: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    raw: tuple[tuple[str, Any], ...] = field(default=(), compare=False, hash=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def norm_offset(self) -> float:
        """Gemma 3 RMSNorm multiplies by (1 + w); Gemma 4 by w."""
        return 1.0 if self.family == "gemma3" else 0.0

    @property
    def has_v_norm(self) -> bool:
        return self.family == "gemma4"

    @property
    def has_layer_scalar(self) -> bool:
        return self.family == "gemma4"

    @property
    def cache_owners(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.owns_cache)

    def rope_for(self, kind: str) -> RopeSpec:
        return dict(self.rope)[kind]

    @staticmethod
    def from_hf_dict(config: dict[str, Any]) -> ModelConfig:
        return _parse(config)


def _parse(cfg: dict[str, Any]) -> ModelConfig:
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        outer = cfg
        cfg = {**cfg["text_config"]}
        cfg.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings", True))
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
    family = "gemma4" if model_type.startswith("gemma4") else "gemma3"
    if cfg.get("enable_moe_block"):
        raise ConfigError("Gemma 4 mixture-of-experts blocks (enable_moe_block) are not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional attention is not supported by a causal server")

    num_layers = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    num_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    kv_heads = int(cfg.get("num_key_value_heads", num_heads))
    layer_types = _layer_types(cfg, num_layers, family)
    overrides = _per_layer_overrides(cfg, layer_types, family)

    kv_sources = _kv_sources(layer_types, int(cfg.get("num_kv_shared_layers") or 0))
    double_wide = bool(cfg.get("use_double_wide_mlp"))
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    layers = []
    for i, kind in enumerate(layer_types):
        shared = kv_sources[i] != i
        mlp_dim = int(cfg["intermediate_size"]) * (2 if double_wide and shared else 1)
        layers.append(
            LayerSpec(
                index=i,
                kind=kind,
                head_dim=int(overrides[i].get("head_dim", head_dim)),
                num_kv_heads=int(overrides[i].get("num_key_value_heads", kv_heads)),
                kv_source=kv_sources[i],
                mlp_dim=mlp_dim,
                k_eq_v=k_eq_v and kind == GLOBAL,
            )
        )
    for layer in layers:
        src = layers[layer.kv_source]
        if (src.head_dim, src.num_kv_heads) != (layer.head_dim, layer.num_kv_heads):
            raise ConfigError(f"layer {layer.index} shares KV with layer {src.index} of another shape")

    # Gemma 4 relies on q_norm/k_norm instead of 1/sqrt(d).
    query_scale = float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5 if family == "gemma3" else 1.0
    eos = cfg.get("eos_token_id", 1)
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])) if eos is not None else ()
    ple_dim = int(cfg.get("hidden_size_per_layer_input") or 0) if family == "gemma4" else 0
    return ModelConfig(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_heads=num_heads,
        layers=tuple(layers),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        query_scale=query_scale,
        attn_logit_softcap=_opt_float(cfg.get("attn_logit_softcapping")),
        final_logit_softcap=_opt_float(cfg.get("final_logit_softcapping")),
        rope=tuple(sorted(_rope_specs(cfg, family).items())),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        ple_dim=ple_dim,
        ple_vocab_size=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) if ple_dim else 0,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        bos_token_id=_opt_int(cfg.get("bos_token_id", 2)),
        eos_token_ids=eos_ids,
        pad_token_id=_opt_int(cfg.get("pad_token_id", 0)),
        raw=tuple(sorted((k, repr(v)) for k, v in cfg.items())),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _layer_types(cfg: dict[str, Any], num_layers: int, family: str) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = set(types) - {SLIDING, GLOBAL}
    if unknown:
        raise ConfigError(f"unsupported layer types {sorted(unknown)}")
    if family == "gemma4" and types[-1] != GLOBAL:
        types[-1] = GLOBAL  # transformers forces the last Gemma 4 layer to full attention
    return types


def _per_layer_overrides(cfg: dict[str, Any], layer_types: list[str], family: str) -> list[dict[str, Any]]:
    """Head size / KV-head overrides per layer, from either Gemma 4 config form."""
    out: list[dict[str, Any]] = [{} for _ in layer_types]
    if family != "gemma4":
        return out
    per_layer = cfg.get("per_layer_config")
    if per_layer:
        for key, value in per_layer.items():
            if not isinstance(value, dict):
                continue
            targets = [int(key)] if str(key).isdigit() else [i for i, t in enumerate(layer_types) if t == key]
            for i in targets:
                out[i].update(value)
        return out
    # Published form: `global_head_dim` (and optionally `num_global_key_value_heads`) for full layers.
    global_override: dict[str, Any] = {"head_dim": int(cfg.get("global_head_dim", 512))}
    if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
        global_override["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
    for i, kind in enumerate(layer_types):
        if kind == GLOBAL:
            out[i].update(global_override)
    return out


def _kv_sources(layer_types: list[str], num_shared: int) -> list[int]:
    """Layers from `first_shared` on read the cache of the last earlier layer of their own type."""
    n = len(layer_types)
    first_shared = n - num_shared
    sources = list(range(n))
    for i in range(first_shared, n):
        owners = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ConfigError(f"KV-shared layer {i} ({layer_types[i]}) has no earlier layer of its type")
        sources[i] = owners[-1]
    return sources


def _rope_specs(cfg: dict[str, Any], family: str) -> dict[str, RopeSpec]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (SLIDING in params or GLOBAL in params):
        per_type = {kind: dict(params.get(kind) or {}) for kind in (SLIDING, GLOBAL)}
    else:
        # Older flat form: rope_theta / rope_local_base_freq / rope_scaling.
        scaling = cfg.get("rope_scaling") or {}
        flat = dict(params or {})
        per_type = {
            GLOBAL: {"rope_theta": flat.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)), **scaling},
            SLIDING: {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0), "rope_type": "default"},
        }
        if family == "gemma4" and not scaling:
            per_type[GLOBAL].setdefault("rope_type", "proportional")
            per_type[GLOBAL].setdefault("partial_rotary_factor", 0.25)
    defaults = {SLIDING: 10_000.0, GLOBAL: 1_000_000.0}
    specs = {}
    for kind, p in per_type.items():
        rope_type = p.get("rope_type") or p.get("type") or "default"
        specs[kind] = RopeSpec(
            theta=float(p.get("rope_theta") or defaults[kind]),
            rope_type=str(rope_type),
            factor=float(p.get("factor") or 1.0),
            partial_rotary_factor=float(p.get("partial_rotary_factor") or 1.0),
        )
        specs[kind].inv_freq(2)  # reject unsupported rope types at parse time
    return specs


def expected_tensor_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Canonical (prefix-free HF) tensor names and shapes, plus the names that may be absent.

    KV-shared layers in published Gemma 4 checkpoints still carry k/v projections that transformers
    ignores; they are listed as optional so a checkpoint with or without them loads.
    """
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    optional: set[str] = set()
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.tie_word_embeddings:
        optional.add("lm_head.weight")  # tied checkpoints may still carry a copy
    if cfg.ple_dim:
        total = cfg.num_layers * cfg.ple_dim
        shapes["embed_tokens_per_layer.weight"] = (cfg.ple_vocab_size, total)
        shapes["per_layer_model_projection.weight"] = (total, h)
        shapes["per_layer_projection_norm.weight"] = (cfg.ple_dim,)
    for layer in cfg.layers:
        p = f"layers.{layer.index}."
        q_out = cfg.num_heads * layer.head_dim
        kv_out = layer.num_kv_heads * layer.head_dim
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "self_attn.q_norm.weight"] = (layer.head_dim,)
        kv_names = {
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.k_norm.weight": (layer.head_dim,),
        }
        if not layer.k_eq_v:
            kv_names[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes.update(kv_names)
        if not layer.owns_cache:
            optional.update(kv_names)
        shapes[p + "mlp.gate_proj.weight"] = (layer.mlp_dim, h)
        shapes[p + "mlp.up_proj.weight"] = (layer.mlp_dim, h)
        shapes[p + "mlp.down_proj.weight"] = (h, layer.mlp_dim)
        if cfg.has_layer_scalar:
            shapes[p + "layer_scalar"] = (1,)
        if cfg.ple_dim:
            shapes[p + "per_layer_input_gate.weight"] = (cfg.ple_dim, h)
            shapes[p + "per_layer_projection.weight"] = (h, cfg.ple_dim)
            shapes[p + "post_per_layer_input_norm.weight"] = (h,)
    return shapes, optional

