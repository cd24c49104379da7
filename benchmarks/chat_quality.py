#!/usr/bin/env python3
"""Free chat on the default model through HTTP: does the answer name what it should, and does it end on its
own? A fixed set of 30 short factual and instruction prompts, each sent as one user message to the default
agent (`assistant`) under each built-in chat template, in the same run:

    python3 benchmarks/chat_quality.py                    # transcript vs gemma-turns, temperature 0 and 0.7
    python3 benchmarks/chat_quality.py --templates transcript --samplings plain,dry,repetition-1.3

It starts `slotserve serve` once per template (`model.chat_template`; default model and CPU defaults, 8
slots x 2048) and sends the 30 prompts 8 in flight, greedy and then at temperature 0.7 with a seed per
prompt (the agent's own top_p). An answer is correct when it contains one of the prompt's accepted words
(case-insensitive); it ends on its own when its finish_reason is "stop" within max_tokens; it echoes when
it repeats the agent's system prompt. ``--samplings`` adds fields to every request (named sets in SAMPLINGS:
the repetition controls a default would set), each measured on the same server. Results:
benchmarks/results/chat-quality-cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402 - after the path set-up that makes it importable
    bench_server,
    free_port,
    git_commit,
    host,
    save_report,
    wait_healthy,
)

# (prompt, accepted words): any one of them in the answer counts as correct
PROMPTS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France? Answer in one sentence.", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is 2 + 3?", ("5", "five")),
    ("Name a primary color.", ("red", "blue", "yellow")),
    ("How many days are in a week?", ("7", "seven")),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What is the chemical formula of water?", ("h2o", "h₂o")),
    ("Translate 'hello' into French.", ("bonjour", "salut")),
    ("What is the opposite of 'hot'?", ("cold",)),
    ("How many legs does a spider have?", ("8", "eight")),
    ("At what temperature in Celsius does water boil?", ("100",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the capital of Italy?", ("rome",)),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What is 10 times 10?", ("100", "hundred")),
    ("Spell the word 'cat' backwards.", ("tac", "t-a-c")),
    ("What language is spoken in Brazil?", ("portuguese",)),
    ("At what temperature in Celsius does water freeze?", ("0", "zero")),
    ("What is the first month of the year?", ("january",)),
    ("How many continents are there?", ("7", "seven")),
    ("What is the capital of Germany?", ("berlin",)),
    ("What do bees make?", ("honey",)),
    ("What is the square root of 16?", ("4", "four")),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("Who painted the Mona Lisa?", ("leonardo", "vinci")),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("Complete the sequence: 2, 4, 6, 8, ...", ("10", "ten")),
    ("What is the currency of the United States?", ("dollar",)),
    ("Give one word that rhymes with 'cat'.", ("hat", "bat", "mat", "rat", "sat", "fat", "pat", "that", "flat")),
]
TEMPLATES = ("gemma-turns", "transcript")
# Request fields per named sampling set (the agent's own temperature / top_p stay unless a set names them).
SAMPLINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "dry": {"dry_multiplier": 0.8},  # llama.cpp's suggested strength, its defaults otherwise
    "dry-json-breakers": {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n", ":", '"', "*", ",", "{", "}"]},
    "repetition-1.1": {"repetition_penalty": 1.1},
    "repetition-1.3": {"repetition_penalty": 1.3},
}
SYSTEM_ECHO = "helpful, honest assistant"  # from configs/agents/assistant.yaml


async def ask(client: httpx.AsyncClient, url: str, prompt: str, temperature: float, seed: int,
              max_tokens: int, gate: asyncio.Semaphore, extra: dict[str, Any]) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, **extra}
    async with gate:
        r = await client.post(f"{url}/agents/assistant/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    return {"text": choice["message"]["content"] or "", "finish_reason": choice["finish_reason"],
            "completion_tokens": usage["completion_tokens"]}


def score(answers: list[dict[str, Any]]) -> dict[str, Any]:
    correct = sum(a["correct"] for a in answers)
    ended = sum(a["finish_reason"] == "stop" for a in answers)
    both = sum(a["correct"] and a["finish_reason"] == "stop" for a in answers)
    return {"prompts": len(answers), "correct": correct, "ended_on_its_own": ended, "correct_and_ended": both,
            "echoed_system_prompt": sum(SYSTEM_ECHO in a["text"].lower() for a in answers),
            "mean_completion_tokens": round(sum(a["completion_tokens"] for a in answers) / len(answers), 1)}


async def run_template(url: str, temperatures: list[float], max_tokens: int, extra: dict[str, Any]
                       ) -> dict[str, Any]:
    gate = asyncio.Semaphore(8)
    out = {}
    async with httpx.AsyncClient() as client:
        for temperature in temperatures:
            replies = await asyncio.gather(*(ask(client, url, prompt, temperature, seed, max_tokens, gate, extra)
                                             for seed, (prompt, _) in enumerate(PROMPTS)))
            answers = [{**reply, "prompt": prompt,
                        "correct": any(word in reply["text"].lower() for word in accepted)}
                       for reply, (prompt, accepted) in zip(replies, PROMPTS, strict=True)]
            out[f"temperature_{temperature}"] = {"summary": score(answers), "answers": answers}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--templates", default=",".join(TEMPLATES))
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--samplings", default="plain", help=f"comma-separated names from {', '.join(SAMPLINGS)}")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chat-quality-cpu.json"))
    args = p.parse_args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    samplings = args.samplings.split(",")
    unknown = set(samplings) - set(SAMPLINGS)
    if unknown:
        p.error(f"unknown sampling sets: {', '.join(sorted(unknown))}")
    result: dict[str, Any] = {"what": __doc__.split("\n\n")[0], "host": host(), "max_tokens": args.max_tokens,
                              "git_commit": git_commit() or "",
                              "templates": {}}
    for template in args.templates.split(","):
        port = free_port()
        with bench_server(ROOT, port, args.max_tokens, f"  chat_template: {template}\n") as proc:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, None, "/ready", timeout=900, every_program=True)
            for sampling in samplings:
                begin = time.monotonic()
                run = asyncio.run(run_template(url, temperatures, args.max_tokens, SAMPLINGS[sampling]))
                run["seconds"] = round(time.monotonic() - begin, 1)
                run["request_fields"] = SAMPLINGS[sampling]
                key = template if samplings == ["plain"] else f"{template}/{sampling}"
                result["templates"][key] = run
                for temperature in temperatures:
                    print(key, temperature, run[f"temperature_{temperature}"]["summary"])
    save_report(args.out, result, echo=False, indent=1, ensure_ascii=False)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
