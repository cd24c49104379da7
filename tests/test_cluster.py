"""Scale-out (docs/scale-out.md): two replicas on the tiny model sharing one real redis-server, behind each
router `slotserve cluster` can start (vllm-router with sticky_least_loaded, HAProxy hashing X-Session-Id).

Sessions spread over both replicas and stay on theirs; a replica killed with kill -9 between turns loses
nothing (the session's next turn is answered by the other replica from the history in Redis); a replica killed
mid-stream loses nothing either (the client's retry with the same Idempotency-Key commits once); a killed
replica restarted on its port gets new sessions. The replicas (and Redis) are shared by both routers. Two
replicas sharing a disk-tier directory: a session moved to the other one continues warm.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server import balancers
from server.cli import build_parser
from server.cluster import Cluster, free_port, serve_command

TINY_SERVER = Path(__file__).resolve().parent / "tiny_server.py"
LEASE_S = 1.5  # a killed replica's holds (session, Idempotency-Key) lapse this fast here
SESSIONS = 6


def tiny_replica(port: int, redis_url: str) -> list[str]:
    return [sys.executable, str(TINY_SERVER), "--port", str(port), "--redis-url", redis_url, "--prefix",
            "cluster:", "--lease-s", str(LEASE_S), "--decode-delay-s", "0.05"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cluster")
    replicas = Cluster(2, tiny_replica, workdir, router=None, ready_timeout_s=300).start()
    yield replicas
    replicas.stop()


def replica_of(cluster: Cluster, response: httpx.Response) -> int:
    names = {f"{socket.gethostname()}:{r.port}": r.index for r in cluster.members}
    return names[response.headers["x-slotserve-replica"]]


def turn(cluster: Cluster, sid: str, key: str, content: str) -> httpx.Response:
    """One chat turn through the router; a turn still held by a killed replica (409) is retried until its
    lease lapses."""
    body = {"model": "assistant", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "ignore_eos": True}
    deadline = time.monotonic() + 10 * LEASE_S
    while True:
        r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=60,
                       headers={"X-Session-Id": sid, "Idempotency-Key": key})
        if r.status_code != 409 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def history(cluster: Cluster, sid: str) -> list[dict]:
    """The session as stored in Redis, read from any live replica."""
    live = next(r for r in cluster.members if r.process.alive())
    r = httpx.get(f"{live.url}/agents/assistant/v1/sessions/{sid}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["messages"]


def reply(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}


def user(content: str) -> dict:
    return {"role": "user", "content": content}


@pytest.mark.slow
@pytest.mark.parametrize("router", ["vllm-router", "haproxy"])
def test_sessions_stick_and_no_committed_turn_is_lost_when_a_replica_dies(cluster, router):
    cluster.port = free_port()
    cluster.start_router(router)
    try:
        sids = [f"{router}-s{i}" for i in range(SESSIONS)]
        placed = spread_and_stick(cluster, sids)
        victim = placed[sids[0]]
        kill_between_turns(cluster, sids[0], victim)
        restart_gets_new_sessions(cluster, victim, router)
        killed = kill_mid_stream(cluster, sids[0])
        cluster.restart(killed)  # whole again for the next router
    finally:
        cluster.stop_router()


def spread_and_stick(cluster: Cluster, sids: list[str]) -> dict[str, int]:
    first = {sid: turn(cluster, sid, f"{sid}-1", "Turn one") for sid in sids}
    placed = {sid: replica_of(cluster, r) for sid, r in first.items()}
    assert set(placed.values()) == {0, 1}, placed  # spread over both replicas
    for sid in sids:
        second = turn(cluster, sid, f"{sid}-2", "Turn two")
        assert replica_of(cluster, second) == placed[sid]  # and each stays on its own
        assert history(cluster, sid) == [user("Turn one"), reply(first[sid]), user("Turn two"), reply(second)]
    return placed


def kill_between_turns(cluster: Cluster, sid: str, victim: int) -> None:
    before = history(cluster, sid)
    cluster.members[victim].process.kill()
    third = turn(cluster, sid, f"{sid}-3", "Turn three")
    assert replica_of(cluster, third) == 1 - victim
    assert history(cluster, sid) == [*before, user("Turn three"), reply(third)]  # rendered from Redis


def restart_gets_new_sessions(cluster: Cluster, victim: int, router: str) -> None:
    cluster.restart(victim)
    deadline = time.monotonic() + 20  # the router's health checks notice it within a few seconds
    for i in range(200):
        sid = f"{router}-new{i}"
        if replica_of(cluster, turn(cluster, sid, f"{sid}-1", "Hello")) == victim:
            return
        assert time.monotonic() < deadline, "no new session reached the restarted replica"
        time.sleep(0.3)


def kill_mid_stream(cluster: Cluster, sid: str) -> int:
    """The session's replica dies while the turn streams: nothing of it is committed, and the client's retry
    (same Idempotency-Key) is answered by the other replica and committed exactly once. The replica killed.

    (Where the session streams from depends on the router: vllm-router keeps it on the replica it moved to,
    HAProxy's hash sends it back to its first replica once that is up again.)"""
    before = history(cluster, sid)
    body = {"model": "assistant", "messages": [user("Turn four")], "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    headers = {"X-Session-Id": sid, "Idempotency-Key": f"{sid}-4"}
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", json=body, timeout=60, headers=headers) as r:
        assert r.status_code == 200
        streaming = replica_of(cluster, r)
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        cluster.members[streaming].process.kill()  # tokens are flowing; nothing of the turn is committed
    assert history(cluster, sid) == before
    retry = turn(cluster, sid, f"{sid}-4", "Turn four")
    assert replica_of(cluster, retry) == 1 - streaming
    assert history(cluster, sid) == [*before, user("Turn four"), reply(retry)]
    again = turn(cluster, sid, f"{sid}-4", "Turn four")  # a second retry replays the committed answer
    assert again.json()["id"] == retry.json()["id"] and again.headers.get("idempotent-replayed") == "true"
    assert len(history(cluster, sid)) == len(before) + 2
    return streaming


# ---- the command and the router configs (fast) -------------------------------------------------------


def test_cluster_command_starts_serve_replicas_with_its_flags_on_the_shared_redis():
    args = build_parser().parse_args(["cluster", "--replicas", "3", "--router", "haproxy", "--port", "9000",
                                      "--config", "my.yaml", "--precision", "w8a8", "--kv-disk-dir", "/kv"])
    assert (args.replicas, args.router, args.port, args.redis_url) == (3, "haproxy", 9000, None)
    argv = serve_command(args)(4242, "redis://127.0.0.1:7/0")
    assert argv[1:4] == ["-m", "server.cli", "serve"]
    assert argv[4:] == ["--host", "127.0.0.1", "--port", "4242", "--redis-url", "redis://127.0.0.1:7/0",
                        "--config", "my.yaml", "--precision", "w8a8", "--kv-disk-dir", "/kv"]


def test_vllm_router_is_sticky_and_checks_ready():
    argv = balancers.vllm_router_command("vllm-router", "127.0.0.1", 8000, ["http://a:1", "http://b:2"], 29999)
    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag("--policy") == "sticky_least_loaded" and flag("--health-check-endpoint") == "/ready"
    assert flag("--prometheus-port") == "29999" and flag("--cb-failure-threshold") == "1"
    assert argv[argv.index("--worker-urls") + 1:argv.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]


def test_haproxy_config_hashes_the_session_header_and_is_valid(tmp_path):
    config = balancers.haproxy_config("127.0.0.1", 8000, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    assert "balance hdr(X-Session-Id)" in config and "option httpchk GET /ready" in config
    assert "server r1 127.0.0.1:8001" in config and "server r2 127.0.0.1:8002" in config
    binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    if binary is None:
        pytest.skip("haproxy is not installed (make haproxy)")
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    check = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


LONG_MESSAGE = " ".join(f"Step {i}: check the input, then say what you checked." for i in range(1, 16))


@pytest.mark.slow
def test_a_session_moved_to_another_replica_continues_warm_from_the_shared_disk_tier(tmp_path):
    """Two replicas sharing a disk-tier directory: a session's turn on one, that replica killed with kill -9
    once the turn's KV files are written, the next turn on the other reads them (cached_tokens covers the
    first turn's prompt) and answers exactly what the same prompt answers cold."""
    kv = tmp_path / "kv"

    def replica(port: int, redis_url: str) -> list[str]:
        return [*tiny_replica(port, redis_url), "--kv-disk-dir", str(kv)]

    replicas = Cluster(2, replica, tmp_path / "cluster", router=None, ready_timeout_s=300).start()
    try:
        first_url, second_url = (r.url for r in replicas.members)
        headers = {"X-Session-Id": "moved"}

        def chat(url: str, body: dict, **extra) -> dict:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers=extra.pop("headers", headers),
                           json={"model": "assistant", "max_tokens": 4, "ignore_eos": True, "temperature": 0,
                                 **body, **extra})
            assert r.status_code == 200, r.text
            return r.json()

        first = chat(first_url, {"messages": [user(LONG_MESSAGE)]})
        deadline = time.monotonic() + 30
        while (metric(first_url, "slotserve_disk_tier_pending")
               or not metric(first_url, "slotserve_disk_tier_writes_total")):
            assert time.monotonic() < deadline, "the first replica wrote no KV files"
            time.sleep(0.1)
        replicas.members[0].process.kill()
        second = chat(second_url, {"messages": [user("Go on.")]})
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        whole = history(replicas, "moved")[:-1]  # the prompt of the second turn: everything before its reply
        cold = chat(second_url, {"messages": whole}, headers={}, cache_salt="cold")
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cold["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    finally:
        replicas.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} "))
