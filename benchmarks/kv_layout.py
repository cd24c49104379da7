#!/usr/bin/env python3
"""Two layouts for sliding-window KV measured against each other (docs/design-notes.md records the choice).

    .venv/bin/python benchmarks/kv_layout.py --ring-tree /tmp/ring   # a checkout of commit e2dcbc2

(a) "full" (this tree): sliding layers keep every position of a slot, as global layers do; attention reads a
    ring view of the last window positions. Any prefix [0, P) of any slot is reusable at once.
(b) "ring" (commit e2dcbc2, the last with rings): sliding layers keep a ring of window + 7 positions, so a
    slot can resume only at its end; reuse elsewhere needs ring checkpoints saved at chosen positions
    (message boundaries, every N tokens), each a copy of every sliding layer's ring.

Three measurements, in one run:
1. KV bytes per slot for the default model and the Gemma 4 E2B config (int8 and bfloat16 KV), from the
   configs (no weights needed).
2. Step cost: `benchmarks/engine.py` run in this tree and in --ring-tree with the same arguments (W8A8 +
   int8 KV, the CPU default), alternated --repeats times: decode ms per 8-slot step at ctx 512 and 4096 and
   prefill tokens/s per chunk size.
3. Reuse on the mission workload (benchmarks/agents_http.py's: 4 agents x 4 sessions x 3 turns, client system
   prompts of ~1,330 tokens, history resent, rendered with slotserve's template; replies stand in as 32 tokens
   of prose): prefill tokens each layout computes with unbounded host memory, and the host bytes it needs:
   (a) reuses the longest common prefix with anything computed before; (b) reuses up to the last checkpoint
   at or before it (checkpoints at every message boundary, every --checkpoint-every tokens, and each
   conversation's end), storing global layers per position plus one ring per checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.agents_http import build_workload, prose, unique_prefix_tokens  # noqa: E402
from benchmarks.common import default_gguf, git_commit, host, save_report  # noqa: E402

RING_SLACK = 7  # the ring layout's slack for 8-token verify chunks (e2dcbc2's default)


def layer_bytes(layer: Any, dtype: str) -> int:
    import jax.numpy as jnp

    itemsize = jnp.dtype(dtype).itemsize
    return 2 * layer.num_kv_heads * layer.head_dim * itemsize + (2 * layer.num_kv_heads * 4 if dtype == "int8" else 0)


def memory_table(max_len: int) -> dict[str, Any]:
    from core.config import ModelConfig

    out = {}
    for name in ("gemma3-270m", "gemma4-e2b"):
        cfg = ModelConfig.from_hf_dict(json.loads((ROOT / f"configs/models/{name}.json").read_text()))
        rows = {}
        for dtype in ("int8", "bfloat16"):
            full = sum(max_len * layer_bytes(layer, dtype) for layer in cfg.cache_owners)
            ring = sum((min(cfg.sliding_window + RING_SLACK, max_len) if layer.is_sliding else max_len)
                       * layer_bytes(layer, dtype) for layer in cfg.cache_owners)
            checkpoint = sum(min(cfg.sliding_window + RING_SLACK, max_len) * layer_bytes(layer, dtype)
                             for layer in cfg.cache_owners if layer.is_sliding)
            rows[dtype] = {"full_bytes_per_slot": full, "ring_bytes_per_slot": ring,
                           "full_over_ring": round(full / ring, 2), "ring_checkpoint_bytes": checkpoint,
                           "full_bytes_per_position": full // max_len,
                           "ring_global_bytes_per_position": sum(layer_bytes(layer, dtype) for layer in
                                                                 cfg.cache_owners if not layer.is_sliding)}
        out[name] = {"owning_layers": len(cfg.cache_owners),
                     "sliding_owning_layers": sum(layer.is_sliding for layer in cfg.cache_owners),
                     "window": cfg.sliding_window, **rows}
    return out


def engine_runs(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/engine.py in both trees, alternated; the figures each run reports."""
    cmd = ["--model", "default", "--precision", "w8a8", "--kv-dtype", "int8", "--slots", "8", "--max-len", "8192",
           "--contexts", "512,4096", "--chunk-sizes", args.chunk_sizes, "--no-breakdown"]
    trees = {"full": ROOT, "ring": Path(args.ring_tree)}
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "ring": []}
    for repeat in range(args.repeats):
        order = ("full", "ring") if repeat % 2 == 0 else ("ring", "full")
        for layout in order:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, str(trees[layout] / "benchmarks/engine.py"), *cmd, "--out", out.name],
                               cwd=trees[layout], check=True, timeout=3600)
                report = json.loads(Path(out.name).read_text())
            result = report["runs"][0]
            runs[layout].append({
                "bytes_per_slot": result["bytes_per_slot"],
                "decode": [{k: d[k] for k in ("context", "active_slots", "ms_p50", "tokens_per_s")}
                           for d in result["decode"]],
                "prefill": [{k: row[k] for k in ("chunk", "ms_p50", "tokens_per_s")} for row in result["prefill"]],
                "compile_seconds": result["compile_seconds"],
            })
    return {"args": cmd, "ring_tree": str(trees["ring"]), "runs": runs}


def simulate(args: argparse.Namespace, memory: dict[str, Any]) -> dict[str, Any]:
    """Prefill tokens computed and host bytes held, per layout, over the mission workload."""
    from agents.chat_template import ChatTemplate
    from core.tokenizer import Tokenizer

    template = ChatTemplate(Tokenizer.from_pretrained(default_gguf()))
    work = build_workload(args)
    rng = random.Random(args.seed + 1)
    order = []  # sessions in flight together run their turns in lockstep, --concurrency at a time
    for first in range(0, len(work["sessions"]), args.concurrency):
        group = work["sessions"][first:first + args.concurrency]
        order += [(spec, turn) for turn in range(args.turns) for spec in group]
    histories = {spec["session"]: [{"role": "system", "content": work["systems"][spec["agent"]]}]
                 for spec in work["sessions"]}
    stored: list[tuple[str, tuple[int, ...], set[int]]] = []  # (agent, tokens computed, checkpoint positions)
    computed = {"full": 0, "ring": 0}
    checkpoints: set[tuple[str, tuple[int, ...]]] = set()
    prompt_tokens = 0
    prompts = []
    for spec, turn in order:
        history = histories[spec["session"]]
        history.append({"role": "user", "content": spec["users"][turn]})
        rendered = template.render("", history)
        ids = tuple(rendered.ids)
        prompts.append(list(ids))
        prompt_tokens += len(ids)
        best_full = best_ring = 0
        for agent, tokens, points in stored:
            if agent != spec["agent"]:
                continue
            common = next((i for i, (a, b) in enumerate(zip(tokens, ids, strict=False)) if a != b),
                          min(len(tokens), len(ids)))
            common = min(common, len(ids) - 1)
            best_full = max(best_full, common)
            best_ring = max(best_ring, max((p for p in points if p <= common), default=0))
        computed["full"] += len(ids) - best_full
        computed["ring"] += len(ids) - best_ring
        reply = prose(rng, args.reply_words)
        reply_ids = template.tokenizer.encode(reply)[:args.max_tokens]
        conversation = ids + tuple(reply_ids[:-1])  # the last sampled token is never fed
        points = {b for b in rendered.boundaries} | {len(conversation)}
        points |= set(range(args.checkpoint_every, len(conversation), args.checkpoint_every))
        stored.append((spec["agent"], conversation, points))
        checkpoints |= {(spec["agent"], conversation[:p]) for p in points}
        history.append({"role": "assistant", "content": template.tokenizer.decode(reply_ids)})
    unique = unique_prefix_tokens([list(t) for _, t, _ in stored])
    out: dict[str, Any] = {"requests": len(order), "prompt_tokens": prompt_tokens,
                           "unique_prompt_tokens": unique_prefix_tokens(prompts),
                           "unique_computed_tokens": unique, "checkpoints": len(checkpoints),
                           "prefill_tokens_computed": computed}
    for name in ("gemma3-270m", "gemma4-e2b"):
        for dtype in ("int8", "bfloat16"):
            row = memory[name][dtype]
            out.setdefault("host_bytes", {})[f"{name}/{dtype}"] = {
                "full": unique * row["full_bytes_per_position"],
                "ring": (unique * row["ring_global_bytes_per_position"]
                         + len(checkpoints) * row["ring_checkpoint_bytes"]),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ring-tree", default=None, help="a checkout of commit e2dcbc2 (skip the timings without)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chunk-sizes", default="32,128,512")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--system-words", type=int, default=1150)
    p.add_argument("--user-words", type=int, default=25)
    p.add_argument("--reply-words", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/kv-layout-cpu.json"))
    args = p.parse_args(argv)
    report: dict[str, Any] = {"benchmark": "kv_layout", "date": datetime.datetime.now(datetime.UTC).isoformat(
        timespec="seconds"), "commit": git_commit(mark_dirty=True), "host": host(), "argv": sys.argv[1:]}
    report["memory"] = memory_table(8192)
    report["reuse"] = simulate(args, report["memory"])
    save_report(args.out, report, echo=False)
    if args.ring_tree:
        report["engine"] = engine_runs(args)
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
