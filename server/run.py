"""`slotserve serve`: config + uvicorn, with graceful shutdown of in-flight streams."""

from __future__ import annotations

import argparse
import sys

from server.config import ConfigError, ServerConfig, load_config


def config_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Dotted config keys set by `serve`'s command-line flags (None: not given)."""
    flags = {"server.host": args.host, "server.port": args.port, "store.url": args.redis_url,
             "model.name": getattr(args, "model", None), "model.precision": getattr(args, "precision", None),
             "model.kv_dtype": getattr(args, "kv_dtype", None),
             "scheduler.disk_tier_dir": getattr(args, "kv_disk_dir", None)}
    return {key: value for key, value in flags.items() if value is not None and value != ""}


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """The config `serve` runs with: the file, its flags' overrides, and each --adapter-dir added to
    adapters.dirs (ConfigError when invalid)."""
    config = load_config(args.config, config_overrides(args))
    config.adapters.dirs = [*config.adapters.dirs, *getattr(args, "adapter_dir", [])]
    return config


def exposure_warning(host: str, auth_enabled: bool) -> str | None:
    """What to tell the operator who serves beyond this machine without API keys."""
    if auth_enabled or host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
        return None
    return (f"listening on {host} with auth disabled: anyone who can reach this address can use every agent, "
            "read and continue every session, and (without admin_keys) change agents; set auth.enabled: true")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import configure_logging, create_app

    try:
        config = serve_config(args)
    except ConfigError as e:
        print(f"slotserve: error: {e}", file=sys.stderr)
        return 2
    srv = config.server
    configure_logging("debug" if args.verbose else srv.log_level, srv.log_json)
    warning = exposure_warning(srv.host, config.auth.enabled)
    if warning:
        print(f"slotserve: WARNING: {warning}", file=sys.stderr, flush=True)
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
    died: list[str] = []

    def exit_on_engine_failure(reason: str) -> None:
        # A dead engine loop cannot recover in this process: stop serving and exit non-zero, so that a
        # supervisor (systemd, Kubernetes, a router's health checks) replaces the replica.
        died.append(reason)
        server.should_exit = True

    state.on_engine_failure = exit_on_engine_failure
    server.run()
    if died:
        print(f"slotserve: exiting: the engine loop died ({died[0]})", file=sys.stderr, flush=True)
        return 3
    return 0
