#!/usr/bin/env python3
"""Single-stream speculative decoding (prompt lookup) against plain decode steps, on the real model.

    .venv/bin/python benchmarks/speculative.py                       # precision by device (w8a8 on CPU)
    .venv/bin/python benchmarks/speculative.py --precision float --max-tokens 64

One Engine (8 slots, every program compiled once) and, per run, a fresh Scheduler with `speculative` off or
on. Each agent-style chat task below (copying JSON fields, fixing code, tool-call arguments, lists; plus two
that copy little: a summary and a translation) runs alone, greedy, up to --max-tokens (EOS and
<end_of_turn> stop it), in the order off, on, on, off (ABBA: a linear drift in machine load cancels).
Reported per task and in total: generated tokens, tokens/s (wall time from submit to finish, single
stream), verify steps, drafted and accepted tokens, and whether the on and off outputs are identical
(they must be: greedy verification only accepts what plain greedy decoding would emit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TASKS = {
    "record_to_json": "Convert this record to a JSON object with the keys name, email, city, phone:\n"
                      "Name: Alice Martin; Email: alice.martin@example.com; City: Lyon; Phone: +33 4 72 00 11 22",
    "fix_code": "Fix the bug in this function and return the whole corrected function:\n```python\n"
                "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
                "    return total / len(value)\n```",
    "tool_arguments": 'Answer with a JSON tool call {"name": "get_weather", "arguments": {"city": ..., "days": ...}} '
                      "for this message: I am travelling to Zurich next week, what will the weather be "
                      "for the next three days?",
    "repeat_list": "Repeat this shopping list exactly, one item per line, with a dash before each item: apples, "
                   "pears, whole milk, brown bread, olive oil, tomatoes, basil, mozzarella, coffee beans, rice.",
    "add_type_hints": "Add type hints to this function and return it:\n```python\ndef merge(left, right):\n"
                      "    result = []\n    while left and right:\n        if left[0] <= right[0]:\n"
                      "            result.append(left.pop(0))\n        else:\n            result.append(right.pop(0))\n"
                      "    return result + left + right\n```",
    "extract_dates": "List every date in this text as YYYY-MM-DD, one per line: The contract was signed on "
                     "3 March 2021, amended on 14 July 2022 and ends on 31 December 2025.",
    "summary": "Summarize in two sentences: The printing press, developed by Johannes Gutenberg around 1440, "
               "made books far cheaper to produce. Literacy spread, scientific ideas travelled faster, and "
               "the Reformation used pamphlets to reach ordinary people.",
    "translate": "Translate to French: The meeting is moved to Thursday at ten because the room is booked.",
}


def run_once(engine: Any, tokenizer: Any, prompt: list[int], max_tokens: int, speculative: bool) -> dict[str, Any]:
    from core.sampling import SamplingParams
    from scheduler.request import GenerationRequest
    from scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(engine, tokenizer, SchedulerConfig(prefix_caching=False, speculative=speculative),
                      stop_ids=frozenset(tokenizer.stop_ids))
    begin = time.perf_counter()
    handle = sched.submit(GenerationRequest(prompt_ids=tuple(prompt), sampling=SamplingParams(temperature=0),
                                            max_tokens=max_tokens))
    sched.run_until_idle()
    ids, text, finish = handle.result(timeout=0)
    wall = time.perf_counter() - begin
    first = finish.timings.get("ttft_s", 0.0)
    return {"ids": ids, "text": text, "tokens": len(ids), "wall_s": wall,
            "decode_tokens_per_s": (len(ids) - 1) / max(wall - first, 1e-9),
            "tokens_per_s": len(ids) / wall, "decode_steps": sched.stats.decode_steps,
            "verify_steps": sched.stats.speculative_steps, "drafted": sched.stats.draft_tokens,
            "accepted": sched.stats.accepted_draft_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--precision", default=None, help="float | w8a8 (default: by device)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--out", default=None, help="default: results/speculative-<backend>-<precision>.json")
    args = parser.parse_args(argv)

    from agents.chat_template import ChatTemplate
    from core.device import enable_compile_cache
    from core.engine import Engine, EngineConfig
    from core.runtime import load_model

    enable_compile_cache()
    model = load_model(args.model, dtype="float32", precision=args.precision)
    engine = Engine(model.cfg, model.params, EngineConfig(num_slots=args.slots, max_len=args.max_len), model.dtype)
    engine.warmup()
    template = ChatTemplate(model.tokenizer)
    result: dict[str, Any] = {"model": args.model, "precision": model.precision, "slots": args.slots,
                              "verify_width": engine.config.verify_tokens, "max_tokens": args.max_tokens,
                              "tasks": {}}
    totals = {"off": [0, 0.0], "on": [0, 0.0]}
    for name, task in TASKS.items():
        prompt = template.render("", [{"role": "user", "content": task}]).ids
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for mode in ("off", "on", "on", "off"):
            runs[mode].append(run_once(engine, model.tokenizer, prompt, args.max_tokens, mode == "on"))
        off, on = runs["off"], runs["on"]
        identical = all(r["ids"] == off[0]["ids"] for r in off + on)
        row = {
            "prompt_tokens": len(prompt), "tokens": on[0]["tokens"], "identical_outputs": identical,
            "tokens_per_s_off": round(statistics.mean(r["tokens_per_s"] for r in off), 2),
            "tokens_per_s_on": round(statistics.mean(r["tokens_per_s"] for r in on), 2),
            "decode_steps_off": off[0]["decode_steps"], "decode_steps_on": on[0]["decode_steps"],
            "verify_steps": on[0]["verify_steps"], "drafted": on[0]["drafted"], "accepted": on[0]["accepted"],
            "output": on[0]["text"][:200],
        }
        row["speedup"] = round(row["tokens_per_s_on"] / row["tokens_per_s_off"], 3)
        result["tasks"][name] = row
        for mode in ("off", "on"):
            totals[mode][0] += sum(r["tokens"] for r in runs[mode])
            totals[mode][1] += sum(r["wall_s"] for r in runs[mode])
        print(f"{name}: {row['tokens']} tokens, {row['tokens_per_s_off']} -> {row['tokens_per_s_on']} tok/s "
              f"(x{row['speedup']}), accepted {row['accepted']}/{row['drafted']}, identical {identical}",
              file=sys.stderr, flush=True)
    rate = {mode: tokens / wall for mode, (tokens, wall) in totals.items()}
    result["total"] = {"tokens_per_s_off": round(rate["off"], 2), "tokens_per_s_on": round(rate["on"], 2),
                       "speedup": round(rate["on"] / rate["off"], 3),
                       "all_identical": all(t["identical_outputs"] for t in result["tasks"].values())}
    print(json.dumps(result, indent=2))
    import jax

    out = args.out or ROOT / f"benchmarks/results/speculative-{jax.default_backend()}-{model.precision}.json"
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
