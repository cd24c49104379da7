"""Measurements that judge a fast path (W8A8, ...) against the float32 reference: perplexity on a fixed
text and teacher-forced top-1 agreement. Used by benchmarks/quality.py and by the quality-gate tests."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core.config import ModelConfig
from core.kv_cache import CacheSpec, init_cache
from core.model import sequence_logits

REFERENCE_TEXT = "pydoc_data.topics (Python's help topics, sorted by name)"


def reference_text() -> str:
    """A fixed English/code text that ships with the interpreter and never changes with this repository."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def reference_tokens(tokenizer: Any, n: int) -> list[int]:
    """BOS + the first n-1 tokens of the reference text."""
    ids = tokenizer.encode(reference_text())
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids[: n - 1]


def _chunk_fn(cfg: ModelConfig):
    def step(params, cache, tokens, start, targets):
        logits, cache = sequence_logits(params, cache, tokens, start, jnp.full(1, tokens.shape[1], jnp.int32),
                                        None, cfg=cfg)
        logp = jax.nn.log_softmax(logits[0], axis=-1)
        return jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0], jnp.argmax(logits[0], axis=-1), cache

    return jax.jit(step, donate_argnums=(1,))


def score(cfg: ModelConfig, params: dict[str, Any], ids: list[int], chunk: int = 512,
          kv_dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced pass over ids in full chunks through one slot whose cache stores `kv_dtype`: the
    log-probability of each next token [n-1] and the argmax prediction after each position [n-1] (a ragged
    tail shorter than `chunk` is dropped). Later chunks read earlier ones from the cache, so a quantized
    cache's error shows."""
    fn = _chunk_fn(cfg)
    ids_np = np.asarray(ids, np.int32)
    usable = (len(ids_np) - 1) // chunk * chunk
    if usable == 0:
        raise ValueError(f"need more than {chunk} tokens, got {len(ids_np)}")
    cache = init_cache(cfg, CacheSpec(1, usable, kv_dtype))
    logps, argmaxes = [], []
    for start in range(0, usable, chunk):
        tokens = jnp.asarray(ids_np[None, start:start + chunk])
        targets = jnp.asarray(ids_np[start + 1:start + chunk + 1])
        lp, top, cache = fn(params, cache, tokens, jnp.full(1, start, jnp.int32), targets)
        logps.append(np.asarray(lp))
        argmaxes.append(np.asarray(top))
    return np.concatenate(logps), np.concatenate(argmaxes)


def perplexity(logprobs: np.ndarray) -> float:
    return float(np.exp(-np.mean(logprobs)))
