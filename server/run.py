"""`slotserve serve`: config + uvicorn, with graceful shutdown of in-flight streams."""

from __future__ import annotations

import argparse
import sys

from server.config import ConfigError, load_config


def config_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Dotted config keys set by `serve`'s command-line flags (None: not given)."""
    flags = {"server.host": args.host, "server.port": args.port, "store.url": args.redis_url,
             "model.name": getattr(args, "model", None), "model.precision": getattr(args, "precision", None),
             "model.kv_dtype": getattr(args, "kv_dtype", None)}
    return {key: value for key, value in flags.items() if value is not None and value != ""}


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import configure_logging, create_app

    overrides = config_overrides(args)
    try:
        config = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"slotserve: error: {e}", file=sys.stderr)
        return 2
    srv = config.server
    configure_logging("debug" if args.verbose else srv.log_level, srv.log_json)
    app = create_app(config)
    print(f"slotserve: listening on http://{srv.host}:{srv.port} (model loads in the background; "
          f"GET /ready says when it is warm)", file=sys.stderr, flush=True)
    state = app.state.slotserve

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGINT/SIGTERM: stop taking generations; running ones get graceful_shutdown_s to finish, then
            # end with a final event; uvicorn's own drain timeout comes a little later, as a backstop.
            state.begin_shutdown(srv.graceful_shutdown_s)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=srv.host, port=srv.port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=srv.graceful_shutdown_s + 5, lifespan="on"))
    server.run()
    return 0
