"""The live slot dashboard: the engine's slot snapshot, ``/admin/slots`` for a known workload, its auth and
stream, and the page in a real headless Chromium while requests run."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from test_server_crash import ServerProcess
from test_server_helpers import LiveServer, server_config, tiny_runtime, wait_until

from scheduler.adapters import AdapterSlots
from scheduler.plan import StepPlan, StepRow
from scheduler.request import GenerationRequest, RequestHandle
from scheduler.sequence import SeqState, Sequence
from scheduler.slots import Slot
from scheduler.snapshot import SnapshotPublisher, take_snapshot
from server.app import create_app

ADMIN = "dash-admin-secret"
WORDS = ["alpha", "beta", "gamma", "delta", "slot", "cache", "token", "agent", "model", "queue", "host", "tier",
         "prefix", "decode", "verify"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def prose(n: int, seed: int) -> str:
    """n words nobody sent before (a cold prompt, whatever ran earlier in this process)."""
    rng = random.Random(f"{seed}-{time.time_ns()}")
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---- the snapshot itself (no engine) --------------------------------------------------------------------


def _seq(seq_id: int, agent: str, session: str | None, state: SeqState, slot: int) -> Sequence:
    request = GenerationRequest(prompt_ids=tuple(range(1, 41)), group=agent, max_tokens=10, cache_scope=(agent, None),
                                affinity=f"{agent}:{session}" if session else None, label=session)
    seq = Sequence(id=seq_id, request=request, handle=RequestHandle(request), detokenizer=None, stop_matcher=None,
                   max_tokens=10, seed=0, state=state, slot=slot)
    return seq


def test_snapshot_states_agents_sessions_and_progress():
    prefilling = _seq(1, "alpha", "s-1", SeqState.PREFILLING, 0)
    prefilling.cached_tokens, prefilling.cursor = 16, 24
    decoding = _seq(2, "beta", None, SeqState.DECODING, 1)
    decoding.generated = [5, 6, 7]
    decoding.first_token_at = time.perf_counter() - 1.0
    verifying = _seq(3, "beta", "s-3", SeqState.DECODING, 2)
    verifying.generated = [9]
    slots = [Slot(0, list(range(24)), ("alpha", None), "alpha:s-1", sequence=prefilling),
             Slot(1, list(range(42)), ("beta", None), None, sequence=decoding),
             Slot(2, list(range(41)), ("beta", None), "beta:s-3", sequence=verifying),
             Slot(3, list(range(7)), ("gamma", None), "gamma:old", group="gamma", label="old")]
    host = SimpleNamespace(stats=lambda: {"hits": 2, "evictions": 0, "stored_positions": 9, "bytes_used": 1024,
                                          "nodes": 1, "budget_bytes": 4096},
                           bytes_by_scope=lambda: {("gamma", None): 1024})
    # The narrow view a snapshot reads (snapshot.SnapshotSource), not a scheduler.
    sched = SimpleNamespace(slots=slots, host=host, step_seconds={"decode": 0.01}, iteration=7,
                            adapters=AdapterSlots(SimpleNamespace(config=SimpleNamespace(adapter_slots=0),
                                                                  loaded_adapters=[])),
                            waiting_by_group=lambda: {"alpha": 2}, disk_stats=lambda: None,
                            counter_values=lambda: {"prompt_tokens": 80, "cached_tokens": 16, "host_restores": 1})
    plan = StepPlan(verify=StepRow(verifying, [9, 1, 2], 41))
    snap = take_snapshot(sched, plan)
    views = {v.index: v for v in snap.slots}
    assert (views[0].state, views[0].group, views[0].label) == ("prefilling", "alpha", "s-1")
    assert (views[0].prompt_tokens, views[0].cached_tokens, views[0].computed_tokens, views[0].prefill_done) == \
        (40, 16, 8, 24)
    assert (views[1].state, views[1].group, views[1].label, views[1].held) == ("decoding", "beta", None, 42)
    assert 1.5 < views[1].tokens_per_s < 2.5  # 2 tokens after the first, in about a second
    assert (views[2].state, views[2].label) == ("verifying", "s-3")
    assert (views[3].state, views[3].group, views[3].label, views[3].held) == ("idle", "gamma", "old", 7)
    assert snap.waiting == {"alpha": 2} and snap.host["bytes_used"] == 1024 and snap.decode_step_s == 0.01
    assert snap.host["by_adapter"] == {}  # no request ran under an adapter: the tier is not walked
    assert snap.counters == {"prompt_tokens": 80, "cached_tokens": 16, "host_restores": 1}
    doc = snap.as_dict()
    json.dumps(doc)  # plain data all the way down
    assert doc["slots"][2]["state"] == "verifying"

    publisher = SnapshotPublisher(interval_s=60.0)  # at most once a minute: the second step is not published
    publisher.after_step(sched, plan)
    first = publisher.latest
    publisher.after_step(sched, None)
    assert publisher.latest is first and publisher.published == 1
    publisher.when_idle(sched)  # the loop went idle: what changed since is published once
    assert publisher.latest is not first and publisher.published == 2
    publisher.when_idle(sched)
    assert publisher.published == 2
    off = SnapshotPublisher(interval_s=None)
    off.after_step(sched, plan)
    off.when_idle(sched)
    assert off.latest is None


# ---- /admin/slots on the tiny runtime ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime():
    return tiny_runtime()


@pytest.fixture(scope="module")
def server(runtime):
    with LiveServer(create_app(server_config(), runtime=runtime)) as srv:
        r = httpx.post(f"{srv.url}/admin/agents", json={"name": "beta", "system_prompt": "You are beta."})
        assert r.status_code in (201, 409), r.text
        yield srv


@pytest.fixture
def slow_engine(runtime, monkeypatch):
    """Slow steps, so that a poll sees each state: 80 ms per decode or verify step, 150 ms per prefill chunk."""
    for name, delay in (("decode", 0.08), ("verify", 0.08), ("verify_rows", 0.08), ("prefill_chunk", 0.15)):
        step = getattr(runtime.engine, name)

        def slow(*args, _step=step, _delay=delay, **kwargs):
            time.sleep(_delay)
            return _step(*args, **kwargs)

        monkeypatch.setattr(runtime.engine, name, slow)


def chat(url: str, agent: str, content: str, session: str | None = None, max_tokens: int = 20,
         headers: dict[str, str] | None = None) -> int:
    """One streamed chat turn (sampled, so no speculation); returns the status."""
    body = {"model": agent, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 1.0}
    extra = {"X-Session-Id": session} if session else {}
    with httpx.stream("POST", f"{url}/agents/{agent}/v1/chat/completions", json=body, timeout=120,
                      headers={**(headers or {}), **extra}) as r:
        for _ in r.iter_lines():
            pass
        return r.status_code


def run_in_threads(calls) -> tuple[list[threading.Thread], list[int]]:
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda c=c: statuses.append(c()), daemon=True) for c in calls]
    for t in threads:
        t.start()
    return threads, statuses


def watch(url: str, threads: list[threading.Thread], headers: dict[str, str] | None = None) -> list[dict]:
    docs = []
    while any(t.is_alive() for t in threads):
        r = httpx.get(f"{url}/admin/slots", headers=headers or {}, timeout=10)
        assert r.status_code == 200, r.text
        docs.append(r.json())
        time.sleep(0.05)
    return docs


def test_slots_document_follows_a_known_workload(server, runtime, slow_engine):
    url = server.url
    before = httpx.get(f"{url}/admin/slots").json()
    assert before["object"] == "slots" and before["status"] == "ready"
    assert before["model"] == {"name": "tiny-gemma3", "dtype": "float32", "precision": "w8a8", "kv_dtype": "int8",
                               "slots": 4, "max_len": 512, "kv_bytes_per_slot": runtime.engine.bytes_per_slot}
    assert len(before["slots"]) == 4 and [s["index"] for s in before["slots"]] == [0, 1, 2, 3]
    long_prompt = prose(260, 1)  # several prefill chunks
    calls = [lambda: chat(url, "assistant", long_prompt, session="dash-a"),
             lambda: chat(url, "beta", prose(5, 2), session="dash-b")]
    calls += [lambda i=i: chat(url, "beta", prose(5, 10 + i)) for i in range(4)]  # 6 requests, 4 slots
    threads, statuses = run_in_threads(calls)
    docs = watch(url, threads)
    assert statuses == [200] * 6
    slots = [s for d in docs for s in d["slots"]]
    assert all(len(d["slots"]) == 4 for d in docs)
    prefill = [s for s in slots if s["state"] == "prefilling" and s["session"] == "dash-a"]
    assert prefill, "the long prompt was never seen prefilling"
    assert all(s["agent"] == "assistant" and s["prompt_tokens"] > 200 for s in prefill)
    assert any(0 < s["prefill_done"] < s["prompt_tokens"] for s in prefill)
    assert all(s["computed_tokens"] == s["prefill_done"] - s["cached_tokens"] for s in prefill)
    decoding = [s for s in slots if s["state"] == "decoding" and s["session"] == "dash-b"]
    assert decoding and all(s["agent"] == "beta" for s in decoding)
    assert any(s["generated"] >= 3 and s["tokens_per_s"] > 0 and s["max_tokens"] == 20 for s in decoding)
    assert all(s["held"] >= s["prompt_tokens"] for s in decoding)
    queued = [d for d in docs if d["totals"]["waiting"]]
    assert queued, "six requests on four slots: some must have waited"
    assert all(set(d["waiting"]) <= {"assistant", "beta"} for d in queued)
    assert any(d["totals"]["busy"] == 4 for d in queued)

    def settled() -> bool:
        doc = httpx.get(f"{url}/admin/slots").json()
        return all(s["state"] == "idle" for s in doc["slots"]) and doc["waiting"] == {}

    wait_until(settled, timeout=3)  # within an idle poll of the last step
    after = httpx.get(f"{url}/admin/slots").json()
    assert after["totals"] == {"busy": 0, "waiting": 0, "tokens_per_s": 0.0,
                               "decode_step_ms": after["totals"]["decode_step_ms"]}
    assert after["totals"]["decode_step_ms"] > 0
    assert after["prefix_cache"]["prompt_tokens"] - before["prefix_cache"]["prompt_tokens"] > 260
    assert after["latency"]["ttft"]["count"] >= 6 and after["latency"]["inter_token"]["count"] >= 6 * 10
    assert after["latency"]["ttft_series"] and after["latency"]["ttft"]["mean"] > 0
    assert {"bytes_used", "budget_bytes", "nodes", "hits", "restores", "saves", "evictions"} <= set(after["host_tier"])
    assert after["snapshot"]["age_s"] < 60

    # the session's second turn reuses its first: cached tokens from its slot, only the new turn computed
    threads, statuses = run_in_threads([lambda: chat(url, "assistant", "and now?", session="dash-a")])
    docs = watch(url, threads)
    assert statuses == [200]
    turn = [s for d in docs for s in d["slots"] if s["session"] == "dash-a" and s["state"] != "idle"]
    assert turn and all(s["cached_tokens"] > 200 for s in turn)
    assert all(s["prompt_tokens"] - s["cached_tokens"] < 120 for s in turn)
    assert after["prefix_cache"]["hit_ratio"] is None or 0 <= after["prefix_cache"]["hit_ratio"] <= 1


def test_the_page_is_self_contained(server):
    r = httpx.get(f"{server.url}/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert set(re.findall(r"https?://[^\s\"'<>)]+", r.text)) <= {"http://www.w3.org/2000/svg"}  # a namespace
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", r.text)
    assert "admin/slots/stream" in r.text


# ---- auth -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server(runtime):
    config = server_config(auth__enabled=True, auth__admin_keys=[ADMIN])
    app = create_app(config, runtime=runtime)
    with LiveServer(app) as srv:
        srv.fastapi = app
        yield srv


def test_slots_need_the_admin_key_like_admin(auth_server):
    url = auth_server.url
    for path in ("/admin/slots", "/admin/slots/stream"):
        missing, admin_missing = httpx.get(f"{url}{path}"), httpx.get(f"{url}/admin/agents")
        assert missing.status_code == admin_missing.status_code == 401
        assert missing.json() == admin_missing.json() and missing.headers["www-authenticate"] == "Bearer"
        wrong, admin_wrong = httpx.get(f"{url}{path}", headers=bearer("nope")), \
            httpx.get(f"{url}/admin/agents", headers=bearer("nope"))
        assert wrong.status_code == admin_wrong.status_code == 403 and wrong.json() == admin_wrong.json()
        # a key in the query string is never read (it would land in access logs)
        assert httpx.get(f"{url}{path}", params={"key": ADMIN, "api_key": ADMIN}).status_code == 401
    ok = httpx.get(f"{url}/admin/slots", headers={"X-Api-Key": ADMIN})
    assert ok.status_code == 200 and len(ok.json()["slots"]) == 4
    assert httpx.get(f"{url}/dashboard").status_code == 200  # the shell holds no data


def test_the_stream_sends_documents_and_stops_when_the_client_leaves(auth_server):
    url, app_state = auth_server.url, auth_server.fastapi.state
    events = []
    with httpx.stream("GET", f"{url}/admin/slots/stream", params={"interval": 0.1}, headers=bearer(ADMIN),
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                assert app_state.dashboard_streams == 1
                if len(events) == 3:
                    break
    assert [e["object"] for e in events] == ["slots"] * 3 and all(len(e["slots"]) == 4 for e in events)
    assert events[0]["time"] < events[2]["time"]
    wait_until(lambda: app_state.dashboard_streams == 0, timeout=5)
    too_fast = httpx.get(f"{url}/admin/slots/stream", params={"interval": 0.01}, headers=bearer(ADMIN))
    assert too_fast.status_code == 422  # FastAPI's validation of the query


# ---- the page in a real browser ------------------------------------------------------------------------


STATES = "JSON.stringify([...document.querySelectorAll('.slot')].map((e) => e.dataset.state))"


@pytest.mark.slow
def test_the_page_in_headless_chromium_shows_every_slot_and_its_changes(tmp_path):
    from headless_chromium import Chromium

    server = ServerProcess(tmp_path / "server.log", "--redis-url", "memory://", "--decode-delay-s", "0.1",
                           "--admin-key", ADMIN)
    try:
        with Chromium(tmp_path) as browser:
            # without the key the page asks for it
            anonymous = browser.open(f"{server.url}/dashboard")
            browser.wait_for(anonymous, "!document.getElementById('keyform').hidden", timeout=30)
            # the key in the fragment: read by the page, dropped from the address bar, sent as a header
            tab = browser.open(f"{server.url}/dashboard#key={ADMIN}")
            browser.wait_for(tab, "Number(document.body.dataset.updates) >= 1", timeout=30)
            assert browser.evaluate(tab, "location.href") == f"{server.url}/dashboard"
            slots = httpx.get(f"{server.url}/admin/slots", headers=bearer(ADMIN)).json()["model"]["slots"]
            idle = json.loads(browser.evaluate(tab, STATES))
            assert len(idle) == slots == 4 and set(idle) == {"idle"}
            header = browser.evaluate(tab, "document.getElementById('model').textContent")
            assert "tiny-gemma3" in header and "w8a8" in header and "KV int8" in header

            calls = [lambda i=i: chat(server.url, "assistant", prose(40, 20 + i), session=f"page-{i}",
                                      max_tokens=30, headers=bearer(ADMIN)) for i in range(6)]
            threads, statuses = run_in_threads(calls)
            busy_with_a_queue = (f"(() => {{ const s = {STATES}; return JSON.parse(s).filter((x) => x !== 'idle')"
                                 ".length >= 3 && document.querySelector('#waiting tr[data-agent]') ? s : ''; })()")
            busy = json.loads(browser.wait_for(tab, busy_with_a_queue, timeout=60))
            assert len(busy) == 4 and set(busy) <= {"idle", "prefilling", "waiting", "decoding", "verifying"}
            text = browser.evaluate(tab, "document.body.innerText")
            assert "assistant" in text and "page-" in text and "host tier" in text.lower()
            disk = browser.evaluate(tab, "document.getElementById('disk').textContent")
            assert "off" in disk  # the suite's servers run without a disk tier
            shot = browser.screenshot(tab, tmp_path / "dashboard-busy.png")
            for t in threads:
                t.join(120)
            assert statuses == [200] * 6
            all_idle = f"(() => {{ const s = {STATES}; return JSON.parse(s).every((x) => x === 'idle') ? s : ''; }})()"
            done = json.loads(browser.wait_for(tab, all_idle, timeout=30))
            assert len(done) == 4
            ttft = browser.evaluate(tab, "document.getElementById('cap-ttft').textContent")
            assert re.match(r"\d+ requests, mean", ttft), ttft
            browser.screenshot(tab, tmp_path / "dashboard-idle.png")
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    finally:
        server.stop()
    assert ADMIN not in (tmp_path / "server.log").read_text(errors="replace")
