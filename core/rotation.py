"""The orthogonal rotation W8A8 applies to every quantized matrix's input dimension.

Gemma's activations carry a few channels far larger than the rest, so a per-token int8 scale set by those
channels leaves the others only a few grid steps (perplexity +4-5% on the 270M model). Rotating the input
space spreads each outlier over many channels before rounding: x @ W.T == (x @ R) @ (W @ R).T for an
orthogonal R, so the weights are stored rotated and each activation is rotated on the fly.

R is block diagonal: the normalised Sylvester Hadamard matrix H_b on each run of b channels, b the largest
power of two dividing n, at most 128. Measured on the 270M model (perplexity over 4096 tokens, float32
10.99): unrotated +4.8%, these blocks +0.7%, a full Hadamard x random orthogonal mix of the blocks +0.5%.
The blocks cost one [rows, b] x [b, b] matmul; mixing across blocks needs a contraction over a middle
axis that XLA's CPU backend runs as transposes, which made W8A8 prefill slower than float32.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

BLOCK = 128  # the largest Hadamard block


@functools.cache
def hadamard(n: int) -> np.ndarray:
    """The normalised (orthogonal, symmetric) Sylvester Hadamard matrix of order n, a power of two."""
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def block_size(n: int) -> int:
    return min(n & -n, BLOCK)


def rotate(x: Any, xp: Any = None) -> Any:
    """x @ R over the last axis, for jax or numpy arrays (xp picks the module). R is its own inverse."""
    if xp is None:
        import jax.numpy as xp
    n = x.shape[-1]
    b = block_size(n)
    if b == 1:
        return x
    y = xp.einsum("...k,kc->...c", x.reshape(*x.shape[:-1], n // b, b), hadamard(b))
    return y.reshape(x.shape)
