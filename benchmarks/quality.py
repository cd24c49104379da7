#!/usr/bin/env python3
"""Fast paths vs float32 on the real model: greedy agreement, perplexity, decode step time.

    python3 benchmarks/quality.py --model default

Variants (`--variants`, the first is the reference): f32 (float32 weights and KV), w8a8 (W8A8 weights,
float32 KV), w8a8_int8kv (W8A8 weights, int8 KV with per-position scales).

- Greedy agreement (teacher-forced): every engine (8 slots each) is fed the reference's own greedy
  continuation of 16 prompts for 128 tokens; agreement is the fraction of the 16 x 128 positions where a
  variant's argmax equals the reference's. Feeding all the same tokens keeps one early difference from
  making every later position incomparable. The free-running figure (length of the common greedy prefix)
  is reported too.
- Perplexity of each on a fixed text of 4096 scored tokens: Python's own help topics (`pydoc_data.topics`,
  every topic in name order; `core.quality.reference_text`), which ship with the interpreter and do not change
  with this repository, in 512-token chunks through one slot; also the top-1 agreement on that text.
- Decode step time of the 8-slot step, the variants interleaved step by step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import host, save_report  # noqa: E402 - after the path set-up that makes it importable

PROMPTS = [
    "The history of the printing press begins", "Write a short poem about the sea.",
    "Explain how a hash table works.", "Once upon a time, in a small village,",
    "The three most important causes of the French Revolution were", "def fibonacci(n):",
    "List five uses of baking soda.", "The capital of Australia is", "Photosynthesis is the process by which",
    "A good night's sleep matters because", "In 1969, the Apollo 11 mission",
    "How do vaccines train the immune system?",
    "The rules of chess say that a knight", "Summarize the plot of Hamlet.", "To make bread at home, first",
    "The difference between weather and climate is",
]


# name -> (precision, KV cache dtype); the first is the reference.
VARIANTS = {"f32": ("float", "float32"), "w8a8": ("w8a8", "float32"), "w8a8_int8kv": ("w8a8", "int8")}


# The greedy phase's engines: the prompts run SLOTS at a time, one per slot.
SLOTS, MAX_LEN = 8, 256


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The options and the variant names, the reference first."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--ppl-tokens", type=int, default=4096, help="tokens scored (in 512-token chunks)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, the first is the reference (default {','.join(VARIANTS)})")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quality-cpu.json"))
    args = parser.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if len(names) < 2 or any(n not in VARIANTS for n in names):
        parser.error(f"--variants takes two or more of {', '.join(VARIANTS)}")
    return args, names


def load_variants(model_name: str, names: list[str]) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """The float32 model, and each variant's weights and KV dtype (the W8A8 weights are converted once and
    shared by the variants that use them)."""
    from core.compile_cache import enable_compile_cache
    from core.runtime import load_model
    from core.weights import to_w8a8

    enable_compile_cache()
    model = load_model(model_name, dtype="float32")
    weights = {"float": model.params}
    if any(VARIANTS[n][0] == "w8a8" for n in names):
        weights["w8a8"] = to_w8a8(model.params)
    params = {n: weights[VARIANTS[n][0]] for n in names}
    kv = {n: VARIANTS[n][1] for n in names}
    return model, params, kv


def describe_variants(model_name: str, names: list[str], params: dict[str, Any], kv: dict[str, str]) -> dict:
    """The head of the report: the model, the host, and what each variant is."""
    from core.weights import param_bytes

    return {"model": model_name, "host": host(), "reference": names[0],
            "variants": {n: {"precision": VARIANTS[n][0], "kv_dtype": kv[n]} for n in names},
            "param_bytes": {n: param_bytes(params[n]) for n in names}}


def build_engines(cfg: Any, params: dict[str, Any], kv: dict[str, str]) -> dict[str, Any]:
    """One compiled engine per variant, in float32 compute."""
    from core.engine import Engine, EngineConfig

    engines = {n: Engine(cfg, params[n], EngineConfig(num_slots=SLOTS, max_len=MAX_LEN, chunk_sizes=(32, 128),
                                                      kv_dtype=None if kv[n] == "float32" else kv[n]), "float32")
               for n in params}
    for e in engines.values():
        e.warmup()
    return engines


def greedy_phase(model: Any, params: dict[str, Any], kv: dict[str, str], names: list[str], steps: int) -> dict:
    """Greedy agreement with the reference and decode step times: the report's "greedy",
    "decode_step_ms_p50" and "decode_step_ratio_vs_reference". The engines are freed on return, before the
    perplexity runs."""
    import numpy as np

    ref, others = names[0], names[1:]
    engines = build_engines(model.cfg, params, kv)
    prompts = [model.tokenizer.encode(p, add_bos=True) for p in PROMPTS]
    match, total, free_prefix, times = greedy_agreement(engines, prompts, ref, others, steps)
    ms = {n: 1e3 * float(np.median(v)) for n, v in times.items()}
    return {
        "greedy": {
            "prompts": len(prompts), "tokens_per_prompt": steps, "slots": SLOTS,
            **{n: {"teacher_forced_top1_agreement": round(match[n] / total, 4),
                   "free_running_common_prefix_mean": round(float(np.mean(free_prefix[n])), 1),
                   "free_running_common_prefix_min": int(np.min(free_prefix[n])),
                   "free_running_full_match_prompts": int(sum(k >= steps for k in free_prefix[n]))}
               for n in others},
        },
        "decode_step_ms_p50": {n: round(v, 2) for n, v in ms.items()},
        "decode_step_ratio_vs_reference": {n: round(ms[n] / ms[ref], 3) for n in others},
    }


def greedy_agreement(engines: dict[str, Any], prompts: list[list[int]], ref: str, others: list[str],
                     steps: int) -> tuple[dict[str, int], int, dict[str, list[int]], dict[str, list[float]]]:
    """The prompts in groups of SLOTS. Returns, per other variant, the positions where its argmax equals the
    reference's and each prompt's free-running common prefix; the positions compared per variant; and
    every variant's decode step times."""
    match = dict.fromkeys(others, 0)
    total = 0
    free_prefix: dict[str, list[int]] = {n: [] for n in others}
    times: dict[str, list[float]] = {n: [] for n in engines}
    for group in range(0, len(prompts), SLOTS):
        group_match, group_total, prefix = greedy_group(engines, prompts[group:group + SLOTS], ref, others, steps,
                                                        times)
        for n in others:
            match[n] += group_match[n]
            free_prefix[n] += prefix[n]
        total += group_total
        print(f"group {group // SLOTS}: agreement so far "
              + ", ".join(f"{n} {match[n] / total:.4f}" for n in others), file=sys.stderr)
    return match, total, free_prefix, times


def greedy_group(engines: dict[str, Any], batch: list[list[int]], ref: str, others: list[str], steps: int,
                 times: dict[str, list[float]]) -> tuple[dict[str, int], int, dict[str, list[int]]]:
    """One group (one prompt per slot) prefilled into every engine, then steps - 1 decode steps, every
    engine fed the reference's greedy tokens (teacher forcing). Returns what `greedy_agreement` sums."""
    import jax.numpy as jnp
    import numpy as np

    last: dict[str, list[int]] = {n: [] for n in engines}
    for slot, ids in enumerate(batch):
        for n, e in engines.items():
            last[n].append(int(jnp.argmax(e.prefill(slot, ids, 0))))
    fed = np.array(last[ref] + [0] * (SLOTS - len(batch)), np.int32)
    diverged = {n: [last[ref][i] != last[n][i] for i in range(len(batch))] for n in others}
    prefix = {n: [0 if d else 1 for d in diverged[n]] for n in others}  # greedy tokens shared so far
    match = {n: sum(not d for d in diverged[n]) for n in others}
    total = len(batch)
    positions = np.array([len(p) for p in batch] + [0] * (SLOTS - len(batch)), np.int32)
    active = np.arange(SLOTS) < len(batch)
    for _ in range(steps - 1):
        out = interleaved_step(engines, fed, positions, active, times)
        total += len(batch)
        for n in others:
            for i in range(len(batch)):
                match[n] += int(out[ref][i] == out[n][i])
                if not diverged[n][i]:
                    diverged[n][i] = bool(out[ref][i] != out[n][i])
                    prefix[n][i] += 0 if diverged[n][i] else 1
        fed = out[ref].astype(np.int32)
        positions = positions + active
    return match, total, prefix


def interleaved_step(engines: dict[str, Any], fed: Any, positions: Any, active: Any,
                     times: dict[str, list[float]]) -> dict[str, Any]:
    """One decode step of every engine on the same inputs, one after the other (so that other load on the host
    slows them alike): each one's argmax tokens, its time appended to ``times``."""
    import jax.numpy as jnp
    import numpy as np

    out = {}
    for n, e in engines.items():
        begin = time.perf_counter()
        out[n] = np.asarray(jnp.argmax(e.decode(fed, positions, active), axis=-1))
        times[n].append(time.perf_counter() - begin)
    return out


def perplexity_phase(model: Any, params: dict[str, Any], kv: dict[str, str], names: list[str],
                     ppl_tokens: int) -> dict[str, Any]:
    """Each variant's perplexity on the reference text, and its top-1 agreement with the reference there:
    the report's "perplexity"."""
    import numpy as np

    from core.quality import REFERENCE_TEXT, perplexity, reference_tokens, score

    ref, others = names[0], names[1:]
    ids = reference_tokens(model.tokenizer, ppl_tokens + 1)
    scored = {n: score(model.cfg, params[n], ids, kv_dtype=kv[n]) for n in names}
    ppl = {n: perplexity(lp) for n, (lp, _) in scored.items()}
    return {
        "text": REFERENCE_TEXT, "python": sys.version.split()[0], "tokens_scored": len(scored[ref][0]),
        **{n: round(v, 4) for n, v in ppl.items()},
        "relative_change": {n: round(ppl[n] / ppl[ref] - 1, 4) for n in others},
        "teacher_forced_top1_agreement_on_text": {
            n: round(float(np.mean(scored[n][1] == scored[ref][1])), 4) for n in others},
    }


def main(argv: list[str] | None = None) -> int:
    args, names = parse_args(argv)
    model, params, kv = load_variants(args.model, names)
    result = describe_variants(args.model, names, params, kv)
    result.update(greedy_phase(model, params, kv, names, args.steps))
    print(json.dumps(result, indent=2), file=sys.stderr)
    result["perplexity"] = perplexity_phase(model, params, kv, names, args.ppl_tokens)
    save_report(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
