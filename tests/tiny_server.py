"""A slotserve server on the tiny test model, as a process of its own: for tests that kill a server (kill -9)
and start another, which an in-process server cannot show.

    python tests/tiny_server.py --port P --redis-url redis://127.0.0.1:R/0 [--lease-s 1.5] [--decode-delay-s 0.02]
        [--admin-key K] [--kv-disk-dir DIR]   (--redis-url memory:// for a private in-memory store)

It serves exactly what `slotserve serve` serves (create_app + uvicorn), with the tiny runtime of
test_server_helpers in place of the real model, so it is ready in seconds once the compile cache is warm.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def slow_down(runtime, delay_s: float) -> None:
    """Sleep before every decode step, so a test can act while a stream is still running."""
    engine = runtime.engine
    for name in ("decode", "verify"):
        step = getattr(engine, name)

        def slowed(*args, _step=step, **kwargs):
            time.sleep(delay_s)
            return _step(*args, **kwargs)

        setattr(engine, name, slowed)


def main() -> None:
    import uvicorn
    from test_server_helpers import build_tiny_runtime, server_config

    from agents.store.lease import LEASE_S
    from server.app import create_app

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", default="slotserve:")
    parser.add_argument("--lease-s", type=float, default=LEASE_S)
    parser.add_argument("--decode-delay-s", type=float, default=0.0)
    parser.add_argument("--admin-key", default=None, help="turn auth on with this admin key")
    parser.add_argument("--kv-disk-dir", default=None, help="the disk tier's directory (default: off)")
    args = parser.parse_args()
    runtime = build_tiny_runtime(disk_tier_dir=args.kv_disk_dir)
    if args.decode_delay_s:
        slow_down(runtime, args.decode_delay_s)
    runtime.start()
    auth = {"auth__enabled": True, "auth__admin_keys": [args.admin_key]} if args.admin_key else {}
    config = server_config(store__url=args.redis_url, store__prefix=args.prefix, store__lease_s=args.lease_s, **auth)
    uvicorn.run(create_app(config, runtime=runtime), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
