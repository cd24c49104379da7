"""Prefill side by side with llama.cpp on the same host, alternated so that drift in the host's load hits both.

    python3 benchmarks/prefill_vs_llama.py --bench PATH/llama-batched-bench [--rounds 2]

Each round runs llama.cpp's prompt processing (benchmarks/llama_prefill.py: llama-batched-bench, one sequence,
PP = 32, 128, 512, -t 2) and then our engine's prefill (benchmarks/engine.py: the CPU default, W8A8 + int8 KV,
consecutive full chunks into one slot), once with the engine's attention buckets (prefill reads the global
caches only up to the bucket covering what the slot holds) and once with a single bucket of max_len (every
chunk attends over all max_len positions, as before prefill used the buckets). Saves per round and per size
the tokens/s of each and the ratios ours / llama.cpp.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import host, save_report  # noqa: E402

ENGINE_ARGS = ["--model", "default", "--precision", "w8a8", "--kv-dtype", "int8", "--contexts", "512", "--steps",
               "2", "--no-breakdown", "--prefill-chunks", "3", "--verify-width", "0"]


def run_json(cmd: list[str], out: Path) -> dict:
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads(out.read_text())


def ours(max_len: int, buckets: str | None, tmp: Path) -> dict[str, float]:
    out = tmp / "engine.json"
    cmd = [sys.executable, "benchmarks/engine.py", *ENGINE_ARGS, "--max-len", str(max_len), "--out", str(out)]
    if buckets:
        cmd += ["--attention-buckets", buckets]
    report = run_json(cmd, out)
    return {str(e["chunk"]): e["tokens_per_s"] for e in report["runs"][0]["prefill"]}


def llama(bench: str, tmp: Path) -> dict[str, float]:
    out = tmp / "llama.json"
    return run_json([sys.executable, "benchmarks/llama_prefill.py", "--bench", bench, "--out", str(out)],
                    out)["prefill_tokens_per_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True, help="llama-batched-bench binary")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill-vs-llama-cpu.json"))
    args = p.parse_args(argv)
    report = {
        "what": "prefill tokens/s, one sequence, same host, alternated: llama.cpp (llama-batched-bench, -t 2, "
                "PP = size, TG 1), ours with attention buckets, ours with one bucket of max_len",
        "commands": {"llama": "benchmarks/llama_prefill.py --bench PATH",
                     "ours": "benchmarks/engine.py " + " ".join(ENGINE_ARGS) + f" --max-len {args.max_len}",
                     "ours_one_bucket": f"... --attention-buckets {args.max_len}"},
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": host(),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for _ in range(args.rounds):
            run = {"llama_cpp": llama(args.bench, tmp), "ours": ours(args.max_len, None, tmp),
                   "ours_one_bucket": ours(args.max_len, str(args.max_len), tmp)}
            for name in ("ours", "ours_one_bucket"):
                run[f"ratio_{name}_over_llama"] = {size: round(run[name][size] / run["llama_cpp"][size], 3)
                                                   for size in run["llama_cpp"] if size in run[name]}
            report["runs"].append(run)
            save_report(args.out, report, echo=False)
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
