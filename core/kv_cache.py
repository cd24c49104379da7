"""The slot KV pool: one cache per cache-owning layer, allocated once for S slots.

Every owning layer, sliding-window layers included, keeps all `max_len` positions of a slot at their
absolute index, so a slot's KV at position p is a pure function of tokens 0..p and any prefix [0, P) of a
slot can be copied, saved or restored however far the slot has moved on (docs/design-notes.md, "Sliding
layers keep every position"). Sliding layers still attend over only the last `window` positions: the model
reads them through a view of consecutive positions (`sliding_view_length`). KV-shared layers own nothing and
read their source layer's cache.

Layout per owning layer i: `{"k": [S, max_len, kv_heads, head_dim], "v": [S, max_len, kv_heads, head_dim]}`;
with int8 storage also `"k_scale"`, `"v_scale"`: [S, max_len, kv_heads] float32 per-position scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from core.config import ModelConfig

KVCache = dict[str, dict[str, jax.Array]]


@dataclass(frozen=True)
class CacheSpec:
    num_slots: int
    max_len: int
    dtype: str = "float32"  # the compute dtype, or "int8" for quantized storage

    @property
    def quantized(self) -> bool:
        return self.dtype == "int8"


def layer_key(layer_index: int) -> str:
    return f"layer{layer_index}"


def init_cache(cfg: ModelConfig, spec: CacheSpec) -> KVCache:
    """Zeros for every owning layer, made by one program: one dispatch instead of one per array, each of which
    would wait for the GIL again while another thread (a tokenizer loading) holds it."""
    return jax.jit(partial(_zero_cache, cfg, spec))()


def _zero_cache(cfg: ModelConfig, spec: CacheSpec) -> KVCache:
    cache: KVCache = {}
    for layer in cfg.cache_owners:
        shape = (spec.num_slots, spec.max_len, layer.num_kv_heads, layer.head_dim)
        entry = {"k": jnp.zeros(shape, spec.dtype), "v": jnp.zeros(shape, spec.dtype)}
        if spec.quantized:
            entry["k_scale"] = jnp.zeros(shape[:3], jnp.float32)
            entry["v_scale"] = jnp.zeros(shape[:3], jnp.float32)
        cache[layer_key(layer.index)] = entry
    return cache


def bytes_per_position(cfg: ModelConfig, dtype: str) -> int:
    """KV bytes one position of one slot takes over every owning layer (scales included)."""
    itemsize = np.dtype(dtype).itemsize
    total = 0
    for layer in cfg.cache_owners:
        total += 2 * layer.num_kv_heads * layer.head_dim * itemsize
        if dtype == "int8":
            total += 2 * layer.num_kv_heads * 4
    return total


def cache_bytes_per_slot(cfg: ModelConfig, spec: CacheSpec) -> int:
    return spec.max_len * bytes_per_position(cfg, spec.dtype)


def sliding_view_length(window: int, max_len: int, width: int, min_width: int, align: int = 1) -> int:
    """Positions a sliding layer reads for a call of `width` tokens per row: the window of the first query plus
    the chunk, and room to start the view at a multiple of `align` (`core.model.sliding_view_positions`).
    Calls up to `min_width` tokens (decode, speculative verify) share one length."""
    needed = window + max(width, min_width) - 1 + align - 1
    return min(-(-needed // align) * align, max_len)
