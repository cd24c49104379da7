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

import hashlib
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
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

    @cached_property
    def fingerprint(self) -> str:
        """What the adapter computes, as a hash of its scale and pairs: equal for equal adapters wherever they
        were read from, different once a file's contents change (KV is shared only under one fingerprint)."""
        digest = hashlib.sha256(f"{self.scale!r}".encode())
        for key in sorted(self.pairs):
            digest.update(repr(key).encode())
            for array in self.pairs[key]:
                digest.update(repr(array.shape).encode())
                digest.update(np.ascontiguousarray(array, np.float32).tobytes())
        return digest.hexdigest()[:16]


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
# The adapters of S slots, each zero-padded to the maximum rank R, are stacked per input group (the
# projections of a layer that read the same input, INPUT_GROUPS) into `down` [in, S, G, R] (the group's G
# A matrices, transposed) and, per projection, `up` [S, R, out] (its B matrix transposed, scale folded in):
# the contracted dimension first, as the products read them, and every slot's columns side by side, so that
# one slot's A form one [in, G*R] matrix, all slots' one [in, S*G*R] and all B of a projection one
# [S*R, out], without a copy. One down product per group, not per projection: a decode step's cost is mostly
# its number of small products. Each batch row names its slot (-1: none); `core.model.lora_delta` applies
# each slot in use to the call's tokens and keeps each token's own, so a row's terms do not depend on the other
# rows of its batch or on how many tokens share its call.

INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def group_key(targets: tuple[str, ...] | list[str]) -> str:
    """The "lora" entry of a layer that holds these projections' slots (`attach_slots`)."""
    return "+".join(targets)


def pack_group(adapters: list[LoraAdapter | None], layer: int, targets: tuple[str, ...], in_dim: int,
               out_dims: tuple[int, ...], max_rank: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(down [in, S, G, R], {target: up [S, R, out]}) float32 for projections ``targets`` of ``layer``, which
    read one input: slot s holds adapter s's pairs (scale folded into up), zero-padded to ``max_rank``; a slot
    with no adapter, or whose adapter leaves a projection alone, is zeros there."""
    down = np.zeros((in_dim, len(adapters), len(targets), max_rank), np.float32)
    ups = {target: np.zeros((len(adapters), max_rank, out), np.float32) for target, out in zip(targets, out_dims,
                                                                                                strict=True)}
    for s, adapter in enumerate(adapters):
        for j, target in enumerate(targets):
            pair = None if adapter is None else adapter.pairs.get((layer, target))
            if pair is not None:
                write_pair(down[:, :, j], ups[target], s, adapter.scale, *pair)
    return down, ups


def write_pair(down: np.ndarray, up: np.ndarray, slot: int, scale: float, a: np.ndarray | None,
               b: np.ndarray | None) -> None:
    """Put one adapter's pair (A [r, in], B [out, r]; None: zeros) into slot ``slot`` of stacked arrays
    (down [in, S, R], a view into a group's, and up [S, R, out])."""
    down[:, slot] = 0
    up[slot] = 0
    if a is not None and b is not None:
        rank = a.shape[0]
        down[:, slot, :rank] = a.T
        up[slot, :rank] = scale * b.T


def adapted_projections(cfg: ModelConfig) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer index, target) -> (in, out) for every projection an adapter slot may change: all seven in each
    decoder layer, but k/v where a layer shares another's cache (it computes none)."""
    shapes, _ = expected_tensor_shapes(cfg)
    found = {}
    for layer in cfg.layers:
        for target, module in TARGETS.items():
            if target in ("k_proj", "v_proj") and not layer.owns_cache:
                continue
            name = f"layers.{layer.index}.{module}.{target}.weight"
            if name in shapes:
                out_dim, in_dim = shapes[name]
                found[layer.index, target] = (in_dim, out_dim)
    return found


def adapted_groups(cfg: ModelConfig) -> dict[tuple[int, tuple[str, ...]], tuple[int, tuple[int, ...]]]:
    """(layer index, targets) -> (in, outs) for each input group of `adapted_projections` (INPUT_GROUPS, the
    projections this layer has)."""
    projections = adapted_projections(cfg)
    found = {}
    for layer in cfg.layers:
        for group in INPUT_GROUPS:
            targets = tuple(t for t in group if (layer.index, t) in projections)
            if targets:
                found[layer.index, targets] = (projections[layer.index, targets[0]][0],
                                               tuple(projections[layer.index, t][1] for t in targets))
    return found


def attach_slots(params: dict[str, Any], adapters: list[LoraAdapter | None], cfg: ModelConfig, max_rank: int,
                 every_projection: bool = False, dtype: str | None = None) -> dict[str, Any]:
    """A copy of ``params`` whose layers carry "lora": {group_key(targets): (down, {target: up})} slots
    (`pack_group`) in ``dtype`` (None: the compute dtype): for every input group one of whose projections
    some adapter adapts, or (``every_projection``) for all of them, so that any adapter can be written into a
    slot later without changing a shape."""
    import jax.numpy as jnp

    dtype = dtype or params["final_norm"].dtype
    adapted = {key for adapter in adapters if adapter is not None for key in adapter.pairs}
    groups = adapted_groups(cfg)
    layers = []
    for layer, lp in zip(cfg.layers, params["layers"], strict=True):
        slots = {}
        for (index, targets), (in_dim, out_dims) in groups.items():
            if index == layer.index and (every_projection or any((index, t) in adapted for t in targets)):
                down, ups = pack_group(adapters, index, targets, in_dim, out_dims, max_rank)
                slots[group_key(targets)] = (jnp.asarray(down, dtype),
                                             {t: jnp.asarray(up, dtype) for t, up in ups.items()})
        layers.append({**lp, "lora": slots} if slots else lp)
    return {**params, "layers": layers}


def with_adapter(params: dict[str, Any], slot: int, adapter: LoraAdapter | None) -> dict[str, Any]:
    """A copy of slotted ``params`` (`attach_slots` with every projection) whose slot ``slot`` holds
    ``adapter`` (None: zeros). Only the "lora" arrays are replaced, with arrays of the same shapes and dtypes, so
    programs compiled for ``params`` run it unchanged. Copies through the host: rare, and no program to
    compile."""
    import jax.numpy as jnp

    layers = []
    for index, lp in enumerate(params["layers"]):
        slots = {}
        for key, (down, ups) in lp.get("lora", {}).items():
            host_down = np.array(down, np.float32)
            host_ups = {}
            for j, target in enumerate(key.split("+")):
                host_ups[target] = np.array(ups[target], np.float32)
                pair = None if adapter is None else adapter.pairs.get((index, target))
                write_pair(host_down[:, :, j], host_ups[target], slot, 0.0 if adapter is None else adapter.scale,
                           *(pair if pair is not None else (None, None)))
            slots[key] = (jnp.asarray(host_down, down.dtype),
                          {t: jnp.asarray(up, ups[t].dtype) for t, up in host_ups.items()})
        layers.append({**lp, "lora": slots} if slots else lp)
    return {**params, "layers": layers}
