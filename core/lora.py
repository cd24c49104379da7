"""LoRA adapters as PEFT saves them (`adapter_config.json` + `adapter_model.safetensors`), read and checked
against the resident model's shapes (docs/lora.md).

An adapter adds ``scale * B @ A`` to a projection's weight, A [r, in] and B [out, r]; ``scale`` is
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA. The seven projections of a decoder layer may
carry one (q/k/v/o, gate/up/down). What is refused, with an `AdapterError` naming it: another PEFT method,
`modules_to_save` (whole copies of modules), DoRA, LoRA biases, per-module ranks or alphas, targets outside
those seven, a rank over the configured maximum, shapes that do not fit the model, half of an A/B pair, and a
damaged or truncated file.

Gemma 4's KV-shared layers compute no keys or values of their own (they read those of the layer they share
with), so an adapter's k/v pairs on such a layer change nothing, as in transformers: they are read, checked and
listed in `LoraAdapter.ignored`. Pairs on a multimodal checkpoint's vision or audio tower are listed there too:
the text model is the one served.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.config import ModelConfig, expected_tensor_shapes
from core.json_file import load_json_object
from core.loaders.errors import CheckpointError
from core.loaders.safetensors_header import TensorEntry, read_header
from core.loaders.safetensors_source import FLOAT_DTYPES

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out
_PAIR = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_OTHER_TOWERS = ("vision_tower", "audio_tower", "vision_model", "audio_model", "multi_modal_projector")


class AdapterError(ValueError):
    """An adapter is malformed or does not fit the model; the message names the file and the problem."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's low-rank pairs: (layer index, target) -> (A [r, in], B [out, r]) in float32."""

    path: Path
    rank: int
    scale: float
    pairs: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(repr=False)
    ignored: tuple[str, ...] = ()  # tensors read but without effect (KV-shared layers, other towers)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


@dataclass(frozen=True)
class AdapterSettings:
    """What an adapter_config.json says that serving needs."""

    rank: int
    alpha: float
    rslora: bool

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def read_adapter(directory: Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter saved in ``directory``, checked against ``cfg``; raises AdapterError."""
    directory = Path(directory)
    settings = read_settings(directory / ADAPTER_CONFIG, max_rank)
    entries = _weight_entries(directory / ADAPTER_WEIGHTS)
    shapes, _ = expected_tensor_shapes(cfg)
    shared = {layer.index for layer in cfg.layers if not layer.owns_cache}
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    ignored: list[str] = []
    for name, entry in sorted(entries.items()):
        if any(tower in name for tower in _OTHER_TOWERS):
            ignored.append(name)
            continue
        found = _PAIR.search(name)
        if found is None:
            raise AdapterError(f"{directory}: tensor {name!r} is not a LoRA pair of a decoder layer's projection")
        layer, module, target, half = int(found[1]), found[2], found[3], found[4]
        if TARGETS.get(target) != module:
            raise AdapterError(f"{directory}: target {module}.{target} is not one of {sorted(TARGETS)}")
        weight = f"layers.{layer}.{module}.{target}.weight"
        if weight not in shapes:
            raise AdapterError(f"{directory}: {name!r} targets {weight}, which this model does not have")
        array = _read(entry, directory)
        _check_half(array, half, shapes[weight], settings.rank, name, directory)
        if layer in shared and target in ("k_proj", "v_proj"):
            ignored.append(name)
            continue
        halves.setdefault((layer, target), {})[half] = array
    pairs = {}
    for (layer, target), got in halves.items():
        if set(got) != {"A", "B"}:
            missing = "lora_B" if "A" in got else "lora_A"
            raise AdapterError(f"{directory}: layers.{layer} {target} has no {missing} weight")
        pairs[layer, target] = (got["A"], got["B"])
    if not pairs and not ignored:
        raise AdapterError(f"{directory}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return LoraAdapter(directory, settings.rank, settings.scale, pairs, tuple(ignored))


def read_settings(path: Path, max_rank: int) -> AdapterSettings:
    """The rank and scaling of an adapter_config.json, refusing what serving does not support."""
    try:
        raw = load_json_object(path)
    except FileNotFoundError:
        raise AdapterError(f"{path.parent}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)") from None
    except ValueError as e:
        raise AdapterError(f"{path}: {e}") from None
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key, what in (("modules_to_save", "whole-module copies"), ("rank_pattern", "per-module ranks"),
                      ("alpha_pattern", "per-module alphas")):
        if raw.get(key):
            raise AdapterError(f"{path}: {key} ({what}) is not supported")
    if raw.get("use_dora"):
        raise AdapterError(f"{path}: use_dora (DoRA) is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias {raw.get('bias')!r} (trained LoRA biases) is not supported")
    if raw.get("fan_in_fan_out"):
        raise AdapterError(f"{path}: fan_in_fan_out is for Conv1D models, not Gemma")
    targets = raw.get("target_modules")
    if isinstance(targets, list) and (unknown := sorted(set(targets) - set(TARGETS))):
        raise AdapterError(f"{path}: target_modules {unknown} are not among {sorted(TARGETS)}")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} is over this server's maximum of {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{path}: lora_alpha must be a number, not {alpha!r}")
    return AdapterSettings(rank, float(alpha), bool(raw.get("use_rslora")))


def _weight_entries(path: Path) -> dict[str, TensorEntry]:
    if not path.is_file():
        raise AdapterError(f"{path.parent}: no {ADAPTER_WEIGHTS}")
    try:
        return read_header(path)
    except CheckpointError as e:
        raise AdapterError(str(e)) from None


def _read(entry: TensorEntry, directory: Path) -> np.ndarray:
    dtype = FLOAT_DTYPES.get(entry.dtype)
    if dtype is None:
        raise AdapterError(f"{directory}: {entry.raw_name!r} is {entry.dtype}, not a float tensor")
    with entry.file.open("rb") as handle:
        handle.seek(entry.start)
        data = handle.read(entry.end - entry.start)
    return np.frombuffer(data, dtype=dtype).reshape(entry.shape).astype(np.float32)


def _check_half(array: np.ndarray, half: str, weight_shape: tuple[int, ...], rank: int, name: str,
                directory: Path) -> None:
    out_dim, in_dim = weight_shape
    want = (rank, in_dim) if half == "A" else (out_dim, rank)
    if array.shape != want:
        raise AdapterError(f"{directory}: {name!r} has shape {list(array.shape)}, this model needs {list(want)} "
                           f"(rank {rank})")
    if not np.isfinite(array).all():
        raise AdapterError(f"{directory}: {name!r} holds a NaN or an infinity")


# ---- batched application: every row its own adapter slot, static shapes ----------------------------------------
#
# The adapters of S slots, each padded to the maximum rank R, are stacked per projection into one `down`
# [S*R, in] (the A matrices) and one `up` [S*R, out] (the B matrices, scale folded in). A row's slot picks its
# R columns of x @ down^T through a 0/1 mask; rows with no adapter have an all-zero mask. One matmul pair serves a
# batch of mixed adapters, in plain XLA (the S-LoRA / Punica shape without a custom kernel): `core.model.
# lora_delta`, applied to every projection that has slots in the layer's "lora" params (`attach_slots`).


def pack_slots(adapters: list[LoraAdapter | None], layer: int, target: str, in_dim: int, out_dim: int,
               max_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(down [S*R, in], up [S*R, out]) float32 for projection ``target`` of ``layer``: slot s holds adapter s's
    pair (scale folded into up), zero-padded to ``max_rank``; a slot with no adapter, or whose adapter leaves
    this projection alone, is zeros."""
    slots = len(adapters)
    down = np.zeros((slots * max_rank, in_dim), np.float32)
    up = np.zeros((slots * max_rank, out_dim), np.float32)
    for s, adapter in enumerate(adapters):
        pair = None if adapter is None else adapter.pairs.get((layer, target))
        if pair is None:
            continue
        a, b = pair  # [r, in], [out, r]
        rank = a.shape[0]
        down[s * max_rank:s * max_rank + rank] = a
        up[s * max_rank:s * max_rank + rank] = (adapter.scale * b).T
    return down, up


def slot_mask(slots_of_rows: np.ndarray, slots: int, max_rank: int) -> np.ndarray:
    """[B, S*R] float32: 1 over the R columns of each row's slot (``slots_of_rows`` [B] int, -1: no adapter)."""
    columns = np.arange(slots * max_rank) // max_rank
    return (columns[None, :] == np.asarray(slots_of_rows)[:, None]).astype(np.float32)


def attach_slots(params: dict[str, Any], adapters: list[LoraAdapter | None], cfg: ModelConfig,
                 max_rank: int) -> dict[str, Any]:
    """A copy of ``params`` whose layers carry "lora": {target: (down, up)} slots (`pack_slots`) for every
    projection some adapter adapts, in the compute dtype."""
    import jax.numpy as jnp

    shapes, _ = expected_tensor_shapes(cfg)
    dtype = params["final_norm"].dtype
    adapted = {key for adapter in adapters if adapter is not None for key in adapter.pairs}
    layers = []
    for layer, lp in zip(cfg.layers, params["layers"], strict=True):
        slots = {}
        for target, module in TARGETS.items():
            if (layer.index, target) in adapted:
                out_dim, in_dim = shapes[f"layers.{layer.index}.{module}.{target}.weight"]
                down, up = pack_slots(adapters, layer.index, target, in_dim, out_dim, max_rank)
                slots[target] = (jnp.asarray(down, dtype), jnp.asarray(up, dtype))
        layers.append({**lp, "lora": slots} if slots else lp)
    return {**params, "layers": layers}
