#!/usr/bin/env python3
"""Write a Hugging Face checkpoint directory of random weights: an HF text config's shapes, a real tokenizer.

For serving benchmarks where the real weights cannot travel (an accelerator machine that reaches no hub and
takes a 64 MiB tree): the server loads the directory like any local checkpoint, so HTTP, the scheduler and the
programs run exactly as they would on real weights of that shape; only the text is noise. Norm weights are
zero (Gemma's norms scale by 1 + w), every other tensor is normal with standard deviation --std.

    python3 benchmarks/random_checkpoint.py --config configs/models/gemma3-270m.json \\
        --tokenizer TOKENIZER_DIR --out /tmp/gemma3-270m-random

--tokenizer is a directory holding tokenizer.json (as core.tokenizer.Tokenizer.save writes it) or a .gguf.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="an HF-style text config JSON")
    p.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer directory or a .gguf")
    p.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def random_tensors(raw_config: dict, dtype: str, std: float, seed: int) -> dict:
    """HF name (prefix "model.") -> random array, for every tensor the model reads."""
    import ml_dtypes
    import numpy as np

    from core.config import ModelConfig, expected_tensor_shapes

    cfg = ModelConfig.from_hf_dict(raw_config)
    expected, optional = expected_tensor_shapes(cfg)
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected.items():
        if name in optional:
            continue
        if name.endswith("norm.weight"):
            tensors["model." + name] = np.zeros(shape, target)
        else:
            tensors["model." + name] = (rng.standard_normal(shape, np.float32) * std).astype(target)
    return tensors


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from safetensors.numpy import save_file

    from core.tokenizer import Tokenizer

    begin = time.perf_counter()
    raw = json.loads(args.config.read_text(encoding="utf-8"))
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    Tokenizer.from_pretrained(args.tokenizer).save(args.out)
    (args.out / "config.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
    tensors = random_tensors(raw, args.dtype, args.std, args.seed)
    save_file(tensors, str(args.out / "model.safetensors"))
    size = sum(a.nbytes for a in tensors.values())
    print(f"wrote {args.out}: {len(tensors)} tensors, {size / 1e9:.2f} GB, {time.perf_counter() - begin:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
