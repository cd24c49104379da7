"""The slot KV pool: one cache per cache-owning layer, allocated once for S slots.

Global-attention layers keep `max_len` positions per slot. Sliding-window layers keep a ring of
`min(window + ring_slack, max_len)` positions indexed by `position % ring` (the slack lets a short
chunk be written before it is read). KV-shared layers own nothing and read
their source layer's cache. A slot's contents are a pure function of the tokens written into it.

Layout per owning layer i: `{"k": [S, L_i, kv_heads, head_dim], "v": [S, L_i, kv_heads, head_dim]}`;
with int8 storage also `"k_scale"`, `"v_scale"`: [S, L_i, kv_heads] float32 per-position scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from core.config import LayerSpec, ModelConfig

KVCache = dict[str, dict[str, jax.Array]]


@dataclass(frozen=True)
class CacheSpec:
    num_slots: int
    max_len: int
    dtype: str = "float32"  # the compute dtype, or "int8" for quantized storage
    ring_slack: int = 0  # extra ring positions, so a chunk of ring_slack + 1 tokens may be written first

    @property
    def quantized(self) -> bool:
        return self.dtype == "int8"


def cache_length(cfg: ModelConfig, layer: LayerSpec, max_len: int, ring_slack: int = 0) -> int:
    return min(cfg.sliding_window + ring_slack, max_len) if layer.is_sliding else max_len


def layer_key(layer_index: int) -> str:
    return f"layer{layer_index}"


def init_cache(cfg: ModelConfig, spec: CacheSpec) -> KVCache:
    cache: KVCache = {}
    for layer in cfg.cache_owners:
        length = cache_length(cfg, layer, spec.max_len, spec.ring_slack)
        shape = (spec.num_slots, length, layer.num_kv_heads, layer.head_dim)
        entry = {"k": jnp.zeros(shape, spec.dtype), "v": jnp.zeros(shape, spec.dtype)}
        if spec.quantized:
            entry["k_scale"] = jnp.zeros(shape[:3], jnp.float32)
            entry["v_scale"] = jnp.zeros(shape[:3], jnp.float32)
        cache[layer_key(layer.index)] = entry
    return cache


def cache_bytes_per_slot(cfg: ModelConfig, spec: CacheSpec) -> int:
    itemsize = np.dtype(spec.dtype).itemsize
    total = 0
    for layer in cfg.cache_owners:
        positions = cache_length(cfg, layer, spec.max_len, spec.ring_slack) * layer.num_kv_heads
        total += 2 * positions * layer.head_dim * itemsize
        if spec.quantized:
            total += 2 * positions * 4
    return total
