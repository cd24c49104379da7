"""llama.cpp's prefill rate on this machine, for the same-host comparison with benchmarks/engine.py's prefill.

    python3 benchmarks/llama_prefill.py --bench PATH/llama-batched-bench [--sizes 32,128,512 --threads 2]

Runs `llama-batched-bench` (built next to llama-server by benchmarks/build_llama_server.sh) on the GGUF the
default model is loaded from, one sequence, prompt sizes = our prefill chunk sizes, one generated token, and
saves its prompt-processing rate (S_PP, tokens/s) per size as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import default_gguf, host, save_report  # noqa: E402


def parse_table(text: str) -> list[dict[str, float]]:
    """Rows of llama-batched-bench's markdown table (| PP | TG | B | N_KV | T_PP s | S_PP t/s | ...)."""
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(cells[0]) <= {"-", ":"}:
            rows.append({name: float(value) for name, value in zip(header, cells, strict=True)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True, help="llama-batched-bench binary")
    p.add_argument("--gguf", default=None, help="model file (default: the packaged Gemma 3 270M Q4_K_M)")
    p.add_argument("--sizes", default="32,128,512", help="prompt sizes (default: our prefill chunk sizes)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/llama-prefill-cpu.json"))
    args = p.parse_args(argv)
    gguf = args.gguf or default_gguf()
    cmd = [args.bench, "-m", gguf, "-c", "4096", "-b", "512", "-ub", "512", "-npp", args.sizes, "-ntg", "1",
           "-npl", "1", "-t", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    rows = parse_table(done.stdout + done.stderr)
    if not rows:
        raise SystemExit(f"no table in llama-batched-bench's output:\n{done.stdout}\n{done.stderr}")
    report = {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": host(),
        "command": cmd,
        "prefill_tokens_per_s": {str(int(r["PP"])): r["S_PP t/s"] for r in rows},
        "rows": rows,
    }
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
