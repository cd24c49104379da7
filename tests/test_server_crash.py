"""kill -9 of a server mid-stream: after a restart on the same Redis the session holds exactly the turns that
were committed, a retried committed turn replays its answer, and the turn that died mid-stream runs once
when retried with its Idempotency-Key (after the dead server's lease lapses)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server_helpers import RedisServer, free_port, is_ready, wait_until

TINY_SERVER = Path(__file__).resolve().parent / "tiny_server.py"
LEASE_S = 1.5  # the dead server's holds lapse this fast here (30 s by default)
BASE = "/agents/assistant/v1"


class ServerProcess:
    """tests/tiny_server.py in a process of its own (what `slotserve serve` runs), ready when constructed.
    ``args``: the script's options besides --port (--redis-url is required)."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("ab")
        self.proc = subprocess.Popen([sys.executable, str(TINY_SERVER), "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self._ready, timeout=240, interval=0.2)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
        return is_ready(self.url)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def crash_server(redis_url: str, log: Path) -> ServerProcess:
    """A replica on the shared Redis whose holds lapse after LEASE_S, with slowed steps (mid-stream kills)."""
    return ServerProcess(log, "--redis-url", redis_url, "--prefix", "crash:", "--lease-s", str(LEASE_S),
                         "--decode-delay-s", "0.05")


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def turn(url: str, sid: str, key: str, content: str) -> httpx.Response:
    body = {"model": "assistant", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "ignore_eos": True}
    return httpx.post(f"{url}{BASE}/chat/completions", json=body, timeout=60,
                      headers={"X-Session-Id": sid, "Idempotency-Key": key})


def stored(url: str, sid: str) -> list[dict]:
    r = httpx.get(f"{url}{BASE}/sessions/{sid}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["messages"]


def test_kill_9_mid_stream_loses_no_committed_turn_and_commits_the_retry_once(redis, tmp_path):
    log = tmp_path / "servers.log"
    first = crash_server(redis.url, log)
    try:
        one = turn(first.url, "s", "turn-1", "First question")
        assert one.status_code == 200, one.text
        body = {"model": "assistant", "messages": [{"role": "user", "content": "Second question"}],
                "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{first.url}{BASE}/chat/completions", json=body, timeout=60,
                          headers={"X-Session-Id": "s", "Idempotency-Key": "turn-2"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            first.kill()  # mid-stream: the turn's tokens are flowing, nothing of it is committed
    finally:
        if first.proc.poll() is None:
            first.kill()

    second = crash_server(redis.url, log)
    try:
        reply_1 = one.json()["choices"][0]["message"]["content"]
        assert stored(second.url, "s") == [{"role": "user", "content": "First question"},
                                           {"role": "assistant", "content": reply_1}]
        again = turn(second.url, "s", "turn-1", "First question")  # a retry of the committed turn: replayed
        assert again.status_code == 200 and again.json()["id"] == one.json()["id"]
        assert len(stored(second.url, "s")) == 2

        begin = time.monotonic()
        retry = turn(second.url, "s", "turn-2", "Second question")
        while retry.status_code == 409 and retry.json()["error"]["code"] == "session_busy":  # the dead turn's hold
            assert time.monotonic() - begin < 10 * LEASE_S
            time.sleep(0.2)
            retry = turn(second.url, "s", "turn-2", "Second question")
        assert retry.status_code == 200, retry.text
        reply_2 = retry.json()["choices"][0]["message"]["content"]
        history = stored(second.url, "s")
        assert history[2:] == [{"role": "user", "content": "Second question"},
                               {"role": "assistant", "content": reply_2}]
        replay = turn(second.url, "s", "turn-2", "Second question")
        assert replay.json()["id"] == retry.json()["id"] and len(stored(second.url, "s")) == 4
    finally:
        second.kill()
