#!/usr/bin/env python3
"""Constrained requests a user sends, through HTTP, on the real default model: the share that finishes within
max_tokens and validates, and the grammar-mask time per token at 8 slots.

    python3 benchmarks/structured_http.py                     # 40 schemas + 12 tool calls, max_tokens 512
    python3 benchmarks/structured_http.py --tree /tmp/before  # the same against another checkout (before/after)
    python3 benchmarks/structured_http.py --llama-server "$(benchmarks/build_llama_server.sh)"  # side by side
    python3 benchmarks/structured_http.py --extra '{"dry_multiplier": 0.8}'  # more fields in every request

It starts `slotserve serve` from ``--tree`` (default: this repository) on a free port (default model, the
server's CPU defaults: W8A8, int8 KV; 8 slots x 2048), then sends, 8 in flight:
* JSON-schema requests (response_format json_schema) for a fixed seeded sample of the vendored
  JSONSchemaBench schemas, the prompt naming the schema and its top-level properties;
* tool calls: a one-argument and a three-argument function, tool_choice required and auto.
Sampling is temperature 0.7 (``--temperature``) with a per-request seed (greedy outputs that repeat would flatter).
Each outcome: refused (HTTP 400 naming a feature), valid (finished, validates), invalid (finished, does not
validate: must be 0), cut (finish_reason length), error. The server's own mask timings come from /metrics.

With ``--llama-server``, llama.cpp's server (same GGUF, `-np` = concurrency, `--jinja` for tools) answers the
same requests after ours, through its own `response_format` / `tools`, with the assistant agent's system prompt
sent as a system message (ours adds it itself); its run is saved as "<label>-llama".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

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

SUITE = ROOT / "tests" / "data" / "json-schema" / "jsonschemabench-sample"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "book_flight", "description": "Book a flight.",
                                      "parameters": {"type": "object", "properties": {
                                          "origin": {"type": "string"}, "destination": {"type": "string"},
                                          "date": {"type": "string", "format": "date"}},
                                          "required": ["origin", "destination", "date"]}}},
]


def llama_cmd(binary: str, port: int, concurrency: int, max_tokens: int) -> list[str]:
    """llama.cpp's server on the default GGUF: one 2048-token context per parallel slot, like ours, with its
    own chat template (its tool-call handling needs one that declares tools)."""
    return llama_command(binary, default_gguf(), port, "-np", str(concurrency), "-c", str(concurrency * 2048), "-n",
                         str(max_tokens), "-t", str(os.cpu_count() or 2), "--jinja", chat_template=None)


def for_llama(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same requests with the assistant agent's system prompt in front (slotserve adds it from the agent)."""
    import yaml

    system = yaml.safe_load((ROOT / "configs" / "agents" / "assistant.yaml").read_text())["system_prompt"]
    return [{**req, "body": {**req["body"], "messages": [{"role": "system", "content": system},
                                                         *req["body"]["messages"]]}} for req in requests]


def schema_requests(count: int, seed: int, max_tokens: int, temperature: float) -> list[dict[str, Any]]:
    files = sorted(SUITE.glob("*.json"))
    chosen = random.Random(seed).sample(files, count)
    out = []
    for i, path in enumerate(chosen):
        schema = json.loads(path.read_text())["schema"]
        fields = list((schema.get("properties") or {}) if isinstance(schema, dict) else [])[:12]
        name = path.stem.split("---")[-1]
        prompt = f"Write one realistic JSON document for the schema {name!r}" + (
            f" with the fields {', '.join(fields)}." if fields else ".")
        out.append({"kind": "schema", "name": path.name, "schema": schema, "body": {
            "model": "assistant", "max_tokens": max_tokens, "temperature": temperature, "seed": i,
            "messages": [{"role": "user", "content": prompt}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}}})
    return out


# (ask, the arguments it names): a call whose arguments hold these values copied the prompt right
TOOL_ASKS = [("What is the weather in Oslo?", {"city": "Oslo"}),
             ("Book me a flight from Paris to Rome on 2026-12-24.",
              {"origin": "Paris", "destination": "Rome", "date": "2026-12-24"}),
             ("Is it raining in Lima?", {"city": "Lima"})]


def tool_requests(max_tokens: int, temperature: float) -> list[dict[str, Any]]:
    out = []
    for i in range(12):
        choice = "required" if i % 2 == 0 else "auto"
        ask, expected = TOOL_ASKS[i % len(TOOL_ASKS)]
        out.append({"kind": "tool", "name": f"tool-{choice}-{i}", "expected": expected, "body": {
            "model": "assistant", "max_tokens": max_tokens, "temperature": temperature, "seed": 100 + i, "tools": TOOLS,
            "tool_choice": choice, "messages": [{"role": "user", "content": ask}]}})
    return out


def classify(req: dict[str, Any], status: int, body: dict[str, Any]) -> dict[str, Any]:
    if status == 400:
        return {"outcome": "refused", "feature": body.get("error", {}).get("param")}
    if status != 200:
        return {"outcome": "error", "status": status}
    choice = body["choices"][0]
    tokens = body["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        return {"outcome": "cut", "tokens": tokens}
    closed = {"budget_closed": True} if choice.get("budget_closed") else {}
    message = choice["message"]
    try:
        if req["kind"] == "schema":
            jsonschema.validate(json.loads(message["content"]), req["schema"])
        elif message.get("tool_calls"):
            call = message["tool_calls"][0]["function"]
            params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
            arguments = json.loads(call["arguments"])
            jsonschema.validate(arguments, params)
            closed["arguments_copied"] = all(str(arguments.get(k, "")).strip().lower() == v.lower()
                                             for k, v in req["expected"].items())
        else:
            return {"outcome": "text", "tokens": tokens}  # tool_choice auto answered in text
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as e:
        return {"outcome": "invalid", "tokens": tokens, "why": str(e)[:200], **closed}
    return {"outcome": "valid", "tokens": tokens, **closed}


async def run_all(url: str, requests: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800) as client:
        async def one(req: dict[str, Any]) -> dict[str, Any]:
            async with gate:
                begin = time.perf_counter()
                r = await client.post(f"{url}/v1/chat/completions", json=req["body"])
                result = classify(req, r.status_code, r.json())
                return {"kind": req["kind"], "name": req["name"], "seconds": round(time.perf_counter() - begin, 2),
                        **result}

        return await asyncio.gather(*(one(r) for r in requests))


def mask_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r'^(slotserve_mask_fill\w*)\{quantile="([\d.]+)"\} (\S+)$', text, re.M)
    return {f"{name}_p{round(float(q) * 100)}_ms": round(float(v) * 1000, 3) for name, q, v in found}


def summary(results: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    mine = [r for r in results if r["kind"] == kind]
    counts: dict[str, int] = {}
    for r in mine:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    constrained = [r for r in mine if r["outcome"] != "refused"]
    copied = sum(bool(r.get("arguments_copied")) for r in mine)
    return {"requests": len(mine), **counts, "budget_closed": sum(bool(r.get("budget_closed")) for r in mine),
            **({"arguments_copied": copied} if kind == "tool" else {}),
            "finished_valid_share_of_constrained": round(counts.get("valid", 0) / max(len(constrained), 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose server is measured")
    parser.add_argument("--schemas", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="after")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--extra", type=json.loads, default={}, help="JSON object of fields added to every request")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's server binary: measure it too")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "structured-http-cpu.json")
    args = parser.parse_args()
    requests = (schema_requests(args.schemas, args.seed, args.max_tokens, args.temperature)
                + tool_requests(args.max_tokens, args.temperature))
    requests = [{**req, "body": {**req["body"], **args.extra}} for req in requests]
    tree_commit = git_commit(args.tree) or ""
    common = {"tree_commit": tree_commit, "host": host(), "temperature": args.temperature, "extra": args.extra}
    runs = {args.label: {"label": args.label, "server": "slotserve", **common, **measure_ours(args, requests)}}
    if args.llama_server:
        runs[f"{args.label}-llama"] = {"label": f"{args.label}-llama", "server": "llama.cpp", **common,
                                       **measure_llama(args, for_llama(requests))}
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report.setdefault("meta", {}).update({
        "command": "python3 benchmarks/structured_http.py " + " ".join(sys.argv[1:]),
        "host": host(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": f"{args.schemas} JSONSchemaBench schemas (seed {args.seed}) + 12 tool calls, max_tokens "
                    f"{args.max_tokens}, temperature per run, {args.concurrency} in flight, default model via HTTP"})
    report.setdefault("runs", {}).update(runs)
    save_report(args.out, report, echo=False, indent=1)
    for run in runs.values():
        print(json.dumps({k: v for k, v in run.items() if k != "results"}, indent=1))


def measure_ours(args: argparse.Namespace, requests: list[dict[str, Any]]) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with bench_server(args.tree.resolve(), port, args.max_tokens) as proc:
        ready_s = wait_healthy(url, proc, None, "/ready", 1200, every_program=True)
        begin = time.perf_counter()
        results = asyncio.run(run_all(url, requests, args.concurrency))
        wall = time.perf_counter() - begin
        masks = mask_metrics(url)
    return {"ready_s": round(ready_s, 1), "wall_s": round(wall, 1), **outcomes(results), "mask": masks,
            "results": results}


def measure_llama(args: argparse.Namespace, requests: list[dict[str, Any]]) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="structured-llama-") as tmp:
        log_path = Path(tmp) / "llama-server.log"
        cmd = llama_cmd(args.llama_server, port, args.concurrency, args.max_tokens)
        with child_process(cmd, log_path=log_path) as proc:
            ready_s = wait_healthy(url, proc, log_path, "/health", 600)
            begin = time.perf_counter()
            results = asyncio.run(run_all(url, requests, args.concurrency))
            wall = time.perf_counter() - begin
    return {"ready_s": round(ready_s, 1), "wall_s": round(wall, 1), **outcomes(results), "results": results}


def outcomes(results: list[dict[str, Any]]) -> dict[str, Any]:
    valid = [r["tokens"] for r in results if r["kind"] == "schema" and r["outcome"] == "valid"]
    return {"schemas": summary(results, "schema"), "tools": summary(results, "tool"),
            "tokens_per_valid_document": round(sum(valid) / max(len(valid), 1), 1)}


if __name__ == "__main__":
    main()
