"""Load a model by name: checkpoint source, config, tokenizer, parameters on the device."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax

from core import weight_cache
from core.config import ModelConfig
from core.device import choose_dtype, choose_precision
from core.loaders import open_checkpoint
from core.loaders.base import CheckpointSource
from core.tokenizer import Tokenizer
from core.weights import WeightPolicy, fuse_projections, load_params, param_bytes

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    path: Path
    cfg: ModelConfig
    params: dict[str, Any]
    dtype: str
    dtype_reason: str
    load_seconds: float
    precision: str = "float"
    precision_reason: str = ""
    weights_from_cache: bool = False  # the prepared weights were read back from the weights cache
    weights_identity: str | None = None  # the checkpoint's hash and how it was prepared (None: not computed)
    _tokenizer: Tokenizer | None = field(default=None, repr=False)
    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, loaded at the first use: building it holds the GIL for about a second, so a caller
        chooses when (the server: while its compile threads load executables outside the GIL; beside the
        weights it slowed both, 2.5 s together against 1.7 s one after the other)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = Tokenizer.from_pretrained(self.path)
            return self._tokenizer

    @property
    def param_bytes(self) -> int:
        return param_bytes(self.params)


def load_model(
    model: str | Path,
    dtype: str | None = None,
    precision: str | None = "float",
    progress: Callable[[int, int], None] | None = None,
    weights_cache: Path | None = None,
    int4_ple: bool = False,
) -> LoadedModel:
    """``weights_cache``: a directory of prepared weights (`core.weight_cache`) to read them from, or to
    store them in after preparing them; None: prepare them every time. ``int4_ple``: Gemma 4's
    per-layer-embedding table as packed int4 (a model without one is unaffected)."""
    begin = time.perf_counter()
    source = open_checkpoint(model)
    cfg = ModelConfig.from_hf_dict(source.config)
    chosen, reason = choose_dtype(dtype)
    log.info("compute dtype %s (%s)", chosen, reason)
    # None: chosen per device; the default stays "float" so library callers get the reference path.
    precision, precision_reason = choose_precision(precision)
    log.info("weight precision %s (%s)", precision, precision_reason)
    policy = WeightPolicy(dtype=chosen, precision=precision, int4_ple=int4_ple)
    params, cached, identity = _prepared_params(source, cfg, policy, progress, weights_cache)
    return LoadedModel(
        name=str(model), path=source.path, cfg=cfg, params=params,
        dtype=chosen, dtype_reason=reason, load_seconds=time.perf_counter() - begin,
        precision=precision, precision_reason=precision_reason, weights_from_cache=cached, weights_identity=identity,
    )


def _prepared_params(source: CheckpointSource, cfg: ModelConfig, policy: WeightPolicy,
                     progress: Callable[[int, int], None] | None,
                     weights_cache: Path | None) -> tuple[dict[str, Any], bool, str | None]:
    """The parameters on the device, whether they came from the weights cache, and their identity (the
    weights cache's key: checkpoint hash and preparation; None without a weights cache)."""
    params, cached, key = None, False, None
    if weights_cache is not None:
        key = weight_cache.cache_key(weight_cache.checkpoint_identity(Path(source.path), weights_cache), asdict(policy))
        params = weight_cache.load(weights_cache, key, jax.device_put)
        cached = params is not None
    if params is None:
        params = fuse_projections(load_params(source, cfg, policy, progress))
        if weights_cache is not None:
            weight_cache.save(weights_cache, key, params)
    return params, cached, key
