"""The `slotserve` command: serve, cluster, generate, tokenize.

Heavy imports happen inside each command so that `configure_environment()` runs before JAX loads.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from server import defaults


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from exc
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description="Multi-agent Gemma serving in pure JAX")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate continuations for one or more prompts on the slot engine")
    gen.add_argument("--model", default=None, help="'default', an HF checkpoint directory or a .gguf file")
    gen.add_argument("--prompt", action="append", default=[], help="prompt text (BOS added); repeatable")
    gen.add_argument("--prompt-ids", action="append", default=[], type=_parse_ids,
                     help="comma-separated token ids fed exactly as given; repeatable")
    gen.add_argument("--prompts-file", help="JSON lines: {\"prompt\": ...} or {\"prompt_ids\": [...]} "
                     "with optional max_tokens, temperature, seed, top_k, top_p, min_p, ignore_eos")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    _engine_args(gen)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (agents, sessions, admin API)")
    serve.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    serve.add_argument("--host", default=None, help=f"bind address (default: the config's, {defaults.HOST})")
    serve.add_argument("--port", type=int, default=None, help=f"port (default: the config's, {defaults.PORT})")
    serve.add_argument("--redis-url", default=None, help="store sessions and agents in Redis (redis://host:port/db)")
    serve.add_argument("--model", default=None, help="override the config's model ('default', a directory, a .gguf)")
    serve.add_argument("--precision", default=None, choices=("float", "f32", "w8a8"),
                       help="override the config's weight precision (default: by device)")
    serve.add_argument("--kv-dtype", default=None, choices=("compute", "int8", "float32", "bfloat16", "float16"),
                       help="override the config's KV cache dtype (default: by device and precision)")
    serve.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                       help="the disk tier of the prefix cache: KV kept across restarts and shared by replicas "
                            "pointing at the same DIR ('off': none; default: the config's, ~/.cache/slotserve/kv)")
    serve.add_argument("--adapter-dir", action="append", default=[], metavar="DIR",
                       help="a directory LoRA adapters named over HTTP may be loaded from (adds to the config's "
                            "adapters.dirs; repeatable; none: loading adapters at run time is off)")

    _cluster_args(sub)

    tok = sub.add_parser("tokenize", help="print the token ids of a text (no special tokens added)")
    tok.add_argument("--model", default="default")
    tok.add_argument("--text", required=True)
    tok.add_argument("--json", action="store_true")
    return parser


def _cluster_args(sub) -> None:
    cluster = sub.add_parser("cluster", help="N `serve` replicas sharing one Redis behind a router, on this machine "
                                             "(docs/scale-out.md)")
    cluster.add_argument("--replicas", type=int, default=defaults.CLUSTER_REPLICAS,
                         help="how many replicas (default %(default)s)")
    cluster.add_argument("--router", default="vllm-router", choices=("vllm-router", "haproxy"),
                         help="vllm-router (sticky_least_loaded; installed under .cache/venvs if not on PATH) or "
                              "haproxy (from PATH)")
    cluster.add_argument("--host", default=defaults.HOST, help="the router's bind address (default %(default)s)")
    cluster.add_argument("--port", type=int, default=defaults.PORT, help="the router's port (default %(default)s)")
    cluster.add_argument("--redis-url", default=None, help="a shared Redis (default: start a private redis-server)")
    cluster.add_argument("--config", default=None, help="YAML config for every replica")
    cluster.add_argument("--model", default=None, help="override the config's model")
    cluster.add_argument("--precision", default=None, choices=("float", "f32", "w8a8"))
    cluster.add_argument("--kv-dtype", default=None, choices=("compute", "int8", "float32", "bfloat16", "float16"))
    cluster.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                         help="the disk tier every replica shares (default: each replica's config; on one "
                              "machine that is one directory already, ~/.cache/slotserve/kv)")
    cluster.add_argument("--workdir", default=None, help="logs and router config (default: a new temp directory)")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    # None: the runtime's default (agents.runtime.RuntimeOptions), read once JAX may load.
    parser.add_argument("--slots", type=int, default=None, help="KV slots (concurrent sequences; default 8)")
    parser.add_argument("--max-len", type=int, default=None, help="positions per slot (default 8192)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: by device)")
    parser.add_argument("--kv-dtype", default=None, choices=("compute", "int8", "float32", "bfloat16", "float16"),
                        help="KV cache dtype (default: as the server chooses per device)")
    parser.add_argument("--precision", default=None, choices=("float", "f32", "w8a8"),
                        help="weight matrices: float (the reference) or w8a8 (int8 weights and activations); "
                             "default: as the server chooses per device")
    parser.add_argument("--compile-cache", default=None, help="persistent XLA compilation cache directory")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from core.device import configure_environment

    configure_environment()
    try:
        if args.command == "generate":
            from agents.generate_cli import run_generate

            return run_generate(args)
        if args.command == "serve":
            from server.run import run_serve

            return run_serve(args)
        if args.command == "cluster":
            from server.cluster import run_cluster

            return run_cluster(args)
        if args.command == "tokenize":
            from agents.generate_cli import run_tokenize

            return run_tokenize(args)
    except (ValueError, OSError) as exc:
        print(f"slotserve: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
