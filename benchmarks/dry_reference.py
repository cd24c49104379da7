#!/usr/bin/env python3
"""DRY on the default model, slotserve against llama.cpp's server: the same penalties on the same tokens?

    python3 benchmarks/dry_reference.py --llama-server "$(benchmarks/build_llama_server.sh)"

Both servers take the same prompts as token ids (texts that repeat, so runs reach past dry_allowed_length)
and return the distribution of the next token with and without DRY: slotserve's /v1/completions top
logprobs (after penalties, before temperature and truncation), llama.cpp's /completion `n_probs` with
`post_sampling_probs` and the sampler chain reduced to DRY (so its probabilities are softmax(logits - DRY)).
A token's penalty is read off each server as how much its log-probability fell under DRY beyond the fall of
the whole distribution's normaliser (the median fall over the listed tokens, most of which DRY leaves
alone). The two models' logits differ slightly (llama.cpp computes with its own Q4_K kernels), so the
penalties should agree to that noise, while each penalty is multiplier * base ** n, 0.8 or more; a token
penalised out of the top list is reported per server (`dropped_under_dry`), which should agree too.
Results: benchmarks/results/dry-reference-cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402 - after the path set-up that makes it importable
    bench_server,
    child_process,
    default_gguf,
    free_port,
    git_commit,
    host,
    llama_command,
    save_report,
    wait_healthy,
)

PROMPTS = [
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
    "one two three four five one two three four five one two three",
    "Alice met Bob at the station. Later, Alice met Bob at the",
    "red green blue red green blue red green",
    "To be or not to be, that is the question. To be or not to",
    "I like apples and pears and apples and pears and apples and",
    "We will go home now. We will go home now. We will go",
    "A B C D E F A B C D E F A B C",
]
DRY = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64}
TOP = 20


def ours(url: str, ids: list[int], dry: bool) -> dict[str, float]:
    body = {"model": "assistant", "prompt": ids, "max_tokens": 1, "temperature": 1.0, "logprobs": TOP,
            **(DRY if dry else {})}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["top_logprobs"][0]


def llama(url: str, ids: list[int], dry: bool) -> dict[str, float]:
    import math

    body = {"prompt": ids, "n_predict": 1, "n_probs": TOP, "post_sampling_probs": True, "samplers": ["dry"],
            "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "cache_prompt": False,
            **(DRY if dry else {"dry_multiplier": 0.0})}
    r = httpx.post(f"{url}/completion", json=body, timeout=300)
    r.raise_for_status()
    probs = r.json()["completion_probabilities"][0]["top_probs"]
    return {p["token"]: math.log(p["prob"]) for p in probs if p["prob"] > 0}


def penalties(plain: dict[str, float], dry: dict[str, float]) -> dict[str, float]:
    """Each token listed in both: its fall in log-probability under DRY beyond the normaliser's fall."""
    both = [t for t in plain if t in dry]
    falls = {t: plain[t] - dry[t] for t in both}
    shift = statistics.median(falls.values())
    return {t: round(f - shift, 4) for t, f in falls.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="llama.cpp's server binary (build_llama_server.sh)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dry-reference-cpu.json"))
    args = p.parse_args(argv)
    from core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(default_gguf())
    prompts = [tokenizer.encode(text, add_bos=True) for text in PROMPTS]
    answers: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {}

    port = free_port()
    with bench_server(ROOT, port, 16) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, None, "/ready", 900, every_program=True)
        answers["slotserve"] = [(ours(url, ids, False), ours(url, ids, True)) for ids in prompts]
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "llama.log"
        cmd = llama_command(args.llama_server, default_gguf(), port, "-np", "1", "-c", "2048")
        with child_process(cmd, log_path=log) as proc:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, log, "/health", 300)
            answers["llama.cpp"] = [(llama(url, ids, False), llama(url, ids, True)) for ids in prompts]

    rows: list[dict[str, Any]] = []
    for i, text in enumerate(PROMPTS):
        ours_pen = penalties(*answers["slotserve"][i])
        llama_pen = penalties(*answers["llama.cpp"][i])
        common = sorted(set(ours_pen) & set(llama_pen), key=lambda t: -max(ours_pen[t], llama_pen[t]))
        penalised = [t for t in common if max(ours_pen[t], llama_pen[t]) > 0.4]
        worst = max((abs(ours_pen[t] - llama_pen[t]) for t in common), default=0.0)
        tops = {name: max(runs[i][0], key=runs[i][0].get) for name, runs in answers.items()}
        # Tokens both servers list without DRY: those a server no longer lists under DRY fell out of its top.
        listed = set(answers["slotserve"][i][0]) & set(answers["llama.cpp"][i][0])
        dropped = {name: sorted(listed - set(runs[i][1])) for name, runs in answers.items()}
        rows.append({"prompt": text, "tokens_compared": len(common), "dropped_under_dry": dropped,
                     "penalised": {t: {"slotserve": ours_pen[t], "llama.cpp": llama_pen[t]} for t in penalised},
                     "max_abs_difference": round(worst, 4), "plain_top_token": tops})
    report = {"what": __doc__.split("\n\n")[0], "host": host(), "dry": DRY,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_commit": git_commit() or "",
              "penalised_tokens": sum(len(r["penalised"]) for r in rows),
              "max_abs_difference": max(r["max_abs_difference"] for r in rows), "prompts": rows}
    save_report(args.out, report, indent=1, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
