#!/usr/bin/env python3
"""Speculative decoding (prompt lookup) against plain decode steps, on the real model.

    .venv/bin/python benchmarks/speculative.py                       # precision by device (w8a8 on CPU)
    .venv/bin/python benchmarks/speculative.py --precision float --max-tokens 64
    .venv/bin/python benchmarks/speculative.py --together            # all tasks at once: batched verify steps

One Engine (8 slots, every program compiled once) and, per run, a fresh Scheduler with `speculative` off or
on. Each agent-style chat task below (copying JSON fields, fixing code, tool-call arguments, lists; plus two
that copy little: a summary and a translation) runs alone, greedy, up to --max-tokens (EOS and
<end_of_turn> stop it), in the order off, on, on, off (ABBA: a linear drift in machine load cancels).
Reported per task and in total: generated tokens, tokens/s (wall time from submit to finish, single
stream), verify steps, drafted and accepted tokens, and whether the on and off outputs are identical
(they must be: greedy verification only accepts what plain greedy decoding would emit).

--together submits every task at once to one scheduler (8 streams in 8 slots), off, on, on, off: with W8A8
weights and int8 KV (the CPU default) the streams share batched verify steps (engine.verify_rows). Reported:
aggregate tokens/s (wall time from submit to the last finish), steps, batched verify steps, drafted and
accepted tokens, and whether every task's output equals its output with speculation off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import host, save_report  # noqa: E402 - after the path set-up that makes it importable

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


def chat_prompt(template: Any, task: str) -> list[int]:
    """The task as one user turn, without a system prompt, in the model's chat template."""
    return template.render("", [{"role": "user", "content": task}]).ids


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


def run_together(engine: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int,
                 speculative: bool) -> dict[str, Any]:
    from core.sampling import SamplingParams
    from scheduler.request import GenerationRequest
    from scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(engine, tokenizer, SchedulerConfig(prefix_caching=False, speculative=speculative),
                      stop_ids=frozenset(tokenizer.stop_ids))
    begin = time.perf_counter()
    handles = [sched.submit(GenerationRequest(prompt_ids=tuple(p), sampling=SamplingParams(temperature=0),
                                              max_tokens=max_tokens)) for p in prompts]
    sched.run_until_idle()
    wall = time.perf_counter() - begin
    ids = [h.result(timeout=0)[0] for h in handles]
    stats = sched.stats
    return {"ids": ids, "tokens": sum(len(i) for i in ids), "wall_s": wall,
            "tokens_per_s": sum(len(i) for i in ids) / wall, "decode_steps": stats.decode_steps,
            "verify_steps": stats.speculative_steps, "batched_verify_steps": stats.batched_speculative_steps,
            "drafted": stats.draft_tokens, "accepted": stats.accepted_draft_tokens}


def abba(measure: Callable[[bool], dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``measure(speculative)`` with speculation off, on, on, off: a linear drift in machine load weighs on
    both modes alike."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for mode in ("off", "on", "on", "off"):
        runs[mode].append(measure(mode == "on"))
    return runs


def together(engine: Any, tokenizer: Any, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, Any]:
    runs = abba(partial(run_together, engine, tokenizer, list(prompts.values()), max_tokens))
    off, on = runs["off"], runs["on"]
    identical = {name: all(r["ids"][i] == off[0]["ids"][i] for r in off + on) for i, name in enumerate(prompts)}
    rate = {mode: sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs) for mode, rs in runs.items()}
    keep = ("tokens", "decode_steps", "verify_steps", "batched_verify_steps", "drafted", "accepted")
    return {"streams": len(prompts), "tokens_per_s_off": round(rate["off"], 2), "tokens_per_s_on": round(rate["on"], 2),
            "speedup": round(rate["on"] / rate["off"], 3), "identical_outputs": identical,
            "all_identical": all(identical.values()),
            "on": {k: on[0][k] for k in keep}, "off": {k: off[0][k] for k in keep},
            "wall_s": {mode: [round(r["wall_s"], 3) for r in rs] for mode, rs in runs.items()}}


def task_row(prompt: list[int], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One task's report entry from its ABBA runs: rates averaged over both runs of a mode, counts and
    output from the first run of each."""
    off, on = runs["off"], runs["on"]
    row = {
        "prompt_tokens": len(prompt), "tokens": on[0]["tokens"],
        "identical_outputs": all(r["ids"] == off[0]["ids"] for r in off + on),
        "tokens_per_s_off": round(statistics.mean(r["tokens_per_s"] for r in off), 2),
        "tokens_per_s_on": round(statistics.mean(r["tokens_per_s"] for r in on), 2),
        "decode_steps_off": off[0]["decode_steps"], "decode_steps_on": on[0]["decode_steps"],
        "verify_steps": on[0]["verify_steps"], "drafted": on[0]["drafted"], "accepted": on[0]["accepted"],
        "output": on[0]["text"][:200],
    }
    row["speedup"] = round(row["tokens_per_s_on"] / row["tokens_per_s_off"], 3)
    return row


def alone(engine: Any, tokenizer: Any, template: Any, max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each task as the only stream, ABBA: the per-task rows, and the total (tokens over wall time of every
    run of a mode, so long tasks weigh more than in a mean of the per-task rates)."""
    tasks: dict[str, Any] = {}
    totals = {"off": [0, 0.0], "on": [0, 0.0]}
    for name, task in TASKS.items():
        prompt = chat_prompt(template, task)
        runs = abba(partial(run_once, engine, tokenizer, prompt, max_tokens))
        row = task_row(prompt, runs)
        tasks[name] = row
        for mode in ("off", "on"):
            totals[mode][0] += sum(r["tokens"] for r in runs[mode])
            totals[mode][1] += sum(r["wall_s"] for r in runs[mode])
        print(f"{name}: {row['tokens']} tokens, {row['tokens_per_s_off']} -> {row['tokens_per_s_on']} tok/s "
              f"(x{row['speedup']}), accepted {row['accepted']}/{row['drafted']}, identical {row['identical_outputs']}",
              file=sys.stderr, flush=True)
    rate = {mode: tokens / wall for mode, (tokens, wall) in totals.items()}
    total = {"tokens_per_s_off": round(rate["off"], 2), "tokens_per_s_on": round(rate["on"], 2),
             "speedup": round(rate["on"] / rate["off"], 3),
             "all_identical": all(t["identical_outputs"] for t in tasks.values())}
    return tasks, total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--precision", default=None, help="float | w8a8 (default: by device)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--kv-dtype", default=None, help="int8 | compute (default: as the server picks it)")
    parser.add_argument("--together", action="store_true", help="all tasks at once (batched verify steps)")
    parser.add_argument("--out", default=None,
                        help="default: results/speculative-<backend>-<precision>[-together].json")
    return parser.parse_args(argv)


def build_engine(args: argparse.Namespace) -> tuple[Any, Any, str | None]:
    """The model, its Engine with every program compiled, and the KV dtype chosen for it (None: compute)."""
    from core.compile_cache import enable_compile_cache
    from core.device import choose_kv_dtype
    from core.engine import ROWS_VERIFY_WIDTH, Engine, EngineConfig
    from core.runtime import load_model

    enable_compile_cache()
    model = load_model(args.model, dtype="float32", precision=args.precision)
    kv_dtype, _ = choose_kv_dtype(args.kv_dtype, model.precision)
    # The batched verify pass is what --together measures (and checks exact on this host): compiled here.
    engine = Engine(model.cfg, model.params, EngineConfig(num_slots=args.slots, max_len=args.max_len,
                                                          kv_dtype=kv_dtype, rows_verify_width=ROWS_VERIFY_WIDTH),
                    model.dtype)
    engine.warmup()
    return model, engine, kv_dtype


def report_header(args: argparse.Namespace, model: Any, engine: Any, kv_dtype: str | None) -> dict[str, Any]:
    """What was measured, on what: the report's first keys."""
    return {"model": args.model, "host": host(), "precision": model.precision, "kv_dtype": kv_dtype or "compute",
            "slots": args.slots, "verify_width": engine.config.verify_tokens,
            "rows_verify_width": engine.config.rows_verify_width, "rows_verify_exact": engine.rows_verify_exact,
            "max_tokens": args.max_tokens}


def default_out(args: argparse.Namespace, precision: str) -> Path:
    import jax

    suffix = "-together" if args.together else ""
    return ROOT / f"benchmarks/results/speculative-{jax.default_backend()}-{precision}{suffix}.json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from agents.chat_template import ChatTemplate

    model, engine, kv_dtype = build_engine(args)
    template = ChatTemplate(model.tokenizer)
    result = report_header(args, model, engine, kv_dtype)
    out = args.out or default_out(args, model.precision)
    if args.together:
        prompts = {name: chat_prompt(template, task) for name, task in TASKS.items()}
        result["together"] = together(engine, model.tokenizer, prompts, args.max_tokens)
    else:
        result["tasks"], result["total"] = alone(engine, model.tokenizer, template, args.max_tokens)
    save_report(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
