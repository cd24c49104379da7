"""The live slot dashboard: ``GET /admin/slots`` (JSON), ``GET /admin/slots/stream`` (the same document as
server-sent events, a few a second) and ``GET /dashboard`` (one HTML page, inline CSS and JavaScript, no
external URL: its Content-Security-Policy allows nothing but this server).

What it shows comes from the scheduler's slot snapshot (`scheduler.snapshot`: published by the engine thread
at most a few times a second, read here as one reference, never locking the engine) and from the last
minute of TTFT and inter-token latency the turns record (`server.metrics.RecentWindow`).

Auth: the two data routes need the admin key exactly like ``/admin/agents`` (``Authorization: Bearer`` or
``X-Api-Key``; 401 / 403 in the same error shape). The page itself is a static shell holding no data; it
reads the stream with ``fetch`` and that header (a browser's EventSource cannot send one), taking the key
from a form or from the URL fragment (``/dashboard#key=...``: a fragment never reaches a server or its logs),
kept in the tab's sessionStorage. A key in a query string is never read.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from server.errors import APIError
from server.state import ServerState, state_of

router = APIRouter()

MAX_STREAMS = 16  # dashboards watching at once; beyond it a stream is refused (429)
STREAM_INTERVAL_S = 0.5  # default seconds between two stream events
_SECURITY = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _hit_ratio(history: list[tuple[float, int, int]]) -> tuple[float | None, list[dict[str, float]]]:
    """Prefix-cache hit ratio over the history (cached / prompt tokens of the requests admitted meanwhile),
    and per interval between two points (intervals without prompt tokens left out)."""
    if len(history) < 2:
        return None, []
    series = []
    for (_, p0, c0), (t1, p1, c1) in zip(history, history[1:], strict=False):
        if p1 > p0:
            series.append({"t": round(t1, 3), "ratio": round(min(1.0, max(0.0, (c1 - c0) / (p1 - p0))), 4)})
    prompt = history[-1][1] - history[0][1]
    cached = history[-1][2] - history[0][2]
    return (round(min(1.0, max(0.0, cached / prompt)), 4) if prompt > 0 else None), series


_converted: list[Any] = [None, None]  # (the latest snapshot converted, its dict): streams share one conversion


def _snapshot_data(snap: Any) -> dict[str, Any]:
    """The snapshot as plain dicts (read-only for callers), converted once however many dashboards read it."""
    seen, data = _converted
    if seen is not snap:
        data = snap.as_dict()
        # The scheduler's request group is the agent and its label the client's session (agents.service).
        data["slots"] = [{"agent": s.pop("group"), "session": s.pop("label"), **s} for s in data["slots"]]
        _converted[:] = [snap, data]
    return data


def slots_document(state: ServerState) -> dict[str, Any]:
    """What the dashboard shows, as JSON (the body of ``/admin/slots`` and of each stream event)."""
    now = time.time()
    runtime = state.runtime
    status = ("failed" if state.engine_failure is not None else "shutting_down" if state.shutting_down
              else "ready" if state.ready.is_set() and runtime is not None else "loading")
    metrics = state.metrics
    doc: dict[str, Any] = {
        "object": "slots", "status": status, "time": round(now, 3),
        "latency": {"ttft": metrics.recent_ttft.summary(now), "ttft_series": metrics.recent_ttft.series(now),
                    "inter_token": metrics.recent_inter_token.summary(now),
                    "inter_token_series": metrics.recent_inter_token.series(now)},
    }
    if runtime is None:
        doc.update(model=None, slots=[], waiting={}, snapshot=None)
        return doc
    info = runtime.info()
    doc["model"] = {"name": info["model"], "dtype": info["dtype"], "precision": info["precision"],
                    "kv_dtype": info["kv_dtype"], "slots": runtime.num_slots, "max_len": runtime.max_len,
                    "kv_bytes_per_slot": int(info["kv_bytes_per_slot"])}
    snap = runtime.scheduler.snapshot  # one reference read: the engine replaces it whole
    if snap is None:
        doc.update(slots=[], waiting={}, snapshot=None)
        return doc
    data = _snapshot_data(snap)
    counters = data["counters"]
    history = [tuple(point) for point in data["history"]]
    history.append((snap.taken_at, counters["prompt_tokens"], counters["cached_tokens"]))
    last_minute, series = _hit_ratio([p for p in history if p[0] >= now - 60.0] or history[-1:])
    slots = data["slots"]
    doc.update(
        snapshot={"taken_at": round(snap.taken_at, 3), "age_s": round(max(0.0, now - snap.taken_at), 3),
                  "iteration": snap.iteration},
        slots=slots,
        waiting=data["waiting"],
        totals={"busy": sum(s["state"] != "idle" for s in slots), "waiting": sum(data["waiting"].values()),
                "tokens_per_s": round(sum(s["tokens_per_s"] for s in slots), 2),
                "decode_step_ms": round(snap.decode_step_s * 1e3, 3) if snap.decode_step_s else None},
        host_tier={"bytes_used": data["host"]["bytes_used"], "budget_bytes": data["host"]["budget_bytes"],
                   "nodes": data["host"]["nodes"], "hits": data["host"]["hits"],
                   "evictions": data["host"]["evictions"], "restores": counters["host_restores"],
                   "saves": counters["host_saves"],
                   "by_adapter": {name: n for name, n in data["host"]["by_adapter"].items() if name}},
        disk_tier=data["disk"],
        prefix_cache={"prompt_tokens": counters["prompt_tokens"], "cached_tokens": counters["cached_tokens"],
                      "hit_ratio": round(counters["cached_tokens"] / counters["prompt_tokens"], 4)
                      if counters["prompt_tokens"] else None,
                      "hit_ratio_last_minute": last_minute, "hit_ratio_series": series,
                      "slot_reuses": counters["slot_reuses"], "device_copies": counters["device_copies"],
                      "in_flight_waits": counters["in_flight_waits"]},
        counters=counters,
    )
    return doc


@router.get("/admin/slots", tags=["admin"])
async def admin_slots(request: Request) -> JSONResponse:
    state = state_of(request)
    state.auth.require_admin(request)
    return JSONResponse(slots_document(state), headers={"Cache-Control": "no-store"})


@router.get("/admin/slots/stream", tags=["admin"])
async def admin_slots_stream(
    request: Request,
    interval: float = Query(STREAM_INTERVAL_S, ge=0.1, le=10.0, description="seconds between two events"),
) -> StreamingResponse:
    """``/admin/slots`` as server-sent events (``event: slots``), one every ``interval`` seconds, until the
    client leaves or the server shuts down."""
    state = state_of(request)
    state.auth.require_admin(request)
    app_state = request.app.state
    streams = getattr(app_state, "dashboard_streams", 0)
    if streams >= MAX_STREAMS:
        raise APIError(429, f"{streams} dashboard streams are open already", code="too_many_streams")

    async def events():
        # counted from the first iteration: a generator never started (client gone first) runs no `finally`
        app_state.dashboard_streams = getattr(app_state, "dashboard_streams", 0) + 1
        try:
            while not state.shutting_down:
                yield f"event: slots\ndata: {json.dumps(slots_document(state), separators=(',', ':'))}\n\n"
                await asyncio.sleep(interval)
        finally:  # the client left (Starlette cancels this generator) or the server is stopping
            app_state.dashboard_streams -= 1

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.get("/dashboard", tags=["operations"], response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """The page: a static shell (no data in it); what it shows comes from /admin/slots/stream."""
    return HTMLResponse(PAGE, headers=_SECURITY)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>slotserve dashboard</title>
<style>
:root{--bg:#0f1419;--panel:#182029;--line:#2a3642;--fg:#dce3ea;--dim:#8a99a8;--idle:#4a5866;--prefill:#d9a233;
--decode:#3fb96f;--verify:#4f9cf0;--wait:#c0608f}
*{box-sizing:border-box}body{margin:0;font:14px/1.4 system-ui,-apple-system,Segoe UI,sans-serif;background:var(--bg);
color:var(--fg)}header{display:flex;flex-wrap:wrap;gap:18px;align-items:baseline;padding:12px 18px;
border-bottom:1px solid var(--line)}h1{font-size:18px;margin:0}h2{font-size:13px;text-transform:uppercase;
letter-spacing:.06em;color:var(--dim);margin:0 0 8px}.dim{color:var(--dim)}main{padding:14px 18px;display:grid;
gap:14px}.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(270px,1fr));gap:10px}
.panel{background:var(--panel);border:1px solid var(--line);border-radius:6px;padding:10px 12px}
.slot{background:var(--panel);border:1px solid var(--line);border-left:5px solid var(--idle);border-radius:6px;
padding:8px 10px;min-height:128px}.slot[data-state=prefilling]{border-left-color:var(--prefill)}
.slot[data-state=decoding]{border-left-color:var(--decode)}.slot[data-state=verifying]{border-left-color:var(--verify)}
.slot[data-state=waiting]{border-left-color:var(--wait)}.slot .top{display:flex;justify-content:space-between}
.badge{font-weight:600;text-transform:uppercase;font-size:12px;letter-spacing:.05em}
.slot[data-state=idle] .badge{color:var(--dim)}.slot[data-state=prefilling] .badge{color:var(--prefill)}
.slot[data-state=decoding] .badge{color:var(--decode)}.slot[data-state=verifying] .badge{color:var(--verify)}
.slot[data-state=waiting] .badge{color:var(--wait)}.bar{height:6px;background:#0b0f13;border-radius:3px;
margin:5px 0;overflow:hidden;display:flex}.bar i{display:block;height:100%}.kv{display:grid;
grid-template-columns:auto 1fr;gap:1px 10px;font-size:13px}.kv b{font-weight:500;color:var(--dim)}
.row{display:grid;grid-template-columns:repeat(auto-fit,minmax(300px,1fr));gap:14px}
table{border-collapse:collapse;width:100%;font-size:13px}td,th{text-align:left;padding:2px 6px;
border-bottom:1px solid var(--line)}th{color:var(--dim);font-weight:500}svg{width:100%;height:90px;display:block}
.big{font-size:20px;font-weight:600}#status.live{color:var(--decode)}#status.down{color:var(--wait)}
form{display:flex;gap:8px;align-items:center}input{background:#0b0f13;color:var(--fg);border:1px solid var(--line);
border-radius:4px;padding:5px 8px}button{background:var(--verify);color:#fff;border:0;border-radius:4px;
padding:6px 12px;cursor:pointer}[hidden]{display:none!important}
</style></head>
<body data-updates="0">
<header><h1>slotserve</h1><span id="model" class="dim">connecting...</span><span id="totals"></span>
<span id="status" class="dim">-</span></header>
<main>
<form id="keyform" class="panel" hidden><span id="keymsg">The admin key is required.</span>
<input id="key" type="password" autocomplete="off" placeholder="admin key"><button type="submit">Connect</button></form>
<section><h2>Slots</h2><div id="slots" class="grid"></div></section>
<div class="row">
<section class="panel"><h2>Waiting queue</h2><table><thead><tr><th>agent</th><th>waiting</th></tr></thead>
<tbody id="waiting"></tbody></table></section>
<section class="panel"><h2>Host tier</h2><div id="host" class="kv"></div></section>
<section class="panel"><h2>Disk tier</h2><div id="disk" class="kv"></div></section>
<section class="panel"><h2>Prefix cache</h2><div id="cache" class="kv"></div></section>
</div>
<div class="row">
<section class="panel"><h2>Prefix-cache hit ratio, last minute</h2><svg id="plot-hit" viewBox="0 0 300 90"
preserveAspectRatio="none"></svg><div id="cap-hit" class="dim"></div></section>
<section class="panel"><h2>Time to first token, last minute</h2><svg id="plot-ttft" viewBox="0 0 300 90"
preserveAspectRatio="none"></svg><div id="cap-ttft" class="dim"></div></section>
<section class="panel"><h2>Inter-token latency, last minute</h2><svg id="plot-itl" viewBox="0 0 300 90"
preserveAspectRatio="none"></svg><div id="cap-itl" class="dim"></div></section>
</div>
</main>
<script>
"use strict";
const STORE = "slotserve.adminKey", $ = (id) => document.getElementById(id);
let updates = 0;
(function keyFromFragment() {  // #key=... never reaches a server; drop it from the address bar at once
  const m = location.hash.match(/(?:^#|&)key=([^&]*)/);
  if (m) { sessionStorage.setItem(STORE, decodeURIComponent(m[1])); history.replaceState(null, "", location.pathname); }
})();
function el(tag, cls, text) { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; }
function fmtBytes(n) { const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; } return (i ? n.toFixed(1) : n) + " " + u[i]; }
function ms(s) { return s >= 1 ? s.toFixed(2) + " s" : (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms"; }
function kv(box, pairs) { box.replaceChildren();
  for (const [k, v] of pairs) { box.append(el("b", "", k), el("span", "", String(v))); } }
function bar(parts, total) { const b = el("div", "bar"); for (const [n, color] of parts) { const i = el("i");
  i.style.width = (total ? Math.max(0, Math.min(100, 100 * n / total)) : 0) + "%";
  i.style.background = color; b.append(i); }
  return b; }
function slotCard(s, maxLen) {
  const c = el("div", "slot"); c.id = "slot-" + s.index; c.dataset.state = s.state;
  const top = el("div", "top"); c.append(top);
  top.append(el("span", "", "slot " + s.index), el("span", "badge", s.state));
  const css = getComputedStyle(document.documentElement), v = (n) => css.getPropertyValue(n);
  const pairs = [];
  if (s.state === "idle") {
    pairs.push(["holds", s.held + " tokens" + (s.agent ? " of " + s.agent : "")]);
    if (s.session) pairs.push(["session", s.session]);
    if (s.adapter) pairs.push(["adapter", s.adapter]);
    c.append(bar([[s.held, v("--idle")]], maxLen));
  } else {
    pairs.push(["agent", s.agent], ["session", s.session || "-"]);
    if (s.adapter) pairs.push(["adapter", s.adapter]);
    if (s.state === "prefilling" || s.state === "waiting") {
      c.append(bar([[s.cached_tokens, v("--verify")], [s.computed_tokens, v("--prefill")]], s.prompt_tokens));
      pairs.push(["prefill", s.prefill_done + " / " + s.prompt_tokens + " (" +
        Math.round(100 * s.prefill_done / Math.max(1, s.prompt_tokens)) + "%)"]);
    } else {
      c.append(bar([[s.held, v("--decode")]], maxLen));
      pairs.push(["generated", s.generated + " / " + s.max_tokens], ["tokens/s", s.tokens_per_s.toFixed(1)]);
    }
    pairs.push(["prompt", s.cached_tokens + " cached + " + (s.prompt_tokens - s.cached_tokens) + " computed"],
               ["held", s.held + " / " + maxLen]);
  }
  const box = el("div", "kv"); kv(box, pairs); c.append(box); return c;
}
function plot(svg, points, key, fixedMax) {  // points: [{t, <key>}], t in unix seconds; x: the last 60 s
  svg.replaceChildren();
  const ns = "http://www.w3.org/2000/svg", now = Date.now() / 1000, W = 300, H = 90;
  const ymax = fixedMax || Math.max(1e-6, ...points.map((p) => p[key])) * 1.15;
  const g = document.createElementNS(ns, "path"); g.setAttribute("d", "M0 " + (H - 0.5) + " H" + W);
  g.setAttribute("stroke", "#2a3642"); svg.append(g);
  if (!points.length) return;
  const xy = points.map((p) => [Math.max(0, W - (now - p.t) * W / 60), H - 2 - (H - 6) * p[key] / ymax]);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", xy.map((q) => q[0].toFixed(1) + "," + q[1].toFixed(1)).join(" "));
  line.setAttribute("fill", "none"); line.setAttribute("stroke", "#4f9cf0"); line.setAttribute("stroke-width", "1.5");
  line.setAttribute("vector-effect", "non-scaling-stroke"); svg.append(line);
  for (const [x, y] of xy) { const d = document.createElementNS(ns, "circle"); d.setAttribute("cx", x);
    d.setAttribute("cy", y); d.setAttribute("r", "1.6"); d.setAttribute("fill", "#4f9cf0"); svg.append(d); }
}
function render(d) {
  const m = d.model;
  $("model").textContent = m ? m.name + " \\u00b7 " + m.dtype + " \\u00b7 precision " + m.precision + " \\u00b7 KV " +
    m.kv_dtype + " \\u00b7 " + m.slots + " slots \\u00d7 " + m.max_len : "model " + d.status;
  const t = d.totals;
  $("totals").textContent = t ? t.busy + " busy \\u00b7 " + t.waiting + " waiting \\u00b7 " +
    t.tokens_per_s.toFixed(1) + " tok/s" +
    (t.decode_step_ms ? " \\u00b7 decode step " + t.decode_step_ms.toFixed(1) + " ms" : "") : "";
  const box = $("slots"); box.replaceChildren(...d.slots.map((s) => slotCard(s, m ? m.max_len : 0)));
  const w = $("waiting"); w.replaceChildren();
  const agents = Object.entries(d.waiting || {});
  if (!agents.length) { const r = el("tr"); r.append(el("td", "dim", "none"), el("td", "", "0")); w.append(r); }
  for (const [a, n] of agents) {
    const r = el("tr"); r.dataset.agent = a; r.append(el("td", "", a), el("td", "", String(n))); w.append(r); }
  const h = d.host_tier;
  if (h) kv($("host"), [["bytes", fmtBytes(h.bytes_used) + " / " + fmtBytes(h.budget_bytes)], ["runs", h.nodes],
    ["hits", h.hits], ["restores", h.restores], ["saves", h.saves], ["evictions", h.evictions],
    ...Object.entries(h.by_adapter || {}).map(([a, n]) => ["adapter " + a, fmtBytes(n)])]);
  const k = d.disk_tier;
  kv($("disk"), k ? [["bytes", fmtBytes(k.bytes_used) + " / " + fmtBytes(k.budget_bytes)], ["files", k.entries],
    ["hits", k.hits], ["misses", k.misses], ["writes", k.writes], ["evictions", k.evictions],
    ["damaged", k.damaged]] : [["state", "off"]]);
  const c = d.prefix_cache, pct = (r) => r === null || r === undefined ? "-" : (100 * r).toFixed(1) + "%";
  if (c) kv($("cache"), [["hit ratio", pct(c.hit_ratio)], ["last minute", pct(c.hit_ratio_last_minute)],
    ["prompt tokens", c.prompt_tokens], ["cached tokens", c.cached_tokens], ["slot reuses", c.slot_reuses],
    ["device copies", c.device_copies], ["in-flight waits", c.in_flight_waits]]);
  plot($("plot-hit"), c ? c.hit_ratio_series : [], "ratio", 1);
  $("cap-hit").textContent = c ? "last minute " + pct(c.hit_ratio_last_minute) : "";
  const L = d.latency;
  plot($("plot-ttft"), L.ttft_series, "mean");
  $("cap-ttft").textContent = L.ttft.count ? L.ttft.count + " requests, mean " + ms(L.ttft.mean) + ", max " +
    ms(L.ttft.max) : "no requests";
  plot($("plot-itl"), L.inter_token_series, "mean");
  $("cap-itl").textContent = L.inter_token.count ? L.inter_token.count + " tokens, mean " + ms(L.inter_token.mean) +
    ", max " + ms(L.inter_token.max) : "no tokens";
  const st = $("status"); st.className = "live";
  st.textContent = "live \\u00b7 " + (d.snapshot ? "iteration " + d.snapshot.iteration : d.status);
  document.body.dataset.updates = String(++updates); document.body.dataset.status = d.status;
}
function down(why) { const st = $("status"); st.className = "down"; st.textContent = why; }
async function stream() {
  const key = sessionStorage.getItem(STORE), headers = { Accept: "text/event-stream" };
  if (key) headers.Authorization = "Bearer " + key;
  let r;
  try { r = await fetch("admin/slots/stream?interval=0.5", { headers, cache: "no-store" }); }
  catch (e) { down("disconnected"); return setTimeout(stream, 2000); }
  if (r.status === 401 || r.status === 403) {
    sessionStorage.removeItem(STORE); $("keymsg").textContent = r.status === 401 ? "The admin key is required." :
      "That key is not an admin key."; $("keyform").hidden = false; down("needs the admin key"); return;
  }
  if (!r.ok) { down("error " + r.status); return setTimeout(stream, 2000); }
  $("keyform").hidden = true;
  const reader = r.body.getReader(), dec = new TextDecoder(); let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read(); if (done) break;
      buf += dec.decode(value, { stream: true }); let i;
      while ((i = buf.indexOf("\\n\\n")) >= 0) {
        const data = buf.slice(0, i).split("\\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5)).join("\\n");
        buf = buf.slice(i + 2); if (data) render(JSON.parse(data));
      }
    }
  } catch (e) { /* the connection dropped */ }
  down("disconnected"); setTimeout(stream, 1000);
}
$("keyform").addEventListener("submit", (e) => { e.preventDefault(); sessionStorage.setItem(STORE, $("key").value);
  $("key").value = ""; stream(); });
stream();
</script></body></html>
"""
