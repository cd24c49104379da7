"""Gemma 3 / Gemma 4 text decoder in plain JAX, written once against the slot KV pool.

One body, `hidden_states` (embedding, decoder layers, final norm), serves every use through small entry points
that differ only in which logits they return: `prefill_chunk` (a prompt chunk into a slot from any position,
continuing what the slot holds) and `decode_step` (one token for every slot at once) give each row's logits at
its last real token; `verify_chunk` (speculative verify) and `sequence_logits` (scoring a whole sequence) give
them at every token; `decode_with_chunk` runs a decode step and another slot's prompt chunk in one pass whose
weight products take both (`grouped_hidden_states`). Each layer that owns a cache writes its chunk's K/V into
it at the chunk's absolute positions before any query reads it (a layer sharing another's cache runs after
that layer has written it); every query then attends over the cache alone (global layers over a prefix of the
positions, sliding layers over a view of the last ones), so a chunk reads its own keys exactly as later decode
steps will read them.

Shapes: B rows (slots), T tokens per row, H hidden, nh query heads, kh KV heads, d head size,
L cache positions read (an attention bucket, or a sliding view), V vocab, P per-layer input size (Gemma 4).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core.config import ModelConfig
from core.kv_cache import KVCache, layer_key, sliding_view_length
from core.lora import group_key
from core.rotation import rotate

Params = dict[str, Any]
MASK_VALUE = -1e30  # finite: a fully masked (padding / idle) row yields a uniform softmax, never NaN


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in float32. `scale` is the effective multiplier (Gemma 3's 1+w folded at load time)."""
    x32 = x.astype(jnp.float32)
    out = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale is not None:
        out = out * scale.astype(jnp.float32)
    return out.astype(x.dtype)


# Products of fewer rows are padded to this many: XLA's CPU int8 dot has a slow path below 8 rows (the lm_head:
# ~10x), and a float product of one row runs a matrix-vector kernel that sums in another order than the
# matrix kernel, so a token's logits would depend on how many rows shared its call.
MIN_MATMUL_ROWS = 8


def linear(x: jax.Array, w: Any) -> jax.Array:
    """x [..., in] @ w [out, in]^T. `w` may be int8 storage {"q": int8 [out, in], "s": f32 [out]}
    (weight-only: dequantized into the float product), or W8A8 storage {"qa8": int8 [out, in], "s": f32 [out]}
    holding W @ R (core.rotation): x is rotated by R, quantized per row (symmetric, scale max|x|/127) and
    contracted int8 x int8 -> int32."""
    rows = math.prod(x.shape[:-1])
    if rows < MIN_MATMUL_ROWS:
        padded = jnp.zeros((MIN_MATMUL_ROWS, x.shape[-1]), x.dtype).at[:rows].set(x.reshape(rows, -1))
        return linear(padded, w)[:rows].reshape(*x.shape[:-1], -1)
    if isinstance(w, dict) and "qa8" in w:
        x8, x_scale = quantize_int8(rotate(x.astype(jnp.float32)))  # [..., in] int8, [...] f32
        acc = jax.lax.dot_general(x8, w["qa8"], (((x.ndim - 1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * (x_scale[..., None] * w["s"].astype(jnp.float32))
        return y.astype(x.dtype)
    if isinstance(w, dict):
        y = jnp.einsum("...i,oi->...o", x, w["q"].astype(x.dtype))
        return y * w["s"].astype(x.dtype)
    return jnp.einsum("...i,oi->...o", x, w)


def embedding_rows(table: Any, ids: jax.Array, dtype: Any) -> jax.Array:
    """Rows of an embedding table, which may be int8 {"q" or "qa8", "s"} or packed int4 {"q4", "s"}."""
    if not isinstance(table, dict):
        return jnp.take(table, ids, axis=0)
    if "q4" in table:
        packed = jnp.take(table["q4"], ids, axis=0)  # uint8 [..., n/2], low nibble first
        low = (packed & 0xF).astype(jnp.int8) - 8
        high = (packed >> 4).astype(jnp.int8) - 8
        q = jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    elif "qa8" in table:  # W8A8 rows are gathered too; they are stored rotated (see linear)
        q = jnp.take(table["qa8"], ids, axis=0).astype(jnp.float32) * jnp.take(table["s"], ids, axis=0)[..., None]
        return rotate(q).astype(dtype)  # R is its own inverse
    else:
        q = jnp.take(table["q"], ids, axis=0)
    return q.astype(dtype) * jnp.take(table["s"], ids, axis=0)[..., None].astype(dtype)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, d] for integer positions [B, T], computed in float32 like transformers, and
    materialized once per program (`materialized`): fused into their consumers, cos and sin were evaluated
    again for each element of every layer's query and key heads in each pass over them (the norm, each
    quantization, the K/V write: ~40 ms of a 512-token prefill chunk)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = materialized(jnp.cos(freqs)), materialized(jnp.sin(freqs))
    return (jnp.concatenate([cos, cos], axis=-1).astype(dtype), jnp.concatenate([sin, sin], axis=-1).astype(dtype))


def materialized(x: jax.Array) -> jax.Array:
    """x [..., n] float32, the same bits, as the output of a library product, which XLA cannot fuse into the
    ops that read it: x @ I, exact since every term but x's own is a zero (XLA:CPU drops optimization
    barriers before it fuses, so they do not keep an elementwise producer from being recomputed per use).
    Tiny inputs are the exception: XLA:CPU's product flushed subnormals to zero (2026-12-07) and a TPU v5e's
    keeps magnitudes down to ~1e-31 only; rope tables hold neither (tests/test_exactness.py)."""
    return jnp.einsum("...d,de->...e", x, jnp.eye(x.shape[-1], dtype=jnp.float32), precision="highest")


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, d]; rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def sliding_view_positions(ends: jax.Array, length: int, align: int) -> jax.Array:
    """Absolute position at each index of a sliding layer's view of `length` positions (sized by
    `core.kv_cache.sliding_view_length` for `align`), [B, L]: consecutive positions in ascending order from
    a multiple of `align`, the view ending at or after `ends` [B]. Positions past what a row holds are masked
    by the attention; none is negative.

    With `align` the float value sum's block (`value_sum_block`), every block of the view holds the same
    absolute positions in every call, whatever its chunk size or view length: the blocked sum then adds the
    same terms in the same order (a ring, position p at index p % L, changed that order with L)."""
    needed = length - align + 1  # at least what the length was sized for before alignment
    start = jnp.maximum(ends - needed, 0) // align * align
    return start[:, None] + jnp.arange(length)[None, :]


def query_key(q: jax.Array, keys: jax.Array, accumulate: Any = None) -> jax.Array:
    """Scores [B, T, kh, g, S] of queries q [B, T, kh, g, d] against keys [B, S, kh, d].

    Query-major: with one KV head (Gemma 3 270M, Gemma 4 E2B) the queries [B, T * g, d] are the rows of a plain
    batched matmul over the cache as it lies, and the scores come out in the order the queries came in, so
    neither side is transposed (a head-major [B, g, T, S] layout copied the int8 queries of every layer and
    the 5-D einsum made XLA transpose the cache, ~3x slower on CPU)."""
    b, t, kh, g, d = q.shape
    if kh != 1:
        return jnp.einsum("btkgd,bskd->btkgs", q, keys, preferred_element_type=accumulate)
    scores = jnp.einsum("bqd,bsd->bqs", q.reshape(b, t * g, d), keys[:, :, 0], preferred_element_type=accumulate)
    return scores.reshape(b, t, 1, g, keys.shape[1])


def prob_value(probs: jax.Array, values: jax.Array, accumulate: Any = None) -> jax.Array:
    """Weighted values [B, T, kh, g, d] from probs [B, T, kh, g, S] and values [B, S, kh, d] (see query_key)."""
    b, t, kh, g, length = probs.shape
    if kh != 1:
        return jnp.einsum("btkgs,bskd->btkgd", probs, values, preferred_element_type=accumulate)
    out = jnp.einsum("bqs,bsd->bqd", probs.reshape(b, t * g, length), values[:, :, 0],
                     preferred_element_type=accumulate)
    return out.reshape(b, t, 1, g, -1)


# Keys per block of the float probabilities x values sum on CPU (`blocked_prob_value`).
FLOAT_VALUE_BLOCK = 64


def value_sum_block(*, quantized_kv: bool) -> int:
    """Keys per block of the attention's value sum: 1 (one contraction over the whole view) where it is exact
    or no exactness is promised, FLOAT_VALUE_BLOCK for float KV on CPU.

    An int8 cache contracts int8 x int8 -> int32, exact in any order. A float contraction over the keys is
    not: YNNPACK splits and orders a long one by its length (a [*, 560] x [560, 256] product and the same
    terms in a [*, 1024] one with zeros after them round differently), and the view's length follows the
    chunk size and the attention bucket. Accelerators keep one contraction (no cross-host exactness there)."""
    return 1 if quantized_kv or jax.default_backend() != "cpu" else FLOAT_VALUE_BLOCK


def blocked_prob_value(probs: jax.Array, values: jax.Array, block: int) -> jax.Array:
    """prob_value summed block by block in key order: probs [B, T, kh, g, S], values [B, S, kh, d] ->
    [B, T, kh, g, d]. Each block is one contraction of `block` keys (one shape in every call, so one rounding)
    and the blocks add up one after the other, so with the keys at the same indices modulo `block`
    (`sliding_view_positions`) masked blocks before or after the real ones add exact zeros and change
    nothing; the running sum keeps memory at one block's worth."""
    b, t, kh, g, length = probs.shape
    pad = -length % block
    probs = jnp.pad(probs, [(0, 0)] * 4 + [(0, pad)])
    values = jnp.pad(values, [(0, 0), (0, pad), (0, 0), (0, 0)])
    n_blocks = (length + pad) // block
    prob_blocks = jnp.moveaxis(probs.reshape(b, t, kh, g, n_blocks, block), 4, 0)
    value_blocks = jnp.moveaxis(values.reshape(b, n_blocks, block, kh, values.shape[-1]), 1, 0)

    def add_block(total: jax.Array, pair: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return total + prob_value(*pair), None

    start = jnp.zeros((b, t, kh, g, values.shape[-1]), probs.dtype)
    total, _ = jax.lax.scan(add_block, start, (prob_blocks, value_blocks))
    return total


def attention(
    q: jax.Array,
    keys: dict[str, jax.Array],
    key_pos: jax.Array,
    positions: jax.Array,
    held: jax.Array,
    *,
    window: int | None,
    scale: float,
    softcap: float | None,
    value_block: int = 1,
) -> jax.Array:
    """Attention of the queries over the cache positions gathered for them.

    q [B, T, nh, d]; keys["k"/"v"] [B, L, kh, d] (int8 with "k_scale"/"v_scale" [B, L, kh] when quantized)
    holding absolute positions key_pos [B, L] (negative: nothing); positions [B, T] of the queries; held [B]:
    each row's cache holds positions 0..held-1 (this call's chunk included); value_block: keys per block of
    the float value sum (`value_sum_block`), the key positions aligned to it. Returns [B, T, nh * d].
    """
    b, t, nh, d = q.shape
    ck, cv = keys["k"], keys["v"]
    kh = ck.shape[2]
    qg = q.reshape(b, t, kh, nh // kh, d)
    quantized = "k_scale" in keys

    if quantized:
        # int8 x int8 -> int32 against the int8 cache itself (no dequantized copy of it); the query's
        # per-head scale and the keys' per-position scales are applied to the scores.
        q8, q_scale = quantize_int8(qg)  # [B, T, kh, g, d], [B, T, kh, g]
        scores = query_key(q8, ck, jnp.int32).astype(jnp.float32)
        scores = scores * q_scale[..., None]
        scores = scores * per_key(keys["k_scale"])
    else:
        scores = query_key(qg, ck)
    scores = scores.astype(jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    kpos = key_pos[:, None, :]
    qpos = positions[:, :, None]
    allowed = (kpos >= 0) & (kpos < held[:, None, None]) & (kpos <= qpos)  # stale entries past held: never
    if window is not None:
        allowed &= kpos > qpos - window
    scores = jnp.where(allowed[:, :, None, None, :], scores, MASK_VALUE)
    probs = softmax(scores).astype(q.dtype)

    if quantized:
        # Fold the values' per-position scales into the probabilities, quantize those per row, and
        # contract int8 x int8 again.
        weighted = probs.astype(jnp.float32) * per_key(keys["v_scale"])
        p8, p_scale = quantize_int8(weighted)
        out = prob_value(p8, cv, jnp.int32).astype(jnp.float32)
        out = (out * p_scale[..., None]).astype(q.dtype)
    elif value_block > 1:
        out = blocked_prob_value(probs, cv, value_block)
    else:
        out = prob_value(probs, cv)
    return out.reshape(b, t, nh * d)


def per_key(scale: jax.Array) -> jax.Array:
    """A cache view's per-position scales [B, S, kh] laid out against scores [B, T, kh, g, S]."""
    return jnp.transpose(scale, (0, 2, 1))[:, None, :, None, :]


def softmax(scores: jax.Array) -> jax.Array:
    """Softmax over the last axis whose result does not depend on where the keys sit along it.

    A float sum rounds in an order set by the positions of its terms and the length of the axis, and both
    change with the chunk layout (a sliding view's length follows the chunk size, a global layer's length its
    attention bucket): a prompt token would see other probabilities in a cold prefill than after a cache hit.
    The denominator is summed exactly instead (`exact_sum`); the max and the exponentials are exact or
    elementwise."""
    shifted = scores - jnp.max(scores, axis=-1, keepdims=True)
    terms = jnp.exp(shifted.astype(jnp.float32))  # in [0, 1], the max term 1
    return terms / exact_sum(terms)


SUM_PART_BITS = 16  # exact_sum's terms are cut into three 16-bit fixed-point parts: resolution 2**-48


def exact_sum(terms: jax.Array) -> jax.Array:
    """Sum over the last axis of float32 terms in [0, 1], keepdims, exact up to 2**-48 per term and so the
    same bits in any order and with any number of zero terms. Each term is cut into three 16-bit
    fixed-point digits (every cut is exact in float32) and each digit summed in int32, where addition is
    associative; the axis may hold up to 2**15 terms. The three digit sums are one variadic reduction, so
    XLA reads the terms once instead of writing and reducing each digit's array in turn (5x faster over a
    2048-key global layer of a prefill chunk)."""
    if terms.shape[-1] >= 2 ** (31 - SUM_PART_BITS):
        raise ValueError(f"exact_sum takes at most {2 ** (31 - SUM_PART_BITS) - 1} terms, got {terms.shape[-1]}")
    unit = 2.0**SUM_PART_BITS
    rest = terms * unit
    digits = []
    for _ in range(3):
        digit = jnp.floor(rest)
        rest = (rest - digit) * unit
        digits.append(digit.astype(jnp.int32))
    zero = jnp.int32(0)
    counts = jax.lax.reduce(digits, [zero] * 3, lambda xs, ys: tuple(x + y for x, y in zip(xs, ys, strict=True)),
                            (terms.ndim - 1,))
    total = jnp.zeros(terms.shape[:-1] + (1,), jnp.float32)
    for place, count in enumerate(counts, start=1):
        total = total + count[..., None].astype(jnp.float32) * unit**-place
    return total


def cache_view(entry: dict[str, jax.Array], rows: jax.Array | None, ends: jax.Array, *, sliding: bool,
               attend: int | None, length: int, align: int) -> tuple[dict[str, jax.Array], jax.Array]:
    """What one layer reads from its cache entry ([S, max_len, ...] arrays): (arrays [B, L, ...], key positions
    [B, L]). rows [B]: the slot of each row (None: row b is slot b); ends [B]: one past each row's last
    query position. A global layer reads positions [0, attend) in place. A sliding layer gathers a view of
    `length` consecutive positions from a multiple of `align`, ending at or after `ends`
    (`sliding_view_positions`); a global layer uses neither."""
    max_len = entry["k"].shape[1]
    if not sliding:
        prefix = max_len if attend is None else min(attend, max_len)
        view = {name: (arr if rows is None else arr[rows])[:, :prefix] for name, arr in entry.items()}
        return view, jnp.broadcast_to(jnp.arange(prefix)[None, :], (ends.shape[0], prefix))
    key_pos = sliding_view_positions(ends, length, align)
    index = jnp.clip(key_pos, 0, max_len - 1)
    slot = (jnp.arange(ends.shape[0]) if rows is None else rows)[:, None]
    return {name: arr[slot, index] for name, arr in entry.items()}, key_pos


def times(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [n, k] @ w [k, m] -> float32: the adapter products, x first cast to w's dtype (bfloat16 slots multiply
    bfloat16 inputs, accumulated in float32). Their weights are stored contracted dimension first, so the library
    reads them as they lie (the [out, in] layout of `linear` costs a copy per call at these shapes). Fewer than
    MIN_MATMUL_ROWS rows are padded to that many, as in `linear`, so a row's bits do not depend on the row
    count."""
    rows = x.shape[0]
    if rows < MIN_MATMUL_ROWS:
        return times(jnp.zeros((MIN_MATMUL_ROWS, x.shape[1]), x.dtype).at[:rows].set(x), w)[:rows]
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


# Adapter down products contract at most this many input channels per library call, the blocks' products
# summed in order: on some hosts a longer contraction rounds differently by the product's width (bfloat16
# over 2048 channels on Zen 4: width 16 and width 128 differ), and the per-slot terms (width G*R) and the wide
# form (width S*G*R) must give a column the same bits.
ADAPTER_K_BLOCK = 1024


def times_in_blocks(x: jax.Array, w: jax.Array) -> jax.Array:
    """`times` of x [n, k] and w [k, m] as ceil(k / ADAPTER_K_BLOCK) products of contiguous channel blocks,
    added first to last in float32."""
    total = times(x[:, :ADAPTER_K_BLOCK], w[:ADAPTER_K_BLOCK])
    for lo in range(ADAPTER_K_BLOCK, x.shape[1], ADAPTER_K_BLOCK):
        total = total + times(x[:, lo:lo + ADAPTER_K_BLOCK], w[lo:lo + ADAPTER_K_BLOCK])
    return total


def slot_down(x: jax.Array, down: jax.Array, slot: int | jax.Array) -> jax.Array:
    """x [n, in] against one slot's A matrices of an input group (down [in, S, G, R]) in one product:
    [n, G*R]; ``slot`` may be traced."""
    d_in, _, groups, rank = down.shape
    return times_in_blocks(x, jax.lax.dynamic_index_in_dim(down, slot, axis=1, keepdims=False).reshape(
        d_in, groups * rank))


def slot_terms(x: jax.Array, down: jax.Array, ups: list[jax.Array], slot: int | jax.Array) -> list[jax.Array]:
    """x [n, in] through one adapter slot of an input group (`core.lora.pack_group` layouts: down
    [in, S, G, R], ups G x [S, R, out]): `slot_down`, then each projection's part @ (scale B)^T; ``slot``
    may be traced. -> G x [n, out]."""
    rank = down.shape[3]
    h = slot_down(x, down, slot)
    return [times(h[:, j * rank:(j + 1) * rank], jax.lax.dynamic_index_in_dim(up, slot, axis=0, keepdims=False))
            for j, up in enumerate(ups)]


def lora_delta(x: jax.Array, down: jax.Array, ups: list[jax.Array], rows: jax.Array, *,
               slot_batched: tuple[str, int] | None = None) -> list[jax.Array]:
    """What each row's LoRA adapter adds to the projections of an input group of x [B, T, in]: G x
    [B, T, out] float32. down [in, S, G, R] holds the slots' A matrices transposed, ups G x [S, R, out] their
    scaled B matrices transposed (`core.lora.pack_group`), rows [B] int32 each row's slot (-1: none; the caller
    keeps such rows as they were). A token's terms are always one `slot_terms` with its own slot's matrices:
    over the one row's tokens in a single-row call, over all the call's tokens per slot some row uses otherwise
    (each token keeping its own slot's). Those differ between calls only in their row count, which changes no
    row's bits (tests/test_exactness.py), so a row's terms do not depend on the other rows' adapters, on how
    its prompt was chunked, or on decode vs prefill (docs/lora.md).

    slot_batched: (form, over): a call of one token per row whose rows use more slots than ``over`` computes
    every slot's terms for all rows at once in that form of SLOT_BATCHED_FORMS, which costs the same for any mix
    (None: never). Only a form that gives the slots' own bits: `slot_batched_lora_form` asks the host at
    start-up."""
    b, t, _ = x.shape
    if b == 1:  # one slot's tokens (a prefill chunk, a lone verify pass): its own matrices
        return [y[None] for y in slot_terms(x[0], down, ups, jnp.maximum(rows[0], 0))]
    flat, owner = x.reshape(b * t, -1), jnp.repeat(rows, t)
    if slot_batched is None or t != 1:
        terms = per_slot_terms(flat, owner, down, ups)
    else:
        form, over = slot_batched
        in_use = jnp.sum(jnp.any(rows[None, :] == jnp.arange(down.shape[1])[:, None], axis=1))
        terms = jax.lax.cond(in_use <= over, per_slot_terms, SLOT_BATCHED_FORMS[form], flat, owner, down, ups)
    return [y.reshape(b, t, -1) for y in terms]


def per_slot_terms(x: jax.Array, owner: jax.Array, down: jax.Array, ups: list[jax.Array]) -> list[jax.Array]:
    """x [N, in] -> G x [N, out]: each slot some token uses (owner [N]) as one `slot_terms` over all N tokens
    (skipped by lax.cond for a slot none uses), each token keeping its own slot's terms."""
    zeros = [jnp.zeros((x.shape[0], up.shape[2]), jnp.float32) for up in ups]
    totals = zeros
    for slot in range(down.shape[1]):
        parts = jax.lax.cond(jnp.any(owner == slot), lambda k=slot: slot_terms(x, down, ups, k), lambda: zeros)
        mine = (owner == slot)[:, None]
        totals = [jnp.where(mine, part, total) for part, total in zip(parts, totals, strict=True)]
    return totals


def wide_slot_terms(x: jax.Array, owner: jax.Array, down: jax.Array, ups: list[jax.Array]) -> list[jax.Array]:
    """`per_slot_terms` in 1 + G wide products: x against every slot's A at once ([N, S*G*R], `wide_down`),
    each token's columns of other slots zeroed, then each projection's part against every slot's B
    ([S*R, out]; the zeros add nothing). It reads every slot's matrices once, whatever the mix; a token's
    terms are its slot's where this host's products keep a column's bits whatever the product's width and the
    zero terms beside its own."""
    slots, _, rank = down.shape[1:]
    own = (jnp.arange(slots)[None, :] == owner[:, None])[:, :, None, None]
    h = jnp.where(own, wide_down(x, down), 0.0)
    return [times(h[:, :, j].reshape(-1, slots * rank), up.reshape(slots * rank, -1)) for j, up in enumerate(ups)]


def wide_down(x: jax.Array, down: jax.Array) -> jax.Array:
    """x [N, in] against every slot's A of an input group at once: [N, S, G, R] (down [in, S, G, R])."""
    d_in, slots, groups, rank = down.shape
    return times_in_blocks(x, down.reshape(d_in, slots * groups * rank)).reshape(-1, slots, groups, rank)


SLOT_BATCHED_FORMS = {"wide": wide_slot_terms}  # in order of preference


@functools.cache
def slot_form_exact(form: str, shapes: tuple[tuple[int, tuple[int, ...]], ...], rows: int, slots: int, rank: int,
                    dtype: str = "float32") -> bool:
    """Whether SLOT_BATCHED_FORMS[form] gives `per_slot_terms`' bits on this host for input groups of these
    (in, outs) shapes, `rows` one-token rows each under its own slot (cycling through `slots` of rank `rank`,
    stored in `dtype`). Whether a library product keeps a row's or a column's bits as the product's shape
    changes depends on the CPU's kernels (and differs between float32 and bfloat16 ones), so each engine asks
    at start-up, once per process and shapes; random values, each shape once. The forms start from
    `wide_down`, whose columns are checked against each slot's own down product before any rounding: in
    bfloat16 slots they are rounded before the up products, which hides most (not all) of a difference from
    the terms alone."""
    rng = np.random.default_rng(0)
    owner = jnp.arange(rows, dtype=jnp.int32) % slots

    def draw(shape: tuple[int, ...], kind: Any) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), kind)

    cases = [(draw((rows, d_in), jnp.float32), draw((d_in, slots, len(outs), rank), dtype),
              [draw((slots, rank, d_out), dtype) for d_out in outs]) for d_in, outs in sorted(set(shapes))]

    def agree(cases: list[tuple[Any, ...]]) -> jax.Array:
        checks = []
        for x, down, ups in cases:
            own_down = jnp.stack([slot_down(x, down, slot) for slot in range(slots)], axis=1)
            checks.append(jnp.array_equal(own_down, wide_down(x, down).reshape(rows, slots, -1)))
            checks += [jnp.array_equal(a, b) for a, b in zip(per_slot_terms(x, owner, down, ups),
                                                              SLOT_BATCHED_FORMS[form](x, owner, down, ups),
                                                              strict=True)]
        return jnp.all(jnp.stack(checks))

    return bool(jax.jit(agree)(cases))


def slot_batched_lora_form(shapes: tuple[tuple[int, tuple[int, ...]], ...], rows: int, slots: int, rank: int,
                           dtype: str = "float32") -> str | None:
    """The first of SLOT_BATCHED_FORMS that gives the per-slot terms' bits on this host (`slot_form_exact`),
    or None: decode steps then keep the per-slot terms whatever the mix."""
    return next((form for form in SLOT_BATCHED_FORMS if slot_form_exact(form, shapes, rows, slots, rank, dtype)),
                None)


def adapted(ys: list[jax.Array], x: jax.Array, lp: dict[str, Any], targets: list[str], chunk: Chunk | None
            ) -> list[jax.Array]:
    """ys, the projections ``targets`` of x (an input group), plus the rows' LoRA terms where the layer has
    slots for them (`core.lora.attach_slots` keys a group's slots by its targets)."""
    slots = lp.get("lora", {}).get(group_key(targets))
    if chunk is None or chunk.adapters is None or slots is None:
        return ys
    down, ups = slots
    rows = chunk.adapters

    def with_terms() -> list[jax.Array]:  # a row without an adapter keeps y's bits (not y + 0.0: -0.0 stays)
        deltas = lora_delta(x, down, [ups[t] for t in targets], rows, slot_batched=chunk.slot_batched_lora)
        keep = (rows >= 0)[:, None, None]
        return [jnp.where(keep, y + delta.astype(y.dtype), y) for y, delta in zip(ys, deltas, strict=True)]

    return jax.lax.cond(jnp.any(rows >= 0), with_terms, lambda: list(ys))  # no adapted row: no products at all


def linear_rows(xs: list[jax.Array], w: Any) -> list[jax.Array]:
    """`linear` of several groups' inputs xs [..., in] in one product, so the weight is read once for all:
    one output per group, in its own shape. Only where every product is exact whatever its row count (int8 x
    int8 -> int32, `core.weights.all_matmuls_integer`) does a group's result keep the bits it has alone."""
    if len(xs) == 1:
        return [linear(xs[0], w)]
    counts = [math.prod(x.shape[:-1]) for x in xs]
    y = linear(jnp.concatenate([x.reshape(n, x.shape[-1]) for x, n in zip(xs, counts, strict=True)]), w)
    parts = jnp.split(y, np.cumsum(counts)[:-1].tolist())
    return [part.reshape(*x.shape[:-1], -1) for part, x in zip(parts, xs, strict=True)]


def project_qkv(xs: list[jax.Array], lp: dict[str, Any], layer: Any, num_heads: int, chunks: list[Chunk]
                ) -> list[tuple[jax.Array, jax.Array | None, jax.Array | None]]:
    """Per group of x [B, T, H]: q [B, T, nh, d] and, for a layer that owns its cache, raw k and v
    [B, T, kh, d] (v is k where the layer shares them); from one fused "qkv_proj" matmul when present
    (core.weights.fuse_projections); with the rows' LoRA terms where the chunk carries adapters."""
    kv_out = layer.num_kv_heads * layer.head_dim
    if "qkv_proj" in lp:
        names = ["q_proj", "k_proj"] + ([] if layer.k_eq_v else ["v_proj"])
        bounds = [0, num_heads * layer.head_dim]
        bounds += [bounds[-1] + kv_out * i for i in range(1, len(names))]
        outs = [[y[..., lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]
                for y in linear_rows(xs, lp["qkv_proj"])]
    else:
        names = ["q_proj"] + (["k_proj"] + ([] if layer.k_eq_v else ["v_proj"]) if layer.owns_cache else [])
        outs = list(zip(*[linear_rows(xs, lp[name]) for name in names], strict=True))
    result = []
    for x, chunk, parts in zip(xs, chunks, outs, strict=True):
        b, t = x.shape[:2]
        own = len(names) if layer.owns_cache else 1  # a KV-shared layer's k/v are unused: no adapter slots
        q, *kv = adapted(list(parts[:own]), x, lp, names[:own], chunk) + list(parts[own:])
        kv = [y.reshape(b, t, layer.num_kv_heads, layer.head_dim) for y in kv]
        k = kv[0] if kv else None
        v = kv[1] if len(kv) > 1 else k
        result.append((q.reshape(b, t, num_heads, layer.head_dim), k, v))
    return result


def per_layer_inputs(params: Params, cfg: ModelConfig, tokens: list[jax.Array], h_emb: list[jax.Array]
                     ) -> list[jax.Array]:
    """Gemma 4 per-layer embeddings of each group's tokens [B, T] and scaled embeddings h [B, T, H]:
    [B, T, num_layers, ple_dim] per group (the projection's weight read once for all, `linear_rows`)."""
    n, p = cfg.num_layers, cfg.ple_dim
    dtype = h_emb[0].dtype
    projected = linear_rows(h_emb, params["per_layer_model_projection"])
    out = []
    for ids, proj in zip(tokens, projected, strict=True):
        b, t = ids.shape
        token_part = embedding_rows(params["embed_per_layer"], ids, dtype)
        token_part = (token_part * jnp.asarray(p**0.5, dtype)).reshape(b, t, n, p)
        proj = proj * jnp.asarray(cfg.hidden_size**-0.5, dtype)
        proj = rms_norm(proj.reshape(b, t, n, p), params["per_layer_projection_norm"], cfg.rms_norm_eps)
        out.append((proj + token_part) * jnp.asarray(2.0**-0.5, dtype))
    return out


def embed(params: Params, tokens: list[jax.Array], *, cfg: ModelConfig
          ) -> tuple[list[jax.Array], list[jax.Array] | list[None]]:
    """Each group's tokens [B, T] int32 -> (h [B, T, H] scaled embeddings in the compute dtype, Gemma 4's
    per-layer inputs [B, T, num_layers, P] or None), one list entry per group."""
    dtype = params["final_norm"].dtype  # the compute dtype
    hs = [embedding_rows(params["embed"], ids, dtype) * jnp.asarray(cfg.hidden_size**0.5, dtype) for ids in tokens]
    ples = per_layer_inputs(params, cfg, tokens, hs) if cfg.ple_dim else [None] * len(hs)
    return hs, ples


def hidden_states(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    starts: jax.Array,
    n_valid: jax.Array,
    slots: jax.Array | None,
    *,
    cfg: ModelConfig,
    attend: int | None = None,
    view_width: int = 1,
    adapters: jax.Array | None = None,
    slot_batched_lora: tuple[str, int] | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run T tokens per row through the embedding, every decoder layer and the final norm: (h [B, T, H], cache).

    tokens [B, T] int32: row b holds positions starts[b] .. starts[b] + T - 1 (starts [B] int32), of which the
    first n_valid[b] (n_valid [B]) are real (the rest is padding; n_valid 0 marks an idle row that writes
    nothing). slots [B] int32: the slot of each row, or None when row b is slot b of the whole pool. attend:
    global layers read only cache positions [0, attend), which must cover every row's chunk (starts +
    n_valid), so a step's attention cost follows the longest context in it, not max_len. view_width: sliding
    layers read a view sized for max(T, view_width) tokens per row (`core.kv_cache.sliding_view_length`);
    decode and speculative verify pass their common width so each of their rows computes exactly what a
    decode step at that position computes.

    New K/V are scattered into the donated cache before any layer reads it, so XLA updates it in place (a
    read before a later scatter makes it copy the whole cache), and every query reads its keys back from the
    cache in the cache's own dtype, as decode does. adapters [B] int32: each row's LoRA slot, -1 for none
    (`lora_delta`; the slots are the layers' "lora" params; None: no row has one); slot_batched_lora:
    `lora_delta`'s slot_batched.
    """
    chunk = make_chunk(starts, n_valid, slots, tokens.shape[1], attend=attend, view_width=view_width,
                       adapters=adapters, slot_batched_lora=slot_batched_lora)
    (h,), cache = grouped_hidden_states(params, cache, [(tokens, chunk)], cfg=cfg)
    return h, cache


def make_chunk(starts: jax.Array, n_valid: jax.Array, slots: jax.Array | None, t: int, *, attend: int | None,
               view_width: int, adapters: jax.Array | None, slot_batched_lora: tuple[str, int] | None) -> Chunk:
    """Where a call's T tokens per row sit (arguments as in `hidden_states`)."""
    positions = starts[:, None] + jnp.arange(t, dtype=starts.dtype)[None, :]  # [B, T] absolute positions
    return Chunk(positions=positions, ends=starts + t, held=starts + n_valid, n_valid=n_valid, slots=slots,
                 attend=attend, view_width=view_width, adapters=adapters, slot_batched_lora=slot_batched_lora)


def grouped_hidden_states(params: Params, cache: KVCache, groups: list[tuple[jax.Array, Chunk]], *,
                          cfg: ModelConfig) -> tuple[list[jax.Array], KVCache]:
    """`hidden_states` of several groups in one pass: groups of (tokens [B, T], chunk), each with its own B and
    T, for different slots. Every op keeps each group's own shapes but the weight products, which take all
    groups' rows at once (`linear_rows`): a decode step's rows and a prompt chunk read each weight once.
    Returns h [B, T, H] per group and the cache."""
    dtype = params["final_norm"].dtype  # the compute dtype
    hs, group_ples = embed(params, [tokens for tokens, _ in groups], cfg=cfg)
    chunks = [chunk for _, chunk in groups]
    ropes = []
    for chunk in chunks:
        tables = {}
        for layer in cfg.layers:
            key = (layer.kind, layer.head_dim)
            if key not in tables:
                tables[key] = rope_tables(chunk.positions, cfg.rope_for(layer.kind).inv_freq(layer.head_dim), dtype)
        ropes.append(tables)
    for layer, lp in zip(cfg.layers, params["layers"], strict=True):
        key = (layer.kind, layer.head_dim)
        ples = [None if ple is None else ple[:, :, layer.index, :] for ple in group_ples]
        hs, cache = decoder_layer(hs, cache, lp, layer, cfg, chunks, [tables[key] for tables in ropes], ples)
    return [rms_norm(h, params["final_norm"], cfg.rms_norm_eps) for h in hs], cache


def last_real_token(h: jax.Array, n_valid: jax.Array) -> jax.Array:
    """h [B, T, H] -> [B, H] at each row's last real token (n_valid [B]; an idle row reads its first)."""
    last = jnp.clip(n_valid - 1, 0, h.shape[1] - 1)
    return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]


def prefill_chunk(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    starts: jax.Array,
    n_valid: jax.Array,
    slots: jax.Array | None,
    *,
    cfg: ModelConfig,
    attend: int | None = None,
    view_width: int = 1,
    adapters: jax.Array | None = None,
    slot_batched_lora: tuple[str, int] | None = None,
) -> tuple[jax.Array, KVCache]:
    """A prompt chunk per row, tokens [B, T] int32 from starts [B] (n_valid [B] real, slots [B] or None,
    adapters [B] or None, as in `hidden_states`), continuing what each slot holds: (logits [B, V] float32 at
    each row's last real token, cache)."""
    h, cache = hidden_states(params, cache, tokens, starts, n_valid, slots, cfg=cfg, attend=attend,
                             view_width=view_width, adapters=adapters, slot_batched_lora=slot_batched_lora)
    return lm_head(params, cfg, last_real_token(h, n_valid)), cache


def decode_step(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    active: jax.Array,
    *,
    cfg: ModelConfig,
    attend: int | None = None,
    view_width: int = 1,
    adapters: jax.Array | None = None,
    slot_batched_lora: tuple[str, int] | None = None,
) -> tuple[jax.Array, KVCache]:
    """One token for every slot of the pool: tokens [B] int32 at positions [B] int32, active [B] (0 / 1; an
    idle slot writes nothing), adapters [B] (each slot's LoRA slot, -1 none) or None, slot_batched_lora as in
    `hidden_states`: (logits [B, V] float32, cache)."""
    return prefill_chunk(params, cache, tokens[:, None], positions, active, None, cfg=cfg, attend=attend,
                         view_width=view_width, adapters=adapters, slot_batched_lora=slot_batched_lora)


def decode_with_chunk(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    active: jax.Array,
    chunk_tokens: jax.Array,
    chunk_start: jax.Array,
    chunk_n: jax.Array,
    chunk_slot: jax.Array,
    *,
    cfg: ModelConfig,
    attend: int | None = None,
    view_width: int = 1,
    adapters: jax.Array | None = None,
    chunk_adapter: jax.Array | None = None,
    slot_batched_lora: tuple[str, int] | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """A decode step (tokens, positions, active [B], adapters as in `decode_step`) and a prompt chunk of one
    other slot (chunk_tokens [1, T], chunk_start, chunk_n, chunk_slot and chunk_adapter [1], as
    `prefill_chunk` takes them) in one pass whose weight products read each weight once for both
    (`grouped_hidden_states`): (decode logits [B, V], the chunk's logits at its last real token [1, V], cache).
    Each equals what its own call gives, bit for bit, where every product is integer (W8A8, int8 KV)."""
    step = make_chunk(positions, active, None, 1, attend=attend, view_width=view_width, adapters=adapters,
                      slot_batched_lora=slot_batched_lora)
    chunk = make_chunk(chunk_start, chunk_n, chunk_slot, chunk_tokens.shape[1], attend=attend,
                       view_width=view_width, adapters=chunk_adapter, slot_batched_lora=None)
    (h_step, h_chunk), cache = grouped_hidden_states(params, cache, [(tokens[:, None], step), (chunk_tokens, chunk)],
                                                     cfg=cfg)
    step_logits, chunk_logits = lm_head_rows(params, cfg, [h_step[:, 0], last_real_token(h_chunk, chunk_n)])
    return step_logits, chunk_logits, cache


def sequence_logits(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    starts: jax.Array,
    n_valid: jax.Array,
    slots: jax.Array | None,
    *,
    cfg: ModelConfig,
    attend: int | None = None,
    view_width: int = 1,
    adapters: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Logits at every position of a chunk (scoring a whole sequence, teacher forcing): tokens [B, T] int32
    and the rest as in `hidden_states` -> (logits [B, T, V] float32, cache)."""
    h, cache = hidden_states(params, cache, tokens, starts, n_valid, slots, cfg=cfg, attend=attend,
                             view_width=view_width, adapters=adapters)
    return lm_head(params, cfg, h), cache


def verify_chunk(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    starts: jax.Array,
    n_valid: jax.Array,
    slots: jax.Array | None,
    *,
    cfg: ModelConfig,
    attend: int | None = None,
    view_width: int = 1,
    adapters: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """A speculative verify chunk per row (the last sampled token, then drafts): tokens [B, T] int32 and the
    rest as in `hidden_states` -> (logits [B, T, V] float32 after each token, cache). view_width must be the
    one decode steps use, so each row's logits equal the decode step's at that position."""
    return sequence_logits(params, cache, tokens, starts, n_valid, slots, cfg=cfg, attend=attend,
                           view_width=view_width, adapters=adapters)


@dataclass(frozen=True)
class Chunk:
    """Where one call's tokens sit, as every layer reads it: positions [B, T]; ends [B] one past each row's
    last (possibly padded) query; held [B] positions each row's slot holds once the chunk is written;
    n_valid [B] real tokens per row; slots [B] or None (row b is slot b); attend and view_width as in
    `hidden_states`."""

    positions: jax.Array
    ends: jax.Array
    held: jax.Array
    n_valid: jax.Array
    slots: jax.Array | None
    attend: int | None
    view_width: int
    adapters: jax.Array | None = None  # [B] int32 each row's LoRA slot, -1 for none (`lora_delta`), or None
    slot_batched_lora: tuple[str, int] | None = None  # `lora_delta`'s slot_batched


def decoder_layer(hs: list[jax.Array], cache: KVCache, lp: dict[str, Any], layer: Any, cfg: ModelConfig,
                  chunks: list[Chunk], ropes: list[tuple[jax.Array, jax.Array]], ples: list[jax.Array | None]
                  ) -> tuple[list[jax.Array], KVCache]:
    """One decoder layer over each group's hidden states h [B, T, H] (`grouped_hidden_states`): every group
    writes its K/V (if the layer owns a cache) before any attends over the cache; ple [B, T, P] is a group's
    per-layer input (Gemma 4) or None."""
    eps = cfg.rms_norm_eps
    groups = range(len(hs))
    xs = [rms_norm(h, lp["input_layernorm"], eps) for h in hs]
    qs = []
    for (q_raw, k_raw, v), chunk, (cos, sin) in zip(project_qkv(xs, lp, layer, cfg.num_heads, chunks), chunks,
                                                     ropes, strict=True):
        if layer.owns_cache:
            # Query and key heads are normed and rotated as one array: the key heads alone are few rows, and
            # XLA's CPU reduction then rounds differently by row count (decode vs verify chunks would differ).
            nh, kh, d = q_raw.shape[2], k_raw.shape[2], q_raw.shape[3]
            scale = jnp.concatenate([jnp.broadcast_to(lp["q_norm"], (nh, d)),
                                     jnp.broadcast_to(lp["k_norm"], (kh, d))])
            heads = apply_rope(rms_norm(jnp.concatenate([q_raw, k_raw], axis=2), scale, eps), cos, sin)
            q, k = heads[:, :, :nh], heads[:, :, nh:]
            if cfg.has_v_norm:
                v = rms_norm(v, None, eps)
            cache = write_chunk(cache, layer.index, k, v, chunk.positions, chunk.n_valid, chunk.slots)
        else:
            q = apply_rope(rms_norm(q_raw, lp["q_norm"], eps), cos, sin)
        qs.append(q)
    entry = cache[layer_key(layer.kv_source)]
    attns = [layer_attention(q, entry, layer.is_sliding, cfg, chunk) for q, chunk in zip(qs, chunks, strict=True)]
    outs = linear_rows(attns, lp["o_proj"])
    hs = [hs[g] + rms_norm(adapted([outs[g]], attns[g], lp, ["o_proj"], chunks[g])[0],
                           lp["post_attention_layernorm"], eps) for g in groups]

    xs = [rms_norm(h, lp["pre_feedforward_layernorm"], eps) for h in hs]
    if "gate_up_proj" in lp:  # fused (core.weights.fuse_projections)
        gates, ups = zip(*[jnp.split(y, 2, axis=-1) for y in linear_rows(xs, lp["gate_up_proj"])], strict=True)
    else:
        gates, ups = linear_rows(xs, lp["gate_proj"]), linear_rows(xs, lp["up_proj"])
    pairs = [adapted([gates[g], ups[g]], xs[g], lp, ["gate_proj", "up_proj"], chunks[g]) for g in groups]
    acts = [jax.nn.gelu(gate, approximate=True) * up for gate, up in pairs]
    mlps = linear_rows(acts, lp["down_proj"])
    hs = [hs[g] + rms_norm(adapted([mlps[g]], acts[g], lp, ["down_proj"], chunks[g])[0],
                           lp["post_feedforward_layernorm"], eps) for g in groups]

    if ples[0] is not None:
        gates = [jax.nn.gelu(y, approximate=True) for y in linear_rows(hs, lp["per_layer_input_gate"])]
        projected = linear_rows([gate * ple for gate, ple in zip(gates, ples, strict=True)],
                                lp["per_layer_projection"])
        hs = [h + rms_norm(y, lp["post_per_layer_input_norm"], eps) for h, y in zip(hs, projected, strict=True)]
    if cfg.has_layer_scalar:
        hs = [h * lp["layer_scalar"].astype(h.dtype) for h in hs]
    return hs, cache


# A sliding layer's queries of a long chunk attend in blocks of this many, each over the view its own block
# needs (window + block - 1 positions instead of window + chunk - 1 for all): 512 queries read 639 keys per
# block instead of 1,023. A query sees the same keys either way, so its result keeps its bits.
SLIDING_QUERY_BLOCK = 128


def layer_attention(q: jax.Array, entry: dict[str, jax.Array], sliding: bool, cfg: ModelConfig, chunk: Chunk
                    ) -> jax.Array:
    """One layer's attention of queries q [B, T, nh, d] over its cache entry: [B, T, nh * d]."""
    b, t = q.shape[:2]
    rows, ends, positions, held = chunk.slots, chunk.ends, chunk.positions, chunk.held
    parts = t // SLIDING_QUERY_BLOCK if sliding and t % SLIDING_QUERY_BLOCK == 0 else 1
    if parts > 1:  # every block of queries becomes a row of its own, with its own end
        rows = jnp.repeat(jnp.arange(b) if rows is None else rows, parts)
        ends = positions[:, ::SLIDING_QUERY_BLOCK].reshape(-1) + SLIDING_QUERY_BLOCK
        positions = positions.reshape(b * parts, SLIDING_QUERY_BLOCK)
        held = jnp.repeat(held, parts)
        q = q.reshape(b * parts, SLIDING_QUERY_BLOCK, *q.shape[2:])
    block = value_sum_block(quantized_kv="k_scale" in entry)
    length = sliding_view_length(cfg.sliding_window, entry["k"].shape[1], q.shape[1], chunk.view_width, block)
    keys, key_pos = cache_view(entry, rows, ends, sliding=sliding, attend=chunk.attend, length=length, align=block)
    attn = attention(q, keys, key_pos, positions, held, window=cfg.sliding_window if sliding else None,
                     scale=cfg.query_scale, softcap=cfg.attn_logit_softcap, value_block=block)
    return attn.reshape(b, t, -1)


def lm_head(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """Hidden states h [..., H] (final-normed) -> logits [..., V] float32, soft-capped where the model says so."""
    return lm_head_rows(params, cfg, [h])[0]


def lm_head_rows(params: Params, cfg: ModelConfig, hs: list[jax.Array]) -> list[jax.Array]:
    """`lm_head` of several groups' hidden states in one product (`linear_rows`)."""
    weight = params["lm_head"] if params.get("lm_head") is not None else params["embed"]
    out = []
    for logits in linear_rows(hs, weight):
        logits = logits.astype(jnp.float32)
        if cfg.final_logit_softcap is not None:
            cap = cfg.final_logit_softcap
            logits = jnp.tanh(logits / cap) * cap
        out.append(logits)
    return out


def write_chunk(
    cache: KVCache,
    layer_index: int,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    n_valid: jax.Array,
    slots: jax.Array | None,
) -> KVCache:
    """Scatter one owning layer's chunk K/V [B, T, kh, d] into its rows' slots at their absolute positions
    [B, T]; padding (t >= n_valid) is dropped (index past the end)."""
    entry = dict(cache[layer_key(layer_index)])
    max_len = entry["k"].shape[1]
    keep = jnp.arange(positions.shape[1])[None, :] < n_valid[:, None]
    target = jnp.where(keep, positions, max_len)
    rows = (jnp.arange(positions.shape[0]) if slots is None else slots)[:, None]
    if "k_scale" in entry:
        for name, value in (("k", k), ("v", v)):
            q, s = quantize_int8(value)  # per position and head: [B, T, kh, d] -> int8, f32 [B, T, kh]
            entry[name] = entry[name].at[rows, target].set(q, mode="drop")
            entry[name + "_scale"] = entry[name + "_scale"].at[rows, target].set(s, mode="drop")
    else:
        entry["k"] = entry["k"].at[rows, target].set(k.astype(entry["k"].dtype), mode="drop")
        entry["v"] = entry["v"].at[rows, target].set(v.astype(entry["v"].dtype), mode="drop")
    return {**cache, layer_key(layer_index): entry}


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 over the last axis: x [..., d] -> (int8 [..., d], f32 scale [...])."""
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
    q = jnp.round(x32 / jnp.where(scale == 0, 1.0, scale)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale

