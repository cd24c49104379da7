"""Load a model by name: checkpoint source, config, tokenizer, parameters on the device."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import ModelConfig
from core.device import choose_dtype, choose_precision
from core.loaders import open_checkpoint
from core.tokenizer import Tokenizer
from core.weights import WeightPolicy, fuse_projections, load_params, param_bytes

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    path: Path
    cfg: ModelConfig
    params: dict[str, Any]
    tokenizer: Tokenizer
    dtype: str
    dtype_reason: str
    load_seconds: float
    precision: str = "float"
    precision_reason: str = ""

    @property
    def param_bytes(self) -> int:
        return param_bytes(self.params)


def load_model(
    model: str | Path,
    dtype: str | None = None,
    int8_matrices: bool = False,
    int4_ple: bool = False,
    precision: str | None = "float",
    progress: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    begin = time.perf_counter()
    source = open_checkpoint(model)
    cfg = ModelConfig.from_hf_dict(source.config)
    chosen, reason = choose_dtype(dtype)
    log.info("compute dtype %s (%s)", chosen, reason)
    # None: chosen per device; the default stays "float" so library callers get the reference path.
    precision, precision_reason = choose_precision(precision)
    log.info("weight precision %s (%s)", precision, precision_reason)
    policy = WeightPolicy(dtype=chosen, int8_matrices=int8_matrices, int4_ple=int4_ple, precision=precision)
    params = fuse_projections(load_params(source, cfg, policy, progress))
    tokenizer = Tokenizer.from_pretrained(source.path)
    return LoadedModel(
        name=str(model), path=source.path, cfg=cfg, params=params, tokenizer=tokenizer,
        dtype=chosen, dtype_reason=reason, load_seconds=time.perf_counter() - begin,
        precision=precision, precision_reason=precision_reason,
    )
