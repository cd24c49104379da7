"""The routers `slotserve cluster` puts in front of its replicas: how each is found, configured and started.

* vllm-router (PyPI `vllm-router`) with ``--policy sticky_least_loaded``: a session (``X-Session-Id``) stays on
  its replica; a new one goes to the replica with the fewest sessions. It is installed into a virtualenv of
  its own under .cache/venvs (its dependencies are unpinned) unless `vllm-router` is on PATH.
* HAProxy (the Debian package): ``balance hdr(X-Session-Id)`` with consistent hashing, health checks on
  ``/ready``, and retries that redispatch a request whose replica refused the connection.

Both check ``/ready`` (503 while a replica loads), so a restarted replica gets traffic only once it is warm.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_ROUTER = "vllm-router==0.1.17"
KINDS = ("vllm-router", "haproxy")
HEALTH_PATH = "/ready"


def vllm_router_binary(venvs: Path = REPO_ROOT / ".cache" / "venvs") -> str:
    """`vllm-router` from PATH, else from a virtualenv of its own (created on first use)."""
    found = shutil.which("vllm-router")
    if found:
        return found
    root = venvs / VLLM_ROUTER.replace("==", "-")
    binary, marker = root / "bin" / "vllm-router", root / ".requirements"
    if marker.exists() and marker.read_text() == VLLM_ROUTER and binary.exists():
        return str(binary)
    shutil.rmtree(root, ignore_errors=True)
    print(f"slotserve: installing {VLLM_ROUTER} into {root}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", VLLM_ROUTER], check=True,
                   timeout=1200)
    marker.write_text(VLLM_ROUTER)
    return str(binary)


def vllm_router_command(binary: str, host: str, port: int, workers: Sequence[str], metrics_port: int) -> list[str]:
    """Sticky sessions; a dead replica is noticed within a second (health check, circuit breaker) and its
    sessions move; a restarted one is tried again after 2 s."""
    return [binary, "--host", host, "--port", str(port), "--worker-urls", *workers,
            "--policy", "sticky_least_loaded", "--prometheus-port", str(metrics_port),
            "--health-check-endpoint", HEALTH_PATH, "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1", "--health-success-threshold", "1",
            "--worker-startup-check-interval", "1", "--cb-failure-threshold", "1",
            "--cb-timeout-duration-secs", "2", "--request-timeout-secs", "3600", "--log-level", "warning"]


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise OSError("haproxy not found: install the Debian package `haproxy` (apt-get install haproxy)")
    return found


def haproxy_config(host: str, port: int, workers: Sequence[str]) -> str:
    """Sessions hashed to replicas by X-Session-Id (consistent: a replica's loss moves only its sessions;
    crc32 and weight 100, many points on the ring, spread ids that differ in one character, which the default
    sdbm with weight 1 piles onto one replica); a refused connection, an empty response or a 503 is retried
    on another replica."""
    servers = "\n".join(f"    server r{i} {url.removeprefix('http://')}" for i, url in enumerate(workers, 1))
    return f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    timeout http-request 30s
    timeout http-keep-alive 10s
    timeout queue 30s
    timeout check 2s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response response-timeout 503
    option http-buffer-request
frontend fe
    bind {host}:{port}
    default_backend replicas
backend replicas
    balance hdr(X-Session-Id)
    hash-type consistent crc32
    option httpchk GET {HEALTH_PATH}
    http-check expect status 200
    default-server check inter 1s fastinter 500ms downinter 1s fall 2 rise 2 weight 100 on-marked-down shutdown-sessions
{servers}
"""


def haproxy_command(binary: str, config_path: Path) -> list[str]:
    return [binary, "-db", "-f", str(config_path)]  # -db: foreground, logs to stderr
