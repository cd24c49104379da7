"""`slotserve generate` and `slotserve tokenize`: prompts from the command line through the runtime the server
builds (`agents.runtime.build_runtime`: the same precision, KV dtype, caches and scheduler), no HTTP."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from core.sampling import SamplingParams

FILE_KEYS = {"prompt", "prompt_ids", "max_tokens", "temperature", "seed", "top_k", "top_p", "min_p",
             "ignore_eos"}


def _stderr_progress(stage: str, done: int = 0, total: int = 0, detail: str = "") -> None:
    """One line per stage and detail (the CLI's output is for scripts; no live redraw)."""
    counted = f" [{done}/{total}]" if total else ""
    print(f"slotserve: {stage}{counted}{': ' + detail if detail else ''}", file=sys.stderr, flush=True)


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


def _request(spec: dict[str, Any], args: argparse.Namespace, tokenizer: Any) -> Any:
    from scheduler.request import GenerationRequest

    ids = spec.get("prompt_ids") or tokenizer.encode(spec["prompt"], add_bos=True)
    sampling = SamplingParams(
        temperature=spec.get("temperature", args.temperature),
        top_k=spec.get("top_k", args.top_k),
        top_p=spec.get("top_p", args.top_p),
        min_p=spec.get("min_p", args.min_p),
        seed=spec.get("seed", args.seed),
    )
    return GenerationRequest(prompt_ids=tuple(int(i) for i in ids), sampling=sampling,
                             max_tokens=int(spec.get("max_tokens", args.max_tokens)),
                             ignore_eos=bool(spec.get("ignore_eos", args.ignore_eos)))


def run_generate(args: argparse.Namespace) -> int:
    from agents.runtime import RuntimeOptions, build_runtime

    specs = _prompt_specs(args)
    given = {"model": args.model, "num_slots": args.slots, "max_len": args.max_len}
    options = RuntimeOptions(**{k: v for k, v in given.items() if v is not None}, dtype=args.dtype,
                             kv_dtype=args.kv_dtype, precision=args.precision, compile_cache=args.compile_cache,
                             background_compile=False)  # a batch wants every program before it starts
    runtime = build_runtime(options, _stderr_progress)
    try:
        requests = [_request(spec, args, runtime.tokenizer) for spec in specs]
        begin = time.perf_counter()
        handles = [runtime.scheduler.submit(request) for request in requests]  # extra prompts wait for a slot
        runtime.scheduler.run_until_idle()
        wall = time.perf_counter() - begin
    finally:
        runtime.stop()
    total = 0
    for request, handle in zip(requests, handles, strict=True):
        ids, text, finish = handle.result(timeout=0)
        total += len(ids)
        if args.json:
            print(json.dumps({"prompt_ids": list(request.prompt_ids), "generated_ids": ids, "text": text,
                              "finish_reason": finish.reason.value,
                              "timings": {k: round(v, 6) for k, v in finish.timings.items()}}, ensure_ascii=False))
        else:
            print(text)
    print(f"[{len(requests)} prompts, {total} tokens in {wall:.2f} s; load {runtime.load_seconds:.1f} s, "
          f"compile {runtime.compile_seconds:.1f} s, precision {runtime.precision}]", file=sys.stderr)
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    from core.loaders import open_checkpoint
    from core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(open_checkpoint(args.model).path)
    ids = tokenizer.encode(args.text)
    print(json.dumps({"ids": ids}) if args.json else " ".join(str(i) for i in ids))
    return 0
