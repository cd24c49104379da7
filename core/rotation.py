"""The orthogonal rotation W8A8 applies to every quantized matrix's input dimension.

Gemma's activations carry a few channels far larger than the rest, so a per-token int8 scale set by those
channels leaves the others only a few grid steps (perplexity +4-5% on the 270M model). Rotating the input
space spreads each outlier over all channels before rounding: x @ W.T == (x @ R) @ (W @ R).T for an
orthogonal R, so the weights are stored rotated and each activation is rotated on the fly (perplexity
+0.3%, benchmarks/quality.py).

R is a pure function of the dimension n = m * p (p the largest power of two dividing n):
kron(Q_m, H_p1, H_p2), Q_m a fixed random orthogonal m x m matrix (mixes the m blocks), H the normalised
Sylvester Hadamard matrices with p = p1 * p2, p2 <= 128. Applied factor by factor it costs about
n * (m + p1 + p2) multiply-adds per row instead of the n^2 of a dense rotation.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

BLOCK = 128  # the largest Hadamard factor applied as one dense matrix


@functools.cache
def _hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


@functools.cache
def _orthogonal(m: int) -> np.ndarray:
    if m == 1:
        return np.ones((1, 1), np.float32)
    q, r = np.linalg.qr(np.random.default_rng(m).standard_normal((m, m)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


@functools.cache
def factors(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Q_m, H_p1, H_p2) with kron of the three = R, an orthogonal n x n matrix."""
    p = n & -n
    p2 = min(p, BLOCK)
    return _orthogonal(n // p), _hadamard(p // p2), _hadamard(p2)


def rotate(x: Any, inverse: bool = False, xp: Any = None) -> Any:
    """x @ R over the last axis (x @ R.T with inverse=True), for jax or numpy arrays (xp picks the module)."""
    if xp is None:
        import jax.numpy as xp
    n = x.shape[-1]
    q, h1, h2 = factors(n)
    if inverse:
        q = q.T  # the Hadamard factors are symmetric
    y = x.reshape(*x.shape[:-1], q.shape[0], h1.shape[0], h2.shape[0])
    if h2.shape[0] > 1:
        y = xp.einsum("...k,kc->...c", y, h2)
    if h1.shape[0] > 1:
        y = xp.einsum("...jc,jb->...bc", y, h1)
    if q.shape[0] > 1:
        y = xp.einsum("...ibc,ia->...abc", y, q)
    return y.reshape(x.shape)
