"""`slotserve cluster`: N replicas sharing one Redis behind a router, on one machine.

Start-up order: Redis (a private redis-server unless a URL is given), the replicas (each `slotserve serve`
on a free loopback port, every one on the same Redis and key prefix), a wait until every replica's
``/ready`` is 200 (a router would otherwise send traffic to a replica still loading), then the router
(`server.balancers`). A replica that dies is restarted on its port; SIGINT/SIGTERM stops the router, then
the replicas (gracefully), then Redis. docs/scale-out.md: the topology over several machines.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from server import balancers, defaults

ReplicaCommand = Callable[[int, str], list[str]]  # (port, redis url) -> the replica's argv
STOP_TIMEOUT_S = 40.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)


@dataclass
class Process:
    """A child process with its output in a log file; stopped with SIGTERM, then SIGKILL."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            # A session of its own: Ctrl-C reaches the cluster command, which stops everything in order.
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} exited with status {code}; see {self.log_path}")

    def kill(self) -> None:
        """kill -9 (what the fault tests do to a replica)."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        if self.alive():
            self.proc.terminate()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if not self.alive():
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Replica:
    index: int
    port: int
    process: Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        self.process.check_alive()
        return http_ok(f"{self.url}/ready")


@dataclass
class Cluster:
    """Redis, ``replicas`` replicas (argv from ``replica_command``) and one router, in ``workdir``."""

    replicas: int
    replica_command: ReplicaCommand
    workdir: Path
    router: str | None = "vllm-router"  # None: no router (start one later with `start_router`)
    host: str = defaults.HOST
    port: int = defaults.PORT
    redis_url: str | None = None
    ready_timeout_s: float = 600.0
    members: list[Replica] = field(default_factory=list)
    redis: Process | None = None
    balancer: Process | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Cluster:
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            if self.redis_url is None:
                self._start_redis()
            self.members = [self._replica(i, free_port()) for i in range(self.replicas)]
            for replica in self.members:
                replica.process.start()
            self.wait_ready(self.members)
            if self.router is not None:
                self.start_router(self.router)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")
        if binary is None:
            raise OSError("redis-server not found: install the Debian package `redis-server`, or give --redis-url")
        port = free_port()
        self.redis = Process("redis-server", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                              "--appendonly", "no", "--dir", str(self.workdir)],
                             self.workdir / "redis.log")
        self.redis.start()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        wait_for(lambda: self._redis_answers(port), 10, "redis-server")

    def _redis_answers(self, port: int) -> bool:
        self.redis.check_alive()
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        return False

    def _replica(self, index: int, port: int) -> Replica:
        argv = self.replica_command(port, self.redis_url)
        return Replica(index, port, Process(f"replica {index}", argv, self.workdir / f"replica-{index}.log"))

    def wait_ready(self, replicas: Sequence[Replica]) -> None:
        for replica in replicas:
            wait_for(replica.ready, self.ready_timeout_s, f"replica {replica.index} ({replica.url}) /ready")

    def start_router(self, kind: str) -> None:
        workers = [r.url for r in self.members]
        if kind == "vllm-router":
            argv = balancers.vllm_router_command(balancers.vllm_router_binary(), self.host, self.port, workers,
                                                 free_port())
        elif kind == "haproxy":
            config = self.workdir / "haproxy.cfg"
            config.write_text(balancers.haproxy_config(self.host, self.port, workers))
            argv = balancers.haproxy_command(balancers.haproxy_binary(), config)
        else:
            raise ValueError(f"unknown router {kind!r}: one of {', '.join(balancers.KINDS)}")
        self.router = kind
        self.balancer = Process(kind, argv, self.workdir / f"{kind}.log")
        self.balancer.start()
        wait_for(self._router_answers, 60, f"{kind} on {self.url}")

    def _router_answers(self) -> bool:
        self.balancer.check_alive()
        return http_ok(f"{self.url}/v1/models")

    def stop_router(self) -> None:
        if self.balancer is not None:
            self.balancer.stop(10)
            self.balancer = None

    def restart(self, index: int, wait: bool = True) -> Replica:
        """Start replica ``index`` again on its port (after it died or was killed)."""
        old = self.members[index]
        old.process.stop()
        replica = self._replica(index, old.port)
        replica.process.start()
        self.members[index] = replica
        if wait:
            self.wait_ready([replica])
        return replica

    def restart_dead(self) -> list[int]:
        """Restart every replica that has exited (without waiting for it to be ready); their indices."""
        dead = [r.index for r in self.members if not r.process.alive()]
        for index in dead:
            print(f"slotserve: replica {index} exited ({self.members[index].process.proc.returncode}); "
                  f"restarting it", file=sys.stderr, flush=True)
            self.restart(index, wait=False)
        return dead

    def stop(self) -> None:
        self.stop_router()
        for replica in self.members:  # all at once: each drains its streams meanwhile
            replica.process.terminate()
        for replica in self.members:
            replica.process.stop()
        if self.redis is not None:
            self.redis.stop(10)


# ---- the command -------------------------------------------------------------------------------------


def serve_command(args: argparse.Namespace) -> ReplicaCommand:
    """`slotserve serve` on a loopback port with the cluster's Redis, and the flags given to `cluster`."""
    extra: list[str] = []
    for flag, value in (("--config", args.config), ("--model", args.model), ("--precision", args.precision),
                        ("--kv-dtype", args.kv_dtype), ("--kv-disk-dir", args.kv_disk_dir)):
        if value:
            extra += [flag, value]

    def command(port: int, redis_url: str) -> list[str]:
        return [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--redis-url", redis_url, *extra]

    return command


def run_cluster(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="slotserve-cluster-"))
    cluster = Cluster(args.replicas, serve_command(args), workdir, router=args.router, host=args.host,
                      port=args.port, redis_url=args.redis_url)
    stop = _stop_on_signals()
    print(f"slotserve: starting {args.replicas} replicas behind {args.router} (logs in {workdir})",
          file=sys.stderr, flush=True)
    try:
        cluster.start()
        print(f"slotserve: cluster ready on {cluster.url} (replicas: {', '.join(r.url for r in cluster.members)}; "
              f"redis: {cluster.redis_url})", file=sys.stderr, flush=True)
        while not stop:
            cluster.restart_dead()
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:  # a replica or the router did not start
        print(f"slotserve: error: {e} (logs in {workdir})", file=sys.stderr, flush=True)
        return 1
    finally:
        print("slotserve: stopping the cluster", file=sys.stderr, flush=True)
        cluster.stop()
    return 0


def _stop_on_signals() -> list[int]:
    """A list that gets the signal number once SIGTERM arrives (SIGINT raises KeyboardInterrupt as usual)."""
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    return received
