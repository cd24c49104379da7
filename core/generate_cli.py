"""`slotserve generate` and `slotserve tokenize`: argument handling and output around core.generate."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from core.sampling import SamplingParams

FILE_KEYS = {"prompt", "prompt_ids", "max_tokens", "temperature", "seed", "top_k", "top_p", "min_p",
             "ignore_eos"}


def _stderr_progress(label: str):
    def report(name: str, done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\r{label}: [{done}/{total}] {name:<24}", end=end, file=sys.stderr, flush=True)

    return report


def _prompt_specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = [{"prompt": text} for text in args.prompt]
    specs += [{"prompt_ids": ids} for ids in args.prompt_ids]
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                spec = json.loads(line)
                if not isinstance(spec, dict) or ("prompt" in spec) == ("prompt_ids" in spec):
                    raise ValueError(f"{args.prompts_file}:{line_no}: need exactly one of prompt / prompt_ids")
                unknown = set(spec) - FILE_KEYS
                if unknown:
                    raise ValueError(f"{args.prompts_file}:{line_no}: unknown keys {sorted(unknown)}")
                specs.append(spec)
    if not specs:
        raise ValueError("give at least one --prompt, --prompt-ids or --prompts-file")
    return specs


def run_generate(args: argparse.Namespace) -> int:
    from core.device import enable_compile_cache
    from core.engine import Engine, EngineConfig
    from core.generate import GenerationRequest, generate
    from core.runtime import load_model

    specs = _prompt_specs(args)
    enable_compile_cache(args.compile_cache)
    model = load_model(args.model, dtype=args.dtype, precision=args.precision)
    tok = model.tokenizer
    requests = []
    for spec in specs:
        ids = spec.get("prompt_ids") or tok.encode(spec["prompt"], add_bos=True)
        sampling = SamplingParams(
            temperature=spec.get("temperature", args.temperature),
            top_k=spec.get("top_k", args.top_k),
            top_p=spec.get("top_p", args.top_p),
            min_p=spec.get("min_p", args.min_p),
            seed=spec.get("seed", args.seed),
        )
        requests.append(GenerationRequest(
            prompt_ids=[int(i) for i in ids],
            max_tokens=int(spec.get("max_tokens", args.max_tokens)),
            sampling=sampling,
            ignore_eos=bool(spec.get("ignore_eos", args.ignore_eos)),
        ))
    engine = Engine(model.cfg, model.params, EngineConfig(num_slots=args.slots, max_len=args.max_len,
                                                          kv_dtype=args.kv_dtype), model.dtype)
    per_slot = engine.bytes_per_slot
    print(f"KV pool: {engine.num_slots} slots x {engine.max_len} positions ({engine.spec.dtype}), "
          f"{per_slot / 2**20:.1f} MiB per slot, {per_slot * engine.num_slots / 2**20:.1f} MiB in total; "
          f"weights {model.param_bytes / 2**20:.0f} MiB {model.dtype} ({model.dtype_reason}), "
          f"precision {model.precision}", file=sys.stderr)
    engine.warmup(_stderr_progress("compiling"))
    begin = time.perf_counter()
    results = generate(engine, requests, frozenset(tok.stop_ids))
    wall = time.perf_counter() - begin
    for result in results:
        text = tok.decode(result.generated_ids, skip_special=True)
        if args.json:
            print(json.dumps({
                "prompt_ids": result.prompt_ids,
                "generated_ids": result.generated_ids,
                "text": text,
                "finish_reason": result.finish_reason,
                "timings": {k: round(v, 6) for k, v in result.timings.items()},
            }, ensure_ascii=False))
        else:
            print(text)
    total = sum(len(r.generated_ids) for r in results)
    print(f"[{len(results)} prompts, {total} tokens in {wall:.2f} s; load {model.load_seconds:.1f} s, "
          f"compile {engine.compile_seconds:.1f} s, dtype {model.dtype}]", file=sys.stderr)
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    from core.loaders import open_checkpoint
    from core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(open_checkpoint(args.model).path)
    ids = tokenizer.encode(args.text)
    print(json.dumps({"ids": ids}) if args.json else " ".join(str(i) for i in ids))
    return 0
