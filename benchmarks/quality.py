#!/usr/bin/env python3
"""W8A8 vs float32 on the real model: greedy agreement, perplexity, decode step time.

    python3 benchmarks/quality.py --model default

- Greedy agreement (teacher-forced): both engines (8 slots each) are fed the float32 model's own greedy
  continuation of 16 prompts for 128 tokens; agreement is the fraction of the 16 x 128 positions where the
  W8A8 argmax equals the float32 argmax. Feeding both the same tokens keeps one early difference from
  making every later position incomparable. The free-running figure (length of the common greedy prefix)
  is reported too.
- Perplexity of both on a fixed text of 4096 scored tokens: Python's own help topics (`pydoc_data.topics`,
  every topic in name order; `core.quality.reference_text`), which ship with the interpreter and do not change
  with this repository, in 512-token chunks through one slot; also the top-1 agreement on that text.
- Decode step time of the 8-slot step, the two precisions interleaved step by step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--ppl-tokens", type=int, default=4096, help="tokens scored (in 512-token chunks)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quality-cpu.json"))
    args = parser.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    from core.device import enable_compile_cache
    from core.engine import Engine, EngineConfig
    from core.quality import REFERENCE_TEXT, perplexity, reference_tokens, score
    from core.runtime import load_model
    from core.weights import param_bytes, to_w8a8

    enable_compile_cache()
    model = load_model(args.model, dtype="float32")
    cfg, tok = model.cfg, model.tokenizer
    variants = {"f32": model.params, "w8a8": to_w8a8(model.params)}
    result: dict = {"model": args.model, "param_bytes": {k: param_bytes(v) for k, v in variants.items()}}

    slots, max_len = 8, 256
    engines = {k: Engine(cfg, p, EngineConfig(num_slots=slots, max_len=max_len, chunk_sizes=(32, 128)), "float32")
               for k, p in variants.items()}
    for e in engines.values():
        e.warmup()

    prompts = [tok.encode(p, add_bos=True) for p in PROMPTS]
    match = total = 0
    free_prefix = []
    times: dict[str, list[float]] = {k: [] for k in engines}
    for group in range(0, len(prompts), slots):
        batch = prompts[group:group + slots]
        last = {k: [] for k in engines}
        for slot, ids in enumerate(batch):
            for k, e in engines.items():
                last[k].append(int(jnp.argmax(e.prefill(slot, ids, 0))))
        fed = np.array(last["f32"] + [0] * (slots - len(batch)), np.int32)
        diverged = [last["f32"][i] != last["w8a8"][i] for i in range(len(batch))]
        prefix = [0 if d else 1 for d in diverged]  # greedy tokens shared before the first difference
        match += sum(not d for d in diverged)
        total += len(batch)
        positions = np.array([len(p) for p in batch] + [0] * (slots - len(batch)), np.int32)
        active = np.arange(slots) < len(batch)
        for _ in range(args.steps - 1):
            out = {}
            for k, e in engines.items():  # interleaved: same step, same inputs, one after the other
                begin = time.perf_counter()
                out[k] = np.asarray(jnp.argmax(e.decode(fed, positions, active), axis=-1))
                times[k].append(time.perf_counter() - begin)
            for i in range(len(batch)):
                match += int(out["f32"][i] == out["w8a8"][i])
                total += 1
                if not diverged[i]:
                    diverged[i] = bool(out["f32"][i] != out["w8a8"][i])
                    prefix[i] += 0 if diverged[i] else 1
            fed = out["f32"].astype(np.int32)
            positions = positions + active
        free_prefix += prefix
        print(f"group {group // slots}: agreement so far {match / total:.4f}", file=sys.stderr)

    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    result["greedy"] = {
        "prompts": len(prompts), "tokens_per_prompt": args.steps, "slots": slots,
        "teacher_forced_top1_agreement": round(match / total, 4),
        "free_running_common_prefix_mean": round(float(np.mean(free_prefix)), 1),
        "free_running_common_prefix_min": int(np.min(free_prefix)),
        "free_running_full_match_prompts": int(sum(n >= args.steps for n in free_prefix)),
    }
    result["decode_step_ms_p50"] = {k: round(v, 2) for k, v in ms.items()}
    result["decode_step_ratio_w8a8_over_f32"] = round(ms["w8a8"] / ms["f32"], 3)
    del engines
    print(json.dumps(result, indent=2), file=sys.stderr)

    ids = reference_tokens(tok, args.ppl_tokens + 1)
    scored = {k: score(cfg, p, ids) for k, p in variants.items()}
    ppl = {k: perplexity(lp) for k, (lp, _) in scored.items()}
    result["perplexity"] = {"text": REFERENCE_TEXT, "python": sys.version.split()[0],
                            "tokens_scored": len(scored["f32"][0]),
                            **{k: round(v, 4) for k, v in ppl.items()},
                            "relative_change": round(ppl["w8a8"] / ppl["f32"] - 1, 4),
                            "teacher_forced_top1_agreement_on_text": round(
                                float(np.mean(scored["w8a8"][1] == scored["f32"][1])), 4)}
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
