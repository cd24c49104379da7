"""Turn a checkpoint source into the model's parameter tree on the device, one tensor at a time.

Host memory stays near one tensor beyond what the device holds: each tensor is read (memory-mapped
or dequantized), converted, placed and dropped before the next.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from core.config import ModelConfig, expected_tensor_shapes
from core.rotation import rotate

if TYPE_CHECKING:  # the loaders pull in gguf, which random-weight benchmarks on bare machines lack
    from core.loaders import CheckpointSource

log = logging.getLogger(__name__)

NORM_SUFFIXES = ("layernorm.weight", "_norm.weight", "norm.weight")
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "layer_scalar": "layer_scalar",
    "per_layer_input_gate.weight": "per_layer_input_gate",
    "per_layer_projection.weight": "per_layer_projection",
    "post_per_layer_input_norm.weight": "post_per_layer_input_norm",
}
TOP_NAMES = {
    "embed_tokens.weight": "embed",
    "norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
    "embed_tokens_per_layer.weight": "embed_per_layer",
    "per_layer_model_projection.weight": "per_layer_model_projection",
    "per_layer_projection_norm.weight": "per_layer_projection_norm",
}
# Matrices that int8 weight storage quantizes (per output row); norms and scalars stay in float.
INT8_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
                "per_layer_input_gate", "per_layer_projection", "embed", "lm_head", "per_layer_model_projection"}


PRECISIONS = ("float", "w8a8")


@dataclass(frozen=True)
class WeightPolicy:
    dtype: str = "float32"  # compute dtype
    int8_matrices: bool = False  # big matrices as int8 with per-row scales
    int4_ple: bool = False  # the per-layer-embedding table as packed int4 with per-row scales
    # "float": matrices as stored (or int8 weight-only with int8_matrices); "w8a8": the INT8_TARGETS
    # matrices, rotated (core.rotation), as int8 with per-row scales under the key "qa8", which linear() runs
    # with per-token int8 activations (int8 x int8 -> int32); embedding lookups gather, dequantize and unrotate.
    precision: str = "float"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


def quantize_rows_int8(w: np.ndarray) -> dict[str, np.ndarray]:
    w = w.astype(np.float32)
    scale = np.abs(w).max(axis=1) / 127.0
    q = np.clip(np.round(w / np.where(scale == 0, 1.0, scale)[:, None]), -127, 127).astype(np.int8)
    return {"q": q, "s": scale.astype(np.float32)}


def quantize_w8a8(w: np.ndarray) -> dict[str, np.ndarray]:
    """W8A8 storage: the rows of W @ R (core.rotation) as int8 with per-row scales."""
    q = quantize_rows_int8(rotate(w.astype(np.float32), xp=np))
    return {"qa8": q["q"], "s": q["s"]}


def quantize_rows_int4(w: np.ndarray) -> dict[str, np.ndarray]:
    """Symmetric int4 per row, two values per byte (low nibble first), stored offset by +8."""
    w = w.astype(np.float32)
    if w.shape[1] % 2:
        raise ValueError("int4 packing needs an even row length")
    scale = np.abs(w).max(axis=1) / 7.0
    q = np.clip(np.round(w / np.where(scale == 0, 1.0, scale)[:, None]), -7, 7).astype(np.int16) + 8
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return {"q4": packed, "s": scale.astype(np.float32)}


def load_params(
    source: CheckpointSource,
    cfg: ModelConfig,
    policy: WeightPolicy = WeightPolicy(),
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    from core.loaders import check_tensors

    expected, optional = expected_tensor_shapes(cfg)
    check_tensors(source, expected, optional)
    present = set(source.names())
    params: dict[str, Any] = {"layers": [{} for _ in cfg.layers], "lm_head": None}
    wanted = [name for name in expected if name in present and _is_used(name, cfg)]
    dtype = jnp.dtype(policy.dtype)
    for done, name in enumerate(wanted, 1):
        array = np.asarray(source.read(name))
        key, target = _destination(name, params)
        target[key] = _place(array, key, name, cfg, policy, dtype)
        del array
        if progress:
            progress(done, len(wanted))
    if cfg.tie_word_embeddings:
        params["lm_head"] = None  # the output projection is the embedding table
    return params


def _is_used(name: str, cfg: ModelConfig) -> bool:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return False
    if name.startswith("layers."):
        index = int(name.split(".")[1])
        if not cfg.layers[index].owns_cache and any(
            part in name for part in ("k_proj", "v_proj", "k_norm")
        ):
            return False  # shared layers read their source layer's K/V
    return True


def _destination(name: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        return LAYER_NAMES[rest], params["layers"][int(index)]
    return TOP_NAMES[name], params


def _place(array: np.ndarray, key: str, name: str, cfg: ModelConfig, policy: WeightPolicy, dtype: Any) -> Any:
    if name.endswith(NORM_SUFFIXES):
        # Fold Gemma 3's (1 + w) into the stored multiplier, in float32 as transformers computes it.
        array = array.astype(np.float32) + np.float32(cfg.norm_offset)
        return jax.device_put(array.astype(dtype))
    if key == "embed_per_layer" and policy.int4_ple:
        return jax.device_put(quantize_rows_int4(array))
    if key in INT8_TARGETS and policy.precision == "w8a8":
        return jax.device_put(quantize_w8a8(array))
    if key in INT8_TARGETS and policy.int8_matrices:
        return jax.device_put(quantize_rows_int8(array))
    if array.dtype != dtype:
        array = array.astype(np.float32).astype(dtype) if array.dtype.kind == "V" else array.astype(dtype)
    return jax.device_put(array)


def random_params(cfg: ModelConfig, dtype: str = "float32", seed: int = 0, std: float = 0.02,
                  norm_std: float = 0.0) -> dict[str, Any]:
    """Random weights of the right shapes, for tests and for benchmarks of sizes we hold no checkpoint of.
    Norm multipliers and layer scalars are 1 + N(0, norm_std)."""
    expected, optional = expected_tensor_shapes(cfg)
    rng = np.random.default_rng(seed)
    params: dict[str, Any] = {"layers": [{} for _ in cfg.layers], "lm_head": None}
    for name, shape in expected.items():
        if name in optional or not _is_used(name, cfg):
            continue
        key, target = _destination(name, params)
        is_multiplier = name.endswith(NORM_SUFFIXES) or key == "layer_scalar"
        value = rng.standard_normal(shape, dtype=np.float32) * (norm_std if is_multiplier else std)
        if is_multiplier:
            value += 1.0
        target[key] = jax.device_put(value.astype(dtype))
    return params


def to_w8a8(params: dict[str, Any]) -> dict[str, Any]:
    """A float parameter tree (from load_params or random_params) with its INT8_TARGETS matrices converted
    to W8A8 storage, as load_params(..., WeightPolicy(precision="w8a8")) would place them. The float
    tree is left as it is (the two share every other array)."""

    def convert(tree: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in tree.items():
            if key in INT8_TARGETS and value is not None and not isinstance(value, dict):
                value = jax.device_put(quantize_w8a8(np.asarray(value, dtype=np.float32)))
            out[key] = value
        return out

    converted = convert({k: v for k, v in params.items() if k != "layers"})
    converted["layers"] = [convert(layer) for layer in params["layers"]]
    return converted


def to_int4_ple(params: dict[str, Any], rows_per_pass: int = 16384) -> dict[str, Any]:
    """A parameter tree with its per-layer-embedding table (Gemma 4) as packed int4, as
    load_params(..., WeightPolicy(int4_ple=True)) would place it; a tree without one is returned as it is.
    The table is read off the device ``rows_per_pass`` rows at a time, so the host never holds it in float32
    (E2B's is 262144 x 8960)."""
    table = params.get("embed_per_layer")
    if table is None or isinstance(table, dict):
        return params
    parts = [quantize_rows_int4(np.asarray(table[start:start + rows_per_pass], dtype=np.float32))
             for start in range(0, table.shape[0], rows_per_pass)]
    packed = {key: jax.device_put(np.concatenate([part[key] for part in parts])) for key in ("q4", "s")}
    return {**params, "embed_per_layer": packed}


def all_matmuls_integer(params: dict[str, Any]) -> bool:
    """Whether every matrix the model multiplies by is W8A8 storage: int8 x int8 -> int32 products are exact,
    so a row's result does not depend on how many rows share the matmul (float GEMMs may block, and so round,
    differently by shape)."""
    trees = [{k: v for k, v in params.items() if k != "layers"}, *params["layers"]]
    return all(isinstance(value, dict) and "qa8" in value
               for tree in trees for key, value in tree.items() if key in INT8_TARGETS and value is not None)


def fuse_projections(params: dict[str, Any]) -> dict[str, Any]:
    """Each layer's q/k/v matrices stacked into one "qkv_proj" and gate/up into one "gate_up_proj" (rows
    concatenated; the model splits the product). Two matmuls per layer instead of five: on CPU every op
    carries a fixed cost, and in W8A8 the shared input is rotated and quantized once instead of 3 + 2
    times. Exact: per-row weight scales and per-token activation scales do not change by stacking rows.
    The input tree is left as it is; the result shares every other array."""

    def stack(parts: list[Any]) -> Any:
        if isinstance(parts[0], dict):
            return {key: jnp.concatenate([part[key] for part in parts], axis=0) for key in parts[0]}
        return jnp.concatenate(parts, axis=0)

    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        names = [n for n in ("q_proj", "k_proj", "v_proj") if n in layer]
        if len(names) > 1:
            layer["qkv_proj"] = stack([layer.pop(n) for n in names])
        if "gate_proj" in layer and "up_proj" in layer:
            layer["gate_up_proj"] = stack([layer.pop("gate_proj"), layer.pop("up_proj")])
        layers.append(layer)
    return {**params, "layers": layers}


def param_bytes(params: dict[str, Any]) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params))
