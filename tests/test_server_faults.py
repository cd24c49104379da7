"""Faults fail fast and say so: an exception in the engine loop ends in-flight streams with a 503, turns
/health and /ready to 503 with the reason, refuses new requests at once, and makes `slotserve serve` exit
non-zero (a supervisor restarts it)."""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import pytest
from test_server_helpers import LiveServer, build_tiny_runtime, free_port, is_ready, server_config, wait_until

from server.app import create_app

USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def doomed_runtime():
    """A runtime of its own whose decode step raises once `break_engine` is set."""
    runtime = build_tiny_runtime()
    broken = threading.Event()
    decode = runtime.engine.decode

    def failing(*args, **kwargs):
        if broken.is_set():
            raise RuntimeError("injected device fault")
        time.sleep(0.02)  # keep a stream running long enough to be caught mid-way
        return decode(*args, **kwargs)

    runtime.engine.decode = failing
    runtime.engine.verify = lambda *a, **k: failing(*a, **k)  # lone greedy streams verify instead of decoding
    runtime.break_engine = broken
    yield runtime
    runtime.stop()


def stream_lines(url: str, body: dict, started: threading.Event, out: list) -> None:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
                out.append(line[len("data: "):])


def test_a_dead_engine_loop_fails_fast_with_503s_naming_the_reason(doomed_runtime):
    app = create_app(server_config(), runtime=doomed_runtime)
    with LiveServer(app) as srv:
        started, lines = threading.Event(), []
        body = {"model": "assistant", "messages": USER, "max_tokens": 48, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=stream_lines, args=(f"{srv.url}/v1/chat/completions", body, started,
                                                             lines))
        reader.start()
        assert started.wait(30)
        doomed_runtime.break_engine.set()
        reader.join(30)
        assert not reader.is_alive()
        assert lines[0] == 200
        last = json.loads(lines[-1])  # the stream ends with an error event
        assert last["error"]["code"] == "engine_failed" and "injected device fault" in last["error"]["message"]
        for path in ("/health", "/ready"):
            r = httpx.get(f"{srv.url}{path}", timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
            assert "injected device fault" in r.json()["error"]["message"]
        begin = time.perf_counter()
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "assistant", "messages": USER}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        assert time.perf_counter() - begin < 5  # refused at once, never queued


def test_serve_exits_nonzero_when_the_engine_loop_dies(doomed_runtime, monkeypatch, tmp_path):
    import server.app
    from server.run import run_serve

    monkeypatch.setattr(server.app, "build_runtime", lambda options, progress=None: doomed_runtime)
    port = free_port()
    config = tmp_path / "server.yaml"
    config.write_text(f"server:\n  port: {port}\n  log_level: warning\nlimits:\n  max_tokens: 48\n")
    args = argparse.Namespace(config=str(config), host=None, port=None, redis_url=None, model=None, precision=None,
                              kv_dtype=None, verbose=False)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", run_serve(args)), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: is_ready(url), timeout=120)
    doomed_runtime.break_engine.set()
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "assistant", "messages": USER, "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    thread.join(60)
    assert result.get("rc") == 3

